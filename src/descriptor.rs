//! [`DescriptorLimiter`]: the engine deciding rate-limit *descriptors* (lists
//! of `key=value` entries, as Envoy's rate limit service receives them),
//! a front door without HTTP. The workspace's `rls` crate serves it as
//! `envoy.service.ratelimit.v3.RateLimitService` (docs/envoy.md); this
//! module has no gRPC dependency.
//!
//! Each [`Rule`] is a tier of the engine: a descriptor matches a rule when it
//! has as many entries as the rule, with the same keys in the same order and,
//! where the rule gives one, the same value. Among the rules a descriptor
//! matches, the most specific applies: the one with a value on the earliest
//! entry where the two differ (a rule `[remote_address = "10.0.0.1"]`
//! replaces `[remote_address]` for that address). The storage key is
//! `<prefix>:<rule>:` and the descriptor's values (the whole nested
//! descriptor forms the key). A descriptor that matches no rule is allowed
//! without a limit; an [`unlimited`](Rule::unlimited) rule's too, without a
//! backend call.
//!
//! All the descriptors of one request are decided **together, in one
//! backend call** (one Lua script call on Redis): either every enforced rule
//! allows and every one is charged, or none is charged. Two descriptors of
//! one request that match one rule with the same values are one check whose
//! cost is the sum of theirs.
//!
//! ```
//! use tiered_ratelimit::descriptor::{Code, Descriptor, DescriptorLimiter, RulesPolicy};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let policy = RulesPolicy::from_toml_str(r#"
//!     domain = "edge"
//!     [[rule]]
//!     name = "per_ip"
//!     match = [{ key = "remote_address" }]
//!     limit = 2
//!     period = "1m"
//! "#).unwrap();
//! let limiter = policy.limiter(tiered_ratelimit::backend::MemoryBackend::new()).unwrap();
//! let d = [Descriptor::new(vec![("remote_address", "10.0.0.1")])];
//! for _ in 0..2 {
//!     let a = limiter.check("edge", &d, 1).await.unwrap();
//!     assert_eq!(a.overall, Code::Ok);
//! }
//! let a = limiter.check("edge", &d, 1).await.unwrap();
//! assert_eq!(a.overall, Code::OverLimit);
//! assert_eq!(a.statuses[0].remaining, 0);
//! # }
//! ```

use crate::backend::Backend;
use crate::engine::{Block, Decision, Engine, Facts, Step};
use crate::error::ConfigError;
use crate::key::{KeyError, KeyWriter};
use crate::observe::RequestDecision;
use crate::policy::RedisConfig;
use crate::response::{HeaderStyle, RateLimitHeaders};
use crate::rollout::{AccessList, Mode};
use crate::{
    Algorithm, CircuitBreaker, FailurePolicy, Quota, RateLimitHandle, RateLimitLayer,
    RateLimitLayerBuilder, Tier,
};
use serde::Deserialize;
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = crate::MAX_TIERS;

/// The most entries one descriptor may have.
pub const MAX_ENTRIES: usize = 16;

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
    pub lease: Option<crate::engine::token_lease::TokenLease>,
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
        }
    }
}

/// A rule's limit as the answer names it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RuleLimit {
    /// The rule's name.
    pub name: Arc<str>,
    /// Its quota.
    pub quota: Quota,
}

/// A descriptor of a request: its entries, and optionally its own cost
/// (Envoy's per-descriptor `hits_addend`).
#[derive(Debug, Clone, Default)]
pub struct Descriptor<'a> {
    /// `(key, value)`, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// Replaces the request's cost for this descriptor.
    pub hits_addend: Option<u64>,
}

impl<'a> Descriptor<'a> {
    /// A descriptor with these entries and the request's cost.
    pub fn new(entries: Vec<(&'a str, &'a str)>) -> Self {
        Self {
            entries,
            hits_addend: None,
        }
    }
}

/// A descriptor's or a request's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Allowed.
    Ok,
    /// Over the limit.
    OverLimit,
}

/// One descriptor's status.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DescriptorStatus {
    /// `OverLimit` when an enforced rule denies it (a shadow rule's denial
    /// is `Ok`).
    pub code: Code,
    /// The rule that decided it; `None` for a descriptor that matched no
    /// rule or an unlimited one.
    pub limit: Option<RuleLimit>,
    /// Whether it matched an [`unlimited`](Rule::unlimited) rule.
    pub unlimited: bool,
    /// Requests left on its rule after this request (when allowed; when
    /// denied, what is left without it), 0 without a rule.
    pub remaining: u64,
    /// When allowed: until its rule is back to full capacity; when over
    /// the limit: until the request would pass on it (exact, µs precision);
    /// when [`exceeds_capacity`](Self::exceeds_capacity), until the rule is
    /// full (the request does not pass then either).
    pub until_reset: Duration,
    /// Over the limit because its cost (`hits_addend`) exceeds the rule's
    /// capacity: it can never pass, whatever the wait. The Envoy service
    /// sends no `duration_until_reset` and no `Retry-After` for it, and
    /// counts it in `tiered_ratelimit_cost_exceeds_capacity_total`.
    pub exceeds_capacity: bool,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Answer {
    /// `OverLimit` when any descriptor is.
    pub overall: Code,
    /// One per descriptor, in the request's order.
    pub statuses: Vec<DescriptorStatus>,
    /// The binding rule's numbers (the denying rule with the longest wait,
    /// or the rule with the least remaining), written as the configured
    /// [`HeaderStyle`] with [`RateLimitHeaders::write`].
    pub headers: Option<RateLimitHeaders>,
    /// The backend could not decide and [`FailurePolicy::Open`] let the
    /// request through (its statuses carry no limits).
    pub fail_open: bool,
}

/// A request the limiter refuses to decide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The domain is empty.
    #[error("domain: empty")]
    EmptyDomain,
    /// The domain is not this limiter's.
    #[error("domain: \"{0}\" is not served here")]
    UnknownDomain(String),
    /// More than [`MAX_DESCRIPTORS`].
    #[error("descriptors: {0}, at most {MAX_DESCRIPTORS} are accepted")]
    TooManyDescriptors(usize),
    /// A descriptor without entries, or with more than [`MAX_ENTRIES`].
    #[error("descriptors[{index}]: {entries} entries, 1 to {MAX_ENTRIES} are accepted")]
    BadDescriptor {
        /// Its position.
        index: usize,
        /// Its number of entries.
        entries: usize,
    },
    /// The backend could not decide and the failure policy is
    /// [`FailurePolicy::Closed`].
    #[error("rate limiter unavailable")]
    Unavailable,
}

/// A rule as compiled: its engine tier (none when unlimited).
#[derive(Debug)]
struct Compiled {
    name: Arc<str>,
    entries: Vec<EntryMatch>,
    quota: Quota,
    tier: Option<usize>,
}

impl Compiled {
    fn matches(&self, d: &Descriptor<'_>) -> bool {
        self.entries.len() == d.entries.len()
            && self
                .entries
                .iter()
                .zip(&d.entries)
                .all(|(m, (k, v))| m.key == *k && m.value.as_deref().is_none_or(|mv| mv == *v))
    }

    /// Greater is more specific: a value on an earlier entry wins.
    fn specificity(&self) -> impl Iterator<Item = bool> + '_ {
        self.entries.iter().map(|e| e.value.is_some())
    }
}

/// The engine deciding descriptors (see the [module docs](self)). Cloning
/// is cheap.
#[derive(Debug, Clone)]
pub struct DescriptorLimiter {
    layer: RateLimitLayer,
    engine: Engine,
    domain: Arc<str>,
    rules: Arc<[Compiled]>,
    /// Engine tier → rule.
    tier_rule: Arc<[usize]>,
}

impl DescriptorLimiter {
    /// The limiter for `domain` with `rules`, on the engine `builder`
    /// builds (its backend, key prefix, failure policy, timeout, header
    /// style, …) with one tier per limited rule. `shadow_mode` runs every
    /// rule in shadow. The builder's deny cache is turned off: every
    /// request's statuses come from the backend.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] naming the field: an empty domain, no rule,
    /// a rule name outside 1-64 characters of `[A-Za-z0-9_-]` or used
    /// twice, more than [`MAX_TIERS`](crate::MAX_TIERS) (64) limited rules,
    /// a rule without entries or with an empty key, more than
    /// [`MAX_ENTRIES`] entries, two rules with the same match; and whatever
    /// [`build`](RateLimitLayerBuilder::build) refuses (rule names, quotas).
    pub fn new(
        domain: impl Into<String>,
        rules: Vec<Rule>,
        shadow_mode: bool,
        builder: RateLimitLayerBuilder,
    ) -> Result<Self, ConfigError> {
        let domain = domain.into();
        if domain.is_empty() {
            return Err(ConfigError::Policy("domain: must not be empty".into()));
        }
        if rules.is_empty() {
            return Err(ConfigError::Policy(
                "rule: no [[rule]]: at least one is required".into(),
            ));
        }
        let mut names = std::collections::HashSet::new();
        let mut limited = 0;
        for r in &rules {
            let bad = |what: &str| ConfigError::Policy(format!("rule \"{}\": {what}", r.name));
            let valid = !r.name.is_empty()
                && r.name.len() <= 64
                && r.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(bad("name: must be 1-64 characters of [A-Za-z0-9_-]"));
            }
            if !names.insert(r.name.as_str()) {
                return Err(bad("name: used by another rule"));
            }
            if !r.unlimited {
                limited += 1;
                if limited > crate::MAX_TIERS {
                    return Err(bad(&format!(
                        "at most {} limited rules per domain (each is a tier of one atomic check)",
                        crate::MAX_TIERS
                    )));
                }
            }
        }
        let mut builder = builder.deny_cache(0);
        if shadow_mode {
            builder = builder.mode(Mode::Shadow);
        }
        let mut compiled = Vec::with_capacity(rules.len());
        let mut tier_rule = Vec::new();
        for (i, r) in rules.into_iter().enumerate() {
            let bad = |what: String| ConfigError::Policy(format!("rule \"{}\": {what}", r.name));
            if r.entries.is_empty() || r.entries.len() > MAX_ENTRIES {
                return Err(bad(format!(
                    "match: {} entries, 1 to {MAX_ENTRIES} are accepted",
                    r.entries.len()
                )));
            }
            if r.entries.iter().any(|e| e.key.is_empty()) {
                return Err(bad("match: an entry's key is empty".into()));
            }
            if let Some(other) = compiled.iter().find(|c: &&Compiled| c.entries == r.entries) {
                return Err(bad(format!("match: the same as rule \"{}\"", other.name)));
            }
            let tier = if r.unlimited {
                None
            } else {
                let mode = if r.shadow {
                    Mode::Shadow
                } else {
                    Mode::Enforce
                };
                let mut tier = Tier::new(r.name.clone(), crate::key::Global, r.quota)
                    .algorithm(r.algorithm)
                    .mode(mode);
                if let Some(lease) = r.lease {
                    tier = tier.lease(lease);
                }
                builder = builder.tier(tier);
                tier_rule.push(i);
                Some(tier_rule.len() - 1)
            };
            compiled.push(Compiled {
                name: Arc::from(r.name),
                entries: r.entries,
                quota: r.quota,
                tier,
            });
        }
        if tier_rule.is_empty() {
            // Every rule unlimited (or none): the engine still needs a tier,
            // which no descriptor ever names.
            builder = builder.tier(
                Tier::new("unused", crate::key::Global, Quota::per_second(1)).mode(Mode::Off),
            );
        }
        let layer = builder.build()?;
        let engine = layer.front.engine.clone();
        Ok(Self {
            layer,
            engine,
            domain: Arc::from(domain),
            rules: compiled.into(),
            tier_rule: tier_rule.into(),
        })
    }

    /// The domain served.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// A handle on the engine (modes, quotas, counts), as a layer's.
    pub fn handle(&self) -> RateLimitHandle {
        self.layer.handle()
    }

    /// The rule a descriptor matches (the most specific).
    fn rule_of(&self, d: &Descriptor<'_>) -> Option<usize> {
        let mut best: Option<usize> = None;
        for (i, r) in self.rules.iter().enumerate() {
            if !r.matches(d) {
                continue;
            }
            let better = match best {
                None => true,
                Some(b) => r.specificity().gt(self.rules[b].specificity()),
            };
            if better {
                best = Some(i);
            }
        }
        best
    }

    /// Decides a request: its `domain`, its `descriptors`, and its cost
    /// `hits_addend` (0 counts as 1, as in Envoy's protocol), all
    /// descriptors at once.
    ///
    /// # Errors
    /// A [`RequestError`] for a request that cannot be decided (empty or
    /// unknown domain, too many descriptors, a descriptor without entries),
    /// or [`RequestError::Unavailable`] under [`FailurePolicy::Closed`].
    pub async fn check(
        &self,
        domain: &str,
        descriptors: &[Descriptor<'_>],
        hits_addend: u64,
    ) -> Result<Answer, RequestError> {
        if domain.is_empty() {
            return Err(RequestError::EmptyDomain);
        }
        if domain != &*self.domain {
            return Err(RequestError::UnknownDomain(
                domain.chars().take(128).collect(),
            ));
        }
        if descriptors.len() > MAX_DESCRIPTORS {
            return Err(RequestError::TooManyDescriptors(descriptors.len()));
        }
        let hits = hits_addend.max(1);
        // Descriptor → (rule, its group among the rule's checks).
        let mut matched: Vec<Option<(usize, usize)>> = Vec::with_capacity(descriptors.len());
        // Per engine tier: its groups (first descriptor, summed cost).
        let mut groups: Vec<Vec<(usize, u64)>> = vec![Vec::new(); self.tier_rule.len()];
        for (index, d) in descriptors.iter().enumerate() {
            if d.entries.is_empty() || d.entries.len() > MAX_ENTRIES {
                return Err(RequestError::BadDescriptor {
                    index,
                    entries: d.entries.len(),
                });
            }
            let Some(rule) = self.rule_of(d) else {
                matched.push(None);
                continue;
            };
            let Some(tier) = self.rules[rule].tier else {
                matched.push(Some((rule, usize::MAX)));
                continue;
            };
            let cost = d.hits_addend.map_or(hits, |h| h.max(1));
            let g = &mut groups[tier];
            let same = g
                .iter()
                .position(|&(first, _)| descriptors[first].entries == d.entries);
            let n = match same {
                Some(n) => {
                    g[n].1 = g[n].1.saturating_add(cost);
                    n
                }
                None => {
                    g.push((index, cost));
                    g.len() - 1
                }
            };
            matched.push(Some((rule, n)));
        }
        let facts = DescriptorFacts {
            descriptors,
            groups: &groups,
            domain: &self.domain,
        };
        let decision = match self.engine.start(&facts, std::time::Instant::now()) {
            Step::Done(d) => d,
            Step::Pending(mut pending) => {
                std::future::poll_fn(|cx| pending.poll_decide(cx, &self.engine, &facts)).await
            }
        };
        self.answer(decision, &matched)
    }

    /// The engine's decision as per-descriptor statuses.
    fn answer(
        &self,
        decision: Decision,
        matched: &[Option<(usize, usize)>],
    ) -> Result<Answer, RequestError> {
        let (details, shadow_tiers, headers, fail_open) = match decision {
            Decision::Allow(a) => {
                let fail_open = a.kind == RequestDecision::FailOpen;
                (a.details, a.shadow_tiers, a.headers, fail_open)
            }
            Decision::Block(Block::Limited(d)) => {
                (d.details, d.shadow_tiers, Some(d.headers), false)
            }
            // No lists are configured, so no request is denylisted; were
            // one, it is over the limit.
            Decision::Block(Block::Denylisted(_)) => {
                return Ok(Answer {
                    overall: Code::OverLimit,
                    statuses: matched
                        .iter()
                        .map(|_| DescriptorStatus {
                            code: Code::OverLimit,
                            limit: None,
                            unlimited: false,
                            remaining: 0,
                            until_reset: Duration::ZERO,
                            exceeds_capacity: false,
                        })
                        .collect(),
                    headers: None,
                    fail_open: false,
                })
            }
            Decision::Block(Block::Unavailable) => return Err(RequestError::Unavailable),
        };
        let mut overall = Code::Ok;
        let mut statuses = Vec::with_capacity(matched.len());
        for m in matched {
            let status = match *m {
                None => DescriptorStatus {
                    code: Code::Ok,
                    limit: None,
                    unlimited: false,
                    remaining: 0,
                    until_reset: Duration::ZERO,
                    exceeds_capacity: false,
                },
                Some((rule, usize::MAX)) => DescriptorStatus {
                    code: Code::Ok,
                    limit: None,
                    unlimited: true,
                    remaining: 0,
                    until_reset: Duration::ZERO,
                    exceeds_capacity: false,
                    ..self.status_of(rule)
                },
                Some((rule, n)) => {
                    let tier = self.rules[rule].tier.unwrap_or(usize::MAX);
                    // Check of occurrence n of this tier: the (n+1)-th check
                    // of the tier, in planned order.
                    let d = details.as_ref().and_then(|ds| {
                        ds.checks
                            .iter()
                            .enumerate()
                            .filter(|(_, (t, _))| *t == tier)
                            .nth(n)
                            .map(|(j, (_, d))| (*d, j < 64 && ds.never_fits & (1 << j) != 0))
                    });
                    let mut s = self.status_of(rule);
                    if let Some((d, never_fits)) = d {
                        s.exceeds_capacity = never_fits;
                        let enforced_denial = !d.allowed && shadow_tiers & (1 << tier) == 0;
                        s.code = if enforced_denial {
                            Code::OverLimit
                        } else {
                            Code::Ok
                        };
                        s.remaining = d.remaining;
                        s.until_reset = Duration::from_micros(if d.allowed {
                            d.reset_after_us
                        } else {
                            d.retry_after_us
                        });
                    } else {
                        // Decided without the backend (fail-open, a
                        // switched-off rule): no numbers.
                        s.limit = None;
                    }
                    s
                }
            };
            if status.code == Code::OverLimit {
                overall = Code::OverLimit;
            }
            statuses.push(status);
        }
        Ok(Answer {
            overall,
            statuses,
            headers,
            fail_open,
        })
    }

    fn status_of(&self, rule: usize) -> DescriptorStatus {
        let r = &self.rules[rule];
        DescriptorStatus {
            code: Code::Ok,
            limit: Some(RuleLimit {
                name: r.name.clone(),
                quota: r.quota,
            }),
            unlimited: false,
            remaining: 0,
            until_reset: Duration::ZERO,
            exceeds_capacity: false,
        }
    }
}

/// A request's descriptors as the engine's facts: tier `t` is asked once
/// per group of its descriptors with the same values.
struct DescriptorFacts<'a> {
    descriptors: &'a [Descriptor<'a>],
    groups: &'a [Vec<(usize, u64)>],
    domain: &'a str,
}

impl Facts for DescriptorFacts<'_> {
    const DETAILS: bool = true;

    fn listed(&self, _: &AccessList) -> bool {
        false
    }
    fn cost(&self, tier: usize) -> Option<u64> {
        self.cost_at(tier, 0)
    }
    fn key(&self, tier: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        self.key_at(tier, 0, key)
    }
    fn occurrences(&self, tier: usize) -> usize {
        self.groups.get(tier).map_or(0, Vec::len)
    }
    fn cost_at(&self, tier: usize, n: usize) -> Option<u64> {
        self.groups.get(tier)?.get(n).map(|&(_, cost)| cost)
    }
    fn key_at(&self, tier: usize, n: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        let Some(&(first, _)) = self.groups.get(tier).and_then(|g| g.get(n)) else {
            return Ok(false);
        };
        let Some(d) = self.descriptors.get(first) else {
            return Ok(false);
        };
        // The rule fixes the keys, so the values identify the descriptor:
        // one value as it is; several, each after its length (`5:alice|4:/api`),
        // so that no two lists of values share a key.
        match d.entries.as_slice() {
            [(_, v)] => key.part(v.as_bytes()),
            entries => {
                let mut raw = Vec::new();
                for (i, (_, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        raw.push(b'|');
                    }
                    raw.extend_from_slice(itoa::Buffer::new().format(v.len()).as_bytes());
                    raw.push(b':');
                    raw.extend_from_slice(v.as_bytes());
                }
                key.part(&raw);
            }
        }
        Ok(true)
    }
    fn plan(&self, _: usize) -> Option<Cow<'_, str>> {
        None
    }
    fn endpoint(&self) -> (&str, &str) {
        ("RLS", self.domain)
    }
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
    /// Requests per period (required unless `unlimited`).
    #[serde(default)]
    pub limit: Option<u64>,
    /// The period, humantime (required unless `unlimited`).
    #[serde(default, with = "humantime_serde")]
    pub period: Option<Duration>,
    /// Capacity (default `limit`).
    #[serde(default)]
    pub burst: Option<u64>,
    /// One of [`Algorithm::NAMES`] (default `token_bucket`).
    #[serde(default)]
    pub algorithm: Option<String>,
    /// Decided and counted, never enforced.
    #[serde(default)]
    pub shadow_mode: bool,
    /// Always allowed, without a backend call.
    #[serde(default)]
    pub unlimited: bool,
    /// `"request"` (the default: one script call per request) or `"lease"`
    /// (lease mode for the rule's hot descriptors, Redis only: see
    /// [`crate::engine::token_lease`]).
    #[serde(default, deserialize_with = "crate::engine::token_lease::sync_name")]
    pub sync: Option<String>,
    /// With `sync = "lease"`: the demand one lease covers (humantime,
    /// default `"100ms"`).
    #[serde(default, with = "humantime_serde")]
    pub sync_interval: Option<Duration>,
    /// With `sync = "lease"`: the most tokens one instance holds of one
    /// descriptor (default the capacity ÷ 8).
    #[serde(default)]
    pub sync_max: Option<u64>,
    /// With `sync = "lease"`: the least demand per interval for a
    /// descriptor to be leased (default 2).
    #[serde(default)]
    pub sync_min: Option<u64>,
}

fn default_prefix() -> String {
    "rls".to_owned()
}

/// The `name` of the `[[rule]]` table that holds byte `at` of `text`, when
/// the text is TOML and that table has a string `name`.
fn rule_at(text: &str, at: usize) -> Option<String> {
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
fn default_timeout_ms() -> u64 {
    100
}
fn default_instances() -> u32 {
    1
}
fn default_headers() -> HeaderStyle {
    HeaderStyle::IetfDraft11
}

impl RulesPolicy {
    /// Parses a rules file's text.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] with the parser's message (field and line),
    /// led by `rule "<name>": ` when the mistake is inside a named
    /// `[[rule]]` table.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let msg = e.to_string();
            match e.span().and_then(|s| rule_at(text, s.start)) {
                Some(name) => ConfigError::Policy(format!("rule \"{name}\": {msg}")),
                None => ConfigError::Policy(msg),
            }
        })
    }

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
    /// `period`, `burst`, `algorithm`, an unknown algorithm.
    pub fn rules(&self) -> Result<Vec<Rule>, ConfigError> {
        self.rules
            .iter()
            .map(|r| {
                let bad = |what: &dyn std::fmt::Display| {
                    ConfigError::Policy(format!("rule \"{}\": {what}", r.name))
                };
                let algorithm = match &r.algorithm {
                    Some(a) => Algorithm::from_name(a, None).map_err(|e| bad(&e))?,
                    None => Algorithm::default(),
                };
                if r.unlimited
                    && (r.limit.is_some()
                        || r.period.is_some()
                        || r.burst.is_some()
                        || r.algorithm.is_some())
                {
                    return Err(bad(
                        &"unlimited = true: limit, period, burst and algorithm must not be set",
                    ));
                }
                let quota = match (r.limit, r.period, r.unlimited) {
                    (Some(limit), Some(period), _) => {
                        let q = Quota::new(limit, period);
                        r.burst.map_or(q, |b| q.burst(b))
                    }
                    (_, _, true) => Quota::per_second(1),
                    (None, _, false) => return Err(bad(&"limit: required (or unlimited = true)")),
                    (_, None, false) => return Err(bad(&"period: required (or unlimited = true)")),
                };
                let lease = crate::engine::token_lease::from_policy(
                    r.sync.as_deref(),
                    r.sync_interval,
                    r.sync_max,
                    r.sync_min,
                )
                .map_err(|e| bad(&e))?;
                if r.unlimited && lease.is_some() {
                    return Err(bad(&"sync: an unlimited rule makes no call to lease for"));
                }
                Ok(Rule {
                    lease,
                    name: r.name.clone(),
                    entries: r.entries.clone(),
                    quota,
                    algorithm,
                    shadow: r.shadow_mode,
                    unlimited: r.unlimited,
                })
            })
            .collect()
    }

    /// The limiter on `backend` (the program chooses it, from
    /// [`redis`](Self::redis) or not).
    ///
    /// # Errors
    /// As [`rules`](Self::rules) and [`DescriptorLimiter::new`].
    pub fn limiter(&self, backend: impl Into<Backend>) -> Result<DescriptorLimiter, ConfigError> {
        if self.backend_timeout_ms == 0 {
            return Err(ConfigError::Policy(
                "backend_timeout_ms: must be at least 1".into(),
            ));
        }
        let builder = RateLimitLayer::builder()
            .backend(backend)
            .key_prefix(self.key_prefix.clone())
            .failure_policy(self.failure_policy)
            .backend_timeout(Duration::from_millis(self.backend_timeout_ms))
            .fallback_instances(self.fallback_instances)
            .circuit_breaker(self.circuit_breaker)
            .headers(self.headers);
        DescriptorLimiter::new(
            self.domain.clone(),
            self.rules()?,
            self.shadow_mode,
            builder,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{ManualClock, MemoryBackend};

    const T0_US: u64 = 1_700_000_000 * 1_000_000;

    fn limiter(rules: &str) -> DescriptorLimiter {
        RulesPolicy::from_toml_str(rules)
            .unwrap()
            .limiter(MemoryBackend::with_manual_clock(ManualClock::new(T0_US)))
            .unwrap()
    }

    fn names(a: &Answer) -> Vec<Option<&str>> {
        a.statuses
            .iter()
            .map(|s| s.limit.as_ref().map(|l| &*l.name))
            .collect()
    }

    /// A value on an earlier entry is more specific than one on a later
    /// entry; a rule with no value is the most general.
    #[tokio::test]
    async fn the_most_specific_rule_applies() {
        let l = limiter(
            r#"
            domain = "d"
            [[rule]]
            name = "any"
            match = [{ key = "a" }, { key = "b" }]
            limit = 5
            period = "1m"
            [[rule]]
            name = "b_is_1"
            match = [{ key = "a" }, { key = "b", value = "1" }]
            limit = 5
            period = "1m"
            [[rule]]
            name = "a_is_x"
            match = [{ key = "a", value = "x" }, { key = "b" }]
            limit = 5
            period = "1m"
            "#,
        );
        let d = |a, b| Descriptor::new(vec![("a", a), ("b", b)]);
        let got = l
            .check(
                "d",
                &[d("x", "1"), d("y", "1"), d("y", "2"), d("x", "2")],
                1,
            )
            .await
            .unwrap();
        assert_eq!(
            names(&got),
            [Some("a_is_x"), Some("b_is_1"), Some("any"), Some("a_is_x")]
        );
        // A descriptor with fewer or other entries matches none of them.
        let got = l
            .check("d", &[Descriptor::new(vec![("a", "x")])], 1)
            .await
            .unwrap();
        assert_eq!(names(&got), [None]);
    }

    /// One rule, two descriptors: the same values are one check with the
    /// summed cost; other values are a check of their own, in the same
    /// all-or-nothing call.
    #[tokio::test]
    async fn descriptors_of_one_rule_are_grouped_by_their_values() {
        let l = limiter(
            r#"
            domain = "d"
            [[rule]]
            name = "ip"
            match = [{ key = "ip" }]
            limit = 3
            period = "1m"
            "#,
        );
        let ip = |v| Descriptor::new(vec![("ip", v)]);
        let a = l.check("d", &[ip("1"), ip("2"), ip("1")], 1).await.unwrap();
        assert_eq!(a.overall, Code::Ok);
        let left: Vec<u64> = a.statuses.iter().map(|s| s.remaining).collect();
        assert_eq!(left, [1, 2, 1]);
        // ip 1 has 1 left: 2 more of it deny the request, and ip 2 is not
        // charged either.
        let a = l.check("d", &[ip("2"), ip("1"), ip("1")], 1).await.unwrap();
        assert_eq!(a.overall, Code::OverLimit);
        assert_eq!(a.statuses[1].code, Code::OverLimit);
        let a = l.check("d", &[ip("2")], 1).await.unwrap();
        assert_eq!(a.statuses[0].remaining, 1);
    }

    #[test]
    fn bad_rules_fail_at_build_naming_the_field() {
        let err = |rules: &str| {
            RulesPolicy::from_toml_str(rules)
                .and_then(|p| p.limiter(MemoryBackend::new()))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(err("domain = \"\""), "policy: domain: must not be empty");
        assert_eq!(
            err("domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = [{ key = \"a\" }]\nperiod = \"1s\""),
            "policy: rule \"r\": limit: required (or unlimited = true)"
        );
        assert_eq!(
            err("domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = []\nunlimited = true"),
            "policy: rule \"r\": match: 0 entries, 1 to 16 are accepted"
        );
        assert_eq!(
            err("domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = [{ key = \"a\" }]\nunlimited = true\n\
                 [[rule]]\nname = \"s\"\nmatch = [{ key = \"a\" }]\nunlimited = true"),
            "policy: rule \"s\": match: the same as rule \"r\""
        );
        // Lease mode's settings, as a tier's.
        let rule = "domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = [{ key = \"a\" }]\n";
        assert_eq!(
            err(&format!("{rule}limit = 5\nperiod = \"1s\"\nsync_max = 2")),
            "policy: rule \"r\": sync_max: only sync = \"lease\" uses it"
        );
        assert_eq!(
            err(&format!(
                "{rule}limit = 5\nperiod = \"1s\"\nsync = \"lease\"\nsync_interval = \"0s\""
            )),
            "policy: rule \"r\": sync_interval: must be above 0"
        );
        assert_eq!(
            err(&format!("{rule}unlimited = true\nsync = \"lease\"")),
            "policy: rule \"r\": sync: an unlimited rule makes no call to lease for"
        );
        assert!(err(&format!(
            "{rule}limit = 5\nperiod = \"1s\"\nsync = \"often\""
        ))
        .contains("unknown variant `often`, expected `request` or `lease`"));
        // Found by trying the service: mistakes that were accepted silently.
        assert_eq!(
            err("domain = \"d\""),
            "policy: rule: no [[rule]]: at least one is required"
        );
        let unlimited = |name: &str| {
            format!("[[rule]]\nname = \"{name}\"\nmatch = [{{ key = \"u\" }}]\nunlimited = true\n")
        };
        let limited = |name: &str, key: &str| {
            format!("[[rule]]\nname = \"{name}\"\nmatch = [{{ key = \"{key}\" }}]\nlimit = 1\nperiod = \"1s\"\n")
        };
        assert_eq!(
            err(&format!(
                "domain = \"d\"\n{}{}",
                unlimited("r"),
                limited("r", "a")
            )),
            "policy: rule \"r\": name: used by another rule"
        );
        assert_eq!(
            err(&format!("domain = \"d\"\n{}", unlimited("bad name"))),
            "policy: rule \"bad name\": name: must be 1-64 characters of [A-Za-z0-9_-]"
        );
        assert_eq!(
            err("domain = \"d\"\n[[rule]]\nname = \"u\"\nmatch = [{ key = \"u\" }]\nunlimited = true\nlimit = 5\nperiod = \"1s\""),
            "policy: rule \"u\": unlimited = true: limit, period, burst and algorithm must not be set"
        );
        let many: String = (0..65)
            .map(|i| limited(&format!("r{i}"), &format!("k{i}")))
            .collect();
        assert_eq!(
            err(&format!("domain = \"d\"\n{many}")),
            "policy: rule \"r64\": at most 64 limited rules per domain (each is a tier of one atomic check)"
        );
        assert_eq!(
            err(&format!(
                "domain = \"d\"\nbackend_timeout_ms = 0\n{}",
                limited("r", "a")
            )),
            "policy: backend_timeout_ms: must be at least 1"
        );
    }
}
