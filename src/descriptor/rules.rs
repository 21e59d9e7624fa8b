//! The rules a descriptor limiter enforces ([`Rule`], [`EntryMatch`],
//! [`RuleLimit`]) and their TOML form ([`RulesPolicy`], [`RulePolicy`],
//! [`FailureStatus`]).

#[cfg(feature = "calendar")]
use crate::algorithm::calendar::Calendar;
use crate::algorithm::calendar::CalendarPeriod;
use crate::backend::Backend;
use crate::error::ConfigError;
use crate::policy::{PolicyPeriod, QuotaPolicy, RedisConfig};
use crate::response::HeaderStyle;
use crate::{
    algorithm::kind::Algorithm, engine::CircuitBreaker, engine::EngineBuilder,
    engine::FailurePolicy, quota::Quota,
};
use serde::Deserialize;
#[cfg(feature = "policy-file")]
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// One entry of a rule's match: a descriptor entry's key and, optionally,
/// its value.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryMatch {
    /// The entry's key (`remote_address`, `generic_key`, a header's
    /// `descriptor_key`, …).
    pub key: String,
    /// The value it must have; any value when absent.
    #[serde(default)]
    pub value: Option<String>,
}

/// A rule: descriptors it matches, and its limit.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Rule {
    /// The rule's name: the engine tier's (1-64 of `[A-Za-z0-9_-]`), the
    /// `name` of Envoy's `current_limit`, the IETF policy name.
    pub name: String,
    /// The entries, in order.
    pub entries: Vec<EntryMatch>,
    /// The quota (ignored when `unlimited`).
    pub quota: Quota,
    /// The counting algorithm.
    pub algorithm: Algorithm,
    /// Decided and counted, never enforced.
    pub shadow: bool,
    /// Always allowed, without a backend call.
    pub unlimited: bool,
    /// Lease mode for the rule's hot descriptors (Redis only): see
    /// [`crate::engine::token_lease`]. `None`: one script call per request.
    pub lease: Option<crate::engine::TokenLease>,
    /// Every request over the limit (the reference's `requests_per_unit:
    /// 0`): a tier of 1 per period that every check overflows, so the
    /// request's other rules are charged nothing.
    pub blocked: bool,
    /// `current_limit` as configured (`requests_per_unit`, unit); `None`:
    /// from the quota, by [`per_unit`](super::per_unit).
    pub per_unit: Option<(u32, super::Unit)>,
    /// `current_limit.name` when it differs from the rule's (tier) name:
    /// the reference's `rate_limit.name`, possibly empty.
    pub limit_name: Option<String>,
    /// The reference's `replaces`: a request with a descriptor on this
    /// rule drops its descriptors on rules whose `limit_name` is listed.
    pub replaces: Vec<String>,
    /// A calendar quota's calendar (the quota's limit per calendar window,
    /// a fixed window; see [`Tier::calendar`](crate::Tier::calendar)).
    #[cfg(feature = "calendar")]
    #[cfg_attr(docsrs, doc(cfg(feature = "calendar")))]
    pub calendar: Option<Calendar>,
    /// The reference service's stat key path (its YAML's rules only):
    /// the Envoy service exports `ratelimit.service.rate_limit.*` under it.
    pub stat: Option<super::StatPath>,
    /// Candidate quotas beside the rule's (at most four; see
    /// [`Tier::candidates`](crate::Tier::candidates)): checked and counted
    /// per descriptor in the same call, never changing an answer.
    pub candidates: Vec<Quota>,
}

impl Rule {
    /// A rule matching `entries` with `quota`, token bucket, enforced.
    pub fn new(name: impl Into<String>, entries: Vec<EntryMatch>, quota: Quota) -> Self {
        Self {
            name: name.into(),
            entries,
            quota,
            algorithm: Algorithm::default(),
            shadow: false,
            unlimited: false,
            lease: None,
            blocked: false,
            per_unit: None,
            limit_name: None,
            replaces: Vec::new(),
            #[cfg(feature = "calendar")]
            calendar: None,
            stat: None,
            candidates: Vec::new(),
        }
    }
}

/// A rule's limit as the answer names it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RuleLimit {
    /// The name `current_limit` carries: the rule's, or its
    /// [`limit_name`](Rule::limit_name).
    pub name: Arc<str>,
    /// The rule's (engine tier's) name, `[A-Za-z0-9_-]`.
    pub rule: Arc<str>,
    /// Its quota.
    pub quota: Quota,
    /// `current_limit`'s `requests_per_unit` (0 for a blocking rule).
    pub requests_per_unit: u32,
    /// `current_limit`'s unit.
    pub unit: super::Unit,
}

/// What a failed backend makes the service answer under
/// [`FailurePolicy::Closed`] (Envoy's server: `failure_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureStatus {
    /// `OVER_LIMIT` for every request (the default).
    #[default]
    OverLimit,
    /// A gRPC `UNAVAILABLE` error: Envoy then applies its filter's
    /// `failure_mode_deny`.
    Unavailable,
}

/// A descriptor rules file (TOML), in the style of a [`Policy`](crate::policy::Policy):
///
/// ```toml
/// domain = "edge"
/// key_prefix = "rls"              # default "rls"
/// failure_policy = "open"         # "open" | "closed" | "fallback"
/// failure_status = "over_limit"   # under "closed": "over_limit" | "unavailable"
/// backend_timeout_ms = 100
/// shadow_mode = false             # every rule in shadow
/// headers = "ietf-draft-11"       # response_headers_to_add: any HeaderStyle
///
/// [redis]                         # absent: in memory
/// url = "redis://127.0.0.1:6379/"
///
/// [[rule]]
/// name = "per_ip"
/// match = [{ key = "remote_address" }]
/// limit = 100
/// period = "1m"
///
/// [[rule]]
/// name = "office"
/// match = [{ key = "remote_address", value = "10.0.0.1" }]
/// unlimited = true
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RulesPolicy {
    /// The domain served.
    pub domain: String,
    /// Storage key prefix (default `rls`).
    #[serde(default = "default_prefix")]
    pub key_prefix: String,
    /// `"open"` (default), `"closed"` or `"fallback"`.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Under `"closed"`: `"over_limit"` (default) or `"unavailable"`.
    #[serde(default)]
    pub failure_status: FailureStatus,
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
    /// Every rule in shadow mode.
    #[serde(default)]
    pub shadow_mode: bool,
    /// The fields of `response_headers_to_add` (default `"ietf-draft-11"`).
    #[serde(default = "default_headers")]
    pub headers: HeaderStyle,
    /// The `[redis]` table; absent: the in-memory backend.
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// The rules (`[[rule]]` tables).
    #[serde(default, rename = "rule")]
    pub rules: Vec<RulePolicy>,
}

/// One `[[rule]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RulePolicy {
    /// Rule name.
    pub name: String,
    /// The entries it matches, in order.
    #[serde(rename = "match")]
    pub entries: Vec<EntryMatch>,
    /// The quota, as a `[[tier]]`'s and written as it is, in the
    /// `[[rule]]` table itself: `limit` and `period` (both required unless
    /// `unlimited`; a calendar `period` is a fixed window over local
    /// midnights, `current_limit` then says DAY, WEEK, MONTH or YEAR and
    /// `duration_until_reset` the time to the next boundary), `time_zone`,
    /// `anchor`, `burst`, and `sync` (`"lease"`: lease mode for the rule's
    /// hot descriptors, Redis only) with its settings.
    #[serde(flatten)]
    pub quota: QuotaPolicy,
    /// One of [`Algorithm::NAMES`] (default `token_bucket`).
    #[serde(default)]
    pub algorithm: Option<String>,
    /// Decided and counted, never enforced.
    #[serde(default)]
    pub shadow_mode: bool,
    /// Always allowed, without a backend call.
    #[serde(default)]
    pub unlimited: bool,
    /// The names of other rules of this file that this one replaces, as
    /// the reference YAML's `replaces`: in a request with a descriptor on
    /// this rule, the descriptors on the named rules have no limit (not
    /// checked, not charged).
    #[serde(default)]
    pub replaces: Vec<String>,
    /// Candidate quotas, as a `[[tier]]`'s `candidates` (docs/rollout.md,
    /// "Candidate quotas"): `candidates = [{ limit = 50, period = "1m" }]`.
    #[serde(default)]
    pub candidates: Vec<crate::policy::CandidatePolicy>,
}

pub(super) fn default_prefix() -> String {
    "rls".to_owned()
}

/// The `name` of the `[[rule]]` table that holds byte `at` of `text`, when
/// the text is TOML and that table has a string `name`.
#[cfg(feature = "policy-file")]
pub(super) fn rule_at(text: &str, at: usize) -> Option<String> {
    let mut index = None;
    let mut rules = 0;
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        if start > at {
            break;
        }
        start += line.len();
        let header: String = line
            .split('#')
            .next()
            .unwrap_or("")
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        if header == "[[rule]]" {
            index = Some(rules);
            rules += 1;
        } else if header.starts_with('[') {
            index = None;
        }
    }
    let table: toml::Table = toml::from_str(text).ok()?;
    let rule = table.get("rule")?.as_array()?.get(index?)?;
    rule.get("name")?.as_str().map(str::to_owned)
}
pub(super) fn default_timeout_ms() -> u64 {
    100
}
pub(super) fn default_instances() -> u32 {
    1
}
pub(super) fn default_headers() -> HeaderStyle {
    HeaderStyle::IetfDraft11
}

impl RulesPolicy {
    #[cfg(feature = "policy-file")]
    #[cfg_attr(docsrs, doc(cfg(feature = "policy-file")))]
    /// Parses a rules file's text.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] with the parser's message (field and line),
    /// led by `rule "<name>": ` when the mistake is inside a named
    /// `[[rule]]` table.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let msg = crate::policy::toml_error(text, &e);
            match e.span().and_then(|s| rule_at(text, s.start)) {
                Some(name) => ConfigError::Policy(format!("rule \"{name}\": {msg}")),
                None => ConfigError::Policy(msg),
            }
        })
    }

    #[cfg(feature = "policy-file")]
    #[cfg_attr(docsrs, doc(cfg(feature = "policy-file")))]
    /// Reads and parses a rules file.
    ///
    /// # Errors
    /// [`ConfigError::PolicyFile`] when it cannot be read, otherwise as
    /// [`from_toml_str`](Self::from_toml_str).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::PolicyFile {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text)
    }

    /// The rules as [`Rule`]s.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] naming the rule and field: a limited rule
    /// without `limit` or `period`, an unlimited one with any of `limit`,
    /// `period`, `burst`, `algorithm`, an unknown algorithm, a `replaces`
    /// naming the rule itself or no rule of the file.
    pub fn rules(&self) -> Result<Vec<Rule>, ConfigError> {
        self.rules
            .iter()
            .map(|r| {
                let bad = |what: &dyn std::fmt::Display| {
                    ConfigError::Policy(format!("rule \"{}\": {what}", r.name))
                };
                let q = &r.quota;
                let calendar = match q.period {
                    Some(_) => q.calendar().map_err(|e| bad(&e))?,
                    None => None,
                };
                let algorithm = match (&r.algorithm, &calendar) {
                    (Some(a), _) => Algorithm::from_name(a, None).map_err(|e| bad(&e))?,
                    (None, Some(_)) => Algorithm::FixedWindow,
                    (None, None) => Algorithm::default(),
                };
                if r.unlimited
                    && (q.limit.is_some()
                        || q.period.is_some()
                        || q.burst.is_some()
                        || r.algorithm.is_some())
                {
                    return Err(bad(
                        &"unlimited = true: limit, period, burst and algorithm must not be set",
                    ));
                }
                let period = match (q.period, &calendar) {
                    (_, Some(c)) => Some(Duration::from_micros(c.longest_us())),
                    (Some(PolicyPeriod::Duration(d)), None) => Some(d),
                    _ => None,
                };
                let quota = match (q.limit, period, r.unlimited) {
                    (Some(limit), Some(period), _) => {
                        let quota = Quota::new(limit, period);
                        q.burst.map_or(quota, |b| quota.burst(b))
                    }
                    (_, _, true) => Quota::per_second(1),
                    (None, _, false) => return Err(bad(&"limit: required (or unlimited = true)")),
                    (_, None, false) => return Err(bad(&"period: required (or unlimited = true)")),
                };
                let lease = q.lease().map_err(|e| bad(&e))?;
                if r.unlimited && lease.is_some() {
                    return Err(bad(&"sync: an unlimited rule makes no call to lease for"));
                }
                for name in &r.replaces {
                    if *name == r.name {
                        return Err(bad(&"replaces: a rule cannot replace itself"));
                    }
                    if !self.rules.iter().any(|o| o.name == *name) {
                        return Err(bad(&format!(
                            "replaces: \"{name}\" is not a rule of this file"
                        )));
                    }
                }
                let mut rule = Rule::new(r.name.clone(), r.entries.clone(), quota);
                rule.replaces = r.replaces.clone();
                rule.lease = lease;
                rule.algorithm = algorithm;
                rule.shadow = r.shadow_mode;
                rule.unlimited = r.unlimited;
                if !r.candidates.is_empty() {
                    if r.unlimited {
                        return Err(bad(
                            &"candidates: an unlimited rule makes no call to check them in",
                        ));
                    }
                    rule.candidates = crate::policy::candidate_quotas(
                        &r.name,
                        &r.candidates,
                        q.period.unwrap_or_default(),
                        period.unwrap_or_default(),
                        calendar.is_some(),
                    )?;
                }
                if let (Some(c), Some(limit)) = (calendar, q.limit) {
                    let unit = match c.period() {
                        CalendarPeriod::Day => super::Unit::Day,
                        CalendarPeriod::Week => super::Unit::Week,
                        CalendarPeriod::Month => super::Unit::Month,
                        CalendarPeriod::Year => super::Unit::Year,
                    };
                    rule.per_unit = Some((u32::try_from(limit).unwrap_or(u32::MAX), unit));
                    #[cfg(feature = "calendar")]
                    {
                        rule.calendar = Some(c);
                    }
                }
                Ok(rule)
            })
            .collect()
    }

    /// The engine settings of this file on `backend`, for
    /// [`limiter`](Self::limiter).
    pub(super) fn engine(&self, backend: impl Into<Backend>) -> Result<EngineBuilder, ConfigError> {
        if self.backend_timeout_ms == 0 {
            return Err(ConfigError::Policy(
                "backend_timeout_ms: must be at least 1".into(),
            ));
        }
        Ok(EngineBuilder::default()
            .backend(backend)
            .key_prefix(self.key_prefix.clone())
            .failure_policy(self.failure_policy)
            .backend_timeout(Duration::from_millis(self.backend_timeout_ms))
            .fallback_instances(self.fallback_instances)
            .circuit_breaker(self.circuit_breaker)
            .headers(self.headers))
    }
}
