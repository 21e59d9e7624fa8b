//! The rate-limit headers: `X-RateLimit-*`, the IETF draft fields and
//! `Retry-After`.

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::HeaderMap;
use std::sync::Arc;

/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// `RateLimit-Policy` (IETF draft).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF draft).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Which rate-limit headers responses carry. `Retry-After` is sent on every
/// 429 whatever the style.
///
/// * `Legacy` (default): `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
///   `X-RateLimit-Reset` (epoch seconds) — what most clients parse today.
/// * `IetfDraft11`: the structured fields of the IETF HTTPAPI draft
///   *RateLimit header fields for HTTP*, `draft-ietf-httpapi-ratelimit-headers-11`
///   (23 May 2026), the current draft, for the binding tier:
///   `RateLimit-Policy: "<tier>";q=<quota>;w=<window s>` (§3.1: `q` the quota
///   in requests, `w` the window in seconds) and
///   `RateLimit: "<tier>";r=<available>;t=<effective window s>` (§4.1). In
///   draft-11, `t` is the *effective window*: "the number of seconds within
///   which the client can use no more than the available quota" (§4.1.2;
///   draft-10 §4.1.2 worded it "until additional quota … is made available").
///   We send: on a 429, the seconds until the request would pass on the
///   binding tier; when allowed, for the token bucket and both leaky buckets
///   (which refill continuously) the seconds until one more request's worth
///   of quota has refilled, and for the window algorithms the seconds until
///   the tier is back to full capacity (exact for the fixed window, whose
///   quota only returns when the window ends; for the sliding windows an
///   upper bound — a longer window only under-states the quota, which §6
///   allows: "a server MAY artificially lower RateLimit header field
///   values"). All rounded up. `Retry-After` is never earlier than `t`
///   (§6: it "SHOULD NOT reference a point in time earlier than the end of
///   the effective window"); we guarantee it.
/// * `IetfDraft09`: the same two fields with the semantics of
///   `draft-ietf-httpapi-ratelimit-headers-09` (March 2025), for clients
///   pinned to it: `t` is "the number of seconds until the quota … resets"
///   (draft-09 §4.1.2), which we send as the seconds until the tier is back
///   to full capacity (on a 429: until the request would pass, so `t`
///   equals `Retry-After`, as draft-09 §6 asks).
/// * `Both`: `Legacy` and `IetfDraft11`.
/// * `None`: no rate-limit headers (`Retry-After` only).
///
/// Draft-09 and draft-11 share the wire syntax (the same parameters `q`,
/// `w`, `r`, `t`); only the meaning of `t` on allowed responses and the
/// rule tying `Retry-After` to it changed. We send the optional quota unit
/// `qu` only for a concurrency tier (`qu="concurrent-requests"`, without
/// `w`; for every other tier the default unit, `requests`, applies; §3.1.2),
/// and never the
/// optional partition key `pk` (§3.1.4, §4.1.3). A
/// `draft-ietf-httpapi-ratelimit-headers-12` was announced in November
/// 2026; its text was not available to us, so this crate has not been
/// checked against it.
///
/// A policy file's `headers` names them `"legacy"`, `"ietf-draft-11"`,
/// `"ietf-draft-09"`, `"both"` and `"none"`; `"ietf"` is the current draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeaderStyle {
    /// `X-RateLimit-*`.
    #[default]
    Legacy,
    /// `RateLimit-Policy` and `RateLimit` per draft-11 (the current draft).
    #[serde(rename = "ietf-draft-11", alias = "ietf")]
    IetfDraft11,
    /// `RateLimit-Policy` and `RateLimit` per draft-09.
    #[serde(rename = "ietf-draft-09")]
    IetfDraft09,
    /// `X-RateLimit-*` and the draft-11 fields.
    Both,
    /// Neither.
    None,
}

impl HeaderStyle {
    /// The current draft, [`HeaderStyle::IetfDraft11`]. Until this release
    /// `Ietf` was a variant sending draft-09; it now follows the current draft
    /// (same wire syntax, a different `t`; see the type's docs). Name the
    /// draft you mean, so that an upgrade never changes your headers silently.
    #[deprecated(note = "name the draft: HeaderStyle::IetfDraft11 or HeaderStyle::IetfDraft09")]
    #[allow(non_upper_case_globals)]
    pub const Ietf: HeaderStyle = HeaderStyle::IetfDraft11;

    /// Whether the IETF fields are sent (any draft).
    pub(crate) fn ietf(self) -> bool {
        matches!(
            self,
            HeaderStyle::IetfDraft11 | HeaderStyle::IetfDraft09 | HeaderStyle::Both
        )
    }
}

/// The header values for one response (see the [module docs](super)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitHeaders {
    /// `X-RateLimit-Limit`: the binding tier's capacity, in requests.
    pub limit: u64,
    /// `X-RateLimit-Remaining` and the IETF `r`: requests left, in requests.
    pub remaining: u64,
    /// `X-RateLimit-Reset`: Unix epoch seconds.
    pub reset: u64,
    /// `Retry-After` in seconds, on denied requests only. Written as at
    /// least `window_in` when the draft-11 fields are sent.
    pub retry_after: Option<u64>,
    /// Seconds from now until `reset` (the draft-09 `t`).
    pub reset_in: u64,
    /// Seconds of the effective window (the draft-11 `t`, see
    /// [`HeaderStyle::IetfDraft11`]).
    pub window_in: u64,
    /// The binding tier (the IETF policy name).
    pub policy: Arc<str>,
    /// The tier's quota (IETF `q`, requests) and window in seconds (IETF `w`).
    pub quota: (u64, u64),
    /// The binding tier limits requests **in flight** (a concurrency tier):
    /// the IETF policy carries the quota unit `qu="concurrent-requests"`
    /// (draft-11 §3.1.2) and no window.
    pub concurrent: bool,
    /// Which headers to write.
    pub style: HeaderStyle,
}

impl RateLimitHeaders {
    /// Writes the headers into `headers`, replacing any of the same name.
    pub fn write(&self, headers: &mut HeaderMap) {
        let legacy = matches!(self.style, HeaderStyle::Legacy | HeaderStyle::Both);
        // The IETF `t`, by draft.
        let t = match self.style {
            HeaderStyle::IetfDraft11 | HeaderStyle::Both => Some(self.window_in),
            HeaderStyle::IetfDraft09 => Some(self.reset_in),
            HeaderStyle::Legacy | HeaderStyle::None => None,
        };
        // Grow the map once, not header by header.
        headers.reserve(
            3 * usize::from(legacy)
                + 2 * usize::from(t.is_some())
                + usize::from(self.retry_after.is_some()),
        );
        if legacy {
            headers.insert(X_RATELIMIT_LIMIT, int_value(self.limit));
            headers.insert(X_RATELIMIT_REMAINING, int_value(self.remaining));
            headers.insert(X_RATELIMIT_RESET, int_value(self.reset));
        }
        if let Some(t) = t {
            // Tier names are [A-Za-z0-9_-], so they need no sf-string escaping.
            // A String becomes a HeaderValue without a copy.
            let policy = if self.concurrent {
                format!(
                    "\"{}\";q={};qu=\"concurrent-requests\"",
                    self.policy, self.quota.0
                )
            } else {
                format!("\"{}\";q={};w={}", self.policy, self.quota.0, self.quota.1)
            };
            let current = format!("\"{}\";r={};t={}", self.policy, self.remaining, t);
            if let Ok(v) = HeaderValue::try_from(policy) {
                headers.insert(RATELIMIT_POLICY, v);
            }
            if let Ok(v) = HeaderValue::try_from(current) {
                headers.insert(RATELIMIT, v);
            }
        }
        if let Some(s) = self.retry_after {
            // Draft-11 §6: never earlier than the end of the effective window.
            let s = match self.style {
                HeaderStyle::IetfDraft11 | HeaderStyle::Both => s.max(self.window_in),
                _ => s,
            };
            headers.insert(RETRY_AFTER, int_value(s));
        }
    }
}

/// Microseconds of the draft-11 effective window (`t`) of an allowed
/// decision. With `refill = Some((limit, period_us))`, a bucket refilling
/// `limit` requests per `period_us` continuously, it is the time until one
/// more request's worth has refilled: `reset_after_us` (until full) less
/// the refill time of the requests still missing after that one (rounded
/// down, so the window is never shorter than the truth). Otherwise, and for
/// a full bucket, `reset_after_us`.
pub(crate) fn effective_window_us(
    capacity: u64,
    remaining: u64,
    reset_after_us: u64,
    refill: Option<(u64, u64)>,
) -> u64 {
    match refill {
        Some((limit, period_us)) if limit > 0 && remaining < capacity => {
            let later =
                u128::from(capacity - remaining - 1) * u128::from(period_us) / u128::from(limit);
            reset_after_us.saturating_sub(u64::try_from(later).unwrap_or(u64::MAX))
        }
        _ => reset_after_us,
    }
}

/// A number as a header value: its digits formatted on the stack, then one
/// copy (`HeaderValue::from(u64)` makes two allocations).
fn int_value(n: u64) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    HeaderValue::from_bytes(digits.format(n).as_bytes())
        .unwrap_or_else(|_| HeaderValue::from_static("0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(style: HeaderStyle, retry_after: Option<u64>, window_in: u64) -> HeaderMap {
        let h = RateLimitHeaders {
            limit: 3,
            remaining: 1,
            reset: 1_700_000_040,
            retry_after,
            reset_in: 40,
            window_in,
            policy: Arc::from("ip"),
            quota: (3, 60),
            concurrent: false,
            style,
        };
        let mut m = HeaderMap::new();
        h.write(&mut m);
        m
    }

    fn get<'m>(m: &'m HeaderMap, name: &str) -> Option<&'m str> {
        m.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn draft11_sends_the_effective_window_as_t() {
        let m = headers(HeaderStyle::IetfDraft11, None, 20);
        assert_eq!(get(&m, "ratelimit-policy"), Some(r#""ip";q=3;w=60"#));
        assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=20"#));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn draft09_sends_the_time_until_reset_as_t() {
        let m = headers(HeaderStyle::IetfDraft09, None, 20);
        assert_eq!(get(&m, "ratelimit-policy"), Some(r#""ip";q=3;w=60"#));
        assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=40"#));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn both_is_legacy_and_draft11() {
        let m = headers(HeaderStyle::Both, None, 20);
        assert_eq!(get(&m, "x-ratelimit-reset"), Some("1700000040"));
        assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=20"#));
        assert_eq!(m.len(), 5);
    }

    /// Draft-11 §6: `Retry-After` not earlier than the end of the window.
    #[test]
    fn retry_after_is_never_earlier_than_draft11_t() {
        let m = headers(HeaderStyle::IetfDraft11, Some(3), 5);
        assert_eq!(get(&m, "retry-after"), Some("5"));
        assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=5"#));
        let m = headers(HeaderStyle::IetfDraft11, Some(7), 5);
        assert_eq!(get(&m, "retry-after"), Some("7"));
        // Without the draft-11 fields there is no `t` to respect.
        let m = headers(HeaderStyle::Legacy, Some(3), 5);
        assert_eq!(get(&m, "retry-after"), Some("3"));
    }

    #[test]
    fn effective_window_of_a_refilling_bucket_is_the_next_request() {
        // 3 per 60 s: one request every 20 s. 0.25 of 3 left: full in 55 s,
        // the next whole request in 15 s.
        assert_eq!(
            effective_window_us(3, 0, 55_000_000, Some((3, 60_000_000))),
            15_000_000
        );
        // Burst 10 refilled at 5 per 10 s (2 s each), 7 left, full in 6 s:
        // the next one in 2 s.
        assert_eq!(
            effective_window_us(10, 7, 6_000_000, Some((5, 10_000_000))),
            2_000_000
        );
        // Full, or a window algorithm: the time until full.
        assert_eq!(effective_window_us(3, 3, 0, Some((3, 60_000_000))), 0);
        assert_eq!(effective_window_us(3, 1, 40_000_000, None), 40_000_000);
    }
}
