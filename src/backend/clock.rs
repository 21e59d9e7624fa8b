use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A clock that only moves when told to, in Unix epoch microseconds.
///
/// For tests and offline replay: give the same `ManualClock` to a
/// [`MemoryBackend`](crate::backend::MemoryBackend) and a
/// [`RedisBackend`](crate::backend::RedisBackend) and both decide at exactly
/// the same instants. With a manual clock the Redis scripts use the time
/// passed in instead of Redis `TIME` — never use one in production, where
/// app servers' clocks disagree.
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::backend::ManualClock;
///
/// let clock = ManualClock::new(1_700_000_000_000_000);
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now_us(), 1_700_000_001_500_000);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `epoch_us` (microseconds since the Unix epoch).
    pub fn new(epoch_us: u64) -> Self {
        Self(Arc::new(AtomicU64::new(epoch_us)))
    }

    /// The current reading in epoch microseconds.
    pub fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// Sets the reading to `epoch_us`.
    pub fn set(&self, epoch_us: u64) {
        self.0.store(epoch_us, Ordering::SeqCst);
    }

    /// Moves the clock forward by `by` (saturating, whole microseconds).
    pub fn advance(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                Some(v.saturating_add(us))
            });
    }
}

/// The memory backend's clock: monotonic (tokio's, so tests can pause it)
/// anchored to the wall clock once, or manual.
#[derive(Debug, Clone)]
pub(crate) enum Clock {
    Monotonic {
        origin_epoch_us: u64,
        origin: tokio::time::Instant,
    },
    Manual(ManualClock),
}

impl Clock {
    pub(crate) fn monotonic() -> Self {
        let origin_epoch_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Clock::Monotonic {
            origin_epoch_us,
            origin: tokio::time::Instant::now(),
        }
    }

    pub(crate) fn now_us(&self) -> u64 {
        match self {
            Clock::Monotonic {
                origin_epoch_us,
                origin,
            } => epoch_us(*origin_epoch_us, origin.elapsed()),
            Clock::Manual(c) => c.now_us(),
        }
    }

    /// [`Self::now_us`] at `at`, an instant already read: one reading of
    /// the clock serves every step of a request that happens at once (a
    /// read costs ~60 ns in a VM). A manual clock reads itself.
    pub(crate) fn at(&self, at: std::time::Instant) -> u64 {
        match self {
            Clock::Monotonic {
                origin_epoch_us,
                origin,
            } => epoch_us(
                *origin_epoch_us,
                tokio::time::Instant::from_std(at).saturating_duration_since(*origin),
            ),
            Clock::Manual(c) => c.now_us(),
        }
    }
}

/// Epoch µs `elapsed` after the origin `origin_epoch_us`.
fn epoch_us(origin_epoch_us: u64, elapsed: std::time::Duration) -> u64 {
    origin_epoch_us.saturating_add(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
}
