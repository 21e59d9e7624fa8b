//! A per-key override as a check applies it ([`Active`]): the data the
//! backends store and read, below the public API of [`handle`](crate::handle#per-key-overrides)
//! (which sets, removes and lists them through the backends).

use crate::algorithm::{Limit, TierDecision};
use crate::backend::TierCheck;
use std::time::Duration;

/// The suffix of an override's key: `<tier key>{ov}` (the same hash slot
/// as the tier's key on a cluster).
pub(crate) const KEY_SUFFIX: &str = "{ov}";

/// `Retry-After` of a block without expiry: 24 hours.
pub const BLOCKED_RETRY: Duration = Duration::from_secs(86_400);

/// An override as the check applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Active {
    pub(crate) effect: Effect,
    /// Unix epoch µs; 0: no expiry.
    pub(crate) until_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    Limit(Limit),
    Unlimited,
    Blocked,
}

/// The override check's `remaining`, read by the engine
/// ([`apply_codes`](apply_codes)): 0 none, 1 unlimited, 2 blocked, 3 + the quota's
/// capacity.
pub(crate) const CODE_UNLIMITED: u64 = 1;
const CODE_BLOCKED: u64 = 2;
pub(crate) const CODE_QUOTA: u64 = 3;

impl Active {
    /// Whether it still applies at `now_us`.
    pub(crate) fn live(&self, now_us: u64) -> bool {
        self.until_us == 0 || self.until_us > now_us
    }

    /// The override check's own decision: allowed, its code as remaining.
    pub(crate) fn code_decision(this: Option<&Self>) -> TierDecision {
        let code = match this.map(|a| a.effect) {
            None => 0,
            Some(Effect::Unlimited) => CODE_UNLIMITED,
            Some(Effect::Blocked) => CODE_BLOCKED,
            Some(Effect::Limit(l)) => CODE_QUOTA.saturating_add(l.capacity()),
        };
        TierDecision {
            allowed: true,
            limit: 0,
            remaining: code,
            reset_after_us: 0,
            retry_after_us: 0,
            delay_us: 0,
        }
    }

    /// The decision of `c` (its tier's check) under this override, and
    /// the state to store when it is charged (`None`: nothing to charge:
    /// unlimited, blocked, or denied).
    pub(crate) fn check(
        &self,
        c: &TierCheck,
        state: Option<&crate::algorithm::State>,
        now_us: u64,
    ) -> (TierDecision, Option<(crate::algorithm::State, u64)>) {
        let capacity = c.limit.capacity();
        match self.effect {
            Effect::Limit(_) => {
                let l = self.limit_of(c.limit);
                let (d, prepared) = l.check_prepared(state, now_us, c.cost);
                let charged = d
                    .allowed
                    .then(|| prepared.unwrap_or_else(|| l.charge(state.cloned(), now_us, c.cost)));
                (d, charged)
            }
            Effect::Unlimited => (
                TierDecision {
                    allowed: true,
                    limit: capacity,
                    remaining: capacity,
                    reset_after_us: 0,
                    retry_after_us: 0,
                    delay_us: 0,
                },
                None,
            ),
            Effect::Blocked => {
                let wait = self.block_wait_us(now_us);
                (
                    TierDecision {
                        allowed: false,
                        limit: capacity,
                        remaining: 0,
                        reset_after_us: wait,
                        retry_after_us: wait,
                        delay_us: 0,
                    },
                    None,
                )
            }
        }
    }

    /// The limit a tier of limit `tier` is checked, refunded and settled
    /// with under this override: another quota's (a calendar tier keeps its
    /// boundaries, the override, a fixed window of the tier's nominal
    /// length, giving its limit, as `lua/override.lua`'s `override_apply`
    /// does); the tier's own when unlimited or blocked (its counter is left
    /// as the tier's quota reads it).
    pub(crate) fn limit_of(&self, tier: Limit) -> Limit {
        match (self.effect, tier) {
            (Effect::Limit(Limit::FixedWindow(w)), Limit::Calendar(cal)) => {
                Limit::Calendar(crate::algorithm::CalendarWindow {
                    limit: w.limit,
                    ..cal
                })
            }
            (Effect::Limit(l), _) => l,
            (Effect::Unlimited | Effect::Blocked, _) => tier,
        }
    }

    /// The wait of a block at `now_us`.
    pub(crate) fn block_wait_us(&self, now_us: u64) -> u64 {
        if self.until_us == 0 {
            u64::try_from(BLOCKED_RETRY.as_micros()).unwrap_or(u64::MAX)
        } else {
            self.until_us.saturating_sub(now_us)
        }
    }

    /// The value stored in Redis (read by `lua/override.lua`):
    /// `<until µs> <kind> <p1> <p2> <p3> <p4> <capacity>`, kind 0 quota
    /// (p1..p4 the tier algorithm's parameters for it), 1 unlimited, 2
    /// blocked.
    #[cfg(feature = "redis")]
    pub(crate) fn redis_value(&self) -> String {
        match self.effect {
            Effect::Limit(l) => {
                let p = crate::backend::redis_params(&l);
                format!(
                    "{} 0 {} {} {} {} {}",
                    self.until_us,
                    p[0],
                    p[1],
                    p[2],
                    p[3],
                    l.capacity()
                )
            }
            Effect::Unlimited => format!("{} 1 0 0 0 0 0", self.until_us),
            Effect::Blocked => format!("{} 2 0 0 0 0 0", self.until_us),
        }
    }
}

/// After a check: each override check's code applied to the tier check
/// right after it (a quota's limit shown, an unlimited tier shown full),
/// and the override check itself shown as its tier (full), with
/// `retry_after_us` [`APPLIED`] when an override applied (an allowed
/// decision's retry is otherwise 0): the deny cache keeps no answer of an
/// overridden key, so a change is seen by every instance at once.
pub(crate) fn apply_codes(sent: &[TierCheck], decisions: &mut [TierDecision]) {
    for i in 0..decisions.len().min(sent.len()).saturating_sub(1) {
        if !sent[i].limit.is_override() {
            continue;
        }
        let code = decisions[i].remaining;
        let applied = if code == 0 { 0 } else { APPLIED };
        let d = &mut decisions[i + 1];
        if code >= CODE_QUOTA {
            d.limit = code - CODE_QUOTA;
            d.remaining = d.remaining.min(d.limit);
        } else if code == CODE_UNLIMITED && d.allowed {
            d.remaining = d.limit;
        }
        let limit = d.limit;
        decisions[i] = TierDecision {
            allowed: true,
            limit,
            remaining: limit,
            reset_after_us: 0,
            retry_after_us: applied,
            delay_us: 0,
        };
    }
}

/// An override check's `retry_after_us` when an override applied (see
/// [`apply_codes`]).
pub(crate) const APPLIED: u64 = 1;

/// Whether check `i` is a tier's whose override applied (the deny cache
/// leaves it alone).
pub(crate) fn overridden(sent: &[TierCheck], decisions: &[TierDecision], i: usize) -> bool {
    i > 0
        && sent.get(i - 1).is_some_and(|c| c.limit.is_override())
        && decisions
            .get(i - 1)
            .is_some_and(|d| d.retry_after_us == APPLIED)
}
