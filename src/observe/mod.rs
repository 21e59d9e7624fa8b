//! Metric names and log throttling.
//!
//! Metrics go through the [`metrics`] facade; install any exporter (for
//! example `metrics-exporter-prometheus`) to see them. Labels are bounded:
//! tier names and fixed words, never a user, IP or API key.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `tiered_ratelimit_requests_total` | counter | `decision` (`allowed`, `limited`, `shadow_limited`, `cache_blocked`, `allowlisted`, `denylisted`, `fail_open`, `fail_closed`, `fallback`, `skipped`) | exactly one per request that reached the layer (`limited`: the backend's 429s and each key's first from the deny cache; `cache_blocked`: the deny cache's later ones, not also `limited`) |
//! | `tiered_ratelimit_tier_decisions_total` | counter | `tier`, `plan` (a configured plan name, or `default`), `endpoint` (`METHOD route template`, `METHOD <unmatched>`, or `<other>` past the endpoint cap), `decision` (`allowed`, `near_limit`, `limited`, `limited_not_binding`, `shadow_limited`) | every decision of every tier: one per tier a request was checked against (`limited`: the binding tier of a 429) |
//! | `tiered_ratelimit_candidate_decisions_total` | counter | `tier`, `candidate` (its quota, `80/1m`), `decision` (`allowed`, `would_deny`) | every check of a candidate quota (docs/rollout.md, "Candidate quotas"): what it would have answered; it never answers |
//! | `tiered_ratelimit_fleet_blocked_flushed_total` | counter | — | deny-cache 429s (cost) flushed to the fleet-wide hourly sets (see docs/redis.md, "Cached 429s in the blocked set") |
//! | `tiered_ratelimit_fleet_blocked_dropped_total` | counter | `reason` (`overflow`, `error`, `timeout`) | deny-cache 429s (cost) not counted fleet-wide |
//! | `tiered_ratelimit_backend_errors_total` | counter | `kind` (`timeout`, `connection`, `script`, `key`, `circuit_open`), `backend` | failed checks |
//! | `tiered_ratelimit_concurrency_lapses_total` | counter | `tier` | a concurrency tier's slot that lapsed while its request still ran (every renewal, retried, failed until the slot's TTL ran out): the tier may have admitted one request too many |
//! | `tiered_ratelimit_key_errors_total` | counter | `tier`, `reason` (`missing_connect_info`, `configuration`, `request`) | key extractions that failed (the tier is skipped, or 503 under `Closed`) |

pub(crate) mod anomaly;
pub(crate) mod candidates;
mod counts;
pub mod demand;
pub(crate) mod fleet;
pub(crate) mod fleet_candidates;
mod flush_task;
// The guard judges fleet buckets, which only a Redis backend keeps.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) mod guard;
pub(crate) mod recorder;
pub(crate) mod topn;

pub use anomaly::AnomalyConfig;
pub use candidates::{CandidateKey, CandidateReport, CandidatesReport};
pub use recorder::{AnomalyStatus, BucketCounts};
pub use topn::BlockedKey;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use counts::Counts;
pub use counts::DecisionCounts;
use recorder::Endpoint;

pub(crate) const REQUESTS: &str = "tiered_ratelimit_requests_total";
pub(crate) const BACKEND_ERRORS: &str = "tiered_ratelimit_backend_errors_total";
pub(crate) const SETTLE_FAILURES: &str = "tiered_ratelimit_settle_failures_total";

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

/// What the layer did with one request: the `decision` label of
/// [`REQUESTS`] and a field of [`DecisionCounts`]. Its discriminant indexes
/// [`DECISIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestDecision {
    Allowed = 0,
    Limited = 1,
    ShadowLimited = 2,
    Allowlisted = 3,
    Denylisted = 4,
    FailOpen = 5,
    FailClosed = 6,
    Skipped = 7,
    CacheBlocked = 8,
    Fallback = 9,
}

/// A layer's handles for the metrics every request touches (the requests
/// counter by decision, the check-duration histograms, and the per-tier
/// decision counter's cells), registered once per recorder instead of per
/// request: a request then costs an atomic add, or nothing with no recorder
/// installed. Registered again when the current recorder changes (installed
/// after the layer was built, or a thread-local recorder in tests; told
/// apart by address), and at least every [`REFRESH`]: an exporter that
/// drops idle series (Prometheus's `idle_timeout`) would otherwise leave a
/// held handle counting into a series it no longer exports
/// (metrics-rs/metrics#372).
pub(crate) struct RequestMetrics {
    backend: &'static str,
    /// Tiers of the layer, and the most endpoint series (the observer's
    /// endpoint cap, `<other>` included): the sizes of the cell tables.
    tiers: usize,
    endpoints: usize,
    cached: arc_swap::ArcSwapOption<Handles>,
    /// Unique in this process, for [`THREAD_HANDLES`].
    id: u64,
    /// Bumped after each store into `cached`: a thread's copy of the
    /// handles is used while it is still of the current generation.
    generation: std::sync::atomic::AtomicU64,
}

/// Distinct ids of [`RequestMetrics`], for [`THREAD_HANDLES`] (an address
/// could be reused by a later layer).
static NEXT_METRICS_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A thread's copy of one layer's current handles: which layer
/// ([`RequestMetrics`]'s id), of which generation.
struct ThreadHandles {
    metrics: u64,
    generation: u64,
    handles: Arc<Handles>,
}

thread_local! {
    /// The handles this thread used last. A request looks its layer's
    /// handles up twice (its tier decisions, then its latency): here that is
    /// a thread-local read, not an `arc_swap` load and its guard each.
    static THREAD_HANDLES: std::cell::RefCell<Option<ThreadHandles>> =
        const { std::cell::RefCell::new(None) };
}

/// How long registered handles are used before they are registered again.
const REFRESH: Duration = Duration::from_secs(1);

/// Plan slots per tier in the cell table: the default plan and the first
/// `PLAN_SLOTS - 1` configured plans of a tier. Further plans are counted
/// correctly, registering their counter on each use.
pub(crate) const PLAN_SLOTS: usize = 8;

/// The `decision` label values of [`TIER_DECISIONS`]: every check of a tier
/// counts exactly once, under one of these.
pub(crate) const TIER_DECISION_LABELS: [&str; 5] = [
    "allowed",
    "near_limit",
    "limited",
    "limited_not_binding",
    "shadow_limited",
];

/// One tier's decision on one request, as counted by [`TIER_DECISIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TierOutcome {
    /// Allowed with at least 20 % of the capacity left.
    Allowed = 0,
    /// Allowed with less than 20 % left (`remaining × 5 < capacity`).
    NearLimit = 1,
    /// Denied, and this tier answered the 429 (the binding tier).
    Limited = 2,
    /// Denied (enforced), but another enforced tier with a longer wait
    /// answered the 429.
    LimitedNotBinding = 3,
    /// Would have denied (shadow, or a canary tier not enforced for the key).
    ShadowLimited = 4,
}

/// One tier's decision on a request, for [`RequestMetrics::count_tiers`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct TierCount {
    /// The request's check index (passed back to the labels function).
    pub(crate) check: usize,
    /// The tier's index in the layer.
    pub(crate) tier: usize,
    /// 0 for the default plan, else 1 + the plan's position in the tier.
    pub(crate) slot: usize,
    pub(crate) decision: TierOutcome,
}

/// A tier-decision counter cell: the plan it was registered for, and it.
type Cell = std::sync::OnceLock<(Arc<str>, metrics::Counter)>;

struct Handles {
    /// Address of the recorder these were registered with.
    recorder: usize,
    /// When these are to be registered again ([`REFRESH`] after they were).
    stale_at: Instant,
    requests: [metrics::Counter; 10],
    backend_latency: metrics::Histogram,
    total_latency: metrics::Histogram,
    /// Per endpoint id: its cells, (tier × plan slot × decision), made on
    /// the endpoint's first use, each registered on its first use.
    endpoints: Box<[std::sync::OnceLock<Box<[Cell]>>]>,
    /// Per tier: `tiered_ratelimit_tier_no_key_total{tier}`, registered on
    /// its first use (anonymous traffic on a `user` tier counts here on
    /// most requests: no registry lookup or label vector each time).
    no_key: Box<[std::sync::OnceLock<metrics::Counter>]>,
}

impl RequestMetrics {
    pub(crate) fn new(backend: &'static str, tiers: usize, endpoints: usize) -> Self {
        Self {
            backend,
            tiers,
            endpoints,
            cached: arc_swap::ArcSwapOption::empty(),
            id: NEXT_METRICS_ID.fetch_add(1, Ordering::Relaxed),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Stores the current handles (or none: registered again on next use),
    /// then moves to the next generation.
    fn store(&self, handles: Option<Arc<Handles>>) {
        self.cached.store(handles);
        self.generation.fetch_add(1, Ordering::Release);
    }

    fn with<R>(&self, f: impl FnOnce(&Handles) -> R) -> R {
        let recorder = metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize);
        // Read before `cached`: a copy made from a later store is then at
        // worst of an older generation, and refreshed at its next use.
        let generation = self.generation.load(Ordering::Acquire);
        let mut f = Some(f);
        let done = THREAD_HANDLES
            .try_with(|t| {
                let t = t.try_borrow().ok()?;
                let t = t.as_ref().filter(|t| {
                    t.metrics == self.id
                        && t.generation == generation
                        && t.handles.recorder == recorder
                })?;
                let f = f.take()?;
                Some(f(&t.handles))
            })
            .ok()
            .flatten();
        if let Some(r) = done {
            return r;
        }
        let Some(f) = f.take() else {
            unreachable!("the closure runs only when it returns its result");
        };
        let cached = self.cached.load_full();
        if let Some(h) = cached.filter(|h| h.recorder == recorder) {
            self.keep_on_thread(generation, &h);
            return f(&h);
        }
        describe();
        let backend = self.backend;
        let h = Arc::new(Handles {
            recorder,
            stale_at: Instant::now() + REFRESH,
            requests: DECISIONS.map(|d| metrics::counter!(REQUESTS, "decision" => d)),
            backend_latency: metrics::histogram!(CHECK_DURATION, "backend" => backend, "part" => "backend"),
            total_latency: metrics::histogram!(CHECK_DURATION, "backend" => backend, "part" => "total"),
            endpoints: (0..self.endpoints)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
            no_key: (0..self.tiers)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
        });
        self.store(Some(h.clone()));
        f(&h)
    }

    /// Makes `handles` this thread's copy, as of `generation`.
    fn keep_on_thread(&self, generation: u64, handles: &Arc<Handles>) {
        let _ = THREAD_HANDLES.try_with(|t| {
            if let Ok(mut t) = t.try_borrow_mut() {
                *t = Some(ThreadHandles {
                    metrics: self.id,
                    generation,
                    handles: handles.clone(),
                });
            }
        });
    }

    /// Counts one request on which tier `tier` (named `name`) had no key,
    /// under `metric` (`tiered_ratelimit_tier_no_key_total`).
    pub(crate) fn count_no_key(&self, metric: &'static str, tier: usize, name: &Arc<str>) {
        self.with(|h| match h.no_key.get(tier) {
            Some(c) => c
                .get_or_init(|| metrics::counter!(metric, "tier" => name.clone()))
                .increment(1),
            None => metrics::counter!(metric, "tier" => name.clone()).increment(1),
        });
    }

    /// Counts one request under `decision` (a [`DECISIONS`] word).
    pub(crate) fn count(&self, decision: RequestDecision) {
        self.with(|h| h.requests[decision as usize].increment(1));
    }

    /// Counts tier decisions of one request on `endpoint`, and the request
    /// under `request` (a [`DECISIONS`] word) if given, with one lookup of
    /// the handles. `labels(check)` gives a check's tier and plan names; it
    /// is called only to register a cell, or to match a named plan.
    pub(crate) fn count_tiers<'a>(
        &self,
        request: Option<RequestDecision>,
        endpoint: &Endpoint,
        decisions: impl IntoIterator<Item = TierCount>,
        labels: impl Fn(usize) -> (&'a str, &'a str),
    ) {
        self.with(|h| {
            if let Some(d) = request {
                h.requests[d as usize].increment(1);
            }
            let cells = h.endpoints.get(endpoint.id).map(|e| {
                e.get_or_init(|| {
                    (0..self.tiers * PLAN_SLOTS * TIER_DECISION_LABELS.len())
                        .map(|_| Cell::new())
                        .collect()
                })
            });
            let register = |check: usize, d: TierOutcome| {
                let (tier, plan) = labels(check);
                metrics::counter!(
                    TIER_DECISIONS,
                    "decision" => TIER_DECISION_LABELS[d as usize],
                    "tier" => tier.to_owned(),
                    "plan" => plan.to_owned(),
                    "endpoint" => endpoint.name.to_string()
                )
            };
            for c in decisions {
                let cell = if c.slot < PLAN_SLOTS {
                    let i = (c.tier * PLAN_SLOTS + c.slot) * TIER_DECISION_LABELS.len()
                        + c.decision as usize;
                    cells.and_then(|cells| cells.get(i))
                } else {
                    None
                };
                let Some(cell) = cell else {
                    register(c.check, c.decision).increment(1);
                    continue;
                };
                let (plan, counter) = cell
                    .get_or_init(|| (Arc::from(labels(c.check).1), register(c.check, c.decision)));
                // Slot 0 is always `default`; a named plan's slot may have
                // been reconfigured to another plan within this REFRESH.
                if c.slot == 0 || **plan == *labels(c.check).1 {
                    counter.increment(1);
                } else {
                    register(c.check, c.decision).increment(1);
                }
            }
        });
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
            now >= h.stale_at
        });
        if stale {
            self.store(None);
        }
    }
}

pub(crate) const TIER_DECISIONS: &str = "tiered_ratelimit_tier_decisions_total";

/// The address of the recorder the metrics were last described to (0:
/// none yet).
static DESCRIBED_FOR: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Gives every series of the crate its unit and `# HELP` text
/// (`metrics::describe_*`), once per recorder: called when a layer is
/// built and whenever a layer registers its handles with a recorder it has
/// not seen (one installed after the layer was built), so a scrape carries
/// HELP lines whatever the order. docs/observability.md has the long form.
pub(crate) fn describe() {
    let recorder = metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize);
    if DESCRIBED_FOR.swap(recorder, Ordering::Relaxed) == recorder {
        return;
    }
    describe_all();
}

/// [`describe`] whatever the recorder (a layer being built: rare, and a
/// recorder at the address of a dropped one is still described).
pub(crate) fn describe_all() {
    let recorder = metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize);
    DESCRIBED_FOR.store(recorder, Ordering::Relaxed);
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        REQUESTS,
        Unit::Count,
        "Requests that reached the rate limiter, one per request, by decision; the 429s are limited + cache_blocked (a key's first 429 is limited)"
    );
    describe_counter!(
        TIER_DECISIONS,
        Unit::Count,
        "Every tier's decision on every request it checked, by tier, plan, endpoint and decision (limited: the tier that answered the 429)"
    );
    describe_counter!(
        BACKEND_ERRORS,
        Unit::Count,
        "Checks the backend did not answer (timeout, connection, script, key, circuit_open), each then decided by the failure policy"
    );
    describe_counter!(
        "tiered_ratelimit_key_errors_total",
        Unit::Count,
        "Requests whose key extractor failed, by tier and reason (that tier skipped, or 503 under the closed failure policy)"
    );
    describe_histogram!(
        CHECK_DURATION,
        Unit::Seconds,
        "Latency the rate limiter added to a checked request, in seconds: part=total (its whole work) or part=backend (the backend call)"
    );
    describe_gauge!(
        CIRCUIT_STATE,
        "The backend circuit breaker: 0 closed, 1 open (set on transitions)"
    );
    describe_gauge!(
        MODE,
        "A tier's mode in force: 0 off, 1 shadow, 2 canary, 3 enforce"
    );
    describe_gauge!(
        ENFORCED_PERCENT,
        Unit::Percent,
        "Share of a tier's keys enforced, in percent: 100 enforce, n canary, 0 shadow or off"
    );
    describe_gauge!(
        SETTINGS_VERSION,
        "The fleet-wide settings version this instance applies (0: the configured settings)"
    );
    describe_gauge!(
        ROLLOUT_STAGE,
        "The stage of the tier's rollout plan this instance read (0 before a start)"
    );
    describe_gauge!(
        ROLLOUT_VERSION,
        "The version of the tier's rollout plan this instance read (0: none stored)"
    );
    describe_gauge!(
        ROLLOUT_HOLDING,
        "1 while a gate holds the tier's rollout plan, else 0"
    );
    describe_gauge!(
        ANOMALY,
        "1 while a (tier, endpoint) 429 rate is outside its baseline, 0 once back"
    );
    describe_counter!(
        fleet::FLUSHED,
        Unit::Count,
        "Deny-cache 429s (cost) added to the fleet-wide hourly blocked-keys sets"
    );
    describe_counter!(
        fleet::DROPPED,
        Unit::Count,
        "Deny-cache 429s (cost) not counted fleet-wide, by reason (overflow, error, timeout)"
    );
    describe_counter!(
        "tiered_ratelimit_lease_calls_total",
        Unit::Count,
        "Lease mode: script calls that took, or tried to take, a token lease from a shared bucket"
    );
    describe_counter!(
        "tiered_ratelimit_lease_tokens_total",
        Unit::Count,
        "Lease mode: tokens (requests) taken out of shared buckets by leases, and returned (op)"
    );
    describe_counter!(
        "tiered_ratelimit_tier_no_key_total",
        Unit::Count,
        "Requests on which a tier found no key and so did not apply, by tier (auth middleware inside the limiter, a missing header)"
    );
    describe_counter!(
        "tiered_ratelimit_cost_exceeds_capacity_total",
        Unit::Count,
        "429s whose cost exceeds the binding tier's capacity: they can never pass (no Retry-After), by tier; a likely misconfiguration"
    );
    describe_counter!(
        "tiered_ratelimit_concurrency_lapses_total",
        Unit::Count,
        "Concurrency slots that lapsed while their request still ran (renewals failed until the slot expired), by tier"
    );
    describe_counter!(
        "tiered_ratelimit_refund_failures_total",
        Unit::Count,
        "Redis Cluster: refunds of a cross-slot denial that did not land, by kind"
    );
    describe_counter!(
        SETTLE_FAILURES,
        Unit::Count,
        "Settles of priced requests that did not land after their retries (the request stays charged at its estimate), by kind"
    );
}

pub(crate) fn count_backend_error(kind: &'static str, backend: &'static str) {
    metrics::counter!(BACKEND_ERRORS, "kind" => kind, "backend" => backend).increment(1);
}

pub(crate) const CIRCUIT_STATE: &str = "tiered_ratelimit_circuit_state";

/// The circuit breaker gauge: 0 closed, 1 open, 2 half-open.
pub(crate) fn set_circuit_state(state: u8) {
    metrics::gauge!(CIRCUIT_STATE).set(f64::from(state));
}

pub(crate) const ANOMALY: &str = "tiered_ratelimit_anomaly";
pub(crate) const CHECK_DURATION: &str = "tiered_ratelimit_check_duration_seconds";
pub(crate) const MODE: &str = "tiered_ratelimit_mode";

/// A tier's rollout plan as read (`engine/rollout/`): its stage, its
/// version, and whether a gate holds it.
pub(crate) const ROLLOUT_STAGE: &str = "tiered_ratelimit_rollout_stage";
pub(crate) const ROLLOUT_VERSION: &str = "tiered_ratelimit_rollout_version";
pub(crate) const ROLLOUT_HOLDING: &str = "tiered_ratelimit_rollout_holding";

/// The fleet-wide settings version applied (`engine/settings/`).
pub(crate) const SETTINGS_VERSION: &str = "tiered_ratelimit_settings_version";

/// The mode gauge of a tier: 0 off, 1 shadow, 2 canary, 3 enforce; and the
/// canary percent gauge.
pub(crate) fn set_mode_gauge(tier: &Arc<str>, mode: crate::rollout::Mode) {
    let (v, percent) = match mode {
        crate::rollout::Mode::Off => (0.0, 0.0),
        crate::rollout::Mode::Shadow => (1.0, 0.0),
        crate::rollout::Mode::Canary { percent } => (2.0, f64::from(percent.min(100))),
        crate::rollout::Mode::Enforce => (3.0, 100.0),
    };
    metrics::gauge!(MODE, "tier" => tier.to_string()).set(v);
    metrics::gauge!(ENFORCED_PERCENT, "tier" => tier.to_string()).set(percent);
}

pub(crate) const ENFORCED_PERCENT: &str = "tiered_ratelimit_enforced_percent";

#[cfg(test)]
mod tests {
    use super::*;

    /// Handles registered with one recorder are not used with another: a
    /// recorder installed after the layer was built sees every request.
    #[test]
    fn request_metrics_follow_the_current_recorder() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let m = RequestMetrics::new("memory", 1, 1);
        m.count(RequestDecision::Allowed); // no recorder: nothing, no panic
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
            m.count(RequestDecision::Allowed);
            m.count(RequestDecision::Allowed);
        });
        let b = DebuggingRecorder::new();
        metrics::with_local_recorder(&b, || m.count(RequestDecision::Allowed));
        metrics::with_local_recorder(&a, || m.count(RequestDecision::Allowed));
        assert_eq!(allowed(&a), vec![3]);
        assert_eq!(allowed(&b), vec![1]);
    }
}
