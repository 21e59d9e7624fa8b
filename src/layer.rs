//! [`RateLimitLayer`] and its builder: the code form of a [`Policy`](crate::policy::Policy).

use crate::backend::clock::Clock;
use crate::backend::{Backend, MemoryBackend};
use crate::breaker::{Breaker, CircuitBreaker};
use crate::control::ControlKey;
use crate::deny_cache::DenyCache;
pub use crate::engine::runtime::FailurePolicy;
use crate::engine::runtime::Overrides;
use crate::engine::runtime::{
    checked_limit, fallback_limit, BuiltTier, PlanRuntime, RefundOn, Runtime, Shared, TierRuntime,
};
use crate::engine::Engine;
use crate::error::ConfigError;
use crate::front::{Front, HttpTier};
use crate::key::ClientIp;
use crate::observe::anomaly::AnomalyConfig;
use crate::observe::recorder::Observer;
use crate::observe::LogThrottle;
use crate::response::{HeaderStyle, JsonRejection, OnRejection};
use crate::rollout::{AccessList, DenyStatus, Mode};
use crate::service::RateLimitService;
use crate::Tier;
use arc_swap::ArcSwap;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A tower [`Layer`](tower_layer::Layer) that rate-limits every request by a
/// list of tiers.
///
/// Tiers are checked in the order added; a request passes only if every tier
/// that applies to it allows it, and then it is charged on all of them (a
/// request denied by one tier consumes nothing anywhere). See the crate docs
/// for the full HTTP contract.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::get, Router};
/// use tiered_ratelimit::{key::{ClientIp, Global}, Quota, RateLimitLayer, Tier};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(1000).burst(2000)))
///     .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(300)))
///     .backend_timeout(Duration::from_millis(50))
///     .build()
///     .expect("valid rate-limit configuration");
/// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer);
/// ```
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    /// The engine's state (also `front.engine`'s), for handles and replay.
    pub(crate) shared: Arc<Shared>,
    /// The HTTP front door every service of this layer decides through.
    pub(crate) front: Arc<Front>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tiers: Vec<&str> = self.shared.tiers.iter().map(|t| &*t.name).collect();
        f.debug_struct("RateLimitLayer")
            .field("backend", &self.shared.backend.name())
            .field("tiers", &tiers)
            .field("failure_policy", &self.shared.failure_policy)
            .field("backend_timeout", &self.shared.backend_timeout)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A builder with the defaults: in-memory backend, key prefix `rl`,
    /// [`FailurePolicy::Open`], 100 ms backend timeout, no docs URL.
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder::default()
    }

    /// The tier names, in check order.
    pub fn tier_names(&self) -> impl Iterator<Item = &str> {
        self.shared.tiers.iter().map(|t| &*t.name)
    }

    /// A handle to change modes, quotas and lists at run time, without
    /// rebuilding the router. Every clone of the layer (and every service
    /// it made) sees the changes from the next request on.
    pub fn handle(&self) -> crate::RateLimitHandle {
        crate::RateLimitHandle::new(self.shared.clone())
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.front.clone())
    }
}

/// Builds a [`RateLimitLayer`]; every setting is checked in
/// [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder {
    backend: Option<Backend>,
    key_prefix: String,
    tiers: Vec<Tier>,
    failure_policy: FailurePolicy,
    backend_timeout: Duration,
    docs_url: Option<String>,
    on_rejection: Arc<dyn OnRejection>,
    mode: Mode,
    client_ip: ClientIp,
    allow: AccessList,
    deny: AccessList,
    deny_status: DenyStatus,
    shadow_headers: bool,
    shadow_log_level: tracing::Level,
    circuit_breaker: CircuitBreaker,
    fallback_instances: u32,
    deny_cache: u64,
    header_style: HeaderStyle,
    anomaly: AnomalyConfig,
    top_n_capacity: usize,
    max_endpoints: usize,
    control: Option<ControlKey>,
    fleet_top_n: bool,
    fleet_flush_interval: Duration,
    fleet_pending_keys: usize,
}

impl Default for RateLimitLayerBuilder {
    fn default() -> Self {
        Self {
            backend: None,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            tiers: Vec::new(),
            failure_policy: FailurePolicy::Open,
            backend_timeout: Duration::from_millis(100),
            docs_url: None,
            on_rejection: Arc::new(JsonRejection),
            mode: Mode::Enforce,
            client_ip: ClientIp::default(),
            allow: AccessList::new(),
            deny: AccessList::new(),
            deny_status: DenyStatus::Forbidden,
            shadow_headers: false,
            shadow_log_level: tracing::Level::INFO,
            circuit_breaker: CircuitBreaker::default(),
            fallback_instances: 1,
            deny_cache: 100_000,
            header_style: HeaderStyle::Legacy,
            anomaly: AnomalyConfig::default(),
            top_n_capacity: 256,
            max_endpoints: crate::observe::recorder::DEFAULT_MAX_ENDPOINTS,
            control: None,
            fleet_top_n: true,
            fleet_flush_interval: Duration::from_secs(1),
            fleet_pending_keys: 10_000,
        }
    }
}

impl fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("backend", &self.backend)
            .field("key_prefix", &self.key_prefix)
            .field("tiers", &self.tiers)
            .field("failure_policy", &self.failure_policy)
            .field("backend_timeout", &self.backend_timeout)
            .field("docs_url", &self.docs_url)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayerBuilder {
    /// Where buckets live: a [`MemoryBackend`] (the default) or a
    /// [`RedisBackend`](crate::backend::RedisBackend).
    pub fn backend(mut self, backend: impl Into<Backend>) -> Self {
        self.backend = Some(backend.into());
        self
    }

    /// Prefix of every storage key (`<prefix>:<tier>:<key>`); default `rl`.
    /// 1-64 printable ASCII characters without `{` or `}`.
    ///
    /// **Two services that share one Redis must use different prefixes**:
    /// with the same prefix, a tier of the same name and key is one bucket
    /// for both, so each service's traffic spends the other's quota (and
    /// their `[control]` keys and blocked-key sets collide too). With a
    /// Redis backend and the default prefix, [`build`](Self::build) logs a
    /// `WARN` line saying so, once per layer built; any other prefix
    /// silences it.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Adds a tier; tiers are checked in the order added.
    pub fn tier(mut self, tier: Tier) -> Self {
        self.tiers.push(tier);
        self
    }

    /// What to do when the backend cannot decide (default [`FailurePolicy::Open`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// The longest a backend check may add to a request (default 100 ms);
    /// past it the failure policy applies.
    pub fn backend_timeout(mut self, timeout: Duration) -> Self {
        self.backend_timeout = timeout;
        self
    }

    /// A URL explaining your limits, sent as `docs` in the 429 body.
    pub fn docs_url(mut self, url: impl Into<String>) -> Self {
        self.docs_url = Some(url.into());
        self
    }

    /// Replaces the 429 response (see [`OnRejection`]).
    pub fn on_rejection(mut self, on_rejection: impl OnRejection) -> Self {
        self.on_rejection = Arc::new(on_rejection);
        self
    }

    /// The global mode (default [`Mode::Enforce`]): each tier runs in the
    /// weaker of its own mode and this one (see [`crate::rollout`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// How the allowlist and denylist resolve a client's IP (trusted proxies,
    /// IPv6 prefix). Give it the same `ClientIp` as your `ip` tier.
    pub fn client_ip(mut self, client_ip: ClientIp) -> Self {
        self.client_ip = client_ip;
        self
    }

    /// Requests matching `list` skip limiting (see [`crate::rollout`]).
    pub fn allowlist(mut self, list: AccessList) -> Self {
        self.allow = list;
        self
    }

    /// Requests matching `list` are refused with `status` before any tier.
    pub fn denylist(mut self, list: AccessList, status: DenyStatus) -> Self {
        self.deny = list;
        self.deny_status = status;
        self
    }

    /// Whether requests decided by shadow tiers carry `X-RateLimit-*` headers
    /// (default `false`: clients see nothing while you observe).
    pub fn shadow_headers(mut self, send: bool) -> Self {
        self.shadow_headers = send;
        self
    }

    /// The level of the log line for a request a shadow tier would have
    /// rejected (default `INFO`).
    pub fn shadow_log_level(mut self, level: tracing::Level) -> Self {
        self.shadow_log_level = level;
        self
    }

    /// The circuit breaker in front of the backend (default: open after 5
    /// consecutive failures, probe every 500 ms; `failures: 0` disables it).
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.circuit_breaker = breaker;
        self
    }

    /// For [`FailurePolicy::Fallback`]: how many app instances share the
    /// quota, so each local fallback admits `quota / instances` (default 1;
    /// a burst or limit below 1 becomes 1).
    pub fn fallback_instances(mut self, instances: u32) -> Self {
        self.fallback_instances = instances;
        self
    }

    /// The local deny cache's size in keys (default 100 000; 0 disables it).
    /// Used with the Redis backend only: the memory backend is local anyway.
    pub fn deny_cache(mut self, capacity: u64) -> Self {
        self.deny_cache = capacity;
        self
    }

    /// The 429-rate baseline and its alert (see [`crate::observe::anomaly`]).
    pub fn anomaly(mut self, config: AnomalyConfig) -> Self {
        self.anomaly = config;
        self
    }

    /// Counters per tier in the top-N blocked and near-limit sketches
    /// (default 256; the error of a count is at most the smallest counter).
    pub fn top_n_capacity(mut self, capacity: usize) -> Self {
        self.top_n_capacity = capacity;
        self
    }

    /// The most distinct endpoints (`METHOD route template`) tracked with
    /// their own series: the `endpoint` label of
    /// `tiered_ratelimit_tier_decisions_total` and the anomaly gauge, and
    /// the anomaly baseline (default 1024). Endpoints seen after that many
    /// share the label `<other>`. Bounds the tier-decision series at
    /// (`max_endpoints` + 1) × tiers × plans × 5 decisions, of which only
    /// the combinations that occur exist.
    pub fn max_endpoints(mut self, endpoints: usize) -> Self {
        self.max_endpoints = endpoints.max(1);
        self
    }

    /// Polls a fleet-wide control hash in Redis (see [`crate::control`]);
    /// Redis backends only (ignored by the memory backend).
    pub fn control_key(mut self, control: ControlKey) -> Self {
        self.control = Some(control);
        self
    }

    /// On a single Redis, count rejected keys fleet-wide in hourly sorted
    /// sets `<prefix>:blocked:<hour>` (TTL 25 h, the 10 000 heaviest kept),
    /// written by the same script call as the decision (default on). The
    /// 429s answered by the local deny cache are added too, without a call
    /// per request: accumulated in this process and flushed in one
    /// pipelined call per [`fleet_top_n_flush`](Self::fleet_top_n_flush)
    /// interval. Read with
    /// [`RateLimitHandle::top_blocked_fleet`](crate::RateLimitHandle::top_blocked_fleet).
    pub fn fleet_top_n(mut self, on: bool) -> Self {
        self.fleet_top_n = on;
        self
    }

    /// How often the deny cache's 429s are flushed to the fleet-wide hourly
    /// sets (default 1 s; at least 10 ms), and how many distinct keys at
    /// most wait for a flush (default 10 000): a 429 for a new key beyond
    /// that is not counted fleet-wide, only in
    /// `tiered_ratelimit_fleet_blocked_dropped_total{reason="overflow"}`. A
    /// crash loses at most one interval; so does a flush Redis fails.
    pub fn fleet_top_n_flush(mut self, interval: Duration, max_keys: usize) -> Self {
        self.fleet_flush_interval = interval;
        self.fleet_pending_keys = max_keys;
        self
    }

    /// Which rate-limit headers to send (default [`HeaderStyle::Legacy`]).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.header_style = style;
        self
    }

    /// Checks the configuration and builds the layer.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: no tiers, a duplicate or invalid
    /// tier name, a zero limit, period or cost, a burst below the cost, a
    /// quota too large to count exactly, an invalid key prefix, a
    /// [`client_ip`](Self::client_ip) with an IPv6 prefix above 128.
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
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
        if self.tiers.len() > MAX_TIERS {
            return Err(ConfigError::TooManyTiers(self.tiers.len()));
        }
        let mut seen = HashSet::new();
        let mut tiers = Vec::with_capacity(self.tiers.len());
        let mut runtime = Vec::with_capacity(self.tiers.len());
        let mut http_tiers = Vec::with_capacity(self.tiers.len());
        for t in self.tiers {
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
            http_tiers.push(HttpTier {
                key: t.key,
                cost: t.cost,
                cost_fn: t.cost_fn,
                methods: t.methods.map(Vec::into_boxed_slice),
                plan_fn: t.plan_fn,
            });
            tiers.push(BuiltTier {
                key_base: format!("{prefix}:{}:", t.name),
                name: Arc::from(t.name),
                key_type: t.key_type,
                key_error_log: LogThrottle::new(Duration::from_secs(60)),
                algorithm: t.algorithm,
                cost: t.cost,
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
                tracing::warn!(
                    key_prefix = DEFAULT_KEY_PREFIX,
                    "Redis backend with the default key_prefix: every service \
                     sharing this Redis with the same prefix shares its buckets; \
                     give each service its own key_prefix"
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
        let shared = Arc::new(Shared {
            backend,
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
        });
        Ok(RateLimitLayer { shared, front })
    }
}

/// The most tiers one layer may have.
pub const MAX_TIERS: usize = 64;

/// The storage key prefix when none is set.
const DEFAULT_KEY_PREFIX: &str = "rl";
