//! Concurrency: how many requests of one key are **in flight** at once
//! (Stripe's and GitHub's concurrency limiters beside their rate limits).
//!
//! The state is a set of **leases**, one per admitted request still running:
//! a lease id and the instant it expires (epoch µs). A request is admitted
//! when fewer than `limit` leases are live (`expires > now`); its lease is
//! added by the charge, in the same all-or-nothing commit as the rate tiers,
//! and taken away when its response has been sent or dropped (the front
//! door's release), or by a cross-slot refund. A lease that is never
//! released (the instance crashed) stops counting when it expires:
//! `lease_us` after it was taken or last renewed; long requests renew it.
//!
//! A request takes one slot whatever its cost. On Redis the set is a sorted
//! set scored by expiry (`lua/concurrency.lua`), trimmed of expired leases
//! by every charge.
//!
//! Numbers: `remaining` = `limit − live − 1` after an admission; `reset_after`
//! = until the latest live lease expires (the admitted request's own lease
//! included), an upper bound on when every slot is free again;
//! `retry_after` of a denial = until the earliest live lease expires, at most
//! [`RETRY_ESTIMATE_US`] (1 s): slots usually free up when responses end,
//! which no clock can foresee, so the wait is an estimate, never 0.

use super::Decision;

/// The most a concurrency denial's `retry_after_us` says: 1 s (an estimate:
/// a slot frees when any running request ends).
pub const RETRY_ESTIMATE_US: u64 = 1_000_000;

/// The default lease: 60 s.
pub const DEFAULT_LEASE_US: u64 = 60_000_000;

/// Concurrency parameters, and the lease id of the request being checked
/// (`0` in a tier's configured limit; the layer gives every request a fresh
/// one, below 2^53).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    /// Requests in flight at once.
    pub limit: u64,
    /// How long a lease lasts without renewal, µs.
    pub lease_us: u64,
    /// The checked request's lease id.
    pub lease: u64,
}

/// Stored state: the leases, `(id, expires µs)`.
pub type LeaseState = Vec<(u64, u64)>;

impl Concurrency {
    /// The same limit with another request's lease id.
    #[must_use]
    pub fn with_lease(self, lease: u64) -> Self {
        Self { lease, ..self }
    }

    /// The decision for one more request at `now_us`.
    pub fn check(&self, leases: Option<&LeaseState>, now_us: u64) -> Decision {
        let live = || leases.into_iter().flatten().filter(|(_, e)| *e > now_us);
        let n = live().count() as u64;
        let latest = live().map(|(_, e)| e - now_us).max().unwrap_or(0);
        if n < self.limit {
            Decision {
                allowed: true,
                limit: self.limit,
                remaining: self.limit - n - 1,
                reset_after_us: latest.max(self.lease_us),
                retry_after_us: 0,
                delay_us: 0,
            }
        } else {
            let earliest = live().map(|(_, e)| e - now_us).min().unwrap_or(0);
            Decision {
                allowed: false,
                limit: self.limit,
                remaining: 0,
                reset_after_us: latest,
                retry_after_us: earliest.clamp(1, RETRY_ESTIMATE_US),
                delay_us: 0,
            }
        }
    }

    /// Adds this request's lease (expired ones dropped): the state and its
    /// time-to-live, µs (until the latest lease expires).
    pub fn charge(&self, leases: Option<LeaseState>, now_us: u64) -> (LeaseState, u64) {
        let mut leases = leases.unwrap_or_default();
        leases.retain(|(id, e)| *e > now_us && *id != self.lease);
        leases.push((self.lease, now_us + self.lease_us));
        let ttl = leases.iter().map(|(_, e)| e - now_us).max().unwrap_or(0);
        (leases, ttl)
    }

    /// The state without lease `id` (released, or refunded): `None` when no
    /// live lease is left. Expired leases are dropped too.
    pub fn release(leases: &LeaseState, id: u64, now_us: u64) -> Option<LeaseState> {
        let left: LeaseState = leases
            .iter()
            .copied()
            .filter(|(i, e)| *i != id && *e > now_us)
            .collect();
        (!left.is_empty()).then_some(left)
    }

    /// Lease `id` renewed at `now_us` (it lasts `lease_us` more), if it is
    /// still held; `None` when it is not (expired or released).
    pub fn renew(&self, leases: &LeaseState, id: u64, now_us: u64) -> Option<LeaseState> {
        let mut leases = leases.clone();
        let l = leases.iter_mut().find(|(i, e)| *i == id && *e > now_us)?;
        l.1 = now_us + self.lease_us;
        Some(leases)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: Concurrency = Concurrency {
        limit: 2,
        lease_us: 60_000_000,
        lease: 1,
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
        let (s, _) = C.with_lease(2).charge(Some(s), 1_000_100);
        let d = C.with_lease(3).check(Some(&s), 2_000_100);
        // Denied: the earliest lease ends in 58 s, so the estimate (1 s).
        assert_eq!(
            (d.allowed, d.remaining, d.reset_after_us, d.retry_after_us),
            (false, 0, 59_000_000, RETRY_ESTIMATE_US)
        );
        // Half a second before the first lease expires: that is the wait.
        let d = C.with_lease(3).check(Some(&s), 59_500_100);
        assert_eq!(d.retry_after_us, 500_000);
        // Released: one slot again.
        let s2 = Concurrency::release(&s, 1, 2_000_100).unwrap();
        assert!(C.with_lease(3).check(Some(&s2), 2_000_100).allowed);
        // Expired: the crashed instance's lease stops counting.
        assert!(C.with_lease(3).check(Some(&s), 60_000_100).allowed);
        // Renewed: lasts a lease from the renewal.
        let r = C.renew(&s, 1, 50_000_000).unwrap();
        assert!(!C.with_lease(3).check(Some(&r), 60_000_100).allowed);
        assert_eq!(C.renew(&s, 1, 60_000_100), None);
        assert_eq!(Concurrency::release(&[(1, 5)].to_vec(), 1, 0), None);
    }
}
