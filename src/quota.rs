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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Quota {
    limit: u64,
    period: Duration,
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

    /// The burst (capacity): the explicit burst, or the limit.
    pub const fn burst_size(&self) -> u64 {
        match self.burst {
            Some(b) => b,
            None => self.limit,
        }
    }
}
