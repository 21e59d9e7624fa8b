//! The engine's decision as the answer to a request: one status per
//! descriptor ([`DescriptorLimiter::answer`]).

use super::limiter::{Answer, Code, DescriptorLimiter, DescriptorStatus, RequestError};
use crate::engine::{Block, Decision};
use crate::observe::RequestDecision;
use std::time::Duration;

impl DescriptorLimiter {
    /// The engine's decision as per-descriptor statuses.
    /// `groups`: per engine tier, its checks' (first descriptor, cost).
    pub(super) fn answer(
        &self,
        decision: Decision,
        matched: &[Option<(usize, usize)>],
        groups: &[Vec<(usize, u64)>],
    ) -> Result<Answer, RequestError> {
        // A denied request charged nothing: a check that allowed shows its
        // count without this request's cost.
        let denied = matches!(decision, Decision::Block(Block::Limited(_)));
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
                        .map(|_| DescriptorStatus::bare(Code::OverLimit))
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
                None => DescriptorStatus::bare(Code::Ok),
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
                    let r = &self.rules[rule];
                    if let Some((d, never_fits)) = d {
                        // A rule in shadow reports OK; under the global
                        // shadow mode the descriptor says OVER_LIMIT and the
                        // request is OK (as the reference service answers).
                        let shadowed =
                            r.shadow || (!self.global_shadow && shadow_tiers & (1 << tier) != 0);
                        s.shadow_over = !d.allowed && shadowed;
                        s.code = if !d.allowed && !shadowed {
                            Code::OverLimit
                        } else {
                            Code::Ok
                        };
                        // Over the limit: nothing left (shadow rules too).
                        s.remaining = if d.allowed { d.remaining } else { 0 };
                        let mut reset_after_us = d.reset_after_us;
                        if d.allowed && denied {
                            let cost = groups
                                .get(tier)
                                .and_then(|g| g.get(n))
                                .map_or(0, |&(_, c)| c);
                            s.remaining = d.remaining.saturating_add(cost).min(d.limit);
                            if r.steady_refill {
                                let q = r.limit.quota;
                                let back = u128::from(cost) * q.period().as_micros()
                                    / u128::from(q.limit().max(1));
                                reset_after_us = reset_after_us
                                    .saturating_sub(u64::try_from(back).unwrap_or(u64::MAX));
                            }
                        }
                        if r.blocked {
                            // `requests_per_unit: 0`: until the unit's
                            // window ends, as the reference says.
                            let unit = r.limit.unit.seconds();
                            let now = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map_or(0, |d| d.as_secs());
                            s.until_reset = Duration::from_secs(unit - now % unit);
                        } else {
                            s.exceeds_capacity = never_fits;
                            s.until_reset = Duration::from_micros(if d.allowed {
                                reset_after_us
                            } else {
                                d.retry_after_us
                            });
                        }
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
        if self.global_shadow {
            overall = Code::Ok;
        }
        Ok(Answer {
            overall,
            statuses,
            headers,
            fail_open,
        })
    }

    pub(super) fn status_of(&self, rule: usize) -> DescriptorStatus {
        DescriptorStatus {
            code: Code::Ok,
            limit: Some(self.rules[rule].limit.clone()),
            unlimited: false,
            remaining: 0,
            until_reset: Duration::ZERO,
            exceeds_capacity: false,
            stat: self.rules[rule].stat.clone(),
            shadow_over: false,
        }
    }

    /// A descriptor of `hits_addend` 0 on `rule`: its numbers read without
    /// a charge (`key`: its storage key part). Never over the limit (a
    /// counter holds at most the limit); no numbers when the backend does
    /// not answer.
    pub(super) async fn uncharged(&self, rule: usize, key: &str) -> DescriptorStatus {
        let r = &self.rules[rule];
        let mut s = self.status_of(rule);
        if r.blocked {
            return s;
        }
        match self.handle().peek(&r.limit.rule, key).await {
            Ok(k) => {
                // The peek charges the tier's cost (1) in its numbers.
                s.remaining = if k.allowed {
                    k.remaining.saturating_add(1).min(k.limit)
                } else {
                    k.remaining
                };
                s.until_reset = k.reset_after;
            }
            Err(_) => s.limit = None,
        }
        s
    }
}
