//! The rate-limit headers: `X-RateLimit-*`, the IETF draft fields and
//! `Retry-After`.

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::HeaderMap;
use std::sync::Arc;

/// `X-RateLimit-Limit`.
pub(crate) const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub(crate) const X_RATELIMIT_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub(crate) const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// `x-should-retry`: sent as `false` on a 429 no wait can lift (a cost
/// above the tier's capacity), for the SDKs that retry every 429 unless it
/// says so (OpenAI's, Cloudflare's).
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

/// `RateLimit-Policy` (IETF draft).
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF draft).
pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Which rate-limit headers responses carry. `Retry-After` is sent on every
/// 429 whatever the style.
///
/// * `Legacy` (default): `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
///   `X-RateLimit-Reset` (epoch seconds) — what most clients parse today.
/// * `IetfDraft11`: the structured fields of the IETF HTTPAPI draft
///   *RateLimit header fields for HTTP*, `draft-ietf-httpapi-ratelimit-headers-11`
///   (23 May 2026), the current draft:
///   `RateLimit-Policy: "<tier>";q=<quota>;w=<window s>, …` for every tier
///   of the request (§3.1: `q` the quota in its unit, `w` the window in
///   seconds) and, for the binding tier,
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
/// * `PerMeter`: OpenAI's per-meter headers, `x-ratelimit-limit-requests`,
///   `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the
///   same three `-tokens`: the priced tiers ([`Tier::priced`](crate::Tier::priced))
///   are the tokens meter, the others the requests meter, each showing its
///   tier closest to exhaustion; the reset as OpenAI writes it (`6m0s`).
///   See [`Meters`](super::Meters). HTTP and gRPC front doors (a 429 the deny
///   cache answers, and the descriptor front door, carry `Retry-After` only).
/// * `None`: no rate-limit headers (`Retry-After` only).
///
/// Draft-09 and draft-11 share the wire syntax (the same parameters `q`,
/// `w`, `r`, `t`); only the meaning of `t` on allowed responses and the
/// rule tying `Retry-After` to it changed. `RateLimit-Policy` lists every
/// tier the request is checked by (§3: a list that "SHOULD remain
/// consistent over a sequence of HTTP responses"), `RateLimit` the binding
/// tier. A policy item carries the quota unit `qu` (§3.1.2) unless it is
/// the default, `requests` (see [`QuotaUnit`]; a concurrency tier's has no
/// `w`). Every integer is at most 999 999 999 999 999 (15 digits, RFC 9651 §3.3.1). We never send the
/// optional partition key `pk` (§3.1.4, §4.1.3). A
/// `draft-ietf-httpapi-ratelimit-headers-12` was announced in November
/// 2026; its text was not available to us, so this crate has not been
/// checked against it.
///
/// A policy file's `headers` names them `"legacy"`, `"ietf-draft-11"`,
/// `"ietf-draft-09"`, `"both"`, `"per-meter"` (or `"openai"`) and `"none"`;
/// `"ietf"` is the current draft.
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
    /// OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`.
    #[serde(rename = "per-meter", alias = "openai")]
    PerMeter,
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

    /// Whether the headers need each tier's quota (its window, and whether
    /// it refills continuously): the IETF fields, and the per-meter resets.
    pub(crate) fn needs_quotas(self) -> bool {
        self.ietf() || self == HeaderStyle::PerMeter
    }

    /// Whether the IETF fields are sent (any draft).
    pub(crate) fn ietf(self) -> bool {
        matches!(
            self,
            HeaderStyle::IetfDraft11 | HeaderStyle::IetfDraft09 | HeaderStyle::Both
        )
    }
}

/// The largest integer a Structured Field carries (RFC 9651 §3.3.1: at
/// most 15 digits): every `q`, `w`, `r` and `t` of the IETF fields is at
/// most this (a quota above it is refused at build, naming the field; a
/// number computed at run time above it, from a quota changed at run time
/// or a per-key override, is sent as this).
pub(crate) const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// A quota unit: what a tier's quota counts, the IETF policy's `qu`
/// parameter (`draft-ietf-httpapi-ratelimit-headers-11` §3.1.2; its
/// default, `requests`, is not written).
///
/// A tier's unit, unless set with [`Tier::quota_unit`](crate::Tier::quota_unit):
/// `concurrent-requests` for a concurrency tier, `tokens` for a priced tier
/// ([`Tier::priced`](crate::Tier::priced)), `cost-units` for a tier with a
/// cost function or a fixed cost other than 1 (its quota counts costs, not
/// requests: name the unit the cost measures, such as
/// [`QuotaUnit::ContentBytes`] for a body-size cost), else `requests`.
/// `tokens` and `cost-units` are not in the draft's registry of quota units
/// (which holds the three registered variants below); the draft lets a
/// specification register more, and a client that does not know a unit
/// learns, at least, that the quota does not count requests.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QuotaUnit {
    /// `requests` (the draft's default).
    Requests,
    /// `content-bytes`.
    ContentBytes,
    /// `concurrent-requests`: requests in flight (a concurrency tier).
    ConcurrentRequests,
    /// Any other unit: 1-32 characters of `[a-z0-9-]` (checked when the
    /// layer is built, naming the field `quota_unit`).
    Custom(Arc<str>),
}

impl QuotaUnit {
    /// The unit as the `qu` parameter names it.
    pub fn as_str(&self) -> &str {
        match self {
            QuotaUnit::Requests => "requests",
            QuotaUnit::ContentBytes => "content-bytes",
            QuotaUnit::ConcurrentRequests => "concurrent-requests",
            QuotaUnit::Custom(u) => u,
        }
    }

    /// The unit named `name`: a registered one, or [`QuotaUnit::Custom`].
    pub fn named(name: &str) -> Self {
        match name {
            "requests" => QuotaUnit::Requests,
            "content-bytes" => QuotaUnit::ContentBytes,
            "concurrent-requests" => QuotaUnit::ConcurrentRequests,
            other => QuotaUnit::Custom(Arc::from(other)),
        }
    }

    /// Whether its name is 1-32 characters of `[a-z0-9-]` (always, for
    /// the registered units).
    pub(crate) fn is_valid(&self) -> bool {
        let n = self.as_str();
        !n.is_empty()
            && n.len() <= 32
            && n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }
}

/// One item of the IETF `RateLimit-Policy` field: a tier's policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyItem {
    /// The tier's name (the policy's name).
    pub name: Arc<str>,
    /// `q`: the quota, in `unit`s.
    pub quota: u64,
    /// `w`: the window in seconds, rounded up; `None` for a concurrency
    /// tier (requests in flight have no window).
    pub window: Option<u64>,
    /// `qu`, written unless it is [`QuotaUnit::Requests`].
    pub unit: QuotaUnit,
}

impl PolicyItem {
    /// Appends the item (`"<name>";q=<quota>[;qu="<unit>"][;w=<window>]`)
    /// to `out`.
    fn write_to(&self, out: &mut String) {
        use std::fmt::Write;
        // Tier names are [A-Za-z0-9_-] and units [a-z0-9-]: no sf-string
        // escaping.
        let _ = write!(out, "\"{}\";q={}", self.name, sf(self.quota));
        if self.unit != QuotaUnit::Requests {
            let _ = write!(out, ";qu=\"{}\"", self.unit.as_str());
        }
        if let Some(w) = self.window {
            let _ = write!(out, ";w={}", sf(w));
        }
    }
}

/// `n`, at most [`SF_INTEGER_MAX`].
fn sf(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
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
    /// The binding tier (the policy the IETF `RateLimit` item names).
    pub policy: Arc<str>,
    /// The IETF `RateLimit-Policy` items: every enforced tier of the
    /// request (observing ones too with `shadow_headers`), in tier order,
    /// whichever binds, so the field stays the same over a route's
    /// responses (draft-11 §3). Empty without the IETF fields.
    pub policies: Vec<PolicyItem>,
    /// Which headers to write.
    pub style: HeaderStyle,
    /// With [`HeaderStyle::PerMeter`]: the two meters' numbers.
    pub meters: Option<Box<super::Meters>>,
}

impl RateLimitHeaders {
    /// Writes the headers into `headers`, replacing any of the same name.
    pub fn write(&self, headers: &mut HeaderMap) {
        let legacy = matches!(self.style, HeaderStyle::Legacy | HeaderStyle::Both);
        // The IETF `t`, by draft.
        let t = match self.style {
            HeaderStyle::IetfDraft11 | HeaderStyle::Both => Some(self.window_in),
            HeaderStyle::IetfDraft09 => Some(self.reset_in),
            HeaderStyle::Legacy | HeaderStyle::PerMeter | HeaderStyle::None => None,
        };
        if let Some(m) = self
            .meters
            .as_deref()
            .filter(|_| self.style == HeaderStyle::PerMeter)
        {
            m.write(headers);
        }
        // Grow the map once, not header by header.
        headers.reserve(
            3 * usize::from(legacy)
                + 2 * usize::from(t.is_some())
                + usize::from(self.retry_after.is_some()),
        );
        if legacy {
            headers.insert(X_RATELIMIT_LIMIT, int_value(Field::Limit, self.limit));
            headers.insert(
                X_RATELIMIT_REMAINING,
                int_value(Field::Remaining, self.remaining),
            );
            headers.insert(X_RATELIMIT_RESET, int_value(Field::Reset, self.reset));
        }
        if let Some(t) = t {
            // Tier names are [A-Za-z0-9_-], so they need no sf-string escaping.
            // A String becomes a HeaderValue without a copy.
            if !self.policies.is_empty() {
                let mut policy = String::with_capacity(32 * self.policies.len());
                for (n, p) in self.policies.iter().enumerate() {
                    if n > 0 {
                        policy.push_str(", ");
                    }
                    p.write_to(&mut policy);
                }
                if let Ok(v) = HeaderValue::try_from(policy) {
                    headers.insert(RATELIMIT_POLICY, v);
                }
            }
            let current = format!("\"{}\";r={};t={}", self.policy, sf(self.remaining), sf(t));
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
            headers.insert(RETRY_AFTER, int_value(Field::RetryAfter, s));
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

/// Which header a number is for: each keeps its own last value per thread
/// ([`int_value`]).
#[derive(Clone, Copy)]
enum Field {
    Limit,
    Remaining,
    Reset,
    RetryAfter,
}

/// The digits of 0, 1, …, 9 999 in a row (38 890 bytes): a number below
/// 10^4 becomes a header value borrowing its digits, with no allocation.
static SMALL: [u8; SMALL_LEN] = small_digits();
const SMALL_MAX: u64 = 9_999;
const SMALL_LEN: usize = 10 + 90 * 2 + 900 * 3 + 9_000 * 4;

const fn small_digits() -> [u8; SMALL_LEN] {
    let mut out = [0u8; SMALL_LEN];
    let (mut n, mut at) = (0u64, 0usize);
    while n <= SMALL_MAX {
        let width = small_width(n);
        let mut i = width;
        let mut rest = n;
        while i > 0 {
            i -= 1;
            out[at + i] = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        at += width;
        n += 1;
    }
    out
}

const fn small_width(n: u64) -> usize {
    match n {
        0..=9 => 1,
        10..=99 => 2,
        100..=999 => 3,
        _ => 4,
    }
}

/// Where `n`'s digits start in [`SMALL`] (`n` ≤ [`SMALL_MAX`]).
fn small_offset(n: u64) -> usize {
    // Below 10^w every number before it has at most w digits: the offset is
    // the widths of the shorter numbers plus w per number of n's width.
    let n = n as usize;
    match n {
        0..=9 => n,
        10..=99 => 10 + 2 * (n - 10),
        100..=999 => 190 + 3 * (n - 100),
        _ => 2_890 + 4 * (n - 1_000),
    }
}

thread_local! {
    /// Per header, the last value this thread wrote that was not in
    /// [`SMALL`], shared by the responses that repeat it: a tier's limit
    /// (the same on every response) and the reset instant (the same for a
    /// second) cost a reference count, not an allocation.
    static LAST: std::cell::RefCell<[Option<(u64, HeaderValue)>; 4]> =
        const { std::cell::RefCell::new([const { None }; 4]) };
    /// The digits of the numbers this thread formatted, one after the other
    /// in one buffer: each header value is a shared slice of it, so a new
    /// number (the remaining count of a busy key, on every response) costs
    /// a reference count, not an allocation of its own. A full buffer is
    /// left to the values still using it and a new one started.
    static DIGITS: std::cell::RefCell<bytes::BytesMut> =
        std::cell::RefCell::new(bytes::BytesMut::new());
}

/// Bytes of each [`DIGITS`] buffer: 20-digit numbers for ~200 values.
const DIGITS_CHUNK: usize = 4096;

/// `n`'s digits as a header value: a slice of this thread's [`DIGITS`]
/// buffer (formatted with `itoa`).
fn fresh_value(n: u64) -> HeaderValue {
    let mut formatted = itoa::Buffer::new();
    let text = formatted.format(n).as_bytes();
    let shared = DIGITS.try_with(|digits| {
        let mut digits = digits.try_borrow_mut().ok()?;
        if digits.capacity() - digits.len() < text.len() {
            *digits = bytes::BytesMut::with_capacity(DIGITS_CHUNK);
        }
        digits.extend_from_slice(text);
        Some(digits.split().freeze())
    });
    let bytes = match shared {
        Ok(Some(b)) => b,
        // During thread teardown: a copy of its own.
        _ => bytes::Bytes::copy_from_slice(text),
    };
    HeaderValue::from_maybe_shared(bytes).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

/// A number as a header value, with no allocation when it is below 10^4
/// (its digits borrowed from [`SMALL`]) or the value this thread last wrote
/// for the same header (shared); else a slice of this thread's digit buffer
/// ([`fresh_value`]: an allocation every ~200 new values, where
/// `HeaderValue::from(u64)` makes two per value).
fn int_value(field: Field, n: u64) -> HeaderValue {
    if n <= SMALL_MAX {
        let at = small_offset(n);
        let digits = &SMALL[at..at + small_width(n)];
        return HeaderValue::from_maybe_shared(bytes::Bytes::from_static(digits))
            .unwrap_or_else(|_| HeaderValue::from_static("0"));
    }
    LAST.try_with(|last| {
        let Ok(mut last) = last.try_borrow_mut() else {
            return fresh_value(n);
        };
        let slot = &mut last[field as usize];
        match slot {
            Some((m, v)) if *m == n => v.clone(),
            _ => {
                let v = fresh_value(n);
                *slot = Some((n, v.clone()));
                v
            }
        }
    })
    .unwrap_or_else(|_| fresh_value(n))
}

#[cfg(test)]
mod tests;
