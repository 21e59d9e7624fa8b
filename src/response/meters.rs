//! The per-meter headers AI clients read ([`HeaderStyle::PerMeter`](super::HeaderStyle::PerMeter)):
//! OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`. A
//! layer's priced tiers ([`Tier::priced`](crate::Tier::priced)) are the
//! **tokens** meter, its other tiers the **requests** meter; each meter
//! shows its tier closest to exhaustion (the least remaining; on a tie, the
//! longest until full), as the single-tier styles do for all tiers.
//!
//! | header | value |
//! |---|---|
//! | `x-ratelimit-limit-requests`, `x-ratelimit-limit-tokens` | the tier's capacity, in requests or tokens |
//! | `x-ratelimit-remaining-requests`, `x-ratelimit-remaining-tokens` | what is left (after a priced request's settle when its actual was in the response head) |
//! | `x-ratelimit-reset-requests`, `x-ratelimit-reset-tokens` | the time until the tier is back to its initial state (full), as OpenAI writes it: Go's duration format, `6m0s`, `1s`, `1.5s`, `20ms`, `0s`, rounded up to the millisecond |
//!
//! A meter no tier of which checked the request is left out.

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// `x-ratelimit-limit-requests`.
pub(crate) const X_RATELIMIT_LIMIT_REQUESTS: HeaderName =
    HeaderName::from_static("x-ratelimit-limit-requests");
/// `x-ratelimit-remaining-requests`.
pub(crate) const X_RATELIMIT_REMAINING_REQUESTS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-requests");
/// `x-ratelimit-reset-requests`.
pub(crate) const X_RATELIMIT_RESET_REQUESTS: HeaderName =
    HeaderName::from_static("x-ratelimit-reset-requests");
/// `x-ratelimit-limit-tokens`.
pub(crate) const X_RATELIMIT_LIMIT_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-limit-tokens");
/// `x-ratelimit-remaining-tokens`.
pub(crate) const X_RATELIMIT_REMAINING_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-tokens");
/// `x-ratelimit-reset-tokens`.
pub(crate) const X_RATELIMIT_RESET_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-reset-tokens");

/// One meter's numbers: the tier shown for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    /// The tier shown.
    pub policy: Arc<str>,
    /// Its capacity (requests, or tokens).
    pub limit: u64,
    /// What it has left.
    pub remaining: u64,
    /// Milliseconds until it is full again.
    pub reset_ms: u64,
}

/// The two meters of a response, as the per-meter header style writes them:
/// the requests meter (tiers that are not priced) and the tokens meter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meters {
    /// The requests meter: the tiers that are not priced.
    pub requests: Option<Meter>,
    /// The tokens meter: the priced tiers.
    pub tokens: Option<Meter>,
}

impl Meters {
    /// A tier's numbers for the tokens meter (`tokens`) or the requests
    /// meter: kept when closer to exhaustion than the meter's so far.
    pub(crate) fn offer(&mut self, tokens: bool, m: Meter) {
        let slot = if tokens {
            &mut self.tokens
        } else {
            &mut self.requests
        };
        let closer = slot.as_ref().is_none_or(|s| {
            (m.remaining, std::cmp::Reverse(m.reset_ms))
                < (s.remaining, std::cmp::Reverse(s.reset_ms))
        });
        if closer {
            *slot = Some(m);
        }
    }

    /// Writes the meters' headers into `headers`.
    pub fn write(&self, headers: &mut HeaderMap) {
        let meters = [
            (
                &self.requests,
                [
                    X_RATELIMIT_LIMIT_REQUESTS,
                    X_RATELIMIT_REMAINING_REQUESTS,
                    X_RATELIMIT_RESET_REQUESTS,
                ],
            ),
            (
                &self.tokens,
                [
                    X_RATELIMIT_LIMIT_TOKENS,
                    X_RATELIMIT_REMAINING_TOKENS,
                    X_RATELIMIT_RESET_TOKENS,
                ],
            ),
        ];
        for (meter, [limit, remaining, reset]) in meters {
            let Some(m) = meter else { continue };
            headers.insert(limit, HeaderValue::from(m.limit));
            headers.insert(remaining, HeaderValue::from(m.remaining));
            if let Ok(v) = HeaderValue::try_from(go_duration(m.reset_ms)) {
                headers.insert(reset, v);
            }
        }
    }
}

/// `ms` milliseconds as Go's `time.Duration` prints them (OpenAI's reset
/// format): `0s`, `20ms`, `1s`, `1.5s`, `6m0s`, `1h0m0s`.
pub fn go_duration(ms: u64) -> String {
    if ms < 1000 {
        return if ms == 0 {
            "0s".to_owned()
        } else {
            format!("{ms}ms")
        };
    }
    let (h, m) = (ms / 3_600_000, ms / 60_000 % 60);
    let (s, frac) = (ms / 1000 % 60, ms % 1000);
    let mut out = String::new();
    if h > 0 {
        let _ = write!(out, "{h}h");
    }
    if h > 0 || m > 0 {
        let _ = write!(out, "{m}m");
    }
    let _ = write!(out, "{s}");
    if frac > 0 {
        let digits = format!("{frac:03}");
        let _ = write!(out, ".{}", digits.trim_end_matches('0'));
    }
    out.push('s');
    out
}

#[cfg(test)]
mod tests {
    use super::go_duration;

    #[test]
    fn durations_print_as_go_does() {
        for (ms, want) in [
            (0, "0s"),
            (20, "20ms"),
            (999, "999ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (8640, "8.64s"),
            (60_000, "1m0s"),
            (360_000, "6m0s"),
            (361_001, "6m1.001s"),
            (3_600_000, "1h0m0s"),
            (90_061_000, "25h1m1s"),
        ] {
            assert_eq!(go_duration(ms), want, "{ms} ms");
        }
    }
}
