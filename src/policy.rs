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
//! `algorithm` is one of `"fixed_window"`, `"sliding_window_log"`,
//! `"sliding_window_counter"`, `"token_bucket"`, `"leaky_bucket"` (police)
//! or `"leaky_bucket_shape"`, which also takes `max_delay = "2s"`.
//!
//! Every field but `[[tier]]`'s `name`, `key`, `limit` and `period` is
//! optional, with the builder's defaults. Each table has its type here, with
//! every field documented: the top level is [`Policy`] (`mode`, `headers`,
//! `body`, `fallback_instances`, `shadow_headers`, …), `[client_ip]` is
//! [`ClientIpPolicy`], `[circuit_breaker]` [`CircuitBreakerPolicy`],
//! `[allowlist]` [`ListPolicy`], `[denylist]` [`DenylistPolicy`], `[control]`
//! [`ControlPolicy`], `[[tier]]` [`TierPolicy`] (its `key` a [`KeySpec`],
//! its `algorithm` an [`AlgorithmName`]) and `[tier.plans]` entries
//! [`PlanQuota`], read per request from a [`PlanSource`]. The operator's
//! guide to lists, plans and the control key is `docs/rollout.md`. Unknown fields are an error naming
//! the field. Closures stay code-only: files use the built-in extractors
//! (`key = "user"` reads [`UserId`](crate::UserId) from the request
//! extensions).

use crate::backend::Backend;
use crate::error::ConfigError;
use crate::key::{ApiKey, ClientIp, Endpoint, ForwardedHeader, Global, User};
use crate::layer::{FailurePolicy, RateLimitLayer, RateLimitLayerBuilder};
use crate::response::HeaderStyle;
use crate::rollout::{AccessList, DenyStatus, Mode};
use crate::{Algorithm, LeakyBucket, Quota, Tier};
use ipnet::IpNet;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

/// A whole layer configuration, as a TOML policy file (the schema: the README's "Policy file" section).
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
    /// With `failure_policy = "fallback"`: the instance count the local
    /// fallback divides quotas by (default 1).
    #[serde(default = "default_instances")]
    pub fallback_instances: u32,
    /// `{ failures = 5, probe_interval = "500ms" }` (the defaults).
    #[serde(default)]
    pub circuit_breaker: CircuitBreakerPolicy,
    /// Sent as `docs` in the 429 body.
    #[serde(default)]
    pub docs_url: Option<String>,
    /// How `key = "ip"` tiers find the client address.
    #[serde(default)]
    pub client_ip: ClientIpPolicy,
    /// The tiers, in check order (`[[tier]]` tables).
    #[serde(default, rename = "tier")]
    pub tiers: Vec<TierPolicy>,
    /// Global mode override: `"enforce"` (default: each tier's own mode),
    /// `"shadow"` or `"off"`.
    #[serde(default)]
    pub mode: GlobalModeName,
    /// Whether shadow decisions send `X-RateLimit-*` headers (default false).
    #[serde(default)]
    pub shadow_headers: bool,
    /// `"legacy"` (default), `"ietf-draft-11"`, `"ietf-draft-09"`, `"ietf"`
    /// (the current draft: draft-11), `"both"` or `"none"` ([`HeaderStyle`]).
    #[serde(default)]
    pub headers: HeaderStyleName,
    /// The 429 body: `"json"` (default) or `"problem"` (RFC 9457).
    #[serde(default)]
    pub body: BodyName,
    /// Clients that skip limiting.
    #[serde(default)]
    pub allowlist: ListPolicy,
    /// Clients refused before any tier.
    #[serde(default)]
    pub denylist: DenylistPolicy,
    /// The fleet-wide control key (see `docs/rollout.md`).
    #[serde(default)]
    pub control: Option<ControlPolicy>,
}

/// The `circuit_breaker` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CircuitBreakerPolicy {
    /// Consecutive failures that open the circuit (default 5; 0 disables).
    #[serde(default = "default_failures")]
    pub failures: u32,
    /// How long it stays open before a probe (humantime, default `"500ms"`).
    #[serde(default = "default_probe", with = "humantime_serde")]
    pub probe_interval: Duration,
}

impl Default for CircuitBreakerPolicy {
    fn default() -> Self {
        Self {
            failures: default_failures(),
            probe_interval: default_probe(),
        }
    }
}

/// The top-level `headers`: `"legacy"`, `"ietf-draft-11"`,
/// `"ietf-draft-09"`, `"ietf"` (the current draft, today draft-11),
/// `"both"` or `"none"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum HeaderStyleName {
    /// [`HeaderStyle::Legacy`].
    #[default]
    Legacy,
    /// `"ietf"`: the current draft, [`HeaderStyle::IetfDraft11`].
    Ietf,
    /// `"ietf-draft-11"`: [`HeaderStyle::IetfDraft11`].
    #[serde(rename = "ietf-draft-11")]
    IetfDraft11,
    /// `"ietf-draft-09"`: [`HeaderStyle::IetfDraft09`].
    #[serde(rename = "ietf-draft-09")]
    IetfDraft09,
    /// [`HeaderStyle::Both`].
    Both,
    /// [`HeaderStyle::None`].
    None,
}

impl From<HeaderStyleName> for HeaderStyle {
    fn from(name: HeaderStyleName) -> Self {
        match name {
            HeaderStyleName::Legacy => HeaderStyle::Legacy,
            HeaderStyleName::Ietf | HeaderStyleName::IetfDraft11 => HeaderStyle::IetfDraft11,
            HeaderStyleName::IetfDraft09 => HeaderStyle::IetfDraft09,
            HeaderStyleName::Both => HeaderStyle::Both,
            HeaderStyleName::None => HeaderStyle::None,
        }
    }
}

/// The top-level `body`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum BodyName {
    /// [`JsonRejection`](crate::response::JsonRejection).
    #[default]
    Json,
    /// [`ProblemRejection`](crate::response::ProblemRejection).
    Problem,
}

/// The top-level `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum GlobalModeName {
    /// Each tier's own mode.
    #[default]
    Enforce,
    /// Every tier observes only.
    Shadow,
    /// Limiting is off.
    Off,
}

/// A tier's `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum TierModeName {
    /// [`Mode::Enforce`].
    #[default]
    Enforce,
    /// [`Mode::Shadow`].
    Shadow,
    /// [`Mode::Canary`], with the tier's `canary_percent`.
    Canary,
    /// [`Mode::Off`].
    Off,
}

/// The `[allowlist]` table (and the body of `[denylist]`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ListPolicy {
    /// CIDRs or addresses, matched against the resolved client IP.
    #[serde(default, deserialize_with = "nets")]
    pub ips: Vec<IpNet>,
    /// API keys, read from `api_key_header`.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// The header API keys are read from (default `x-api-key`).
    #[serde(default)]
    pub api_key_header: Option<String>,
    /// User ids ([`UserId`](crate::UserId)).
    #[serde(default)]
    pub users: Vec<String>,
}

/// The `[denylist]` table: a list plus the status refused requests get.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DenylistPolicy {
    /// CIDRs or addresses, matched against the resolved client IP.
    #[serde(default, deserialize_with = "nets")]
    pub ips: Vec<IpNet>,
    /// API keys, read from `api_key_header`.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// The header API keys are read from (default `x-api-key`).
    #[serde(default)]
    pub api_key_header: Option<String>,
    /// User ids.
    #[serde(default)]
    pub users: Vec<String>,
    /// `403` (default) or `429`.
    #[serde(default = "default_deny_status")]
    pub status: u16,
}

impl Default for DenylistPolicy {
    fn default() -> Self {
        Self {
            ips: Vec::new(),
            api_keys: Vec::new(),
            api_key_header: None,
            users: Vec::new(),
            status: default_deny_status(),
        }
    }
}

/// The `[control]` table: the fleet-wide control key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ControlPolicy {
    /// The Redis hash every instance polls (e.g. `rl:control`).
    pub redis_key: String,
    /// How often (humantime, default `"5s"`).
    #[serde(default = "default_poll", with = "humantime_serde")]
    pub poll_interval: Duration,
}

/// A tier's `[tier.plans]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PlanQuota {
    /// Requests per period.
    pub limit: u64,
    /// The period (humantime).
    #[serde(with = "humantime_serde")]
    pub period: Duration,
    /// Capacity (default: `limit`).
    #[serde(default)]
    pub burst: Option<u64>,
}

/// Where a tier reads the client's plan: `"extension"` (the
/// [`Plan`](crate::Plan) set by your auth layer; the default) or
/// `{ header = "x-plan" }` — only behind a gateway that sets or strips that
/// header, since clients can send any header.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PlanSource {
    /// [`Plan`](crate::Plan) in the request extensions.
    #[default]
    Extension,
    /// A request header written by a trusted gateway.
    Header(String),
}

impl<'de> Deserialize<'de> for PlanSource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PlanSource;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#""extension" or { header = "<name>" }"#)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PlanSource, E> {
                match v {
                    "extension" => Ok(PlanSource::Extension),
                    other => Err(E::unknown_variant(other, &["extension"])),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PlanSource, A::Error> {
                let mut header = None;
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "header" => header = Some(map.next_value::<String>()?),
                        other => return Err(de::Error::unknown_field(other, &["header"])),
                    }
                }
                let h = header.ok_or_else(|| de::Error::missing_field("header"))?;
                if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                    return Err(de::Error::invalid_value(
                        de::Unexpected::Str(&h),
                        &"a header name",
                    ));
                }
                Ok(PlanSource::Header(h))
            }
        }
        d.deserialize_any(V)
    }
}

/// The `[client_ip]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ClientIpPolicy {
    /// CIDRs (or single addresses) of proxies whose forwarding headers are
    /// trusted; empty (the default) trusts no forwarding header.
    #[serde(default, deserialize_with = "nets")]
    pub trusted_proxies: Vec<IpNet>,
    /// The forwarding headers read from a trusted proxy, by header name
    /// (`"x-forwarded-for"`, `"forwarded"`, `"x-real-ip"`; case-insensitive),
    /// in priority order: the first one present on a request is used. Default
    /// `["x-forwarded-for"]`. Unknown names are an error naming the value.
    /// List only headers every trusted proxy writes or strips (see
    /// [`ClientIp`]).
    #[serde(default = "default_forwarded_headers")]
    pub forwarded_headers: Vec<ForwardedHeader>,
    /// IPv6 grouping prefix length (default 64).
    #[serde(default = "default_v6_prefix")]
    pub ipv6_prefix: u8,
}

impl Default for ClientIpPolicy {
    fn default() -> Self {
        Self {
            trusted_proxies: Vec::new(),
            forwarded_headers: default_forwarded_headers(),
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
    /// `"enforce"` (default), `"shadow"`, `"canary"` (with `canary_percent`)
    /// or `"off"`.
    #[serde(default)]
    pub mode: TierModeName,
    /// Percent of keys enforced in canary mode (0-100).
    #[serde(default)]
    pub canary_percent: Option<u8>,
    /// Methods counted (default: all but OPTIONS).
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// Refund this tier's cost when the response's status is ≥ 400
    /// (default `false`); see [`Tier::skip_failed_requests`].
    #[serde(default)]
    pub skip_failed_requests: bool,
    /// Refund this tier's cost when the response's status is < 400
    /// (default `false`; for login endpoints); see
    /// [`Tier::skip_successful_requests`].
    #[serde(default)]
    pub skip_successful_requests: bool,
    /// Quotas per plan (`[tier.plans]`).
    #[serde(default)]
    pub plans: std::collections::BTreeMap<String, PlanQuota>,
    /// Where the plan is read (default `"extension"`).
    #[serde(default)]
    pub plan: PlanSource,
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

fn default_instances() -> u32 {
    1
}
fn default_failures() -> u32 {
    5
}
fn default_probe() -> Duration {
    Duration::from_millis(500)
}

fn default_deny_status() -> u16 {
    403
}
fn default_poll() -> Duration {
    Duration::from_secs(5)
}

fn make_quota(limit: u64, period: Duration, burst: Option<u64>) -> Quota {
    let q = Quota::new(limit, period);
    match burst {
        Some(b) => q.burst(b),
        None => q,
    }
}

fn list(
    tier_err: &str,
    ips: &[IpNet],
    api_keys: &[String],
    header: Option<&String>,
    users: &[String],
) -> Result<AccessList, ConfigError> {
    let mut l = AccessList::new();
    for n in ips {
        l = l.ip(*n);
    }
    for k in api_keys {
        l = l.api_key(k.clone());
    }
    if let Some(h) = header {
        let h = http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
            ConfigError::Policy(format!(
                "{tier_err}.api_key_header: invalid header name {h:?}"
            ))
        })?;
        l = l.api_key_header(h);
    }
    for u in users {
        l = l.user(u.clone());
    }
    Ok(l)
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
fn default_forwarded_headers() -> Vec<ForwardedHeader> {
    ForwardedHeader::DEFAULT.to_vec()
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
            .forwarded_headers(self.client_ip.forwarded_headers.iter().copied())
            .ipv6_prefix(self.client_ip.ipv6_prefix);
        let mut b = RateLimitLayer::builder()
            .backend(backend)
            .key_prefix(self.key_prefix.clone())
            .failure_policy(self.failure_policy)
            .backend_timeout(Duration::from_millis(self.backend_timeout_ms));
        if let Some(url) = &self.docs_url {
            b = b.docs_url(url.clone());
        }
        b = b
            .mode(match self.mode {
                GlobalModeName::Enforce => Mode::Enforce,
                GlobalModeName::Shadow => Mode::Shadow,
                GlobalModeName::Off => Mode::Off,
            })
            .shadow_headers(self.shadow_headers)
            .headers(self.headers.into())
            .fallback_instances(self.fallback_instances)
            .circuit_breaker(crate::CircuitBreaker {
                failures: self.circuit_breaker.failures,
                probe_interval: self.circuit_breaker.probe_interval,
            })
            .client_ip(client_ip.clone());
        if let Some(c) = &self.control {
            b = b.control_key(
                crate::ControlKey::new(c.redis_key.clone()).poll_interval(c.poll_interval),
            );
        }
        if self.body == BodyName::Problem {
            b = b.on_rejection(crate::response::ProblemRejection);
        }
        let a = &self.allowlist;
        b = b.allowlist(list(
            "allowlist",
            &a.ips,
            &a.api_keys,
            a.api_key_header.as_ref(),
            &a.users,
        )?);
        let d = &self.denylist;
        let status = match d.status {
            403 => DenyStatus::Forbidden,
            429 => DenyStatus::TooManyRequests,
            other => {
                return Err(ConfigError::Policy(format!(
                    "denylist.status: {other} is not 403 or 429"
                )))
            }
        };
        b = b.denylist(
            list(
                "denylist",
                &d.ips,
                &d.api_keys,
                d.api_key_header.as_ref(),
                &d.users,
            )?,
            status,
        );
        for t in &self.tiers {
            let quota = make_quota(t.limit, t.period, t.burst);
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
            let mode = match (t.mode, t.canary_percent) {
                (TierModeName::Canary, Some(p)) if p <= 100 => Mode::Canary { percent: p },
                (TierModeName::Canary, Some(p)) => {
                    return Err(ConfigError::Policy(format!(
                        "tier \"{}\": canary_percent: {p} is above 100",
                        t.name
                    )))
                }
                (TierModeName::Canary, None) => {
                    return Err(ConfigError::Policy(format!(
                        "tier \"{}\": canary_percent: required by mode = \"canary\"",
                        t.name
                    )))
                }
                (_, Some(_)) => {
                    return Err(ConfigError::Policy(format!(
                        "tier \"{}\": canary_percent: only mode = \"canary\" uses it",
                        t.name
                    )))
                }
                (TierModeName::Enforce, None) => Mode::Enforce,
                (TierModeName::Shadow, None) => Mode::Shadow,
                (TierModeName::Off, None) => Mode::Off,
            };
            let mut tier = tier.cost(t.cost).algorithm(algorithm).mode(mode);
            if let Some(methods) = &t.methods {
                let mut ms = Vec::with_capacity(methods.len());
                for m in methods {
                    ms.push(http::Method::from_bytes(m.as_bytes()).map_err(|_| {
                        ConfigError::Policy(format!(
                            "tier \"{}\": methods: invalid method {m:?}",
                            t.name
                        ))
                    })?);
                }
                tier = tier.methods(ms);
            }
            if !t.plans.is_empty() {
                tier = tier.plans(
                    t.plans
                        .iter()
                        .map(|(name, p)| (name.clone(), make_quota(p.limit, p.period, p.burst))),
                );
            }
            if let PlanSource::Header(h) = &t.plan {
                let h = http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                    ConfigError::Policy(format!("tier \"{}\": plan.header: invalid", t.name))
                })?;
                tier = tier.plan_fn(move |p: &http::request::Parts| {
                    p.headers
                        .get(&h)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                });
            }
            let tier = tier
                .skip_failed_requests(t.skip_failed_requests)
                .skip_successful_requests(t.skip_successful_requests);
            b = b.tier(tier);
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
