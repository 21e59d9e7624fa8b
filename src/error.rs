//! Errors: configuration errors (at build time) and backend errors (at run time).

use std::time::Duration;

/// A configuration the layer refuses to build, naming the offending field.
///
/// Returned by [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build),
/// [`RateLimitLayer::from_policy`](crate::RateLimitLayer::from_policy),
/// [`Policy::from_toml_str`](crate::policy::Policy::from_toml_str) and the backend constructors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The builder or policy has no `tier`.
    #[error("tiers: at least one tier is required")]
    NoTiers,
    /// Two tiers share a name (names are part of the storage key).
    #[error("tier \"{0}\": name: duplicate tier name")]
    DuplicateTier(String),
    /// A tier name is empty, too long, or has characters outside `[A-Za-z0-9_-]`.
    #[error("tier \"{0}\": name: must be 1-64 characters of [A-Za-z0-9_-]")]
    InvalidTierName(String),
    /// More than [`MAX_TIERS`](crate::MAX_TIERS) tiers.
    #[error("tiers: {0} tiers; at most 64 are supported")]
    TooManyTiers(usize),
    /// Both `skip_failed_requests` and `skip_successful_requests`: every
    /// request would be refunded and the tier would never limit.
    #[error("tier \"{tier}\": skip_failed_requests/skip_successful_requests: both set, so nothing would ever count")]
    SkipBoth {
        /// The tier's name.
        tier: String,
    },
    /// Lease mode (`sync = "lease"`, [`Tier::lease`](crate::Tier::lease)) on
    /// a tier it cannot run on: an algorithm other than the token bucket,
    /// the policing leaky bucket and the fixed window, or with a penalty
    /// box, per-key overrides or refunds by status.
    #[error("tier \"{tier}\": sync: lease mode {reason}")]
    LeaseUnsupported {
        /// The tier's name.
        tier: String,
        /// Why.
        reason: &'static str,
    },
    /// A calendar tier ([`Tier::calendar`](crate::Tier::calendar)) with
    /// another algorithm than the fixed window: a calendar period is a
    /// quota, not a rate.
    #[error("tier \"{tier}\": algorithm: a calendar period (period = {period:?}) counts with fixed_window only, not {algorithm}")]
    CalendarAlgorithm {
        /// The tier's name.
        tier: String,
        /// The calendar period's name.
        period: &'static str,
        /// The algorithm's name.
        algorithm: &'static str,
    },
    /// A priced tier ([`Tier::priced`](crate::Tier::priced)) configured
    /// wrongly: an invalid header name, an estimate's `default` above its
    /// `max`, an algorithm that cannot settle (only the token bucket and
    /// the fixed window can), or with lease mode or refunds by status.
    #[error("tier \"{tier}\": {field}: {reason}")]
    Priced {
        /// The tier's name.
        tier: String,
        /// The field (`priced.estimate.header`, `priced.estimate.json`,
        /// `priced.estimate.max_body_bytes`, `priced.actual.header`,
        /// `priced.estimate.default`, `algorithm`, `sync`, `overrides`,
        /// `skip_failed_requests`).
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A tier's rollout plan ([`Tier::rollout`](crate::Tier::rollout)) is
    /// refused: no stage, a stage `off` or over 100 %, a stage but the last
    /// without a duration (or of 0), the last one with one, or no control
    /// key to keep its state in.
    #[error("tier \"{tier}\": {field}: {reason}")]
    RolloutPlan {
        /// The tier's name.
        tier: String,
        /// The field (`rollout`, `rollout[2].for`, `rollout[0].mode`,
        /// `rollout.lease`).
        field: String,
        /// Why.
        reason: String,
    },
    /// A tier's candidate quota ([`Tier::candidates`](crate::Tier::candidates))
    /// is refused: more than four, on a concurrency tier or beside lease
    /// mode, or a quota the tier's own would be refused for.
    #[error("tier \"{tier}\": {field}: {reason}")]
    Candidate {
        /// The tier's name.
        tier: String,
        /// The field (`candidates`, `candidates[1].limit`).
        field: String,
        /// Why.
        reason: String,
    },
    /// `fallback_instances` is 0.
    #[error("fallback_instances: must be at least 1")]
    ZeroFallbackInstances,
    /// A [`RateLimitHandle`](crate::RateLimitHandle) change of a quota or a
    /// list on a layer with a fleet-wide control key (and a Redis backend):
    /// there they are fleet-wide settings, changed with the `set_fleet_*`
    /// methods, so that no instance answers a limit of its own.
    #[error("{setter}: this layer has a fleet-wide control key, so quotas and lists are fleet-wide settings: use RateLimitHandle::{instead}")]
    FleetWide {
        /// The change refused (`tier_quota`, `plan_quota`, `allowlist`, `denylist`).
        setter: &'static str,
        /// The fleet-wide method to use instead.
        instead: &'static str,
    },
    /// A runtime change named a tier the layer does not have.
    #[error("tier \"{0}\": no such tier")]
    UnknownTier(String),
    /// A quota's `limit` is zero.
    #[error("tier \"{tier}\": limit: must be greater than 0")]
    ZeroLimit {
        /// The tier's name.
        tier: String,
    },
    /// A quota's `period` is zero (or under one microsecond).
    #[error("tier \"{tier}\": period: must be at least 1 microsecond, got {period:?}")]
    ZeroPeriod {
        /// The tier's name.
        tier: String,
        /// The period given.
        period: Duration,
    },
    /// A tier's fixed `cost` is zero.
    #[error("tier \"{tier}\": cost: must be greater than 0")]
    ZeroCost {
        /// The tier's name.
        tier: String,
    },
    /// The `burst` is smaller than the tier's `cost`, so no request could ever pass.
    #[error(
        "tier \"{tier}\": burst: {burst} is smaller than cost {cost}; no request could ever pass"
    )]
    BurstBelowCost {
        /// The tier's name.
        tier: String,
        /// The burst (capacity) in tokens.
        burst: u64,
        /// The fixed cost per request in tokens.
        cost: u64,
    },
    /// A window algorithm was given a `burst` other than its limit.
    #[error("tier \"{tier}\": burst: {algorithm:?} has no burst (it admits up to the limit per window); remove burst or use token_bucket/leaky_bucket")]
    BurstNotSupported {
        /// The tier's name.
        tier: String,
        /// The tier's algorithm.
        algorithm: crate::algorithm::kind::Algorithm,
    },
    /// A quota value the Redis script could not compute exactly: it counts in
    /// Lua doubles, and every value it handles must stay at or below 2^53.
    /// `field` names the quota field to change (`limit`, `burst`, `period`
    /// or `max_delay`); the bound of each algorithm is documented on
    /// [`Quota`](crate::Quota).
    #[error("tier \"{tier}\": {field}: {detail}; the Redis script counts exactly only up to 2^53 (see Quota's docs for each algorithm's bound)")]
    QuotaTooLarge {
        /// The tier's name.
        tier: String,
        /// The field to change: `limit`, `burst`, `period` or `max_delay`.
        field: &'static str,
        /// What is too large, with the value and the bound.
        detail: String,
    },
    /// With the IETF headers ([`HeaderStyle`](crate::response::HeaderStyle)
    /// `IetfDraft11`, `IetfDraft09`, `Both`): a quota number the
    /// `RateLimit-Policy` and `RateLimit` fields cannot carry, being above
    /// 999 999 999 999 999, the largest Structured Fields integer (RFC 9651
    /// §3.3.1, 15 digits). `field`: `limit`, `burst` or `period` (in
    /// seconds), or a plan's, `plans.<plan>.limit`.
    #[error("tier \"{tier}\": {field}: {value} is above 999999999999999, the largest integer the IETF RateLimit fields can carry (RFC 9651 Structured Fields: 15 digits)")]
    BeyondStructuredFields {
        /// The tier's name.
        tier: String,
        /// The field to change.
        field: String,
        /// Its value (a period in seconds, rounded up).
        value: u128,
    },
    /// A tier's quota unit ([`Tier::quota_unit`](crate::Tier::quota_unit))
    /// is not 1-32 characters of `[a-z0-9-]`.
    #[error("tier \"{tier}\": quota_unit: \"{unit}\" must be 1-32 characters of [a-z0-9-]")]
    InvalidQuotaUnit {
        /// The tier's name.
        tier: String,
        /// The unit given.
        unit: String,
    },
    /// The key prefix is empty, too long, or has whitespace, `{`, `}` or non-ASCII.
    #[error("key_prefix: \"{0}\" must be 1-64 printable ASCII characters without '{{' or '}}'")]
    InvalidKeyPrefix(String),
    /// The Redis URL does not parse.
    #[error("redis url: {0}")]
    InvalidRedisUrl(String),
    /// [`build_checked`](crate::RateLimitLayerBuilder::build_checked) under
    /// `FailurePolicy::Closed`: the backend did not answer at start-up, so
    /// every request would get 503.
    #[error("failure_policy = \"closed\" and {0}: refusing to start")]
    BackendUnreachable(#[source] PingError),
    /// `client_ip.ipv6_prefix` is above 128.
    #[error("client_ip.ipv6_prefix: {0} is not a prefix length (0-128)")]
    InvalidIpv6Prefix(u8),
    /// The policy file does not parse or does not match the schema; the
    /// message names the field (unknown fields included).
    #[error("policy: {0}")]
    Policy(String),
    /// The policy file could not be read.
    #[error("policy file {path}: {source}")]
    PolicyFile {
        /// The path given.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Why a backend could not decide. The layer turns every one of these into the
/// configured [`FailurePolicy`](crate::FailurePolicy); none reaches the client
/// as a 500. The underlying error, where there is one, is kept as the
/// [`source`](std::error::Error::source) (in an `Arc`, so the error stays
/// `Clone`).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The backend did not answer within `backend_timeout`.
    #[error("backend timed out after {0:?}")]
    Timeout(Duration),
    /// No connection: it could not be made or was lost, the pool could not
    /// hand one out, or the node cannot serve the call now (loading,
    /// read-only, its primary down, the cluster reconfiguring).
    #[error("backend connection error: {0}")]
    Connection(#[source] std::sync::Arc<dyn std::error::Error + Send + Sync>),
    /// The backend answered the call with an error (a script error, say).
    #[error("backend script error: {0}")]
    Script(#[source] std::sync::Arc<dyn std::error::Error + Send + Sync>),
    /// The backend's reply does not have the layout this version expects.
    #[error("unexpected backend reply: {0}")]
    Reply(String),
    /// The task a cluster check ran in failed (panicked or was cancelled).
    #[error("backend task failed: {0}")]
    Task(#[source] std::sync::Arc<dyn std::error::Error + Send + Sync>),
    /// There is no tokio runtime to run the backend call on.
    #[error("no tokio runtime to run the backend call on")]
    NoRuntime,
    /// This backend cannot do what was asked (what, in words).
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
    /// The circuit breaker is open: the backend failed repeatedly and is not
    /// being called until the next probe.
    #[error("backend circuit open: not calling it until the next probe")]
    CircuitOpen,
    /// A key extractor could not run (for example `ClientIp` without
    /// `ConnectInfo`) under `FailurePolicy::Closed`; under the other
    /// policies only that tier is skipped (see [`KeyError`](crate::key::KeyError)).
    #[error("key extraction failed: {0}")]
    Key(#[from] crate::key::KeyError),
}

/// The backend did not answer [`Backend::ping`](crate::backend::Backend::ping):
/// which backend (a Redis address, never its password) and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("backend {backend} unreachable: {source}")]
#[non_exhaustive]
pub struct PingError {
    /// The backend as an operator finds it: `redis at 127.0.0.1:6379`,
    /// `redis cluster at ...`, `redis primary of "mymaster" via sentinels`.
    pub backend: String,
    /// What the ping got instead of `PONG`.
    pub source: BackendError,
}

impl BackendError {
    /// A connection error with `e` as its source.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn connection(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        BackendError::Connection(std::sync::Arc::new(e))
    }

    /// A script error with `e` as its source.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn script(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        BackendError::Script(std::sync::Arc::new(e))
    }

    /// A short, bounded label for metrics: `timeout`, `connection`, `script`
    /// (also an unexpected reply, a failed task, no runtime, unsupported),
    /// `key` or `circuit_open`.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::Timeout(_) => "timeout",
            BackendError::Connection(_) => "connection",
            BackendError::Script(_)
            | BackendError::Reply(_)
            | BackendError::Task(_)
            | BackendError::NoRuntime
            | BackendError::Unsupported(_) => "script",
            BackendError::Key(_) => "key",
            BackendError::CircuitOpen => "circuit_open",
        }
    }
}
