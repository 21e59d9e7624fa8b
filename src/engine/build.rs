//! [`EngineBuilder::build`]: every engine setting and tier checked, the
//! engine's state assembled, its background tasks started.

use super::builder::{EngineBuilder, DEFAULT_KEY_PREFIX};
use super::spec::TierSpec;
use crate::algorithm::kind::Algorithm;
use crate::backend::clock::Clock;
use crate::backend::{Backend, MemoryBackend};
use crate::engine::breaker::Breaker;
use crate::engine::check::Engine;
use crate::engine::deny_cache::DenyCache;
use crate::engine::limits::{checked_limit, fallback_limit};
use crate::engine::no_key::NoKeyWatch;
use crate::engine::runtime::{
    BuiltTier, FailurePolicy, ModeOverrides, PlanRuntime, RefundOn, Runtime, TierRuntime,
};
use crate::engine::state::{Config, Guards, Live, Shared, Telemetry};
use crate::engine::MAX_TIERS;
use crate::error::ConfigError;
use crate::observe::recorder::Observer;
use crate::util::throttle::LogThrottle;
use arc_swap::ArcSwap;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

impl EngineBuilder {
    /// Checks the settings and every tier, and builds the engine. Inside a
    /// Tokio runtime, the control key's watcher starts here.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: a duplicate or invalid
    /// tier name, a zero limit, period or cost, a burst below the cost, a
    /// quota too large to count exactly, an option a tier's algorithm does
    /// not take, an invalid key prefix, too many checks.
    pub(crate) fn build(self) -> Result<Engine, ConfigError> {
        let prefix = self.key_prefix;
        if prefix.is_empty()
            || prefix.len() > 64
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(ConfigError::InvalidKeyPrefix(prefix));
        }
        if self.fallback_instances == 0 {
            return Err(ConfigError::ZeroFallbackInstances);
        }
        let instances = self.fallback_instances;
        // A penalty box is checked as a tier of its own.
        // So is a per-key override's read.
        let checks = self.tiers.len()
            + self.tiers.iter().filter(|t| t.penalty.is_some()).count()
            + self.tiers.iter().filter(|t| t.overrides).count()
            + self.tiers.iter().map(|t| t.candidates.len()).sum::<usize>();
        // Candidates need every request in a backend call: not beside a
        // tier in lease mode (whose checks are answered without one).
        let leased = self.tiers.iter().any(|t| t.lease.is_some());
        if checks > MAX_TIERS {
            return Err(ConfigError::TooManyTiers(checks));
        }
        let mut seen = HashSet::new();
        let mut tiers = Vec::with_capacity(self.tiers.len());
        let mut runtime = Vec::with_capacity(self.tiers.len());
        let mut leases = Vec::with_capacity(self.tiers.len());
        let mut plans = Vec::with_capacity(self.tiers.len());
        let mut guards = Vec::with_capacity(self.tiers.len());
        for t in self.tiers {
            if let Some(plan) = &t.rollout {
                let refused = |(field, reason)| ConfigError::RolloutPlan {
                    tier: t.name.clone(),
                    field,
                    reason,
                };
                plan.validate().map_err(refused)?;
                if self.control.is_none() {
                    return Err(refused((
                        "rollout".into(),
                        "a plan runs fleet-wide through the control key, which keeps its state and moves every instance together: set a control key (`control_key`, a policy's [control]) on a Redis backend".into(),
                    )));
                }
            }
            if let Some(guard) = &t.guard {
                let refused = |(field, reason)| ConfigError::RolloutPlan {
                    tier: t.name.clone(),
                    field,
                    reason,
                };
                guard.validate().map_err(refused)?;
                if let Some(c) = self
                    .control
                    .as_ref()
                    .filter(|c| guard.bucket < c.poll_interval)
                {
                    return Err(refused((
                        "guard.bucket".into(),
                        format!(
                            "at least the control key's poll interval ({}): every instance adds its counts once a poll",
                            humantime::format_duration(c.poll_interval)
                        ),
                    )));
                }
                if self.control.is_none() {
                    return Err(refused((
                        "guard".into(),
                        "the fall back guard counts and acts fleet-wide through the control key: set a control key (`control_key`, a policy's [control]) on a Redis backend".into(),
                    )));
                }
            }
            plans.push(t.rollout.clone());
            guards.push(t.guard.clone());
            let (built, rt, lease) = compile_tier(
                t,
                &mut seen,
                instances,
                &prefix,
                self.no_key_warn_after,
                leased,
            )
            .and_then(|c| {
                if self.header_style.ietf() {
                    structured_fields_fit(&c.0.name, &c.1)?;
                }
                Ok(c)
            })?;
            tiers.push(built);
            runtime.push(rt);
            leases.push(lease);
        }
        let names: Vec<Arc<str>> = tiers.iter().map(|t| t.name.clone()).collect();
        let n_tiers = names.len();
        crate::observe::describe_all();
        for (t, r) in names.iter().zip(&runtime) {
            crate::observe::set_mode_gauge(t, r.mode.under(self.mode));
        }
        let backend = self
            .backend
            .unwrap_or_else(|| Backend::Memory(MemoryBackend::new()));
        let local_clock = backend.local_clock();
        #[cfg(feature = "redis")]
        if let Backend::Redis(r) = &backend {
            r.set_deadline_budget(self.backend_timeout);
            if prefix == DEFAULT_KEY_PREFIX {
                // Whether set or left to the default: the words hold for a
                // policy that writes `key_prefix = "rl"` too.
                tracing::warn!(
                    key_prefix = DEFAULT_KEY_PREFIX,
                    "Redis backend with key_prefix \"rl\", the one every service \
                     gets without a key_prefix of its own: services sharing this \
                     Redis with the same prefix share their buckets; give each \
                     service its own key_prefix"
                );
            }
        }
        #[cfg(not(feature = "redis"))]
        let _ = DEFAULT_KEY_PREFIX;
        let is_memory = matches!(backend, Backend::Memory(_));
        if is_memory && self.control.is_some() {
            // Not an error (a policy file may serve both backends), but not
            // silent: the kill switch would look fleet-wide and is not.
            tracing::warn!(
                "control key configured with the in-memory backend: it is not \
                 watched (it lives in Redis); mode changes apply to this \
                 instance only"
            );
        }
        let backend_name = backend.name();
        #[cfg(feature = "redis")]
        let single_redis = matches!(&backend, Backend::Redis(r) if !r.is_cluster());
        #[cfg(not(feature = "redis"))]
        let single_redis = false;
        let fallback =
            (self.failure_policy == FailurePolicy::Fallback).then(|| match &local_clock {
                Clock::Manual(c) => MemoryBackend::with_manual_clock(c.clone()),
                Clock::Monotonic { .. } => MemoryBackend::new(),
            });
        let penalties = tiers.iter().any(|t| t.penalty.is_some());
        let any_candidates = tiers.iter().any(|t| !t.candidates.is_empty());
        let overrides = tiers.iter().any(|t| t.overrides);
        let is_concurrency = |t: &&BuiltTier| matches!(t.algorithm, Algorithm::Concurrency { .. });
        let concurrency = tiers.iter().any(|t| is_concurrency(&t));
        // Registered at 0, so a dashboard sees the series before a lapse.
        for t in tiers.iter().filter(is_concurrency) {
            metrics::counter!(crate::engine::slots::LAPSES, "tier" => t.name.to_string())
                .increment(0);
        }
        let leases = crate::engine::token_lease::pool::LeasePool::new(
            &backend,
            local_clock.clone(),
            self.backend_timeout,
            leases,
        );
        let configured = Runtime {
            mode: self.mode,
            tiers: runtime.into_boxed_slice(),
        };
        let demand = crate::observe::demand::Demand::new(
            &names
                .iter()
                .zip(&configured.tiers)
                .map(|(n, r)| (n.clone(), r.plans.iter().map(|p| p.name.clone()).collect()))
                .collect::<Vec<_>>(),
            crate::observe::demand::store::Store::for_backend(&backend, &prefix),
            local_clock.clone(),
            self.demand,
        );
        let shared = Arc::new(Shared {
            backend,
            local_clock,
            config: Config {
                any_refunds: Config::refunds_of(&tiers),
                any_priced: tiers.iter().any(|t| t.priced),
                tiers: tiers.into_boxed_slice(),
                penalties,
                key_overrides: overrides,
                concurrency,
                failure_policy: self.failure_policy,
                backend_timeout: self.backend_timeout,
                fallback_instances: instances,
                key_prefix: Arc::from(prefix.as_str()),
                docs_url: self.docs_url.map(Arc::from),
                lists_violated: self.lists_violated,
                shadow_headers: self.shadow_headers,
                shadow_log_level: self.shadow_log_level,
                header_style: self.header_style,
                control: self.control,
                configured: configured.clone(),
            },
            live: Live {
                runtime: ArcSwap::from_pointee(configured.clone()),
                mode_overrides: ArcSwap::from_pointee(ModeOverrides {
                    mode: None,
                    tiers: vec![None; n_tiers],
                }),
                control_started: std::sync::OnceLock::new(),
                fleet: super::settings::FleetSettings::default(),
                plans: super::rollout::Plans::new(plans, guards),
            },
            guards: Guards {
                breaker: Breaker::new(self.circuit_breaker),
                deny_cache: DenyCache::new(if is_memory { 0 } else { self.deny_cache }),
                leases,
                fallback,
            },
            telemetry: Telemetry {
                counts: crate::observe::Counts::default(),
                metrics: crate::observe::RequestMetrics::new(
                    backend_name,
                    n_tiers,
                    self.max_endpoints.max(1) + 1,
                ),
                observer: Observer::new(
                    names,
                    self.anomaly,
                    self.top_n_capacity,
                    self.max_endpoints,
                ),
                failure_log: LogThrottle::new(Duration::from_secs(1)),
                blocked_set: (self.fleet_top_n && single_redis).then(|| {
                    ArcSwap::from_pointee(super::state::TopSets {
                        hour: u64::MAX,
                        ..Default::default()
                    })
                }),
                fleet_candidates: (self.fleet_top_n && single_redis && any_candidates).then(|| {
                    crate::observe::fleet_candidates::FleetCandidates::new(
                        Arc::from(prefix.as_str()),
                        self.fleet_flush_interval,
                        self.fleet_pending_keys,
                    )
                }),
                fleet_blocked: (self.fleet_top_n && single_redis).then(|| {
                    crate::observe::fleet::FleetBlocked::new(
                        Arc::from(prefix.as_str()),
                        self.fleet_flush_interval,
                        self.fleet_pending_keys,
                    )
                }),
                demand,
            },
        });
        // Background work starts with the engine when there is a runtime to
        // run it (a layer built before its runtime starts it with its first
        // request instead).
        if tokio::runtime::Handle::try_current().is_ok() {
            crate::engine::watch::start(&shared);
        }
        Ok(Engine { shared })
    }
}

/// One tier checked and compiled: its fixed part, its run-time settings and
/// its lease configuration.
fn compile_tier(
    t: TierSpec,
    seen: &mut HashSet<String>,
    instances: u32,
    prefix: &str,
    no_key_warn_after: u64,
    leased: bool,
) -> Result<
    (
        BuiltTier,
        TierRuntime,
        Option<crate::engine::token_lease::TokenLease>,
    ),
    ConfigError,
> {
    let valid_name = !t.name.is_empty()
        && t.name.len() <= 64
        && t.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid_name {
        return Err(ConfigError::InvalidTierName(t.name));
    }
    if !seen.insert(t.name.clone()) {
        return Err(ConfigError::DuplicateTier(t.name));
    }
    if t.cost == 0 {
        return Err(ConfigError::ZeroCost { tier: t.name });
    }
    if t.skip_failed && t.skip_successful {
        return Err(ConfigError::SkipBoth { tier: t.name });
    }
    if let Some(c) = &t.calendar {
        if t.algorithm != Algorithm::FixedWindow {
            return Err(ConfigError::CalendarAlgorithm {
                tier: t.name,
                period: c.period().name(),
                algorithm: t.algorithm.name(),
            });
        }
        if t.lease.is_some() {
            return Err(ConfigError::LeaseUnsupported {
                tier: t.name,
                reason: "cannot run a calendar quota",
            });
        }
    }
    match (t.exhausted_status, &t.calendar) {
        (None | Some(429), _) | (Some(403), Some(_)) => {}
        (Some(403), None) => {
            return Err(ConfigError::Policy(format!(
                "tier \"{}\": exhausted_status: 403 is for a calendar quota (period = \"day\", \"week\", \"month\" or \"year\"); a rate answers 429",
                t.name
            )))
        }
        (Some(s), _) => {
            return Err(ConfigError::Policy(format!(
                "tier \"{}\": exhausted_status: {s} is neither 429 nor 403",
                t.name
            )))
        }
    }
    let limit = checked_limit(&t.name, t.algorithm, t.quota, t.cost)?;
    if t.priced {
        super::settle::check_priced(&t, &limit)?;
    }
    if t.lease.is_some() {
        let reason = if !crate::engine::token_lease::pool::leasable(&limit) {
            Some("takes token_bucket, leaky_bucket (police) and fixed_window only")
        } else if t.penalty.is_some() {
            Some("cannot run with a penalty box")
        } else if t.overrides {
            Some("cannot run with per-key overrides")
        } else if t.skip_failed || t.skip_successful {
            Some("cannot run with skip_failed_requests/skip_successful_requests")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(ConfigError::LeaseUnsupported {
                tier: t.name,
                reason,
            });
        }
    }
    let unit = quota_unit(&t);
    if !unit.is_valid() {
        return Err(ConfigError::InvalidQuotaUnit {
            tier: t.name,
            unit: unit.as_str().to_owned(),
        });
    }
    let penalty = t.penalty.map(|p| p.compile(&t.name)).transpose()?;
    let fallback = fallback_limit(&t.name, t.algorithm, t.quota, t.cost, instances)?;
    let mut plans = Vec::with_capacity(t.plans.len());
    for (plan, q) in &t.plans {
        // A calendar tier's plans count per its calendar window.
        let q = &match &t.calendar {
            Some(_) => crate::quota::Quota::new(q.limit(), t.quota.period()),
            None => *q,
        };
        plans.push(PlanRuntime {
            name: Arc::<str>::from(plan.as_str()),
            quota: *q,
            limit: checked_limit(&t.name, t.algorithm, *q, t.cost)?,
            fallback: fallback_limit(&t.name, t.algorithm, *q, t.cost, instances)?,
            home: None,
        });
    }
    let candidates = super::candidates::compile(&t, leased)?;
    let runtime = TierRuntime {
        mode: t.mode,
        quota: t.quota,
        limit,
        fallback,
        plans,
        home: None,
    };
    let name = Arc::<str>::from(t.name.as_str());
    crate::engine::no_key::register(&name);
    metrics::counter!(crate::engine::decide::COST_EXCEEDS_CAPACITY, "tier" => name.clone())
        .increment(0);
    let built = BuiltTier {
        candidate_stats: crate::observe::candidates::CandidateStats::new(
            name.clone(),
            candidates.iter().map(|c| c.label.clone()).collect(),
        ),
        unit_candidates: super::candidates::UnitCandidates::new(&candidates, t.calendar.is_some()),
        candidates,
        no_key: NoKeyWatch::new(no_key_warn_after, t.no_key_cause),
        cost_exceeded_logged: std::sync::atomic::AtomicBool::new(false),
        calendar: t.calendar.map(crate::engine::runtime::CalendarBounds::new),
        exhausted_status: t.exhausted_status.unwrap_or(429),
        key_base: format!("{prefix}:{}:", t.name),
        name,
        key_type: t.key_type,
        key_error_log: LogThrottle::new(Duration::from_secs(60)),
        algorithm: t.algorithm,
        cost: t.cost,
        penalty,
        // A concurrency tier takes none (see Tier::overrides).
        overrides: t.overrides && !matches!(t.algorithm, Algorithm::Concurrency { .. }),
        priced: t.priced,
        unit,
        // Both at once was refused above.
        refund_on: if t.skip_failed {
            RefundOn::Failure
        } else if t.skip_successful {
            RefundOn::Success
        } else {
            RefundOn::Never
        },
    };
    Ok((built, runtime, t.lease))
}

/// With the IETF fields: refuses a tier whose quota (its limit `q`, its
/// burst, the most `r` can say, or its window `w` in seconds) is above the
/// largest Structured Fields integer (RFC 9651 §3.3.1: 15 digits), naming
/// the field; a plan's quota by `plans.<name>.<field>`.
fn structured_fields_fit(tier: &str, r: &TierRuntime) -> Result<(), ConfigError> {
    use crate::response::SF_INTEGER_MAX;
    let quotas =
        std::iter::once((None, &r.quota)).chain(r.plans.iter().map(|p| (Some(&*p.name), &p.quota)));
    for (plan, q) in quotas {
        let secs = q.period().as_micros().div_ceil(1_000_000);
        for (field, value) in [
            ("limit", u128::from(q.limit())),
            ("burst", u128::from(q.burst_size())),
            ("period", secs),
        ] {
            if value > u128::from(SF_INTEGER_MAX) {
                return Err(ConfigError::BeyondStructuredFields {
                    tier: tier.to_owned(),
                    field: match plan {
                        Some(p) => format!("plans.{p}.{field}"),
                        None => field.to_owned(),
                    },
                    value,
                });
            }
        }
    }
    Ok(())
}

/// A tier's quota unit: as set, else `concurrent-requests` for a
/// concurrency tier, `tokens` for a priced tier, `cost-units` for a tier
/// whose requests cost other than 1, else `requests` (see
/// [`QuotaUnit`](crate::response::QuotaUnit)).
fn quota_unit(t: &TierSpec) -> crate::response::QuotaUnit {
    use crate::response::QuotaUnit;
    match &t.unit {
        Some(u) => u.clone(),
        None if matches!(t.algorithm, Algorithm::Concurrency { .. }) => {
            QuotaUnit::ConcurrentRequests
        }
        None if t.priced => QuotaUnit::Custom(Arc::from("tokens")),
        None if t.weighted || t.cost != 1 => QuotaUnit::Custom(Arc::from("cost-units")),
        None => QuotaUnit::Requests,
    }
}
