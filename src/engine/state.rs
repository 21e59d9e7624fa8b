//! [`Shared`]: everything an engine shares between requests, in four bags
//! by who changes them:
//!
//! - [`Config`]: compiled at build, never changed (the tiers, the failure
//!   policy, the answers' settings);
//! - [`Live`]: the settings a [`RateLimitHandle`](crate::RateLimitHandle)
//!   swaps ([`Runtime`]) and the control key's mode overrides ([`ModeOverrides`]);
//! - [`Guards`]: what protects the backend and the quota (the circuit
//!   breaker, the deny cache, lease mode's tokens, the local fallback);
//! - [`Telemetry`]: what the operator reads (counts, metrics, the
//!   observer's series, the fleet-wide blocked-keys sets).

use super::runtime::{BuiltTier, FailurePolicy, ModeOverrides, RefundOn, Runtime};
use crate::backend::clock::Clock;
use crate::backend::{Backend, MemoryBackend};
use crate::engine::breaker::Breaker;
use crate::engine::deny_cache::DenyCache;
use crate::engine::watch::ControlKey;
use crate::error::ConfigError;
use crate::observe::recorder::Observer;
use crate::response::HeaderStyle;
use crate::util::throttle::LogThrottle;
use arc_swap::ArcSwap;
use std::sync::Arc;
use std::time::Duration;

/// Everything the engine shares between requests.
pub(crate) struct Shared {
    pub(crate) backend: Backend,
    /// The clock the deny cache and the fallback read (the backend's manual
    /// clock in tests; a monotonic epoch clock otherwise).
    pub(crate) local_clock: Clock,
    pub(crate) config: Config,
    pub(crate) live: Live,
    pub(crate) guards: Guards,
    pub(crate) telemetry: Telemetry,
}

/// What `build` compiled: never changes afterwards.
pub(crate) struct Config {
    pub(crate) tiers: Box<[BuiltTier]>,
    /// Whether any tier has a penalty box: when none, a request pays no
    /// step for them.
    pub(crate) penalties: bool,
    /// Whether any tier takes per-key overrides.
    pub(crate) key_overrides: bool,
    /// Whether any tier is a concurrency tier (slots to guard and release).
    pub(crate) concurrency: bool,
    /// Whether any tier refunds by result or is priced ([`Config::refunds`]),
    /// and whether any is priced ([`Config::priced`]): asked on every
    /// request, so found once.
    pub(crate) any_refunds: bool,
    pub(crate) any_priced: bool,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) backend_timeout: Duration,
    pub(crate) fallback_instances: u32,
    pub(crate) key_prefix: Arc<str>,
    pub(crate) docs_url: Option<Arc<str>>,
    /// Whether the rejection lists every violated tier (the deny cache then
    /// answers only fully cached requests).
    pub(crate) lists_violated: bool,
    pub(crate) shadow_headers: bool,
    pub(crate) shadow_log_level: tracing::Level,
    pub(crate) header_style: HeaderStyle,
    pub(crate) control: Option<ControlKey>,
    /// The quotas and modes as built: what fleet-wide settings start from
    /// (`engine/settings/`).
    pub(crate) configured: Runtime,
}

/// The settings that change while requests run.
pub(crate) struct Live {
    /// What a handle sets, swapped whole.
    pub(crate) runtime: ArcSwap<Runtime>,
    /// Modes set by the fleet-wide control key (none without one).
    pub(crate) mode_overrides: ArcSwap<ModeOverrides>,
    /// Whether the control key's watcher runs.
    pub(crate) control_started: std::sync::OnceLock<()>,
    /// The fleet-wide settings applied (quotas and lists from the control
    /// hash).
    pub(crate) fleet: super::settings::FleetSettings,
    /// The tiers' rollout plans and their state as read.
    pub(crate) plans: super::rollout::Plans,
}

/// What protects the backend and the quota.
pub(crate) struct Guards {
    pub(crate) breaker: Breaker,
    pub(crate) deny_cache: DenyCache,
    /// Lease mode's local tokens (Redis, with a leased tier; see
    /// [`crate::engine::token_lease`]).
    pub(crate) leases: Option<super::token_lease::pool::LeasePool>,
    /// The local limiter of [`FailurePolicy::Fallback`].
    pub(crate) fallback: Option<MemoryBackend>,
}

/// What the operator reads.
pub(crate) struct Telemetry {
    pub(crate) counts: crate::observe::Counts,
    /// Handles of the per-request metrics.
    pub(crate) metrics: crate::observe::RequestMetrics,
    pub(crate) observer: Observer,
    /// Throttles the backend-failure log line (once a second).
    pub(crate) failure_log: LogThrottle,
    /// With fleet-wide top-N on a single Redis: the current hour's sets of
    /// refused and of shadow-limited keys.
    pub(crate) blocked_set: Option<ArcSwap<TopSets>>,
    /// With `blocked_set`: the deny cache's 429s, waiting for their
    /// pipelined flush into the same sets.
    pub(crate) fleet_blocked: Option<crate::observe::fleet::FleetBlocked>,
    /// With `blocked_set` and a tier with candidates: their counts, waiting
    /// for their pipelined flush (`observe/fleet_candidates.rs`).
    pub(crate) fleet_candidates: Option<crate::observe::fleet_candidates::FleetCandidates>,
    /// Per-key demand per tier and plan (`crate::observe::demand`).
    pub(crate) demand: Arc<crate::observe::demand::Demand>,
}

/// One hour's fleet-wide sets (lua/check.lua's last two keys): the keys
/// refused, `<prefix>:blocked:<hour>`, and the keys a tier not enforced for
/// them would have refused, `<prefix>:shadow_limited:<hour>`.
#[derive(Debug, Default)]
pub(crate) struct TopSets {
    /// Hours since the epoch (`u64::MAX`: none yet).
    pub(crate) hour: u64,
    pub(crate) blocked: Box<str>,
    pub(crate) shadow_limited: Box<str>,
}

impl Shared {
    /// The blocked-keys sets to pass with this request's check, if any, at
    /// `now_us` on the local clock.
    pub(crate) fn blocked_set(&self, now_us: u64) -> Option<Arc<TopSets>> {
        let cell = self.telemetry.blocked_set.as_ref()?;
        let hour = now_us / 3_600_000_000;
        let cur = cell.load_full();
        if cur.hour == hour {
            return Some(cur);
        }
        let prefix = &self.config.key_prefix;
        let sets = Arc::new(TopSets {
            hour,
            blocked: format!("{prefix}:{}:{hour}", super::BLOCKED_SET).into(),
            shadow_limited: format!("{prefix}:{}:{hour}", super::SHADOW_LIMITED_SET).into(),
        });
        cell.store(sets.clone());
        Some(sets)
    }

    /// Counts one request under `decision`, here and in the metrics facade.
    pub(crate) fn count(&self, decision: crate::observe::RequestDecision) {
        self.telemetry.counts.add(decision);
        self.telemetry.metrics.count(decision);
    }

    /// Counts a 429 answered by the deny cache for the fleet-wide hourly
    /// sets (a no-op without them).
    pub(crate) fn count_fleet_blocked(&self, key: &str, cost: u64, now_us: u64) {
        if let Some(f) = &self.telemetry.fleet_blocked {
            f.record(&self.backend, key, cost, now_us);
        }
    }

    /// Sets every tier's mode gauge to its mode in force (code, file and
    /// control-key mode overrides combined).
    pub(crate) fn refresh_mode_gauges(&self) {
        let rt = self.live.runtime.load();
        let ov = self.live.mode_overrides.load();
        let global = ov.mode.unwrap_or(rt.mode);
        for (i, (t, r)) in self.config.tiers.iter().zip(rt.tiers.iter()).enumerate() {
            let mode = ov.tiers.get(i).copied().flatten().unwrap_or(r.mode);
            crate::observe::set_mode_gauge(&t.name, mode.under(global));
        }
    }
}

impl Config {
    /// Whether any tier refunds by response status (so checks must report
    /// their charges).
    #[inline]
    pub(crate) fn refunds(&self) -> bool {
        self.any_refunds
    }

    /// Whether any tier is priced by its response.
    #[inline]
    pub(crate) fn priced(&self) -> bool {
        self.any_priced
    }

    /// [`Config::any_refunds`] of `tiers`.
    pub(crate) fn refunds_of(tiers: &[BuiltTier]) -> bool {
        tiers
            .iter()
            .any(|t| t.refund_on != RefundOn::Never || t.priced)
    }

    /// The index of the tier named `name`.
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`].
    pub(crate) fn tier_index(&self, name: &str) -> Result<usize, ConfigError> {
        self.tiers
            .iter()
            .position(|t| &*t.name == name)
            .ok_or_else(|| ConfigError::UnknownTier(name.to_owned()))
    }
}
