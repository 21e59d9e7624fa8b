//! Concurrency leases in memory: a request's release, and the renewal of
//! a long request's lease (see [`crate::algorithm::concurrency`]).

use super::shard::{lock, shard_of, Entry};
use super::MemoryBackend;
use crate::algorithm::{Concurrency, State};

impl MemoryBackend {
    /// Takes lease `id` out of `key`'s leases (the key goes when none is
    /// left).
    pub(crate) fn release(&self, key: &str, id: u64) {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(key);
        let mut g = lock(&self.inner.shards[shard_of(h)]);
        let Ok(mut slot) = g.map.find_entry(h, |s| s.key == key) else {
            return;
        };
        let Entry::Locked(l) = &slot.get().entry else {
            return;
        };
        let State::Leases(leases) = &l.state else {
            return;
        };
        match Concurrency::release(leases, id, now_us) {
            Some(left) => {
                if let Entry::Locked(l) = &mut slot.get_mut().entry {
                    l.state = State::Leases(left);
                }
            }
            None => {
                slot.remove();
            }
        }
    }

    /// Renews lease `c.lease` of `key` for `c.lease_us` from now; false when
    /// it is no longer held.
    pub(crate) fn renew(&self, key: &str, c: &Concurrency) -> bool {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(key);
        let mut g = lock(&self.inner.shards[shard_of(h)]);
        let Some(slot) = g.map.find_mut(h, |s| s.key == key) else {
            return false;
        };
        let Entry::Locked(l) = &mut slot.entry else {
            return false;
        };
        let State::Leases(leases) = &l.state else {
            return false;
        };
        if l.expires_us <= now_us {
            return false;
        }
        let Some(renewed) = c.renew(leases, c.lease, now_us) else {
            return false;
        };
        let until = now_us.saturating_add(c.lease_us);
        l.state = State::Leases(renewed);
        l.expires_us = l.expires_us.max(until);
        true
    }
}
