//! Metric names and log throttling.
//!
//! Metrics go through the [`metrics`] facade; install any exporter (for
//! example `metrics-exporter-prometheus`) to see them. Labels are bounded:
//! tier names and fixed words, never a user, IP or API key.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `tiered_ratelimit_requests_total` | counter | `decision` (`allowed`, `limited`, `fail_open`, `fail_closed`, `skipped`), `tier` (on `limited`: the binding tier) | one per request that reached the layer |
//! | `tiered_ratelimit_backend_errors_total` | counter | `kind` (`timeout`, `connection`, `script`, `key`), `backend` | failed checks |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) const REQUESTS: &str = "tiered_ratelimit_requests_total";
pub(crate) const BACKEND_ERRORS: &str = "tiered_ratelimit_backend_errors_total";

pub(crate) fn count_decision(decision: &'static str) {
    metrics::counter!(REQUESTS, "decision" => decision).increment(1);
}

pub(crate) fn count_limited(tier: &Arc<str>) {
    metrics::counter!(REQUESTS, "decision" => "limited", "tier" => tier.to_string()).increment(1);
}

pub(crate) fn count_backend_error(kind: &'static str, backend: &'static str) {
    metrics::counter!(BACKEND_ERRORS, "kind" => kind, "backend" => backend).increment(1);
}

/// Lets one log line through per interval and counts the rest, so an outage
/// at 10 000 requests per second logs once a second, not 10 000 times.
pub(crate) struct LogThrottle {
    origin: Instant,
    interval_ms: u64,
    /// Milliseconds since `origin` at which the next line may be logged.
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl LogThrottle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            origin: Instant::now(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(suppressed since the last line)` if a line may be logged now.
    pub(crate) fn permit(&self) -> Option<u64> {
        let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(self.interval_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
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
    fn throttle_lets_one_through_per_interval() {
        let t = LogThrottle::new(Duration::from_secs(3600));
        assert_eq!(t.permit(), Some(0));
        assert_eq!(t.permit(), None);
        assert_eq!(t.permit(), None);
        t.next_ms.store(0, Ordering::Relaxed);
        assert_eq!(t.permit(), Some(2));
    }
}
