//! [`RateLimitLayerBuilder`]: its settings, their defaults and setters
//! (checked and assembled by `build`, in `build.rs`).

use crate::backend::Backend;
use crate::engine::CircuitBreaker;
use crate::engine::ControlKey;
use crate::engine::EngineBuilder;
use crate::engine::FailurePolicy;
use crate::http::tier::Tier;
use crate::key::ClientIp;
use crate::observe::AnomalyConfig;
use crate::response::{HeaderStyle, JsonRejection, OnRejection};
use crate::rollout::{AccessList, DenyStatus, Mode};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Builds a [`RateLimitLayer`](crate::RateLimitLayer); every setting is
/// checked in [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder {
    /// The engine's settings (every setter below but `tier`, `on_rejection`,
    /// `client_ip`, `allowlist`, `denylist` and `protocol` sets one of them).
    pub(super) engine: EngineBuilder,
    pub(super) tiers: Vec<Tier>,
    pub(super) on_rejection: Arc<dyn OnRejection>,
    pub(super) client_ip: ClientIp,
    pub(super) allow: AccessList,
    pub(super) deny: AccessList,
    pub(super) deny_status: DenyStatus,
    #[cfg(feature = "grpc")]
    pub(super) protocol: crate::http::grpc::Protocol,
}

impl Default for RateLimitLayerBuilder {
    fn default() -> Self {
        Self {
            engine: EngineBuilder::default(),
            tiers: Vec::new(),
            on_rejection: Arc::new(JsonRejection),
            client_ip: ClientIp::default(),
            allow: AccessList::new(),
            deny: AccessList::new(),
            deny_status: DenyStatus::Forbidden,
            #[cfg(feature = "grpc")]
            protocol: crate::http::grpc::Protocol::Auto,
        }
    }
}

impl fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("engine", &self.engine)
            .field("tiers", &self.tiers)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayerBuilder {
    /// Where buckets live: a [`MemoryBackend`](crate::backend::MemoryBackend)
    /// (the default) or a [`RedisBackend`](crate::backend::RedisBackend).
    ///
    /// See [`EngineBuilder::backend`].
    pub fn backend(mut self, backend: impl Into<Backend>) -> Self {
        self.engine = self.engine.backend(backend);
        self
    }

    /// Prefix of every storage key (`<prefix>:<tier>:<key>`); default `rl`.
    /// 1-64 printable ASCII characters without `{` or `}`.
    ///
    /// See [`EngineBuilder::key_prefix`].
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.engine = self.engine.key_prefix(prefix);
        self
    }

    /// Adds a tier; tiers are checked in the order added.
    pub fn tier(mut self, tier: Tier) -> Self {
        self.tiers.push(tier);
        self
    }

    /// What to do when the backend cannot decide (default [`FailurePolicy::Open`]).
    ///
    /// See [`EngineBuilder::failure_policy`].
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.engine = self.engine.failure_policy(policy);
        self
    }

    /// The longest a backend check may add to a request (default 100 ms);
    /// past it the failure policy applies.
    ///
    /// See [`EngineBuilder::backend_timeout`].
    pub fn backend_timeout(mut self, timeout: Duration) -> Self {
        self.engine = self.engine.backend_timeout(timeout);
        self
    }

    /// A URL explaining your limits, sent as `docs` in the 429 body.
    ///
    /// See [`EngineBuilder::docs_url`].
    pub fn docs_url(mut self, url: impl Into<String>) -> Self {
        self.engine = self.engine.docs_url(url);
        self
    }

    /// Replaces the 429 response (see [`OnRejection`]).
    pub fn on_rejection(mut self, on_rejection: impl OnRejection) -> Self {
        self.on_rejection = Arc::new(on_rejection);
        self
    }

    /// The global mode (default [`Mode::Enforce`]): each tier runs in the
    /// weaker of its own mode and this one (see [`crate::rollout`]).
    ///
    /// See [`EngineBuilder::mode`].
    pub fn mode(mut self, mode: Mode) -> Self {
        self.engine = self.engine.mode(mode);
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
    ///
    /// See [`EngineBuilder::shadow_headers`].
    pub fn shadow_headers(mut self, send: bool) -> Self {
        self.engine = self.engine.shadow_headers(send);
        self
    }

    /// The level of the log line for a request a shadow tier would have
    /// rejected (default `INFO`).
    ///
    /// See [`EngineBuilder::shadow_log_level`].
    pub fn shadow_log_level(mut self, level: tracing::Level) -> Self {
        self.engine = self.engine.shadow_log_level(level);
        self
    }

    /// The circuit breaker in front of the backend (default: open after 5
    /// consecutive failures, probe every 500 ms; `failures: 0` disables it).
    ///
    /// See [`EngineBuilder::circuit_breaker`].
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.engine = self.engine.circuit_breaker(breaker);
        self
    }

    /// For [`FailurePolicy::Fallback`]: how many app instances share the
    /// quota, so each local fallback admits `quota / instances` (default 1;
    /// a burst or limit below 1 becomes 1).
    ///
    /// See [`EngineBuilder::fallback_instances`].
    pub fn fallback_instances(mut self, instances: u32) -> Self {
        self.engine = self.engine.fallback_instances(instances);
        self
    }

    /// The local deny cache's size in keys (default 100 000; 0 disables it).
    /// Used with the Redis backend only: the memory backend is local anyway.
    ///
    /// See [`EngineBuilder::deny_cache`].
    pub fn deny_cache(mut self, capacity: u64) -> Self {
        self.engine = self.engine.deny_cache(capacity);
        self
    }

    /// The 429-rate baseline and its alert (see [`AnomalyConfig`]).
    ///
    /// See [`EngineBuilder::anomaly`].
    pub fn anomaly(mut self, config: AnomalyConfig) -> Self {
        self.engine = self.engine.anomaly(config);
        self
    }

    /// Counters per tier in the top-N blocked and near-limit sketches
    /// (default 256; the error of a count is at most the smallest counter).
    ///
    /// See [`EngineBuilder::top_n_capacity`].
    pub fn top_n_capacity(mut self, capacity: usize) -> Self {
        self.engine = self.engine.top_n_capacity(capacity);
        self
    }

    /// The most distinct endpoints (`METHOD route template`) tracked with
    /// their own series: the `endpoint` label of
    /// `tiered_ratelimit_tier_decisions_total` and the anomaly gauge, and
    /// the anomaly baseline (default 1024). Endpoints seen after that many
    /// share the label `<other>`. Bounds the tier-decision series at
    /// (`max_endpoints` + 1) × tiers × plans × 5 decisions, of which only
    /// the combinations that occur exist.
    ///
    /// See [`EngineBuilder::max_endpoints`].
    pub fn max_endpoints(mut self, endpoints: usize) -> Self {
        self.engine = self.engine.max_endpoints(endpoints);
        self
    }

    /// Polls a fleet-wide control hash in Redis (see [`handle`](crate::handle#the-fleet-wide-control-key));
    /// Redis backends only (ignored by the memory backend).
    ///
    /// See [`EngineBuilder::control_key`].
    pub fn control_key(mut self, control: ControlKey) -> Self {
        self.engine = self.engine.control_key(control);
        self
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
    ///
    /// See [`EngineBuilder::fleet_top_n`].
    pub fn fleet_top_n(mut self, on: bool) -> Self {
        self.engine = self.engine.fleet_top_n(on);
        self
    }

    /// How often the deny cache's 429s are flushed to the fleet-wide hourly
    /// sets (default 1 s; at least 10 ms), and how many distinct keys at
    /// most wait for a flush (default 10 000): a 429 for a new key beyond
    /// that is not counted fleet-wide, only in
    /// `tiered_ratelimit_fleet_blocked_dropped_total{reason="overflow"}`. A
    /// crash loses at most one interval; so does a flush Redis fails.
    pub fn fleet_top_n_flush(mut self, interval: Duration, max_keys: usize) -> Self {
        self.engine = self.engine.fleet_top_n_flush(interval, max_keys);
        self
    }

    /// Which protocol blocked requests are answered in (feature `grpc`;
    /// default [`Protocol::Auto`](crate::http::grpc::Protocol::Auto): gRPC for
    /// `application/grpc` requests, HTTP for the others). See
    /// [`crate::http::grpc`].
    #[cfg(feature = "grpc")]
    #[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
    pub fn protocol(mut self, protocol: crate::http::grpc::Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// After how many requests in a row from the start on which a tier had
    /// no key (its extractor returned none, so the tier never applied) the
    /// layer logs one `WARN` naming the tier and the likely cause (for a
    /// [`User`](crate::key::User) tier: the auth middleware placed inside
    /// the limiter instead of outside it; for an
    /// [`ApiKey`](crate::key::ApiKey) tier: a header no client sends).
    /// Default 1000 requests; 0 never warns. Every keyless request is
    /// counted in `tiered_ratelimit_tier_no_key_total{tier}` whatever this
    /// says. Policy file: `no_key_warn_after`.
    ///
    /// See [`EngineBuilder::no_key_warning_after`].
    pub fn no_key_warning_after(mut self, requests: u64) -> Self {
        self.engine = self.engine.no_key_warning_after(requests);
        self
    }

    /// Which rate-limit headers to send (default [`HeaderStyle::Legacy`]).
    ///
    /// See [`EngineBuilder::headers`].
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.engine = self.engine.headers(style);
        self
    }
}
