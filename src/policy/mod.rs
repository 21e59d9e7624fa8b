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
//! `[[tier]]` a [`TierPolicy`] (its `key` a [`KeySpec`]) and
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
mod redis;
mod tier;

pub use lists::DenylistPolicy;
pub use priced::{ActualPolicy, EstimatePolicy, PricedPolicy};
pub use redis::RedisConfig;
pub(crate) use tier::{anchor, calendar_of, optional_period};
pub use tier::{KeySpec, PlanSource, PolicyPeriod, TierPolicy};

use crate::backend::Backend;
use crate::engine::FailurePolicy;
use crate::engine::{CircuitBreaker, ControlKey};
use crate::error::ConfigError;
use crate::http::layer::{RateLimitLayer, RateLimitLayerBuilder};
use crate::key::ClientIp;
use crate::response::{HeaderStyle, RejectionBody};
use crate::rollout::{AccessList, Mode};
use serde::Deserialize;
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
    /// Parses a policy from TOML text.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] with the parser's message, which names the
    /// offending field and line (unknown fields included).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Policy(e.to_string()))
    }

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
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_named() {
        let err = Policy::from_toml_str("key_prefx = \"rl\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("key_prefx"), "{err}");
        let err = Policy::from_toml_str(
            "[[tier]]\nname='a'\nkey='global'\nlimit=1\nperiod='1s'\nburts=3\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("burts"), "{err}");
        let err = Policy::from_toml_str("[[tier]]\nname='a'\nkey='ipp'\nlimit=1\nperiod='1s'\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("ipp"), "{err}");
    }

    /// An unknown `key` string lists the four names and the header form
    /// (docs/rollout.md once showed `key = "api_key"`).
    #[test]
    fn an_unknown_key_names_the_header_form() {
        let err = Policy::from_toml_str(
            "[[tier]]\nname = 'api'\nkey = 'api_key'\nlimit = 1\nperiod = '1s'\n",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "policy: TOML parse error at line 3, column 7\n  |\n3 | key = 'api_key'\n  |       ^^^^^^^^^\n\
             unknown key `api_key`, expected `global`, `ip`, `user`, `endpoint`, \
             or { header = \"<name>\" } to key on a request header \
             (an API key: { header = \"x-api-key\" })\n"
        );
    }

    #[test]
    fn trusted_proxies_accept_cidrs_and_addresses() {
        let p =
            Policy::from_toml_str("[client_ip]\ntrusted_proxies=['10.0.0.0/8','192.0.2.1','::1']")
                .unwrap();
        assert_eq!(p.client_ip.trusted().len(), 3);
        let err = Policy::from_toml_str("[client_ip]\ntrusted_proxies=['nope']")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nope") && err.contains("trusted_proxies"),
            "{err}"
        );
    }

    #[test]
    fn invalid_tiers_fail_at_build_naming_the_field() {
        let p =
            Policy::from_toml_str("[[tier]]\nname='ip'\nkey='ip'\nlimit=0\nperiod='1s'\n").unwrap();
        let err =
            RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tier \"ip\": limit: must be greater than 0"
        );
    }

    /// Every table reads straight into the type the builder takes.
    #[test]
    fn tables_are_the_builder_types() {
        use crate::key::ForwardedHeader;
        use crate::{quota::Quota, rollout::DenyStatus};
        let p = Policy::from_toml_str(
            r#"
mode = "canary:5"
headers = "ietf"
body = "problem"
circuit_breaker = { failures = 7 }
[client_ip]
trusted_proxies = ["10.0.0.0/8", "::ffff:192.0.2.0/120"]
forwarded_headers = ["Forwarded", "x-real-ip", "forwarded"]
ipv6_prefix = 56
[allowlist]
users = ["ops-bot"]
[denylist]
api_keys = ["sk_bad"]
status = 429
[control]
redis_key = "svc:control"
[[tier]]
name = "t"
key = { header = "X-Api-Key" }
limit = 10
period = "1m"
algorithm = "leaky_bucket_shape"
max_delay = "1500ms"
methods = ["GET", "PURGE"]
plan = { header = "X-Plan" }
[tier.plans]
pro = { limit = 100, period = "1m", burst = 200 }
"#,
        )
        .unwrap();
        assert_eq!(p.mode, Mode::Canary { percent: 5 });
        assert_eq!(p.headers, HeaderStyle::IetfDraft11);
        assert_eq!(p.body, RejectionBody::Problem);
        assert_eq!(
            p.circuit_breaker,
            CircuitBreaker {
                failures: 7,
                probe_interval: Duration::from_millis(500),
            }
        );
        assert_eq!(
            p.client_ip.trusted(),
            [
                "10.0.0.0/8".parse().unwrap(),
                "192.0.2.0/24".parse().unwrap()
            ]
        );
        assert_eq!(
            p.client_ip.headers(),
            [ForwardedHeader::Forwarded, ForwardedHeader::XRealIp]
        );
        assert_eq!(p.denylist.status, DenyStatus::TooManyRequests);
        assert!(!p.denylist.list.is_empty() && !p.allowlist.is_empty());
        assert_eq!(p.control, Some(ControlKey::new("svc:control")));
        let t = &p.tiers[0];
        assert_eq!(
            t.key,
            KeySpec::Header(http::HeaderName::from_static("x-api-key"))
        );
        assert_eq!(t.key.to_string(), "header:x-api-key");
        assert_eq!(t.algorithm.as_deref(), Some("leaky_bucket_shape"));
        assert_eq!(
            t.methods,
            Some(vec![http::Method::GET, "PURGE".parse().unwrap()])
        );
        assert_eq!(
            t.plan,
            PlanSource::Header(http::HeaderName::from_static("x-plan"))
        );
        assert_eq!(t.plans["pro"], Quota::per_minute(100).burst(200));
        let layer = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap();
        let tier = &layer.handle().tiers()[0];
        assert_eq!(
            tier.algorithm,
            crate::algorithm::kind::Algorithm::LeakyBucket(
                crate::algorithm::kind::LeakyBucket::Shape {
                    max_delay: Duration::from_millis(1500)
                }
            )
        );
        assert_eq!(layer.handle().mode(), Mode::Canary { percent: 5 });
    }

    /// Every name of the one table is a valid `algorithm`.
    #[test]
    fn every_algorithm_name_is_accepted() {
        for name in crate::algorithm::kind::Algorithm::NAMES {
            let max_delay = if name == "leaky_bucket_shape" {
                "max_delay = '1s'"
            } else {
                ""
            };
            let p = Policy::from_toml_str(&format!(
                "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\nalgorithm='{name}'\n{max_delay}"
            ))
            .unwrap();
            let layer =
                RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap();
            assert_eq!(layer.handle().tiers()[0].algorithm.name(), name);
        }
    }

    /// What the file alone can get wrong is an error when it is read,
    /// naming the field or value and the line.
    #[test]
    fn values_are_checked_when_read_with_their_line() {
        let tier = "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\n";
        for (text, line, what) in [
            (
                format!("{tier}[denylist]\nstatus = 418\n"),
                7,
                "denylist.status: 418 is not 403 or 429",
            ),
            (
                format!("[allowlist]\napi_key_header = 'a b'\n{tier}"),
                2,
                "\"a b\", expected a header name",
            ),
            (
                format!("[allowlist]\nusers = []\nipz = []\n{tier}"),
                3,
                "unknown field `ipz`",
            ),
            (
                format!("[denylist]\nips = ['10.0.0.0/33']\n{tier}"),
                2,
                "10.0.0.0/33",
            ),
            (
                format!("[client_ip]\nipv6_prefix = 64\nproxies = []\n{tier}"),
                3,
                "unknown field `proxies`",
            ),
            (
                format!("{tier}methods = ['GET', 'G E T']\n"),
                6,
                "\"G E T\", expected an HTTP method",
            ),
            (
                format!("{tier}mode = 'sometimes'\n"),
                6,
                "unknown variant `sometimes`, expected one of `enforce`, `shadow`, `canary`, `off`",
            ),
            (
                format!("mode = 'canary'\n{tier}"),
                1,
                "unknown mode \"canary\"",
            ),
            (
                format!("{tier}plan = {{ header = 'x plan' }}\n"),
                6,
                "\"x plan\", expected a header name",
            ),
            (
                tier.replace("key='global'", "key={ header = 'a b' }"),
                3,
                "\"a b\", expected a header name",
            ),
            (
                tier.replace("key='global'", "key={ heder = 'x' }"),
                3,
                "unknown field `heder`, expected `header`",
            ),
        ] {
            let e = Policy::from_toml_str(&text).unwrap_err().to_string();
            assert!(
                e.contains(&format!("at line {line},")) && e.contains(what),
                "{text}\n{e}"
            );
        }
    }

    /// The pairs a file spells as two fields are checked together when the
    /// builder is made, naming the tier and the field.
    #[test]
    fn paired_fields_are_checked_by_the_builder() {
        let tier = "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\n";
        for (extra, message) in [
            (
                "algorithm='leaky_bucket_shape'",
                "max_delay: required by algorithm = \"leaky_bucket_shape\"",
            ),
            (
                "max_delay='1s'",
                "max_delay: only algorithm = \"leaky_bucket_shape\" delays requests",
            ),
            (
                "mode='canary'",
                "canary_percent: required by mode = \"canary\"",
            ),
            (
                "mode='canary'\ncanary_percent=101",
                "canary_percent: 101 is above 100",
            ),
            (
                "mode='shadow'\ncanary_percent=1",
                "canary_percent: only mode = \"canary\" uses it",
            ),
        ] {
            let p = Policy::from_toml_str(&format!("{tier}{extra}\n")).unwrap();
            let e = p.builder(crate::backend::MemoryBackend::new()).unwrap_err();
            assert_eq!(e.to_string(), format!("policy: tier \"t\": {message}"));
        }
        let p =
            Policy::from_toml_str(&format!("{tier}mode='canary'\ncanary_percent=100\n")).unwrap();
        let layer = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap();
        assert_eq!(
            layer.handle().tiers()[0].mode,
            Mode::Canary { percent: 100 }
        );
    }
}
