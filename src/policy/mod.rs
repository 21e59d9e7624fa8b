//! [`Policy`]: the layer's configuration as a TOML file, for limits that
//! operators tune without a recompile.
//!
//! ```
//! use tiered_ratelimit::{backend::MemoryBackend, RateLimitLayer, policy::Policy};
//!
//! let policy = Policy::from_toml_str(r#"
//!     key_prefix = "rl"
//!     failure_policy = "open"              # "open" | "closed"
//!     backend_timeout_ms = 100
//!     no_key_warn_after = 1000             # WARN once when a tier had no key on its first 1000 requests (0: never)
//!     docs_url = "https://example.com/docs/rate-limits"
//!
//!     [client_ip]
//!     trusted_proxies = []                 # CIDRs; empty = trust no forwarding header
//!     forwarded_headers = ["x-forwarded-for"] # first present wins; "x-forwarded-for" | "forwarded" | "x-real-ip"
//!     ipv6_prefix = 64
//!
//!     [[tier]]
//!     name = "global"
//!     key = "global"                       # "global" | "ip" | "user" | "endpoint" | { header = "x-api-key" }
//!     limit = 1000
//!     period = "1s"                        # humantime: "1s", "10s", "1m", "1h"
//!     burst = 2000                         # optional, default = limit
//!     algorithm = "token_bucket"           # optional, default token_bucket (see below)
//!     cost = 1                             # optional, default 1
//!
//!     [[tier]]
//!     name = "api_key"
//!     key = { header = "x-api-key" }
//!     limit = 10000
//!     period = "1h"
//! "#).unwrap();
//! let layer = RateLimitLayer::from_policy(&policy, MemoryBackend::new()).unwrap();
//! assert_eq!(layer.tier_names().collect::<Vec<_>>(), ["global", "api_key"]);
//! ```
//!
//! `algorithm` is one of [`Algorithm::NAMES`](crate::Algorithm::NAMES):
//! `"fixed_window"`, `"sliding_window_log"`, `"sliding_window_counter"`,
//! `"token_bucket"`, `"leaky_bucket"` (police) or `"leaky_bucket_shape"`,
//! which also takes `max_delay = "2s"`.
//!
//! Every field but `[[tier]]`'s `name`, `key`, `limit` and `period` is
//! optional, with the builder's defaults. Each table deserializes into the
//! type the builder takes, which documents its fields: the top level is
//! [`Policy`] (`mode` a [`Mode`], `headers` a [`HeaderStyle`], `body` a
//! [`RejectionBody`], `fallback_instances`, `shadow_headers`, …),
//! `[client_ip]` is a [`ClientIp`], `[circuit_breaker]` a
//! [`CircuitBreaker`], `[allowlist]` an [`AccessList`], `[denylist]` a
//! [`DenylistPolicy`] (an `AccessList` and a
//! [`DenyStatus`](crate::rollout::DenyStatus)), `[control]` a [`ControlKey`],
//! `[redis]` a [`RedisConfig`] (where the Redis backend is: `url`,
//! `cluster_nodes`, or `sentinels` and `master_name`),
//! `[[tier]]` a [`TierPolicy`] (its `key` a [`KeySpec`], its quota fields a
//! [`QuotaPolicy`], which the Envoy service's rules file shares) and
//! `[tier.plans]` entries [`Quota`](crate::Quota)s, read per request from a
//! [`PlanSource`]. The operator's guide to lists, plans and the control key
//! is `docs/rollout.md`. Unknown fields are an error naming the field and
//! its line, as is a value of the wrong kind. What concerns the
//! configuration as a whole (quota bounds, a burst below the cost, duplicate
//! tier names, an IPv6 prefix above 128) is checked by
//! [`RateLimitLayerBuilder::build`], for a policy exactly as for code.
//! Closures stay code-only: files use the built-in extractors
//! (`key = "user"` reads [`UserId`](crate::key::UserId) from the request
//! extensions).

mod lists;
mod priced;
mod quota;
mod redis;
mod tier;

pub use lists::DenylistPolicy;
pub use priced::{ActualPolicy, EstimatePolicy, PricedPolicy};
#[cfg(all(feature = "policy-file", feature = "descriptor"))]
pub(crate) use quota::toml_error;
pub use quota::QuotaPolicy;
pub use redis::RedisConfig;
#[cfg_attr(not(feature = "descriptor"), allow(unused_imports))]
pub(crate) use tier::candidate_quotas;
pub use tier::{CandidatePolicy, KeySpec, PlanSource, PolicyPeriod, TierPolicy};

use crate::backend::Backend;
use crate::engine::FailurePolicy;
use crate::engine::{CircuitBreaker, ControlKey};
use crate::error::ConfigError;
use crate::http::layer::{RateLimitLayer, RateLimitLayerBuilder};
use crate::key::ClientIp;
use crate::response::{HeaderStyle, RejectionBody};
use crate::rollout::{AccessList, Mode};
use serde::Deserialize;
#[cfg(feature = "policy-file")]
use std::path::Path;
use std::time::Duration;

/// A whole layer configuration, as a TOML policy file (the schema: the
/// README's "Policy file" section). Each field has the type the builder
/// takes, and [`Policy::builder`] hands it over as it is.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Policy {
    /// Storage key prefix (default `rl`).
    #[serde(default = "default_prefix")]
    pub key_prefix: String,
    /// `"open"` (default), `"closed"` or `"fallback"`.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Backend timeout in milliseconds (default 100).
    #[serde(default = "default_timeout_ms")]
    pub backend_timeout_ms: u64,
    /// With `failure_policy = "fallback"`: the instance count the local
    /// fallback divides quotas by (default 1).
    #[serde(default = "default_instances")]
    pub fallback_instances: u32,
    /// `{ failures = 5, probe_interval = "500ms" }` (the defaults).
    #[serde(default)]
    pub circuit_breaker: CircuitBreaker,
    /// Sent as `docs` in the 429 body.
    #[serde(default)]
    pub docs_url: Option<String>,
    /// How `key = "ip"` tiers and the lists find the client address: the
    /// `[client_ip]` table, whose fields [`ClientIp`] documents.
    #[serde(default)]
    pub client_ip: ClientIp,
    /// After how many requests in a row from the start without a key a
    /// tier logs one `WARN` (default 1000; 0 never): see
    /// [`RateLimitLayerBuilder::no_key_warning_after`].
    #[serde(default = "default_no_key_warn_after")]
    pub no_key_warn_after: u64,
    /// The tiers, in check order (`[[tier]]` tables).
    #[serde(default, rename = "tier")]
    pub tiers: Vec<TierPolicy>,
    /// The global mode: `"enforce"` (default: each tier's own mode),
    /// `"shadow"`, `"off"`, or `"canary:<percent>"` as the control key
    /// spells it.
    #[serde(default)]
    pub mode: Mode,
    /// Whether shadow decisions send `X-RateLimit-*` headers (default false).
    #[serde(default)]
    pub shadow_headers: bool,
    /// Whether per-key demand is recorded for limit suggestions (default
    /// false: it costs 1.5–3 % of a check's instructions and one Redis
    /// call a second; `docs/rollout.md`, "Which limit? Suggestions").
    #[serde(default)]
    pub demand: bool,
    /// `"legacy"` (default), `"ietf-draft-11"`, `"ietf-draft-09"`, `"ietf"`
    /// (the current draft: draft-11), `"both"` or `"none"`.
    #[serde(default)]
    pub headers: HeaderStyle,
    /// The 429 body: `"json"` (default) or `"problem"` (RFC 9457).
    #[serde(default)]
    pub body: RejectionBody,
    /// Clients that skip limiting: the `[allowlist]` table, with `ips`,
    /// `api_keys`, `api_key_header` and `users`.
    #[serde(default)]
    pub allowlist: AccessList,
    /// Clients refused before any tier: the `[denylist]` table.
    #[serde(default)]
    pub denylist: DenylistPolicy,
    /// The fleet-wide control key (see `docs/rollout.md`).
    #[serde(default)]
    pub control: Option<ControlKey>,
    /// Where the Redis backend is: the `[redis]` table (a URL, cluster
    /// nodes, or sentinels and a master name), turned into a backend by
    /// [`RedisConfig::backend`]. The layer takes its backend as an
    /// argument, so this table is for the program that reads the policy.
    #[serde(default)]
    pub redis: Option<RedisConfig>,
}

fn default_no_key_warn_after() -> u64 {
    crate::engine::DEFAULT_NO_KEY_WARN_AFTER
}

fn default_prefix() -> String {
    "rl".to_owned()
}
fn default_timeout_ms() -> u64 {
    100
}
fn default_instances() -> u32 {
    1
}

impl Policy {
    #[cfg(feature = "policy-file")]
    #[cfg_attr(docsrs, doc(cfg(feature = "policy-file")))]
    /// Parses a policy from TOML text.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] with the parser's message, which names the
    /// offending field and line (unknown fields included).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Policy(quota::toml_error(text, &e)))
    }

    #[cfg(feature = "policy-file")]
    #[cfg_attr(docsrs, doc(cfg(feature = "policy-file")))]
    /// Reads and parses a policy file.
    ///
    /// # Errors
    /// [`ConfigError::PolicyFile`] when it cannot be read, otherwise as
    /// [`Policy::from_toml_str`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::PolicyFile {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text)
    }

    /// A builder holding this policy, for adding what files cannot say
    /// (closure tiers, a custom rejection body). It checks only what a
    /// file can get wrong and code cannot; the rest is
    /// [`build`](RateLimitLayerBuilder::build)'s, as for any builder.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] for a tier whose `algorithm` and
    /// `max_delay`, or `mode` and `canary_percent`, do not go together.
    pub fn builder(
        &self,
        backend: impl Into<Backend>,
    ) -> Result<RateLimitLayerBuilder, ConfigError> {
        let mut b = RateLimitLayer::builder()
            .backend(backend)
            .key_prefix(self.key_prefix.clone())
            .failure_policy(self.failure_policy)
            .backend_timeout(Duration::from_millis(self.backend_timeout_ms))
            .mode(self.mode)
            .shadow_headers(self.shadow_headers)
            .demand(self.demand)
            .headers(self.headers)
            .on_rejection(self.body)
            .fallback_instances(self.fallback_instances)
            .no_key_warning_after(self.no_key_warn_after)
            .circuit_breaker(self.circuit_breaker)
            .client_ip(self.client_ip.clone())
            .allowlist(self.allowlist.clone())
            .denylist(self.denylist.list.clone(), self.denylist.status);
        if let Some(url) = &self.docs_url {
            b = b.docs_url(url.clone());
        }
        if let Some(control) = &self.control {
            b = b.control_key(control.clone());
        }
        for t in &self.tiers {
            b = b.tier(t.tier(&self.client_ip)?);
        }
        Ok(b)
    }
}

impl RateLimitLayer {
    /// Builds a layer from a [`Policy`] and a backend.
    ///
    /// # Errors
    /// Any [`ConfigError`] of [`Policy::builder`] or
    /// [`RateLimitLayerBuilder::build`].
    pub fn from_policy(policy: &Policy, backend: impl Into<Backend>) -> Result<Self, ConfigError> {
        policy.builder(backend)?.build()
    }
}

#[cfg(test)]
mod tests;
