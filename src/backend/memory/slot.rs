//! Concurrency slots in memory: a request's release, and the renewal of
//! a long request's slot (see [`crate::algorithm::Concurrency`]).

use super::shard::{locked, shard_of, Entry, Held, Lookup, Writer};
use super::MemoryBackend;
use crate::algorithm::{Concurrency, State};

impl MemoryBackend {
    /// Takes slot `id` out of `key`'s slots (the key goes when none is
    /// left).
    pub(crate) fn release(&self, key: &str, id: u64) {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(key);
        let guard = self.inner.collector.enter();
        let mut w = Writer::lock(&self.inner.shards[shard_of(h)]);
        let mut held = Held::new(&guard);
        let key = Lookup { hash: h, text: key };
        let Some(e) = w.find(key, &held) else {
            return;
        };
        let Entry::Locked(m) = e.live() else {
            return;
        };
        let mut l = locked(m);
        let State::Slots(slots) = &l.state else {
            return;
        };
        match Concurrency::release(slots, id, now_us) {
            Some(left) => l.state = State::Slots(left),
            None => {
                drop(l);
                w.remove(e, &mut held, key);
            }
        }
    }

    /// Renews slot `c.slot` of `key` for `c.ttl_us` from now; false when
    /// it is no longer held.
    pub(crate) fn renew(&self, key: &str, c: &Concurrency) -> bool {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(key);
        let guard = self.inner.collector.enter();
        let w = Writer::lock(&self.inner.shards[shard_of(h)]);
        let held = Held::new(&guard);
        let Some(Entry::Locked(m)) = w
            .find(Lookup { hash: h, text: key }, &held)
            .map(Entry::live)
        else {
            return false;
        };
        let mut l = locked(m);
        let State::Slots(slots) = &l.state else {
            return false;
        };
        if l.expires_us <= now_us {
            return false;
        }
        let Some(renewed) = c.renew(slots, c.slot, now_us) else {
            return false;
        };
        let until = now_us.saturating_add(c.ttl_us);
        l.state = State::Slots(renewed);
        l.expires_us = l.expires_us.max(until);
        true
    }
}
