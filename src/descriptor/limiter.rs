//! [`DescriptorLimiter`]: the engine deciding a request's descriptors, its
//! answer ([`Answer`], [`DescriptorStatus`], [`Code`]), and the engine's
//! [`Facts`] over descriptors.

use super::matching::{Compiled, Descriptor};
use super::rules::{Rule, RuleLimit, RulesPolicy};
use super::{MAX_DESCRIPTORS, MAX_ENTRIES};
use crate::backend::Backend;
use crate::engine::builder::EngineBuilder;
use crate::engine::spec::TierSpec;
use crate::engine::{Block, Decision, Engine, Facts, Step};
use crate::error::ConfigError;
use crate::handle::RateLimitHandle;
use crate::key::{KeyError, KeyWriter};
use crate::observe::RequestDecision;
use crate::response::RateLimitHeaders;
use crate::rollout::Mode;
use std::borrow::Cow;
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
    /// The limiter for `domain` with `rules`, on an engine with the
    /// settings of `builder` (its backend, key prefix, failure policy,
    /// timeout, header style, …) and one tier per limited rule. `shadow_mode` runs every
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
                let mut tier = TierSpec::new(r.name.clone(), r.quota);
                tier.algorithm = r.algorithm;
                tier.mode = mode;
                tier.lease = r.lease;
                tier.key_type = "Descriptor";
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
        // Every rule unlimited: an engine without tiers, which passes every
        // request it is asked about (none is: no descriptor names a tier).
        let engine = builder.build()?;
        Ok(Self {
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
            let Some(rule) = super::matching::rule_of(&self.rules, d) else {
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
    pub(super) fn answer(
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

    pub(super) fn status_of(&self, rule: usize) -> DescriptorStatus {
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
pub(super) struct DescriptorFacts<'a> {
    pub(super) descriptors: &'a [Descriptor<'a>],
    pub(super) groups: &'a [Vec<(usize, u64)>],
    pub(super) domain: &'a str,
}

impl Facts for DescriptorFacts<'_> {
    const DETAILS: bool = true;

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
