//! [`Algorithm`]: which model a tier counts with, and its policy-file names.

use std::time::Duration;

/// The algorithm a tier counts with (see `docs/algorithms.md` for the
/// trade-offs and measured costs).
///
/// | algorithm | state per key | precision | bursts |
/// |---|---|---|---|
/// | [`FixedWindow`](Algorithm::FixedWindow) | 1 counter | up to 2 × limit across a window boundary | the whole limit at once |
/// | [`SlidingWindowLog`](Algorithm::SlidingWindowLog) | 1 entry per admitted request | exact | the whole limit at once |
/// | [`SlidingWindowCounter`](Algorithm::SlidingWindowCounter) | 2 counters | approximate (interpolated) | the whole limit at once |
/// | [`TokenBucket`](Algorithm::TokenBucket) (default) | tokens + timestamp | exact | up to `burst` |
/// | [`LeakyBucket`](Algorithm::LeakyBucket) | 1 timestamp (GCRA) | exact | up to `burst`; `Shape` delays instead of rejecting |
/// | [`Concurrency`](Algorithm::Concurrency) | 1 slot per request in flight | exact | — (requests **in flight**, not per period) |
///
/// Window algorithms use the quota's limit and period as the window; a
/// `burst` other than the limit is a configuration error for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// One counter per window, windows aligned to the Unix epoch
    /// ([`Limit::FixedWindow`](crate::algorithm::Limit::FixedWindow)).
    FixedWindow,
    /// Every admitted request's timestamp; exact
    /// ([`Limit::SlidingWindowLog`](crate::algorithm::Limit::SlidingWindowLog)).
    SlidingWindowLog,
    /// Current and previous window counters, interpolated
    /// ([`Limit::SlidingWindowCounter`](crate::algorithm::Limit::SlidingWindowCounter)).
    SlidingWindowCounter,
    /// Token bucket: capacity = the quota's burst, refilled at
    /// `limit / period`, in exact integer arithmetic
    /// ([`algorithm::TokenBucket`](crate::algorithm::TokenBucket)).
    #[default]
    TokenBucket,
    /// Leaky bucket as GCRA ([`algorithm::Gcra`](crate::algorithm::Gcra)).
    LeakyBucket(LeakyBucket),
    /// Requests **in flight** per key: at most the quota's `limit` at once
    /// (its period is not used); a slot is taken with the rate tiers' charge
    /// and released when the response body has been sent or dropped
    /// ([`algorithm::Concurrency`](crate::algorithm::Concurrency); see
    /// [`Tier::concurrency`](crate::Tier::concurrency)).
    Concurrency {
        /// How long a slot is held without renewal: a crashed instance's
        /// slots come back after it. Requests that run longer renew their
        /// slot every `slot_ttl / 2`. Default 60 s (policy file: `lease`).
        slot_ttl: Duration,
    },
}

/// The default slot TTL of a concurrency tier: 60 s.
pub(crate) const DEFAULT_SLOT_TTL: Duration = Duration::from_secs(60);

/// The two leaky buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeakyBucket {
    /// A meter: excess requests are rejected at once (decisions equal a token
    /// bucket's; the state is one theoretical arrival time).
    Police,
    /// A queue: a request that fits within `max_delay` is **delayed** until its
    /// slot and then passed (smoothing, like nginx `limit_req` without
    /// `nodelay`); one that does not fit is rejected with 429 at once. The wait
    /// holds no lock and no Redis connection.
    Shape {
        /// The longest a request may be held.
        max_delay: Duration,
    },
}

impl Algorithm {
    /// Every algorithm's [`name`](Algorithm::name), in the order of the
    /// table above: the values `algorithm` takes in a policy file.
    pub const NAMES: [&'static str; 7] = {
        let every = Algorithm::every(Duration::ZERO);
        let mut names = [""; 7];
        let mut i = 0;
        while i < names.len() {
            names[i] = every[i].name();
            i += 1;
        }
        names
    };

    /// The algorithm's name: `fixed_window`, `sliding_window_log`,
    /// `sliding_window_counter`, `token_bucket`, `leaky_bucket` (police) or
    /// `leaky_bucket_shape`. It is how a policy file spells it
    /// (`algorithm = "..."`; the shaping bucket's `max_delay` is a field of
    /// its own there), and how the admin API and replay reports show it.
    ///
    /// ```
    /// use tiered_ratelimit::{Algorithm, LeakyBucket};
    /// assert_eq!(Algorithm::TokenBucket.name(), "token_bucket");
    /// assert_eq!(Algorithm::LeakyBucket(LeakyBucket::Police).name(), "leaky_bucket");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket(LeakyBucket::Police) => "leaky_bucket",
            Algorithm::LeakyBucket(LeakyBucket::Shape { .. }) => "leaky_bucket_shape",
            Algorithm::Concurrency { .. } => "concurrency",
        }
    }

    /// The algorithm called `name` (one of [`Algorithm::NAMES`]), given
    /// the shaping leaky bucket's `max_delay`: `leaky_bucket_shape` requires
    /// it and every other algorithm refuses it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiered_ratelimit::{Algorithm, LeakyBucket};
    /// let two = Duration::from_secs(2);
    /// assert_eq!(Algorithm::from_name("fixed_window", None), Ok(Algorithm::FixedWindow));
    /// assert_eq!(
    ///     Algorithm::from_name("leaky_bucket_shape", Some(two)),
    ///     Ok(Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay: two }))
    /// );
    /// assert!(Algorithm::from_name("leaky_bucket_shape", None).is_err());
    /// assert!(Algorithm::from_name("gcra", None).is_err());
    /// ```
    ///
    /// # Errors
    /// [`AlgorithmNameError`]: an unknown name, a missing `max_delay` or one
    /// given to an algorithm that does not delay.
    pub fn from_name(name: &str, max_delay: Option<Duration>) -> Result<Self, AlgorithmNameError> {
        let algorithm = Algorithm::every(max_delay.unwrap_or_default())
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| AlgorithmNameError::Unknown(name.to_owned()))?;
        let shape = matches!(algorithm, Algorithm::LeakyBucket(LeakyBucket::Shape { .. }));
        match (shape, max_delay) {
            (true, None) => Err(AlgorithmNameError::MaxDelayRequired),
            (false, Some(_)) => Err(AlgorithmNameError::MaxDelayUnused),
            _ => Ok(algorithm),
        }
    }

    /// One of each algorithm, the shaping bucket with `max_delay`.
    const fn every(max_delay: Duration) -> [Algorithm; 7] {
        [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindowLog,
            Algorithm::SlidingWindowCounter,
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket(LeakyBucket::Police),
            Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }),
            Algorithm::Concurrency {
                slot_ttl: DEFAULT_SLOT_TTL,
            },
        ]
    }
}

/// The name of the one algorithm with a `max_delay`, for the messages.
const SHAPE: &str = Algorithm::LeakyBucket(LeakyBucket::Shape {
    max_delay: Duration::ZERO,
})
.name();

/// Why [`Algorithm::from_name`] returned no algorithm. The messages name
/// the policy file's field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AlgorithmNameError {
    /// No algorithm has this name.
    #[error("algorithm: unknown algorithm {0:?}, expected one of {names}", names = Algorithm::NAMES.join(", "))]
    Unknown(String),
    /// `leaky_bucket_shape` without a `max_delay`.
    #[error("max_delay: required by algorithm = {SHAPE:?}")]
    MaxDelayRequired,
    /// A `max_delay` for an algorithm that never delays.
    #[error("max_delay: only algorithm = {SHAPE:?} delays requests")]
    MaxDelayUnused,
}

#[cfg(test)]
mod tests {
    /// One table: every name parses back to its algorithm, and no two
    /// algorithms share a name.
    #[test]
    fn algorithm_names_round_trip() {
        use super::{Algorithm, AlgorithmNameError, LeakyBucket};
        use std::time::Duration;
        let d = Duration::from_millis(1500);
        for a in Algorithm::every(d) {
            let max_delay =
                matches!(a, Algorithm::LeakyBucket(LeakyBucket::Shape { .. })).then_some(d);
            assert_eq!(Algorithm::from_name(a.name(), max_delay), Ok(a));
        }
        let mut names = Algorithm::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 7);
        assert_eq!(
            Algorithm::from_name("gcra", None).unwrap_err().to_string(),
            "algorithm: unknown algorithm \"gcra\", expected one of fixed_window, \
             sliding_window_log, sliding_window_counter, token_bucket, leaky_bucket, \
             leaky_bucket_shape, concurrency"
        );
        assert_eq!(
            Algorithm::from_name("leaky_bucket_shape", None),
            Err(AlgorithmNameError::MaxDelayRequired)
        );
        assert_eq!(
            Algorithm::from_name("sliding_window_log", Some(d))
                .unwrap_err()
                .to_string(),
            "max_delay: only algorithm = \"leaky_bucket_shape\" delays requests"
        );
    }
}
