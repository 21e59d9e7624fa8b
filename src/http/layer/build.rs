//! [`RateLimitLayerBuilder::build`]: every setting checked, the engine's
//! state and the HTTP front door assembled.

#[cfg(feature = "redis")]
use super::DEFAULT_KEY_PREFIX;
use super::{RateLimitLayer, RateLimitLayerBuilder};
use crate::backend::clock::Clock;
use crate::backend::{Backend, MemoryBackend};
use crate::engine::breaker::Breaker;
use crate::engine::deny_cache::DenyCache;
use crate::engine::runtime::Overrides;
use crate::engine::runtime::{
    checked_limit, fallback_limit, BuiltTier, FailurePolicy, PlanRuntime, RefundOn, Runtime,
    Shared, TierRuntime,
};
use crate::engine::Engine;
use crate::engine::MAX_TIERS;
use crate::error::ConfigError;
use crate::http::front::{Front, HttpTier};
use crate::observe::recorder::Observer;
use crate::util::throttle::LogThrottle;
use arc_swap::ArcSwap;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

impl RateLimitLayerBuilder {
    /// Checks the configuration and builds the layer.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: no tiers, a duplicate or invalid
    /// tier name, a zero limit, period or cost, a burst below the cost, a
    /// quota too large to count exactly, an invalid key prefix, a
    /// [`client_ip`](Self::client_ip) with an IPv6 prefix above 128.
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
        self.build_inner()
    }

    /// [`build`](Self::build), then one [`Backend::ping`] (within the
    /// backend timeout, at least 1 s for the first connection): a backend
    /// that does not answer at start-up is said at start-up, not on the
    /// first request. Under [`FailurePolicy::Closed`](crate::FailurePolicy::Closed)
    /// it is an error (every request would get 503); under the other
    /// policies one `WARN` line naming the backend and what the requests
    /// will get, and the layer (the backend connects when it can).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use tiered_ratelimit::{key::Global, FailurePolicy, Quota, RateLimitLayer, Tier};
    /// use tiered_ratelimit::backend::RedisBackend;
    ///
    /// // Nothing listens on port 1.
    /// let redis = RedisBackend::from_url("redis://127.0.0.1:1/").unwrap();
    /// let err = RateLimitLayer::builder()
    ///     .backend(redis)
    ///     .failure_policy(FailurePolicy::Closed)
    ///     .tier(Tier::new("global", Global, Quota::per_second(10)))
    ///     .build_checked()
    ///     .await
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("redis at 127.0.0.1:1"));
    /// # }
    /// ```
    ///
    /// # Errors
    /// Any of [`build`](Self::build)'s, and
    /// [`ConfigError::BackendUnreachable`] under `Closed`.
    pub async fn build_checked(self) -> Result<RateLimitLayer, ConfigError> {
        let timeout = self.backend_timeout.max(Duration::from_secs(1));
        let policy = self.failure_policy;
        let layer = self.build_inner()?;
        if let Err(e) = layer.shared.backend.ping(timeout).await {
            if policy == crate::engine::runtime::FailurePolicy::Closed {
                return Err(ConfigError::BackendUnreachable(e));
            }
            let then = match policy {
                crate::engine::runtime::FailurePolicy::Fallback => {
                    "requests are decided by the local fallback limiter until it answers"
                }
                _ => "requests pass unlimited (failure_policy = \"open\") until it answers",
            };
            tracing::warn!(target: "tiered_ratelimit::layer::build",
                backend = %e.backend,
                "rate limiter backend unreachable at start-up: {e}; {then}",
            );
        }
        Ok(layer)
    }

    fn build_inner(self) -> Result<RateLimitLayer, ConfigError> {
        self.client_ip.check()?;
        let prefix = self.key_prefix;
        if prefix.is_empty()
            || prefix.len() > 64
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(ConfigError::InvalidKeyPrefix(prefix));
        }
        if self.tiers.is_empty() {
            return Err(ConfigError::NoTiers);
        }
        if self.fallback_instances == 0 {
            return Err(ConfigError::ZeroFallbackInstances);
        }
        let instances = self.fallback_instances;
        // A penalty box is checked as a tier of its own.
        // So is a per-key override's read.
        let checks = self.tiers.len()
            + self.tiers.iter().filter(|t| t.penalty.is_some()).count()
            + self.tiers.iter().filter(|t| t.overrides).count();
        if checks > MAX_TIERS {
            return Err(ConfigError::TooManyTiers(checks));
        }
        let mut seen = HashSet::new();
        let mut tiers = Vec::with_capacity(self.tiers.len());
        let mut runtime = Vec::with_capacity(self.tiers.len());
        let mut http_tiers = Vec::with_capacity(self.tiers.len());
        let mut leases = Vec::with_capacity(self.tiers.len());
        let mut actual_headers = Vec::with_capacity(self.tiers.len());
        for mut t in self.tiers {
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
            if t.skip_failed_requests && t.skip_successful_requests {
                return Err(ConfigError::SkipBoth { tier: t.name });
            }
            let limit = checked_limit(&t.name, t.algorithm, t.quota, t.cost)?;
            let priced = crate::http::priced::compile(&mut t, &limit)?;
            if t.lease.is_some() {
                let reason = if !crate::engine::token_lease::pool::leasable(&limit) {
                    Some("takes token_bucket, leaky_bucket (police) and fixed_window only")
                } else if t.penalty.is_some() {
                    Some("cannot run with a penalty box")
                } else if t.overrides {
                    Some("cannot run with per-key overrides")
                } else if t.skip_failed_requests || t.skip_successful_requests {
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
            leases.push(t.lease);
            let penalty = t.penalty.map(|p| p.compile(&t.name)).transpose()?;
            let fallback = fallback_limit(&t.name, t.algorithm, t.quota, t.cost, instances)?;
            let mut plans = Vec::with_capacity(t.plans.len());
            for (plan, q) in &t.plans {
                plans.push(PlanRuntime {
                    name: Arc::<str>::from(plan.as_str()),
                    quota: *q,
                    limit: checked_limit(&t.name, t.algorithm, *q, t.cost)?,
                    fallback: fallback_limit(&t.name, t.algorithm, *q, t.cost, instances)?,
                });
            }
            runtime.push(TierRuntime {
                mode: t.mode,
                quota: t.quota,
                limit,
                fallback,
                plans,
            });
            let no_key_cause = t.key.no_key_cause();
            actual_headers.push(priced.clone().flatten());
            http_tiers.push(HttpTier {
                key: t.key,
                cost: t.cost,
                cost_fn: t.cost_fn,
                methods: t.methods.map(Vec::into_boxed_slice),
                plan_fn: t.plan_fn,
            });
            let name = Arc::<str>::from(t.name.as_str());
            crate::engine::no_key::register(&name);
            metrics::counter!(crate::engine::decide::COST_EXCEEDS_CAPACITY, "tier" => name.clone())
                .increment(0);
            tiers.push(BuiltTier {
                no_key: crate::engine::no_key::NoKeyWatch::new(
                    self.no_key_warn_after,
                    no_key_cause,
                ),
                cost_exceeded_logged: std::sync::atomic::AtomicBool::new(false),
                key_base: format!("{prefix}:{}:", t.name),
                name,
                key_type: t.key_type,
                key_error_log: LogThrottle::new(Duration::from_secs(60)),
                algorithm: t.algorithm,
                cost: t.cost,
                penalty,
                // A concurrency tier takes none (see Tier::overrides).
                overrides: t.overrides
                    && !matches!(
                        t.algorithm,
                        crate::algorithm::kind::Algorithm::Concurrency { .. }
                    ),
                priced: priced.is_some(),
                // Both at once was refused above.
                refund_on: if t.skip_failed_requests {
                    RefundOn::Failure
                } else if t.skip_successful_requests {
                    RefundOn::Success
                } else {
                    RefundOn::Never
                },
            });
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
        let lists_violated = self.on_rejection.uses_violated_policies();
        let penalties = tiers.iter().any(|t| t.penalty.is_some());
        let overrides = tiers.iter().any(|t| t.overrides);
        let concurrency = tiers.iter().any(|t| {
            matches!(
                t.algorithm,
                crate::algorithm::kind::Algorithm::Concurrency { .. }
            )
        });
        // Registered at 0, so a dashboard sees the series before a lapse.
        for t in tiers.iter().filter(|t| {
            matches!(
                t.algorithm,
                crate::algorithm::kind::Algorithm::Concurrency { .. }
            )
        }) {
            metrics::counter!(crate::engine::slots::LAPSES, "tier" => t.name.to_string())
                .increment(0);
        }
        let leases = crate::engine::token_lease::pool::LeasePool::new(
            &backend,
            local_clock.clone(),
            self.backend_timeout,
            leases,
        );
        let shared = Arc::new(Shared {
            leases,
            backend,
            penalties,
            key_overrides: overrides,
            concurrency,
            tiers: tiers.into_boxed_slice(),
            runtime: ArcSwap::from_pointee(Runtime {
                mode: self.mode,
                tiers: runtime.into_boxed_slice(),
                allow: Arc::new(self.allow),
                deny: Arc::new(self.deny),
            }),
            failure_policy: self.failure_policy,
            backend_timeout: self.backend_timeout,
            docs_url: self.docs_url.map(Arc::from),
            lists_violated,
            failure_log: LogThrottle::new(Duration::from_secs(1)),
            deny_status: self.deny_status,
            shadow_headers: self.shadow_headers,
            shadow_log_level: self.shadow_log_level,
            counts: crate::observe::Counts::default(),
            metrics: crate::observe::RequestMetrics::new(
                backend_name,
                n_tiers,
                self.max_endpoints.max(1) + 1,
            ),
            breaker: Breaker::new(self.circuit_breaker),
            deny_cache: DenyCache::new(if is_memory { 0 } else { self.deny_cache }),
            local_clock,
            fallback,
            fallback_instances: instances,
            header_style: self.header_style,
            observer: Observer::new(names, self.anomaly, self.top_n_capacity, self.max_endpoints),
            control: self.control,
            control_started: std::sync::OnceLock::new(),
            overrides: ArcSwap::from_pointee(Overrides {
                mode: None,
                tiers: vec![None; n_tiers],
            }),
            blocked_set: (self.fleet_top_n && single_redis)
                .then(|| ArcSwap::from_pointee((u64::MAX, Arc::from("")))),
            fleet_blocked: (self.fleet_top_n && single_redis).then(|| {
                crate::observe::fleet::FleetBlocked::new(
                    Arc::from(prefix.as_str()),
                    self.fleet_flush_interval,
                    self.fleet_pending_keys,
                )
            }),
            key_prefix: Arc::from(prefix.as_str()),
        });
        let front = Arc::new(Front {
            engine: Engine {
                shared: shared.clone(),
            },
            tiers: http_tiers.into_boxed_slice(),
            client_ip: self.client_ip,
            on_rejection: self.on_rejection,
            actual_headers: actual_headers.into(),
            #[cfg(feature = "grpc")]
            protocol: self.protocol,
        });
        Ok(RateLimitLayer { shared, front })
    }
}
