//! The engine's runtime state: the built tiers, the settings a handle can
//! swap, the control key's overrides, and the limits compiled from quotas.

use crate::algorithm::kind::LeakyBucket;
use crate::algorithm::{Gcra, Limit, TokenBucket, Window, MAX_PERIOD_US};
use crate::backend::clock::Clock;
use crate::backend::{Backend, MemoryBackend};
use crate::engine::breaker::Breaker;
use crate::engine::deny_cache::DenyCache;
use crate::error::ConfigError;
use crate::handle::control::ControlKey;
use crate::observe::recorder::Observer;
use crate::response::HeaderStyle;
use crate::rollout::Mode;
use crate::util::throttle::LogThrottle;
use crate::{algorithm::kind::Algorithm, quota::Quota};
use arc_swap::ArcSwap;
use std::sync::Arc;
use std::time::Duration;

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
    /// Its penalty box, checked right after it (key `<key>{pb}`).
    pub(crate) penalty: Option<crate::algorithm::PenaltyBox>,
    /// Whether each check is preceded by a read of the key's override (key
    /// `<key>{ov}`; see [`crate::handle::overrides`]).
    pub(crate) overrides: bool,
    /// Its first requests without a key (see `engine/no_key.rs`).
    pub(crate) no_key: super::no_key::NoKeyWatch,
    /// Whether a request whose cost exceeds its capacity was logged.
    pub(crate) cost_exceeded_logged: std::sync::atomic::AtomicBool,
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
}

/// One plan's quota on a tier.
#[derive(Debug, Clone)]
pub(crate) struct PlanRuntime {
    pub(crate) name: Arc<str>,
    pub(crate) quota: Quota,
    pub(crate) limit: Limit,
    pub(crate) fallback: Limit,
}

/// Everything [`RateLimitHandle`](crate::RateLimitHandle) can change; swapped
/// whole, so a request sees one consistent version.
#[derive(Debug, Clone)]
pub(crate) struct Runtime {
    pub(crate) mode: Mode,
    pub(crate) tiers: Box<[TierRuntime]>,
}

/// Everything the service shares between requests.
pub(crate) struct Shared {
    pub(crate) backend: Backend,
    /// Whether any tier has a penalty box, or is a concurrency tier: when
    /// neither, a request pays no step for them.
    pub(crate) penalties: bool,
    /// Whether any tier takes per-key overrides.
    pub(crate) key_overrides: bool,
    /// Whether any tier is a concurrency tier (slots to guard and release).
    pub(crate) concurrency: bool,
    pub(crate) tiers: Box<[BuiltTier]>,
    pub(crate) runtime: ArcSwap<Runtime>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) backend_timeout: Duration,
    pub(crate) docs_url: Option<Arc<str>>,
    /// Whether the rejection lists every violated tier (the deny cache then
    /// answers only fully cached requests).
    pub(crate) lists_violated: bool,
    pub(crate) failure_log: LogThrottle,
    pub(crate) shadow_headers: bool,
    pub(crate) shadow_log_level: tracing::Level,
    pub(crate) counts: crate::observe::Counts,
    /// Handles of the per-request metrics.
    pub(crate) metrics: crate::observe::RequestMetrics,
    pub(crate) breaker: Breaker,
    pub(crate) deny_cache: DenyCache,
    /// The clock the deny cache and the fallback read (the backend's manual
    /// clock in tests; a monotonic epoch clock otherwise).
    pub(crate) local_clock: Clock,
    /// The local limiter of [`FailurePolicy::Fallback`].
    pub(crate) fallback: Option<MemoryBackend>,
    pub(crate) fallback_instances: u32,
    pub(crate) header_style: HeaderStyle,
    pub(crate) observer: Observer,
    pub(crate) control: Option<ControlKey>,
    pub(crate) control_started: std::sync::OnceLock<()>,
    /// Modes set by the fleet-wide control key (empty without one).
    pub(crate) overrides: ArcSwap<Overrides>,
    pub(crate) key_prefix: Arc<str>,
    /// With fleet-wide top-N on a single Redis: the current hour's set of
    /// rejected keys, `<prefix>:blocked:<hour since epoch>`.
    pub(crate) blocked_set: Option<ArcSwap<(u64, Arc<str>)>>,
    /// With `blocked_set`: the deny cache's 429s, waiting for their
    /// pipelined flush into the same sets.
    pub(crate) fleet_blocked: Option<crate::observe::fleet::FleetBlocked>,
    /// Lease mode's local tokens (Redis, with a leased tier; see
    /// `engine/leased.rs`).
    pub(crate) leases: Option<super::token_lease::pool::LeasePool>,
}

impl Shared {
    /// The blocked-keys set to pass with this request's check, if any.
    pub(crate) fn blocked_set(&self) -> Option<Arc<str>> {
        let cell = self.blocked_set.as_ref()?;
        let hour = self.local_clock.now_us() / 3_600_000_000;
        let cur = cell.load();
        if cur.0 == hour {
            return Some(cur.1.clone());
        }
        let name: Arc<str> = Arc::from(format!("{}:blocked:{hour}", self.key_prefix));
        cell.store(Arc::new((hour, name.clone())));
        Some(name)
    }
}

impl Shared {
    /// Counts one request under `decision`, here and in the metrics facade.
    pub(crate) fn count(&self, decision: crate::observe::RequestDecision) {
        self.counts.add(decision);
        self.metrics.count(decision);
    }

    /// Whether any tier refunds by response status (so checks must report
    /// their charges).
    pub(crate) fn refunds(&self) -> bool {
        self.tiers
            .iter()
            .any(|t| t.refund_on != RefundOn::Never || t.priced)
    }

    /// Whether any tier is priced by its response.
    pub(crate) fn priced(&self) -> bool {
        self.tiers.iter().any(|t| t.priced)
    }

    pub(crate) fn tier_index(&self, name: &str) -> Result<usize, ConfigError> {
        self.tiers
            .iter()
            .position(|t| &*t.name == name)
            .ok_or_else(|| ConfigError::UnknownTier(name.to_owned()))
    }
}

/// Overrides from the control hash: global and per tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Overrides {
    pub(crate) mode: Option<Mode>,
    pub(crate) tiers: Vec<Option<Mode>>,
}

/// Checks a quota for a tier (limit, period, burst against the fixed cost)
/// and derives the algorithm's integer parameters.
pub(crate) fn checked_limit(
    tier: &str,
    algorithm: Algorithm,
    q: Quota,
    cost: u64,
) -> Result<Limit, ConfigError> {
    if q.limit() == 0 {
        return Err(ConfigError::ZeroLimit {
            tier: tier.to_owned(),
        });
    }
    let period_us = u64::try_from(q.period().as_micros()).unwrap_or(u64::MAX);
    if period_us == 0 {
        return Err(ConfigError::ZeroPeriod {
            tier: tier.to_owned(),
            period: q.period(),
        });
    }
    if q.burst_size() < cost {
        return Err(ConfigError::BurstBelowCost {
            tier: tier.to_owned(),
            burst: q.burst_size(),
            cost,
        });
    }
    limit_for(tier, algorithm, q, period_us)
}

/// The fallback limit: the quota divided by `instances` (at least 1, and at
/// least the fixed cost).
pub(crate) fn fallback_limit(
    tier: &str,
    algorithm: Algorithm,
    q: Quota,
    cost: u64,
    instances: u32,
) -> Result<Limit, ConfigError> {
    let n = u64::from(instances.max(1));
    let limit = (q.limit() / n).max(1);
    let burst = (q.burst_size() / n).max(1).max(cost);
    let divided = if q.burst_size() == q.limit() && limit >= cost {
        Quota::new(limit, q.period())
    } else {
        Quota::new(limit, q.period()).burst(burst)
    };
    // Window algorithms have no burst: keep their limit at least the cost.
    let divided = match algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingWindowLog | Algorithm::SlidingWindowCounter => {
            Quota::new(limit.max(cost), q.period())
        }
        _ => divided,
    };
    checked_limit(tier, algorithm, divided, cost)
}

/// The integer parameters of a tier's algorithm, checked so that every value
/// the Redis script computes stays at or below 2^53 (the bounds are on
/// [`Quota`](crate::Quota)).
fn limit_for(
    tier: &str,
    algorithm: Algorithm,
    q: crate::quota::Quota,
    period_us: u64,
) -> Result<Limit, ConfigError> {
    let too_large = |field: &'static str, detail: String| ConfigError::QuotaTooLarge {
        tier: tier.to_owned(),
        field,
        detail,
    };
    if period_us > MAX_PERIOD_US {
        return Err(too_large(
            "period",
            format!(
                "{period_us} µs is above {MAX_PERIOD_US} µs (2^51 µs, about 71 years), the longest period"
            ),
        ));
    }
    let window = || -> Result<Window, ConfigError> {
        if q.burst_size() != q.limit() {
            return Err(ConfigError::BurstNotSupported {
                tier: tier.to_owned(),
                algorithm,
            });
        }
        Ok(Window {
            limit: q.limit(),
            window_us: period_us,
        })
    };
    let capped = |w: Window| -> Result<Window, ConfigError> {
        if w.limit > Window::MAX_LIMIT {
            return Err(too_large(
                "limit",
                format!(
                    "{} is above {} (2^52 - 1), the largest limit of {algorithm:?}",
                    w.limit,
                    Window::MAX_LIMIT
                ),
            ));
        }
        Ok(w)
    };
    let bucket = || -> Result<TokenBucket, ConfigError> {
        let (unit, rate) = TokenBucket::unit_and_rate(q.limit(), period_us);
        let capacity = u128::from(q.burst_size()) * u128::from(unit);
        if capacity > u128::from(TokenBucket::MAX_CAPACITY_UNITS) {
            // Name the field the user wrote: without a burst, the capacity
            // is the limit.
            let (field, what) = if q.has_burst() {
                ("burst", "burst")
            } else {
                ("limit", "limit (the capacity: no burst is set)")
            };
            return Err(too_large(
                field,
                format!(
                    "{what} × period in units, {} × {unit} = {capacity}, is above 2^52; use a smaller {field} or a shorter period",
                    q.burst_size()
                ),
            ));
        }
        if rate > TokenBucket::MAX_RATE {
            return Err(too_large(
                "limit",
                format!(
                    "the refill rate, {rate} units per µs (limit / gcd(limit, period in µs)), is above 2^51"
                ),
            ));
        }
        TokenBucket::new(q.limit(), period_us, q.burst_size()).ok_or_else(|| {
            too_large(
                "burst",
                format!("{} tokens cannot be counted", q.burst_size()),
            )
        })
    };
    Ok(match algorithm {
        Algorithm::Concurrency { lease } => {
            let lease_us = u64::try_from(lease.as_micros()).unwrap_or(u64::MAX);
            if lease_us == 0 {
                return Err(ConfigError::Policy(format!(
                    "tier \"{tier}\": lease: must be at least 1 microsecond"
                )));
            }
            if lease_us > MAX_PERIOD_US {
                return Err(too_large(
                    "lease",
                    format!("{lease_us} µs is above {MAX_PERIOD_US} µs (2^51 µs)"),
                ));
            }
            if q.limit() > Window::MAX_LIMIT {
                return Err(too_large(
                    "limit",
                    format!("{} is above {}", q.limit(), Window::MAX_LIMIT),
                ));
            }
            Limit::Concurrency(crate::algorithm::Concurrency {
                limit: q.limit(),
                lease_us,
                lease: 0,
            })
        }
        Algorithm::FixedWindow => Limit::FixedWindow(capped(window()?)?),
        Algorithm::SlidingWindowLog => Limit::SlidingWindowLog(capped(window()?)?),
        Algorithm::SlidingWindowCounter => {
            let w = window()?;
            if !w.counter_is_exact() {
                return Err(too_large(
                    "limit",
                    format!(
                        "(2 × limit + 1) × period, (2 × {} + 1) × {} µs, is above 2^53; use a smaller limit or a shorter period",
                        w.limit, w.window_us
                    ),
                ));
            }
            Limit::SlidingWindowCounter(w)
        }
        Algorithm::TokenBucket => Limit::TokenBucket(bucket()?),
        Algorithm::LeakyBucket(LeakyBucket::Police) => Limit::LeakyBucket(Gcra {
            bucket: bucket()?,
            max_delay_us: None,
        }),
        Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) => {
            let b = bucket()?;
            let max_delay_us = max_delay.as_micros();
            let ticks = max_delay_us
                .saturating_mul(u128::from(b.rate))
                .saturating_add(u128::from(b.capacity));
            if ticks > u128::from(TokenBucket::MAX_CAPACITY_UNITS) {
                return Err(too_large(
                    "max_delay",
                    format!(
                        "capacity + max_delay × rate, {} + {max_delay_us} × {} units, is above 2^52; use a shorter max_delay or a smaller burst",
                        b.capacity, b.rate
                    ),
                ));
            }
            Limit::LeakyBucket(Gcra {
                bucket: b,
                // At most 2^52 by the check above.
                max_delay_us: Some(u64::try_from(max_delay_us).unwrap_or(u64::MAX)),
            })
        }
    })
}

impl Shared {
    /// Counts a 429 answered by the deny cache for the fleet-wide hourly
    /// sets (a no-op without them).
    pub(crate) fn count_fleet_blocked(&self, key: &str, cost: u64, now_us: u64) {
        if let Some(f) = &self.fleet_blocked {
            f.record(&self.backend, key, cost, now_us);
        }
    }
}

impl Shared {
    /// Sets every tier's mode gauge to its mode in force (code, file and
    /// control-key overrides combined).
    pub(crate) fn refresh_mode_gauges(&self) {
        let rt = self.runtime.load();
        let ov = self.overrides.load();
        let global = ov.mode.unwrap_or(rt.mode);
        for (i, (t, r)) in self.tiers.iter().zip(rt.tiers.iter()).enumerate() {
            let mode = ov.tiers.get(i).copied().flatten().unwrap_or(r.mode);
            crate::observe::set_mode_gauge(&t.name, mode.under(global));
        }
    }
}
