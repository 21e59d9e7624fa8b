//! [`Quota`]: how many requests per period, and how many at once.

use std::time::Duration;

/// A rate: `limit` requests per `period`, with bursts of up to `burst`
/// requests (the bucket's capacity; defaults to `limit`).
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::Quota;
///
/// let q = Quota::per_second(1000).burst(2000);
/// assert_eq!(q.limit(), 1000);
/// assert_eq!(q.period(), Duration::from_secs(1));
/// assert_eq!(q.burst_size(), 2000);
/// assert_eq!(Quota::new(50, Duration::from_secs(10)).burst_size(), 50);
/// ```
///
/// Invalid values (zero limit, zero period, a burst below the tier's cost)
/// are reported by the layer's `build()` as a
/// [`ConfigError`](crate::ConfigError) naming the tier.
///
/// In a policy file (a `[tier.plans]` entry) it is
/// `{ limit = 1000, period = "1s", burst = 2000 }`: `period` in humantime,
/// `burst` optional.
///
/// # One integer per key in Redis
/// The Redis backend stores each key's state as one integer (Redis keeps it
/// inside the object: 72 B for an idle `rl:ip:<IPv4>` key) wherever exact
/// arithmetic allows it, and a short string otherwise (104 B for such a
/// key); `docs/redis.md`, "Stored values". With `rate` = limit / gcd(limit,
/// period in µs):
///
/// | algorithm | one integer when | otherwise (a string) |
/// |---|---|---|
/// | token bucket, leaky bucket | rate ≤ 44: the period in µs a multiple of the limit (rate 1: 100/hour, 60/minute, 1000/second), or a limit whose factors the period lacks multiply to at most 44 (7/minute: rate 7; 3/second: 3; 128/second: 2) | rate > 44, e.g. 47/minute or 99/second: the theoretical arrival time, its remainder in `1 / rate` µs and the rate do not fit the 19 digits of a 64-bit integer |
/// | fixed window | limit < period in µs | a limit of a million or more per second |
/// | sliding window counter | limit < ⌊√(period in µs)⌋ (7 745 for a minute) | a larger limit |
/// | sliding window log | a member per request: one integer for a cost of 1 | a member of a larger cost |
/// | concurrency, penalty box | never (a sorted set; a string of strikes) | always |
///
/// # Exact bounds
/// The Redis scripts count in Lua doubles, exact for every integer up to
/// 2^53, so `build()` (and `RateLimitLayer::from_policy`) rejects any quota
/// for which a value they compute could pass 2^53, with
/// [`ConfigError::QuotaTooLarge`](crate::ConfigError::QuotaTooLarge) naming
/// the field. The memory backend counts in `u64` and would agree with any
/// quota; the bounds keep both backends giving the same answers. Per tier
/// (periods in microseconds; `unit` = period / gcd(limit, period) and
/// `rate` = limit / gcd(limit, period), see
/// [`algorithm::TokenBucket`](crate::algorithm::TokenBucket)):
///
/// | algorithm | bound | why |
/// |---|---|---|
/// | every one | period ≤ 2^51 µs (about 71 years) | timestamps reach now + 2 × period, ≤ 2^53 until 2112 |
/// | fixed window, sliding log | limit ≤ 2^52 − 1 | count (≤ limit) + cost (clamped to limit + 1) |
/// | sliding window counter | (2 × limit + 1) × period ≤ 2^53 | estimate (≤ limit × period) + cost × period |
/// | token bucket, leaky bucket | burst × unit ≤ 2^52 and rate ≤ 2^51 | a cost of capacity + 1 token is ≤ 2^53 units; rounded-up division by the rate adds up to 2 × rate |
/// | leaky bucket, shaping | burst × unit + max_delay × rate ≤ 2^52 | the backlog plus one cost stays ≤ 2^53 ticks |
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::{key::Global, Algorithm, Quota, RateLimitLayer, Tier};
///
/// let fixed = |limit| {
///     RateLimitLayer::builder()
///         .tier(Tier::new("t", Global, Quota::per_minute(limit)).algorithm(Algorithm::FixedWindow))
///         .build()
/// };
/// assert!(fixed((1 << 52) - 1).is_ok());
/// assert_eq!(
///     fixed(1 << 52).unwrap_err().to_string(),
///     "tier \"t\": limit: 4503599627370496 is above 4503599627370495 (2^52 - 1), the largest \
///      limit of FixedWindow; the Redis script counts exactly only up to 2^53 (see Quota's docs \
///      for each algorithm's bound)"
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[must_use]
pub struct Quota {
    limit: u64,
    // Optional in a file only for a calendar tier's plans (which count per
    // the tier's calendar window); elsewhere a missing period is zero,
    // refused by build() naming it.
    #[serde(default, with = "humantime_serde")]
    period: Duration,
    #[serde(default)]
    burst: Option<u64>,
}

impl Quota {
    /// `limit` requests per `period`.
    pub const fn new(limit: u64, period: Duration) -> Self {
        Self {
            limit,
            period,
            burst: None,
        }
    }

    /// `limit` requests per second.
    pub const fn per_second(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(1))
    }

    /// `limit` requests per minute.
    pub const fn per_minute(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(60))
    }

    /// `limit` requests per hour.
    pub const fn per_hour(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(3600))
    }

    /// Allows bursts of up to `burst` requests at once (the token bucket's
    /// capacity). Without it the burst equals the limit.
    pub const fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// Requests per period.
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// The period.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// Whether a burst was set (else the capacity is the limit).
    pub(crate) const fn has_burst(&self) -> bool {
        self.burst.is_some()
    }

    /// The burst (capacity): the explicit burst, or the limit.
    pub const fn burst_size(&self) -> u64 {
        match self.burst {
            Some(b) => b,
            None => self.limit,
        }
    }
}
