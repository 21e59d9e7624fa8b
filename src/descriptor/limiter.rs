//! [`DescriptorLimiter`]: the engine deciding a request's descriptors, its
//! answer ([`Answer`], [`DescriptorStatus`], [`Code`]), and the engine's
//! [`Facts`] over descriptors.

use super::facts::{raw_key, same_values, DescriptorFacts};
use super::matching::{Compiled, Descriptor};
use super::reference::tree::Tree;
use super::rules::{Rule, RuleLimit, RulesPolicy};
use super::{per_unit, MAX_DESCRIPTORS, MAX_ENTRIES};
use crate::backend::Backend;
use crate::engine::EngineBuilder;
use crate::engine::TierSpec;
use crate::engine::{Engine, Step};
use crate::error::ConfigError;
use crate::handle::RateLimitHandle;
use crate::response::RateLimitHeaders;
use crate::rollout::Mode;
use std::sync::Arc;
use std::time::Duration;

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
    /// Requests left on its rule after this request when the request is
    /// allowed; 0 when this descriptor is over the limit; when another
    /// descriptor denied the request (nothing charged), its count without
    /// this request. 0 without a rule.
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
    /// The reference service's stat key path of its rule (a rule read
    /// from the reference's YAML); `None` otherwise.
    pub stat: Option<std::sync::Arc<super::StatPath>>,
    /// Over the limit on a rule in shadow mode (its code is `Ok`): the
    /// reference's `shadow_mode` stat counts it.
    pub shadow_over: bool,
}

impl DescriptorStatus {
    /// A status with `code` and nothing else: no limit, nothing remaining
    /// or to wait for (a descriptor no rule matches, an unknown domain, a
    /// denylisted request).
    pub(crate) fn bare(code: Code) -> Self {
        Self {
            code,
            limit: None,
            unlimited: false,
            remaining: 0,
            until_reset: Duration::ZERO,
            exceeds_capacity: false,
            stat: None,
            shadow_over: false,
        }
    }
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
    /// [`HeaderStyle`](crate::response::HeaderStyle) with [`RateLimitHeaders::write`].
    pub headers: Option<RateLimitHeaders>,
    /// The backend could not decide and [`FailurePolicy::Open`](crate::FailurePolicy::Open) let the
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
    /// A request without descriptors.
    #[error("descriptors: the list must not be empty")]
    NoDescriptors,
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
    /// [`FailurePolicy::Closed`](crate::FailurePolicy::Closed).
    #[error("rate limiter unavailable")]
    Unavailable,
}

/// The engine deciding descriptors (see the [module docs](super)). Cloning
/// is cheap.
#[derive(Debug, Clone)]
pub struct DescriptorLimiter {
    pub(super) engine: Engine,
    pub(super) domain: Arc<str>,
    pub(super) rules: Arc<[Compiled]>,
    /// Engine tier → rule.
    pub(super) tier_rule: Arc<[usize]>,
    /// The reference's descriptor tree, for a configuration read from its
    /// YAML; `None`: the most specific rule (the TOML rules file).
    pub(super) tree: Option<Arc<Tree>>,
    /// Global shadow mode: every denial reported on its descriptor, the
    /// request answered OK.
    pub(super) global_shadow: bool,
    /// Whether any rule `replaces` another.
    pub(super) replacing: bool,
}

impl RulesPolicy {
    /// The limiter on `backend` (the program chooses it, from
    /// [`redis`](Self::redis) or not).
    ///
    /// # Errors
    /// As [`rules`](Self::rules) and [`DescriptorLimiter::new`].
    pub fn limiter(&self, backend: impl Into<Backend>) -> Result<DescriptorLimiter, ConfigError> {
        let engine = self.engine(backend)?;
        DescriptorLimiter::new(self.domain.clone(), self.rules()?, self.shadow_mode, engine)
    }
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
    /// the engine refuses (quotas, options).
    pub fn new(
        domain: impl Into<String>,
        rules: Vec<Rule>,
        shadow_mode: bool,
        builder: EngineBuilder,
    ) -> Result<Self, ConfigError> {
        Self::build(domain.into(), rules, None, shadow_mode, builder)
    }

    pub(super) fn build(
        domain: String,
        rules: Vec<Rule>,
        tree: Option<Tree>,
        shadow_mode: bool,
        builder: EngineBuilder,
    ) -> Result<Self, ConfigError> {
        if domain.is_empty() {
            return Err(ConfigError::Policy("domain: must not be empty".into()));
        }
        if rules.is_empty() && tree.is_none() {
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
                if limited > crate::engine::MAX_TIERS {
                    return Err(bad(&format!(
                        "at most {} limited rules per domain (each is a tier of one atomic check)",
                        crate::engine::MAX_TIERS
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
                if tree.is_none() {
                    return Err(bad(format!(
                        "match: the same as rule \"{}\"",
                        other.limit.rule
                    )));
                }
            }
            let tier = if r.unlimited {
                None
            } else {
                let mode = if r.shadow {
                    Mode::Shadow
                } else {
                    Mode::Enforce
                };
                let mut tier = TierSpec::new(r.name.clone(), r.quota);
                tier.algorithm = r.algorithm;
                tier.mode = mode;
                tier.lease = r.lease;
                tier.candidates = r.candidates;
                #[cfg(feature = "calendar")]
                {
                    tier.calendar = r.calendar.clone();
                }
                tier.key_type = "Descriptor";
                builder = builder.tier(tier);
                tier_rule.push(i);
                Some(tier_rule.len() - 1)
            };
            let (requests_per_unit, unit) = r.per_unit.unwrap_or_else(|| per_unit(r.quota));
            let rule: Arc<str> = Arc::from(r.name);
            compiled.push(Compiled {
                limit: RuleLimit {
                    name: r.limit_name.map_or_else(|| rule.clone(), Arc::from),
                    rule,
                    quota: r.quota,
                    requests_per_unit,
                    unit,
                },
                entries: r.entries,
                tier,
                shadow: r.shadow,
                blocked: r.blocked,
                stat: r.stat.map(Arc::new),
                steady_refill: matches!(
                    r.algorithm,
                    crate::algorithm::kind::Algorithm::TokenBucket
                        | crate::algorithm::kind::Algorithm::LeakyBucket(_)
                ),
                replaces: r.replaces,
            });
        }
        // Every rule unlimited: an engine without tiers, which passes every
        // request it is asked about (none is: no descriptor names a tier).
        let engine = builder.build()?;
        let replacing = compiled.iter().any(|c| !c.replaces.is_empty());
        Ok(Self {
            engine,
            domain: Arc::from(domain),
            rules: compiled.into(),
            tier_rule: tier_rule.into(),
            tree: tree.map(Arc::new),
            global_shadow: shadow_mode,
            replacing,
        })
    }

    /// The domain served.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// A handle on the engine (modes, quotas, counts), as a layer's.
    pub fn handle(&self) -> RateLimitHandle {
        RateLimitHandle::new(self.engine.shared.clone(), None)
    }

    /// Decides a request: its `domain`, its `descriptors`, and its cost
    /// `hits_addend` (0 counts as 1, as in Envoy's protocol), all
    /// descriptors at once.
    ///
    /// # Errors
    /// A [`RequestError`] for a request that cannot be decided (empty or
    /// unknown domain, too many descriptors, a descriptor without entries),
    /// or [`RequestError::Unavailable`] under [`FailurePolicy::Closed`](crate::FailurePolicy::Closed).
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
        if descriptors.is_empty() {
            return Err(RequestError::NoDescriptors);
        }
        if descriptors.len() > MAX_DESCRIPTORS {
            return Err(RequestError::TooManyDescriptors(descriptors.len()));
        }
        let hits = hits_addend.max(1);
        // Descriptor → its rule, and the entries a shared pattern stands for.
        let mut found: Vec<Option<usize>> = Vec::with_capacity(descriptors.len());
        let mut shared: Vec<Vec<(usize, &str)>> = Vec::new();
        for (index, d) in descriptors.iter().enumerate() {
            if d.entries.is_empty() || d.entries.len() > MAX_ENTRIES {
                return Err(RequestError::BadDescriptor {
                    index,
                    entries: d.entries.len(),
                });
            }
            match &self.tree {
                Some(tree) => {
                    let landing = tree.descend(&d.entries);
                    if !landing.shared.is_empty() {
                        shared.resize_with(descriptors.len(), Vec::new);
                        shared[index] = landing.shared;
                    }
                    found.push(landing.rule);
                }
                None => found.push(super::matching::rule_of(&self.rules, d)),
            }
        }
        if self.replacing {
            self.drop_replaced(&mut found);
        }
        // Descriptor → (rule, its group among the rule's checks).
        let mut matched: Vec<Option<(usize, usize)>> = Vec::with_capacity(descriptors.len());
        // Per engine tier: its groups (first descriptor, summed cost).
        let mut groups: Vec<Vec<(usize, u64)>> = vec![Vec::new(); self.tier_rule.len()];
        let mut zero = Vec::new();
        for (index, (d, rule)) in descriptors.iter().zip(&found).enumerate() {
            let Some(rule) = *rule else {
                matched.push(None);
                continue;
            };
            let Some(tier) = self.rules[rule].tier else {
                matched.push(Some((rule, usize::MAX)));
                continue;
            };
            // A blocking rule's check overflows its capacity of 1.
            let cost = if self.rules[rule].blocked {
                2
            } else {
                d.hits_addend.unwrap_or(hits)
            };
            if cost == 0 {
                // An explicit `hits_addend: 0` charges nothing: read after
                // the decision.
                zero.push((index, rule));
                matched.push(None);
                continue;
            }
            let g = &mut groups[tier];
            let same = g
                .iter()
                .position(|&(first, _)| same_values(descriptors, &shared, first, index));
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
            shared: &shared,
            groups: &groups,
            domain: &self.domain,
        };
        let decision = match self.engine.start(&facts, std::time::Instant::now()) {
            Step::Done(d) => d,
            Step::Pending(mut pending) => {
                std::future::poll_fn(|cx| pending.poll_decide(cx, &self.engine, &facts)).await
            }
        };
        let mut answer = self.answer(decision, &matched, &groups)?;
        for (index, rule) in zero {
            let key = tiered_key(&raw_key(descriptors, &shared, index));
            answer.statuses[index] = self.uncharged(rule, &key).await;
        }
        Ok(answer)
    }

    /// The reference's `replaces`: a descriptor whose rule's limit name is
    /// listed by the rule of any descriptor of the request (unlimited ones
    /// included) has no limit in this request.
    fn drop_replaced(&self, found: &mut [Option<usize>]) {
        let replaced: Vec<&str> = found
            .iter()
            .flatten()
            .flat_map(|&r| self.rules[r].replaces.iter().map(String::as_str))
            .collect();
        if replaced.is_empty() {
            return;
        }
        for f in found.iter_mut() {
            if let Some(r) = *f {
                let name = &*self.rules[r].limit.name;
                if !name.is_empty() && replaced.contains(&name) {
                    *f = None;
                }
            }
        }
    }
}

fn tiered_key(raw: &[u8]) -> String {
    crate::key::storage_key_part(raw)
}
