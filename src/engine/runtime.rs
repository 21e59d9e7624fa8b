//! The parts of the engine's state: the built tiers (fixed), the settings a
//! handle can swap and the control key's mode overrides (live). They are held
//! together by [`Shared`](super::state::Shared).

use crate::algorithm::Limit;
use crate::rollout::Mode;
use crate::util::throttle::LogThrottle;
use crate::{algorithm::kind::Algorithm, quota::Quota};
use arc_swap::ArcSwap;
use std::sync::Arc;

/// What the layer does when the backend cannot decide (error, timeout, or a
/// key extractor that cannot run).
///
/// Whichever applies, the failure is logged at `warn` (at most once a second,
/// with a count of what was suppressed) and counted in
/// `tiered_ratelimit_backend_errors_total{kind}` and
/// `tiered_ratelimit_requests_total{decision="fail_open"|"fail_closed"|"fallback"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Let the request through, without rate-limit headers (the default:
    /// a limiter outage must not become an API outage).
    #[default]
    Open,
    /// Answer `503 Service Unavailable` with
    /// `{"error":"rate_limiter_unavailable"}` (for routes where an unlimited
    /// request is worse than none, such as login).
    Closed,
    /// Decide with a local in-memory limiter (the same algorithms) whose
    /// quotas are the tiers' quotas divided by the expected instance count
    /// ([`RateLimitLayerBuilder::fallback_instances`](crate::RateLimitLayerBuilder::fallback_instances)), the "insurance"
    /// strategy: N instances together admit about the quota while the
    /// backend is down. Switches back as soon as the backend answers.
    /// Decisions are counted as `fallback`.
    Fallback,
}

/// One tier as the service runs it: what never changes after `build()`.
pub(crate) struct BuiltTier {
    pub(crate) name: Arc<str>,
    /// `<prefix>:<tier>:`; the key part is appended per request.
    pub(crate) key_base: String,
    /// The extractor's type name (`ClientIp`), for logs.
    pub(crate) key_type: &'static str,
    /// Throttles the log line of this tier's failed extractions (once a minute).
    pub(crate) key_error_log: LogThrottle,
    pub(crate) algorithm: Algorithm,
    /// The fixed cost (the quota checks' lower bound for bursts).
    pub(crate) cost: u64,
    /// Which results give this tier's charge back.
    pub(crate) refund_on: RefundOn,
    /// Priced by its response (`Tier::priced`): its charge is a reservation
    /// at the estimate, settled when the response ends (`engine/settle.rs`).
    pub(crate) priced: bool,
    /// What its quota counts: the IETF policy's `qu`.
    pub(crate) unit: crate::response::QuotaUnit,
    /// Its penalty box, checked right after it (key `<key>{pb}`).
    pub(crate) penalty: Option<crate::algorithm::PenaltyBox>,
    /// Whether each check is preceded by a read of the key's override (key
    /// `<key>{ov}`; see [`handle`](crate::handle#per-key-overrides)).
    pub(crate) overrides: bool,
    /// Its first requests without a key (see `engine/no_key.rs`).
    pub(crate) no_key: super::no_key::NoKeyWatch,
    /// Whether a request whose cost exceeds its capacity was logged.
    pub(crate) cost_exceeded_logged: std::sync::atomic::AtomicBool,
    /// A calendar tier's calendar and its boundaries around this
    /// instance's clock (see [`CalendarBounds`]).
    pub(crate) calendar: Option<CalendarBounds>,
    /// The status of this tier's denials (429, or 403 for a calendar quota
    /// that asks for it).
    pub(crate) exhausted_status: u16,
    /// Its candidate quotas (`engine/candidates.rs`).
    pub(crate) candidates: Vec<super::candidates::BuiltCandidate>,
    /// Their checks on a request of cost 1, built once (none for a
    /// calendar tier).
    pub(crate) unit_candidates: super::candidates::UnitCandidates,
    /// With candidates: their counts and metric, and the live quota's
    /// counts on the same requests.
    pub(crate) candidate_stats: crate::observe::candidates::CandidateStats,
}

/// A calendar tier's [`Calendar`](crate::algorithm::Calendar) and the last
/// boundaries computed from it: recomputed (with the time-zone rules) only
/// when the local clock leaves the span they serve, about twice a window.
pub(crate) struct CalendarBounds {
    pub(crate) calendar: crate::algorithm::Calendar,
    last: ArcSwap<[u64; 3]>,
}

impl CalendarBounds {
    pub(crate) fn new(calendar: crate::algorithm::Calendar) -> Self {
        Self {
            calendar,
            last: ArcSwap::from_pointee([0; 3]),
        }
    }

    /// [`Calendar::bounds_around`](crate::algorithm::Calendar::bounds_around)
    /// `now_us`: the cached ones while `now_us` is at least half a window
    /// from both ends (they are then exactly what it would compute).
    pub(crate) fn around(&self, now_us: u64) -> Option<[u64; 3]> {
        let b = **self.last.load();
        let from = b[0] + (b[1] - b[0]).div_ceil(2);
        let to = b[1] + (b[2] - b[1]).div_ceil(2);
        if from <= now_us && now_us < to && b[0] < b[1] {
            return Some(b);
        }
        let b = self.calendar.bounds_around(now_us)?;
        self.last.store(Arc::new(b));
        Some(b)
    }

    /// `limit` (the tier's, a plan's or an override's, compiled as a fixed
    /// window of the calendar's nominal length) over the windows around
    /// `now_us`; unchanged in the one case the boundaries cannot be
    /// computed (a clock past the year 2262).
    pub(crate) fn limit(&self, limit: Limit, now_us: u64) -> Limit {
        match (limit, self.around(now_us)) {
            (Limit::FixedWindow(w), Some(bounds)) => {
                Limit::Calendar(crate::algorithm::CalendarWindow {
                    limit: w.limit,
                    bounds,
                })
            }
            (l, _) => l,
        }
    }
}

/// Which requests a tier gives its charge back to, once their result is
/// known (`skip_failed_requests` and `skip_successful_requests` exclude each
/// other: the builder refuses both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefundOn {
    /// Every charge stands.
    Never,
    /// Failed requests (HTTP: a status ≥ 400).
    Failure,
    /// Successful requests (HTTP: a status < 400).
    Success,
}

/// A tier's settings that can change at run time.
#[derive(Debug, Clone)]
pub(crate) struct TierRuntime {
    pub(crate) mode: Mode,
    pub(crate) quota: Quota,
    pub(crate) limit: Limit,
    /// The limit of the local fallback (quota ÷ instances).
    pub(crate) fallback: Limit,
    /// Per-plan quotas and limits, in the order given.
    pub(crate) plans: Vec<PlanRuntime>,
    /// The configured limit when `limit` is another (`TierCheck::home`):
    /// set by [`Runtime::with_homes`].
    pub(crate) home: Option<Limit>,
}

/// One plan's quota on a tier.
#[derive(Debug, Clone)]
pub(crate) struct PlanRuntime {
    pub(crate) name: Arc<str>,
    pub(crate) quota: Quota,
    pub(crate) limit: Limit,
    pub(crate) fallback: Limit,
    /// The plan's configured limit (the tier's, for a plan added at run
    /// time) when `limit` is another ([`Runtime::with_homes`]).
    pub(crate) home: Option<Limit>,
}

impl Runtime {
    /// This runtime with every tier's and plan's `home` set against the
    /// `configured` one: the configured limit where the limit is another
    /// (a plan added at run time counts against the tier's configured
    /// limit), so that the Redis backend reads the values written under
    /// the configured quota as that quota's (`TierCheck::home`). Called
    /// on every runtime a request can see.
    #[must_use]
    pub(crate) fn with_homes(mut self, configured: &Runtime) -> Self {
        for (rt, c) in self.tiers.iter_mut().zip(configured.tiers.iter()) {
            rt.home = (rt.limit != c.limit).then_some(c.limit);
            for p in &mut rt.plans {
                let home = c
                    .plans
                    .iter()
                    .find(|cp| cp.name == p.name)
                    .map_or(c.limit, |cp| cp.limit);
                p.home = (p.limit != home).then_some(home);
            }
        }
        self
    }
}

/// Everything [`RateLimitHandle`](crate::RateLimitHandle) can change; swapped
/// whole, so a request sees one consistent version.
#[derive(Debug, Clone)]
pub(crate) struct Runtime {
    pub(crate) mode: Mode,
    pub(crate) tiers: Box<[TierRuntime]>,
}

/// The control hash's mode overrides: global and per tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ModeOverrides {
    pub(crate) mode: Option<Mode>,
    pub(crate) tiers: Vec<Option<Mode>>,
}
