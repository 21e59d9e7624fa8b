//! Concurrency: how many requests of one key are **in flight** at once
//! (Stripe's and GitHub's concurrency limiters beside their rate limits).
//!
//! The state is a set of **slots**, one per admitted request still running:
//! a slot id and the instant it expires (epoch µs). A request is admitted
//! when fewer than `limit` slots are live (`expires > now`); its slot is
//! added by the charge, in the same all-or-nothing commit as the rate tiers,
//! and taken away when its response has been sent or dropped (the front
//! door's release), or by a cross-slot refund. A slot that is never
//! released (the instance crashed) stops counting when it expires:
//! `ttl_us` after it was taken or last renewed; long requests renew it.
//!
//! A request takes one slot whatever its cost. On Redis the set is a sorted
//! set scored by expiry (`lua/concurrency.lua`), trimmed of expired slots
//! by every charge.
//!
//! Numbers: `remaining` = `limit − live − 1` after an admission; `reset_after`
//! = until the latest live slot expires (the admitted request's own slot
//! included), an upper bound on when every slot is free again;
//! `retry_after` of a denial = until the earliest live slot expires, at most
//! [`RETRY_ESTIMATE_US`] (1 s): slots usually free up when responses end,
//! which no clock can foresee, so the wait is an estimate, never 0.

use super::TierDecision;

/// The most a concurrency denial's `retry_after_us` says: 1 s (an estimate:
/// a slot frees when any running request ends).
pub const RETRY_ESTIMATE_US: u64 = 1_000_000;

/// The default slot TTL: 60 s.
pub const DEFAULT_SLOT_TTL_US: u64 = 60_000_000;

/// Concurrency parameters, and the slot id of the request being checked
/// (`0` in a tier's configured limit; the layer gives every request a fresh
/// one, below 2^53).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    /// Requests in flight at once.
    pub limit: u64,
    /// How long a slot lasts without renewal, µs.
    pub ttl_us: u64,
    /// The checked request's slot id.
    pub slot: u64,
}

/// Stored state: the slots, `(id, expires µs)`.
pub type SlotState = Vec<(u64, u64)>;

impl Concurrency {
    /// The same limit with another request's slot id.
    #[must_use]
    pub fn with_slot(self, slot: u64) -> Self {
        Self { slot, ..self }
    }

    /// The decision for one more request at `now_us`.
    pub fn check(&self, slots: Option<&SlotState>, now_us: u64) -> TierDecision {
        let live = || slots.into_iter().flatten().filter(|(_, e)| *e > now_us);
        let n = live().count() as u64;
        let latest = live().map(|(_, e)| e - now_us).max().unwrap_or(0);
        if n < self.limit {
            TierDecision {
                allowed: true,
                limit: self.limit,
                remaining: self.limit - n - 1,
                reset_after_us: latest.max(self.ttl_us),
                retry_after_us: 0,
                delay_us: 0,
            }
        } else {
            let earliest = live().map(|(_, e)| e - now_us).min().unwrap_or(0);
            TierDecision {
                allowed: false,
                limit: self.limit,
                remaining: 0,
                reset_after_us: latest,
                retry_after_us: earliest.clamp(1, RETRY_ESTIMATE_US),
                delay_us: 0,
            }
        }
    }

    /// Adds this request's slot (expired ones dropped): the state and its
    /// time-to-live, µs (until the latest slot expires).
    pub fn charge(&self, slots: Option<SlotState>, now_us: u64) -> (SlotState, u64) {
        let mut slots = slots.unwrap_or_default();
        slots.retain(|(id, e)| *e > now_us && *id != self.slot);
        slots.push((self.slot, now_us + self.ttl_us));
        let ttl = slots.iter().map(|(_, e)| e - now_us).max().unwrap_or(0);
        (slots, ttl)
    }

    /// The state without slot `id` (released, or refunded): `None` when no
    /// live slot is left. Expired slots are dropped too.
    pub fn release(slots: &SlotState, id: u64, now_us: u64) -> Option<SlotState> {
        let left: SlotState = slots
            .iter()
            .copied()
            .filter(|(i, e)| *i != id && *e > now_us)
            .collect();
        (!left.is_empty()).then_some(left)
    }

    /// Slot `id` renewed at `now_us` (it lasts `ttl_us` more), if it is
    /// still held; `None` when it is not (expired or released).
    pub fn renew(&self, slots: &SlotState, id: u64, now_us: u64) -> Option<SlotState> {
        let mut slots = slots.clone();
        let l = slots.iter_mut().find(|(i, e)| *i == id && *e > now_us)?;
        l.1 = now_us + self.ttl_us;
        Some(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: Concurrency = Concurrency {
        limit: 2,
        ttl_us: 60_000_000,
        slot: 1,
    };

    #[test]
    fn admits_up_to_the_limit_and_frees_on_release_or_expiry() {
        let d = C.check(None, 100);
        assert_eq!(
            (d.allowed, d.remaining, d.reset_after_us),
            (true, 1, 60_000_000)
        );
        let (s, ttl) = C.charge(None, 100);
        assert_eq!((s.clone(), ttl), (vec![(1, 60_000_100)], 60_000_000));
        let (s, _) = C.with_slot(2).charge(Some(s), 1_000_100);
        let d = C.with_slot(3).check(Some(&s), 2_000_100);
        // Denied: the earliest slot ends in 58 s, so the estimate (1 s).
        assert_eq!(
            (d.allowed, d.remaining, d.reset_after_us, d.retry_after_us),
            (false, 0, 59_000_000, RETRY_ESTIMATE_US)
        );
        // Half a second before the first slot expires: that is the wait.
        let d = C.with_slot(3).check(Some(&s), 59_500_100);
        assert_eq!(d.retry_after_us, 500_000);
        // Released: one slot again.
        let s2 = Concurrency::release(&s, 1, 2_000_100).unwrap();
        assert!(C.with_slot(3).check(Some(&s2), 2_000_100).allowed);
        // Expired: the crashed instance's slot stops counting.
        assert!(C.with_slot(3).check(Some(&s), 60_000_100).allowed);
        // Renewed: lasts a TTL from the renewal.
        let r = C.renew(&s, 1, 50_000_000).unwrap();
        assert!(!C.with_slot(3).check(Some(&r), 60_000_100).allowed);
        assert_eq!(C.renew(&s, 1, 60_000_100), None);
        assert_eq!(Concurrency::release(&[(1, 5)].to_vec(), 1, 0), None);
    }
}
