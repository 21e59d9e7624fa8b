//! The misconfiguration warning's rate limit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Lets one event through per interval, lock-free: the hot path (an event
/// that is not due) is one clock read and one relaxed atomic load.
pub(super) struct WarnThrottle {
    origin: Instant,
    interval_ms: u64,
    /// Milliseconds since `origin` from which the next event may pass.
    next_ms: AtomicU64,
}

impl WarnThrottle {
    pub(super) fn new(interval: Duration) -> Self {
        Self {
            origin: Instant::now(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
        }
    }

    pub(super) fn permit(&self) -> bool {
        let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(self.interval_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warn_throttle_passes_one_per_interval() {
        let t = WarnThrottle::new(Duration::from_secs(3600));
        assert!(t.permit());
        assert!(!t.permit());
        t.next_ms.store(0, Ordering::Relaxed);
        assert!(t.permit());
        assert!(!t.permit());
    }
}
