//! Metric names and log throttling.
//!
//! Metrics go through the [`metrics`] facade; install any exporter (for
//! example `metrics-exporter-prometheus`) to see them. Labels are bounded:
//! tier names and fixed words, never a user, IP or API key.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `tiered_ratelimit_requests_total` | counter | `decision` (`allowed`, `limited`, `shadow_limited`, `cache_blocked`, `allowlisted`, `denylisted`, `fail_open`, `fail_closed`, `fallback`, `skipped`) | exactly one per request that reached the layer (`cache_blocked` is a 429 answered by the deny cache, not also `limited`) |
//! | `tiered_ratelimit_tier_decisions_total` | counter | `decision` (`limited`, `shadow_limited`, `near_limit`), `tier`, `plan` (a configured plan name, or `default`) | per tier: rejections (the binding tier), would-be rejections, and admissions with under 20 % left |
//! | `tiered_ratelimit_fleet_blocked_flushed_total` | counter | — | deny-cache 429s (cost) flushed to the fleet-wide hourly sets (see [`fleet`]) |
//! | `tiered_ratelimit_fleet_blocked_dropped_total` | counter | `reason` (`overflow`, `error`, `timeout`) | deny-cache 429s (cost) not counted fleet-wide |
//! | `tiered_ratelimit_backend_errors_total` | counter | `kind` (`timeout`, `connection`, `script`, `key`, `circuit_open`), `backend` | failed checks |
//! | `tiered_ratelimit_key_errors_total` | counter | `tier`, `reason` (`missing_connect_info`, `configuration`, `request`) | key extractions that failed (the tier is skipped, or 503 under `Closed`) |

pub mod anomaly;
pub(crate) mod fleet;
pub mod recorder;
pub mod topn;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) const REQUESTS: &str = "tiered_ratelimit_requests_total";
pub(crate) const BACKEND_ERRORS: &str = "tiered_ratelimit_backend_errors_total";

/// The `decision` label values of [`REQUESTS`], in [`Counts`]' order.
const DECISIONS: [&str; 10] = [
    "allowed",
    "limited",
    "shadow_limited",
    "allowlisted",
    "denylisted",
    "fail_open",
    "fail_closed",
    "skipped",
    "cache_blocked",
    "fallback",
];

/// Index of a decision in [`DECISIONS`] (unknown words count as `skipped`).
fn decision_index(decision: &str) -> usize {
    DECISIONS.iter().position(|d| *d == decision).unwrap_or(7)
}

/// A layer's handles for the metrics every request touches (the requests
/// counter by decision, the check-duration histograms), registered once per
/// recorder instead of per request: a request then costs an atomic add, or
/// nothing with no recorder installed. Registered again when the current
/// recorder changes (installed after the layer was built, or a thread-local
/// recorder in tests; told apart by address), and at least every
/// [`REFRESH`]: an exporter that drops idle series (Prometheus's
/// `idle_timeout`) would otherwise leave a held handle counting into a
/// series it no longer exports (metrics-rs/metrics#372).
pub(crate) struct RequestMetrics {
    backend: &'static str,
    cached: arc_swap::ArcSwapOption<Handles>,
}

/// How long registered handles are used before they are registered again.
const REFRESH: Duration = Duration::from_secs(1);

struct Handles {
    /// Address of the recorder these were registered with.
    recorder: usize,
    registered: Instant,
    requests: [metrics::Counter; 10],
    backend_latency: metrics::Histogram,
    total_latency: metrics::Histogram,
}

impl RequestMetrics {
    pub(crate) fn new(backend: &'static str) -> Self {
        Self {
            backend,
            cached: arc_swap::ArcSwapOption::empty(),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&Handles) -> R) -> R {
        let recorder = metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize);
        let cached = self.cached.load();
        if let Some(h) = cached.as_deref() {
            if h.recorder == recorder {
                return f(h);
            }
        }
        let backend = self.backend;
        let h = Arc::new(Handles {
            recorder,
            registered: Instant::now(),
            requests: DECISIONS.map(|d| metrics::counter!(REQUESTS, "decision" => d)),
            backend_latency: metrics::histogram!(CHECK_DURATION, "backend" => backend, "part" => "backend"),
            total_latency: metrics::histogram!(CHECK_DURATION, "backend" => backend, "part" => "total"),
        });
        self.cached.store(Some(h.clone()));
        f(&h)
    }

    /// Counts one request under `decision` (a [`DECISIONS`] word).
    pub(crate) fn count(&self, decision: &str) {
        self.with(|h| h.requests[decision_index(decision)].increment(1));
    }

    /// Records the latency the check added: the backend call, and the
    /// layer's whole work for the request since `started` (backend
    /// included). Once a [`REFRESH`] the handles are dropped, to be
    /// registered again by the next use.
    pub(crate) fn latency(&self, backend: Option<Duration>, started: Option<Instant>) {
        let now = Instant::now();
        let stale = self.with(|h| {
            if let Some(d) = backend {
                h.backend_latency.record(d.as_secs_f64());
            }
            if let Some(t) = started {
                h.total_latency
                    .record(now.saturating_duration_since(t).as_secs_f64());
            }
            now.saturating_duration_since(h.registered) >= REFRESH
        });
        if stale {
            self.cached.store(None);
        }
    }
}

pub(crate) const LIMITED: &str = "limited";
pub(crate) const SHADOW_LIMITED: &str = "shadow_limited";

/// Counts a tier's rejection (or would-be rejection, or near-limit
/// admission) with the tier and plan labels.
pub(crate) fn count_tier(decision: &'static str, tier: &Arc<str>, plan: &str) {
    metrics::counter!(
        TIER_DECISIONS,
        "decision" => decision,
        "tier" => tier.to_string(),
        "plan" => plan.to_owned()
    )
    .increment(1);
}

pub(crate) const TIER_DECISIONS: &str = "tiered_ratelimit_tier_decisions_total";

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

    /// Handles registered with one recorder are not used with another: a
    /// recorder installed after the layer was built sees every request.
    #[test]
    fn request_metrics_follow_the_current_recorder() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let m = RequestMetrics::new("memory");
        m.count("allowed"); // no recorder: nothing, no panic
                            // Every decision's series exists (at 0) once registered.
        let allowed = |r: &DebuggingRecorder| -> Vec<u64> {
            r.snapshotter()
                .snapshot()
                .into_vec()
                .into_iter()
                .filter_map(|(k, _, _, v)| match v {
                    DebugValue::Counter(c)
                        if k.key().name() == REQUESTS
                            && k.key().labels().any(|l| l.value() == "allowed") =>
                    {
                        Some(c)
                    }
                    _ => None,
                })
                .collect()
        };
        let a = DebuggingRecorder::new();
        metrics::with_local_recorder(&a, || {
            m.count("allowed");
            m.count("allowed");
        });
        let b = DebuggingRecorder::new();
        metrics::with_local_recorder(&b, || m.count("allowed"));
        metrics::with_local_recorder(&a, || m.count("allowed"));
        assert_eq!(allowed(&a), vec![3]);
        assert_eq!(allowed(&b), vec![1]);
    }
}

/// Requests by decision since the layer was built (this process only), as
/// read by [`RateLimitHandle::counts`](crate::RateLimitHandle::counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DecisionCounts {
    /// Passed every applicable tier.
    pub allowed: u64,
    /// Rejected with 429 by an enforced tier.
    pub limited: u64,
    /// Passed, but a shadow (or not-enforced canary) tier would have rejected it.
    pub shadow_limited: u64,
    /// On the allowlist: not limited.
    pub allowlisted: u64,
    /// On the denylist: refused.
    pub denylisted: u64,
    /// Passed because the backend failed and the policy is open.
    pub fail_open: u64,
    /// Refused with 503 because the backend failed and the policy is closed.
    pub fail_closed: u64,
    /// No tier applied (anonymous on a user tier, OPTIONS, mode off, ...).
    pub skipped: u64,
    /// Rejected by the local deny cache, without a backend call.
    pub cache_blocked: u64,
    /// Decided by the local fallback limiter while the backend was down.
    pub fallback: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counts {
    allowed: AtomicU64,
    limited: AtomicU64,
    shadow_limited: AtomicU64,
    allowlisted: AtomicU64,
    denylisted: AtomicU64,
    fail_open: AtomicU64,
    fail_closed: AtomicU64,
    skipped: AtomicU64,
    cache_blocked: AtomicU64,
    fallback: AtomicU64,
}

impl Counts {
    /// Counts one request under `decision`.
    pub(crate) fn add(&self, decision: &'static str) {
        let c = match decision_index(decision) {
            0 => &self.allowed,
            1 => &self.limited,
            2 => &self.shadow_limited,
            3 => &self.allowlisted,
            4 => &self.denylisted,
            5 => &self.fail_open,
            6 => &self.fail_closed,
            8 => &self.cache_blocked,
            9 => &self.fallback,
            _ => &self.skipped,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> DecisionCounts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DecisionCounts {
            allowed: r(&self.allowed),
            limited: r(&self.limited),
            shadow_limited: r(&self.shadow_limited),
            allowlisted: r(&self.allowlisted),
            denylisted: r(&self.denylisted),
            fail_open: r(&self.fail_open),
            fail_closed: r(&self.fail_closed),
            skipped: r(&self.skipped),
            cache_blocked: r(&self.cache_blocked),
            fallback: r(&self.fallback),
        }
    }
}

pub(crate) const CIRCUIT_STATE: &str = "tiered_ratelimit_circuit_state";

/// The circuit breaker gauge: 0 closed, 1 open, 2 half-open.
pub(crate) fn set_circuit_state(state: crate::breaker::State) {
    metrics::gauge!(CIRCUIT_STATE).set(f64::from(state as u8));
}

pub(crate) const ANOMALY: &str = "tiered_ratelimit_anomaly";
pub(crate) const CHECK_DURATION: &str = "tiered_ratelimit_check_duration_seconds";
pub(crate) const MODE: &str = "tiered_ratelimit_mode";

/// The mode gauge of a tier: 0 off, 1 shadow, 2 canary, 3 enforce; and the
/// canary percent gauge.
pub(crate) fn set_mode_gauge(tier: &Arc<str>, mode: crate::Mode) {
    let (v, percent) = match mode {
        crate::Mode::Off => (0.0, 0.0),
        crate::Mode::Shadow => (1.0, 0.0),
        crate::Mode::Canary { percent } => (2.0, f64::from(percent.min(100))),
        crate::Mode::Enforce => (3.0, 100.0),
    };
    metrics::gauge!(MODE, "tier" => tier.to_string()).set(v);
    metrics::gauge!(ENFORCED_PERCENT, "tier" => tier.to_string()).set(percent);
}

pub(crate) const ENFORCED_PERCENT: &str = "tiered_ratelimit_enforced_percent";
pub(crate) const NEAR_LIMIT: &str = "near_limit";
