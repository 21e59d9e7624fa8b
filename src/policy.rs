//! [`Policy`]: the layer's configuration as a TOML file, for limits that
//! operators tune without a recompile.
//!
//! ```
//! use tiered_ratelimit::{backend::MemoryBackend, Policy, RateLimitLayer};
//!
//! let policy = Policy::from_toml_str(r#"
//!     key_prefix = "rl"
//!     failure_policy = "open"              # "open" | "closed"
//!     backend_timeout_ms = 100
//!     docs_url = "https://example.com/docs/rate-limits"
//!
//!     [client_ip]
//!     trusted_proxies = []                 # CIDRs; empty = trust no forwarding header
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
//! `algorithm` is one of `"fixed_window"`, `"sliding_window_log"`,
//! `"sliding_window_counter"`, `"token_bucket"`, `"leaky_bucket"` (police)
//! or `"leaky_bucket_shape"`, which also takes `max_delay = "2s"`.
//!
//! Every field but `[[tier]]`'s `name`, `key`, `limit` and `period` is
//! optional, with the builder's defaults. Unknown fields are an error naming
//! the field. Closures stay code-only: files use the built-in extractors
//! (`key = "user"` reads [`UserId`](crate::UserId) from the request
//! extensions).

use crate::backend::Backend;
use crate::error::ConfigError;
use crate::key::{ApiKey, ClientIp, Endpoint, Global, User};
use crate::layer::{FailurePolicy, RateLimitLayer, RateLimitLayerBuilder};
use crate::{Algorithm, LeakyBucket, Quota, Tier};
use ipnet::IpNet;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

/// A whole layer configuration (see the [module docs](self) for the schema).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Policy {
    /// Storage key prefix (default `rl`).
    #[serde(default = "default_prefix")]
    pub key_prefix: String,
    /// `"open"` (default) or `"closed"`.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Backend timeout in milliseconds (default 100).
    #[serde(default = "default_timeout_ms")]
    pub backend_timeout_ms: u64,
    /// Sent as `docs` in the 429 body.
    #[serde(default)]
    pub docs_url: Option<String>,
    /// How `key = "ip"` tiers find the client address.
    #[serde(default)]
    pub client_ip: ClientIpPolicy,
    /// The tiers, in check order (`[[tier]]` tables).
    #[serde(default, rename = "tier")]
    pub tiers: Vec<TierPolicy>,
}

/// The `[client_ip]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ClientIpPolicy {
    /// CIDRs (or single addresses) of proxies whose `X-Forwarded-For` is
    /// trusted; empty (the default) trusts no forwarding header.
    #[serde(default, deserialize_with = "nets")]
    pub trusted_proxies: Vec<IpNet>,
    /// IPv6 grouping prefix length (default 64).
    #[serde(default = "default_v6_prefix")]
    pub ipv6_prefix: u8,
}

impl Default for ClientIpPolicy {
    fn default() -> Self {
        Self {
            trusted_proxies: Vec::new(),
            ipv6_prefix: default_v6_prefix(),
        }
    }
}

/// One `[[tier]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TierPolicy {
    /// Tier name.
    pub name: String,
    /// What the tier keys by.
    pub key: KeySpec,
    /// Requests per period.
    pub limit: u64,
    /// The period, in humantime (`"1s"`, `"10s"`, `"1m"`, `"1h"`).
    #[serde(with = "humantime_serde")]
    pub period: Duration,
    /// Capacity (default: `limit`).
    #[serde(default)]
    pub burst: Option<u64>,
    /// Counting algorithm (default `token_bucket`).
    #[serde(default)]
    pub algorithm: AlgorithmName,
    /// For `leaky_bucket_shape`: the longest a request may be delayed
    /// (humantime, e.g. `"2s"`). Required by that algorithm, rejected by the others.
    #[serde(default, with = "humantime_serde")]
    pub max_delay: Option<Duration>,
    /// Tokens per request (default 1).
    #[serde(default = "one")]
    pub cost: u64,
}

/// A tier's `algorithm` in a policy file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AlgorithmName {
    /// [`Algorithm::FixedWindow`].
    FixedWindow,
    /// [`Algorithm::SlidingWindowLog`].
    SlidingWindowLog,
    /// [`Algorithm::SlidingWindowCounter`].
    SlidingWindowCounter,
    /// [`Algorithm::TokenBucket`] (the default).
    #[default]
    TokenBucket,
    /// [`LeakyBucket::Police`].
    LeakyBucket,
    /// [`LeakyBucket::Shape`], with the tier's `max_delay`.
    LeakyBucketShape,
}

/// A tier's key in a policy file: `"global"`, `"ip"`, `"user"`,
/// `"endpoint"` or `{ header = "x-api-key" }`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySpec {
    /// [`Global`].
    Global,
    /// [`ClientIp`], configured by `[client_ip]`.
    Ip,
    /// [`User`] ([`UserId`](crate::UserId) from the request extensions).
    User,
    /// [`Endpoint`].
    Endpoint,
    /// [`ApiKey`] read from this header.
    Header(String),
}

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeySpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#""global", "ip", "user", "endpoint" or { header = "<name>" }"#)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeySpec, E> {
                match v {
                    "global" => Ok(KeySpec::Global),
                    "ip" => Ok(KeySpec::Ip),
                    "user" => Ok(KeySpec::User),
                    "endpoint" => Ok(KeySpec::Endpoint),
                    other => Err(E::unknown_variant(
                        other,
                        &["global", "ip", "user", "endpoint"],
                    )),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KeySpec, A::Error> {
                let mut header = None;
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "header" => header = Some(map.next_value::<String>()?),
                        other => return Err(de::Error::unknown_field(other, &["header"])),
                    }
                }
                let h = header.ok_or_else(|| de::Error::missing_field("header"))?;
                if ApiKey::try_header(&h).is_none() {
                    return Err(de::Error::invalid_value(
                        de::Unexpected::Str(&h),
                        &"a header name",
                    ));
                }
                Ok(KeySpec::Header(h))
            }
        }
        d.deserialize_any(V)
    }
}

fn nets<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<IpNet>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| {
            s.parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    de::Error::invalid_value(
                        de::Unexpected::Str(s),
                        &"a CIDR such as 10.0.0.0/8 or an IP address",
                    )
                })
        })
        .collect()
}

fn default_prefix() -> String {
    "rl".to_owned()
}
fn default_timeout_ms() -> u64 {
    100
}
fn default_v6_prefix() -> u8 {
    64
}
fn one() -> u64 {
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
    /// (closure tiers, a custom rejection body).
    ///
    /// # Errors
    /// [`ConfigError::InvalidIpv6Prefix`] for `ipv6_prefix` above 128.
    pub fn builder(
        &self,
        backend: impl Into<Backend>,
    ) -> Result<RateLimitLayerBuilder, ConfigError> {
        if self.client_ip.ipv6_prefix > 128 {
            return Err(ConfigError::InvalidIpv6Prefix(self.client_ip.ipv6_prefix));
        }
        let client_ip = ClientIp::default()
            .trusted_proxies(self.client_ip.trusted_proxies.iter().copied())
            .ipv6_prefix(self.client_ip.ipv6_prefix);
        let mut b = RateLimitLayer::builder()
            .backend(backend)
            .key_prefix(self.key_prefix.clone())
            .failure_policy(self.failure_policy)
            .backend_timeout(Duration::from_millis(self.backend_timeout_ms));
        if let Some(url) = &self.docs_url {
            b = b.docs_url(url.clone());
        }
        for t in &self.tiers {
            let mut quota = Quota::new(t.limit, t.period);
            if let Some(burst) = t.burst {
                quota = quota.burst(burst);
            }
            let name = t.name.clone();
            let tier = match &t.key {
                KeySpec::Global => Tier::new(name, Global, quota),
                KeySpec::Ip => Tier::new(name, client_ip.clone(), quota),
                KeySpec::User => Tier::new(name, User, quota),
                KeySpec::Endpoint => Tier::new(name, Endpoint, quota),
                KeySpec::Header(h) => match ApiKey::try_header(h) {
                    Some(k) => Tier::new(name, k, quota),
                    None => {
                        return Err(ConfigError::Policy(format!(
                            "tier \"{}\": key.header: invalid header name {h:?}",
                            t.name
                        )))
                    }
                },
            };
            let algorithm = match (t.algorithm, t.max_delay) {
                (AlgorithmName::LeakyBucketShape, Some(max_delay)) => {
                    Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay })
                }
                (AlgorithmName::LeakyBucketShape, None) => {
                    return Err(ConfigError::Policy(format!(
                        "tier \"{}\": max_delay: required by algorithm = \"leaky_bucket_shape\"",
                        t.name
                    )))
                }
                (_, Some(_)) => {
                    return Err(ConfigError::Policy(format!(
                        "tier \"{}\": max_delay: only algorithm = \"leaky_bucket_shape\" delays requests",
                        t.name
                    )))
                }
                (AlgorithmName::FixedWindow, None) => Algorithm::FixedWindow,
                (AlgorithmName::SlidingWindowLog, None) => Algorithm::SlidingWindowLog,
                (AlgorithmName::SlidingWindowCounter, None) => Algorithm::SlidingWindowCounter,
                (AlgorithmName::TokenBucket, None) => Algorithm::TokenBucket,
                (AlgorithmName::LeakyBucket, None) => Algorithm::LeakyBucket(LeakyBucket::Police),
            };
            b = b.tier(tier.cost(t.cost).algorithm(algorithm));
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

    #[test]
    fn trusted_proxies_accept_cidrs_and_addresses() {
        let p =
            Policy::from_toml_str("[client_ip]\ntrusted_proxies=['10.0.0.0/8','192.0.2.1','::1']")
                .unwrap();
        assert_eq!(p.client_ip.trusted_proxies.len(), 3);
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
}
