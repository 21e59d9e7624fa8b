//! [`EngineBuilder`]: the decision engine's settings, their defaults and
//! setters (checked and assembled by `build`, in `build.rs`).
//!
//! Every front door builds its engine here: the HTTP
//! [`RateLimitLayerBuilder`](crate::RateLimitLayerBuilder) (whose setters of
//! the same names set these), the descriptor front door
//! ([`DescriptorLimiter::new`](crate::descriptor::DescriptorLimiter::new)
//! takes one) and, through the layer, the offline door. A front door adds
//! its tiers as [`TierSpec`]s and keeps their protocol half (key
//! extractors, cost functions) for itself.

use super::spec::TierSpec;
use crate::backend::Backend;
use crate::engine::breaker::CircuitBreaker;
use crate::engine::runtime::FailurePolicy;
use crate::engine::watch::ControlKey;
use crate::observe::AnomalyConfig;
use crate::response::HeaderStyle;
use crate::rollout::Mode;
use std::fmt;
use std::time::Duration;

/// The storage key prefix when none is set.
pub(crate) const DEFAULT_KEY_PREFIX: &str = "rl";

/// The engine's settings, each declared once: its docs, its setter's
/// signature and what it sets. [`EngineBuilder`] defines them
/// (`engine_settings!(define_setters)`, below) and the HTTP layer's
/// builder forwards them to the `EngineBuilder` inside it
/// (`engine_settings!(forward_setters)`, in `http/layer/builder.rs`), so
/// both have the same setters with the same docs. Types and doc links are
/// written as full paths: they are resolved where the setters are made.
macro_rules! engine_settings {
    ($then:ident) => {
        $then! {
            /// Where buckets live: a [`MemoryBackend`](crate::backend::MemoryBackend)
            /// (the default) or a [`RedisBackend`](crate::backend::RedisBackend).
            fn backend(self, backend: impl Into<crate::backend::Backend>) {
                self.backend = Some(backend.into());
            }

            /// Prefix of every storage key (`<prefix>:<tier>:<key>`); default `rl`.
            /// 1-64 printable ASCII characters without `{` or `}`.
            ///
            /// **Two services that share one Redis must use different prefixes**:
            /// with the same prefix, a tier of the same name and key is one bucket
            /// for both, so each service's traffic spends the other's quota (and
            /// their `[control]` keys and blocked-key sets collide too). With a
            /// Redis backend and the prefix `rl` (the default, whether left unset
            /// or set to it), building logs a `WARN` line saying so, once per
            /// engine built; any other prefix silences it.
            fn key_prefix(self, prefix: impl Into<String>) {
                self.key_prefix = prefix.into();
            }

            /// What to do when the backend cannot decide (default
            /// [`FailurePolicy::Open`](crate::FailurePolicy::Open)).
            fn failure_policy(self, policy: crate::engine::FailurePolicy) {
                self.failure_policy = policy;
            }

            /// The longest a backend check may add to a request (default 100 ms);
            /// past it the failure policy applies.
            fn backend_timeout(self, timeout: std::time::Duration) {
                self.backend_timeout = timeout;
            }

            /// A URL explaining your limits, sent as `docs` in the 429 body.
            fn docs_url(self, url: impl Into<String>) {
                self.docs_url = Some(url.into());
            }

            /// The global mode (default
            /// [`Mode::Enforce`](crate::rollout::Mode::Enforce)): each tier runs in
            /// the weaker of its own mode and this one (see [`crate::rollout`]).
            fn mode(self, mode: crate::rollout::Mode) {
                self.mode = mode;
            }

            /// Whether requests decided by shadow tiers carry `X-RateLimit-*` headers
            /// (default `false`: clients see nothing while you observe).
            fn shadow_headers(self, send: bool) {
                self.shadow_headers = send;
            }

            /// The level of the log line for a request a shadow tier would have
            /// rejected (default `INFO`).
            fn shadow_log_level(self, level: tracing::Level) {
                self.shadow_log_level = level;
            }

            /// The circuit breaker in front of the backend (default: open after 5
            /// consecutive failures, probe every 500 ms; `failures: 0` disables it).
            fn circuit_breaker(self, breaker: crate::engine::CircuitBreaker) {
                self.circuit_breaker = breaker;
            }

            /// For [`FailurePolicy::Fallback`](crate::FailurePolicy::Fallback): how
            /// many app instances share the quota, so each local fallback admits
            /// `quota / instances` (default 1; a burst or limit below 1 becomes 1).
            fn fallback_instances(self, instances: u32) {
                self.fallback_instances = instances;
            }

            /// The local deny cache's size in keys (default 100 000; 0 disables it).
            /// Used with the Redis backend only: the memory backend is local anyway.
            fn deny_cache(self, capacity: u64) {
                self.deny_cache = capacity;
            }

            /// The 429-rate baseline and its alert (see
            /// [`AnomalyConfig`](crate::observe::AnomalyConfig)).
            fn anomaly(self, config: crate::observe::AnomalyConfig) {
                self.anomaly = config;
            }

            /// Counters per tier in the top-N blocked and near-limit sketches
            /// (default 256; the error of a count is at most the smallest counter).
            fn top_n_capacity(self, capacity: usize) {
                self.top_n_capacity = capacity;
            }

            /// The most distinct endpoints (`METHOD route template`) tracked with
            /// their own series: the `endpoint` label of
            /// `tiered_ratelimit_tier_decisions_total` and the anomaly gauge, and
            /// the anomaly baseline (default 1024). Endpoints seen after that many
            /// share the label `<other>`. Bounds the tier-decision series at
            /// (`max_endpoints` + 1) × tiers × plans × 5 decisions, of which only
            /// the combinations that occur exist.
            fn max_endpoints(self, endpoints: usize) {
                self.max_endpoints = endpoints.max(1);
            }

            /// Polls a fleet-wide control hash in Redis (see
            /// [`handle`](crate::handle#the-fleet-wide-control-key));
            /// Redis backends only (ignored by the memory backend). The watcher
            /// starts when the engine is built inside a Tokio runtime, else with
            /// its first request.
            fn control_key(self, control: crate::engine::ControlKey) {
                self.control = Some(control);
            }

            /// On a single Redis, count rejected keys fleet-wide in hourly sorted
            /// sets (TTL 25 h, the 10 000 heaviest kept), the refused keys in
            /// `<prefix>:blocked:<hour>` and those a tier not enforced for them would
            /// have refused in `<prefix>:shadow_limited:<hour>`, written by the same
            /// script call as the decision (default on). The
            /// 429s answered by the local deny cache are added too, without a call
            /// per request: accumulated in this process and flushed in one
            /// pipelined call per [`fleet_top_n_flush`](Self::fleet_top_n_flush)
            /// interval. Read with
            /// [`RateLimitHandle::top_blocked_fleet`](crate::RateLimitHandle::top_blocked_fleet)
            /// and [`top_shadow_limited_fleet`](crate::RateLimitHandle::top_shadow_limited_fleet).
            fn fleet_top_n(self, on: bool) {
                self.fleet_top_n = on;
            }

            /// Record per-key demand for limits suggested from it (default off;
            /// [`RateLimitHandle::set_demand`](crate::RateLimitHandle::set_demand)
            /// turns it on or off while running): every planned check adds its
            /// cost to its key's count (a hash, a probe in a pre-sized table, an
            /// atomic add: no allocation), flushed once a second, to Redis on a
            /// Redis backend. Read with
            /// [`RateLimitHandle::suggest`](crate::RateLimitHandle::suggest) and
            /// the admin API's `GET /api/suggest/{tier}`; see
            /// [`observe::demand`](crate::observe::demand).
            fn demand(self, on: bool) {
                self.demand = on;
            }

            /// How often the deny cache's 429s are flushed to the fleet-wide hourly
            /// sets (default 1 s; at least 10 ms), and how many distinct keys at
            /// most wait for a flush (default 10 000): a 429 for a new key beyond
            /// that is not counted fleet-wide, only in
            /// `tiered_ratelimit_fleet_blocked_dropped_total{reason="overflow"}`. A
            /// crash loses at most one interval; so does a flush Redis fails.
            fn fleet_top_n_flush(self, interval: std::time::Duration, max_keys: usize) {
                self.fleet_flush_interval = interval;
                self.fleet_pending_keys = max_keys;
            }

            /// After how many requests in a row from the start on which a tier had
            /// no key (its extractor returned none, so the tier never applied) the
            /// engine logs one `WARN` naming the tier and the likely cause (for a
            /// [`User`](crate::key::User) tier: the auth middleware placed inside
            /// the limiter instead of outside it; for an
            /// [`ApiKey`](crate::key::ApiKey) tier: a header no client sends).
            /// Default 1000 requests; 0 never warns. Every keyless request is
            /// counted in `tiered_ratelimit_tier_no_key_total{tier}` whatever this
            /// says. Policy file: `no_key_warn_after`.
            fn no_key_warning_after(self, requests: u64) {
                self.no_key_warn_after = requests;
            }

            /// Which rate-limit headers to send (default
            /// [`HeaderStyle::Legacy`](crate::response::HeaderStyle::Legacy)).
            fn headers(self, style: crate::response::HeaderStyle) {
                self.header_style = style;
            }
        }
    };
}
pub(crate) use engine_settings;

/// Makes each setting of [`engine_settings`] a setter of [`EngineBuilder`].
macro_rules! define_setters {
    ($( $(#[$doc:meta])* fn $name:ident($this:ident $(, $arg:ident: $ty:ty)*) $body:block )*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut $this $(, $arg: $ty)*) -> Self {
                $body
                $this
            }
        )*
    };
}

/// The decision engine's settings: its backend, storage keys, failure
/// policy, guards (circuit breaker, deny cache), answers and telemetry.
/// Every setting is checked when a front door builds its engine.
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::descriptor::{DescriptorLimiter, RulesPolicy};
/// use tiered_ratelimit::{EngineBuilder, FailurePolicy};
///
/// let engine = EngineBuilder::default()
///     .key_prefix("edge")
///     .failure_policy(FailurePolicy::Closed)
///     .backend_timeout(Duration::from_millis(20));
/// let policy = RulesPolicy::from_toml_str(r#"
///     domain = "edge"
///     [[rule]]
///     name = "per_ip"
///     match = [{ key = "remote_address" }]
///     limit = 10
///     period = "1s"
/// "#).unwrap();
/// let limiter = DescriptorLimiter::new("edge", policy.rules().unwrap(), false, engine).unwrap();
/// assert_eq!(limiter.domain(), "edge");
/// ```
#[must_use]
pub struct EngineBuilder {
    pub(crate) backend: Option<Backend>,
    pub(crate) key_prefix: String,
    pub(crate) tiers: Vec<TierSpec>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) backend_timeout: Duration,
    pub(crate) docs_url: Option<String>,
    pub(crate) mode: Mode,
    pub(crate) shadow_headers: bool,
    pub(crate) shadow_log_level: tracing::Level,
    pub(crate) circuit_breaker: CircuitBreaker,
    pub(crate) fallback_instances: u32,
    pub(crate) deny_cache: u64,
    pub(crate) header_style: HeaderStyle,
    pub(crate) anomaly: AnomalyConfig,
    pub(crate) top_n_capacity: usize,
    pub(crate) max_endpoints: usize,
    pub(crate) control: Option<ControlKey>,
    pub(crate) fleet_top_n: bool,
    pub(crate) demand: bool,
    pub(crate) fleet_flush_interval: Duration,
    pub(crate) fleet_pending_keys: usize,
    pub(crate) no_key_warn_after: u64,
    /// Whether the front door's rejection lists every violated tier (then
    /// the deny cache answers only fully cached requests).
    pub(crate) lists_violated: bool,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        Self {
            backend: None,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            tiers: Vec::new(),
            failure_policy: FailurePolicy::Open,
            backend_timeout: Duration::from_millis(100),
            docs_url: None,
            mode: Mode::Enforce,
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
            demand: false,
            fleet_flush_interval: Duration::from_secs(1),
            fleet_pending_keys: 10_000,
            no_key_warn_after: super::no_key::DEFAULT_NO_KEY_WARN_AFTER,
            lists_violated: false,
        }
    }
}

impl fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("backend", &self.backend)
            .field("key_prefix", &self.key_prefix)
            .field("tiers", &self.tiers)
            .field("failure_policy", &self.failure_policy)
            .field("backend_timeout", &self.backend_timeout)
            .field("docs_url", &self.docs_url)
            .finish_non_exhaustive()
    }
}

impl EngineBuilder {
    /// Adds a tier; tiers are checked in the order added.
    pub(crate) fn tier(mut self, tier: TierSpec) -> Self {
        self.tiers.push(tier);
        self
    }

    engine_settings!(define_setters);
}
