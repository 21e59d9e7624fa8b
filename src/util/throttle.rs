//! Rate limits for the limiter's own log lines: [`Throttle`] lets one event
//! through per interval; [`LogThrottle`] also counts what it held back, so
//! an outage at 10 000 requests per second logs once a second with the
//! number of lines suppressed, not 10 000 lines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Lets one event through per interval, lock-free: the hot path (an event
/// that is not due) is one clock read and one relaxed atomic load.
#[derive(Debug)]
pub(crate) struct Throttle {
    origin: Instant,
    interval_ms: u64,
    /// Milliseconds since `origin` from which the next event may pass.
    next_ms: AtomicU64,
}

impl Throttle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            origin: Instant::now(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
        }
    }

    /// Whether an event may pass now (at most one per interval).
    pub(crate) fn permit(&self) -> bool {
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

/// A [`Throttle`] for log lines that counts the lines it held back.
#[derive(Debug)]
pub(crate) struct LogThrottle {
    gate: Throttle,
    suppressed: AtomicU64,
}

impl LogThrottle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            gate: Throttle::new(interval),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last one)` if a line may be logged
    /// now.
    pub(crate) fn permit(&self) -> Option<u64> {
        if self.gate.permit() {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_passes_one_per_interval() {
        let t = Throttle::new(Duration::from_secs(3600));
        assert!(t.permit());
        assert!(!t.permit());
        t.next_ms.store(0, Ordering::Relaxed);
        assert!(t.permit());
        assert!(!t.permit());
    }

    #[test]
    fn log_throttle_counts_what_it_held_back() {
        let t = LogThrottle::new(Duration::from_secs(3600));
        assert_eq!(t.permit(), Some(0));
        assert_eq!(t.permit(), None);
        assert_eq!(t.permit(), None);
        t.gate.next_ms.store(0, Ordering::Relaxed);
        assert_eq!(t.permit(), Some(2));
    }
}
