//! Peek and reset of one key: its shard's mutex held only while the key is
//! read or removed.

use super::shard::{shard_of, Held, Lookup, Writer};
use super::MemoryBackend;
use crate::backend::{TierCheck, Verdict};

impl MemoryBackend {
    /// The decision `check` would get now, with nothing charged
    /// ([`Limit::check`](crate::algorithm::Limit::check) of the stored state).
    pub(crate) fn peek(&self, check: &TierCheck) -> Verdict {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(&check.key);
        let guard = self.inner.collector.enter();
        let w = Writer::lock(&self.inner.shards[shard_of(h)]);
        let mut held = Held::new(&guard);
        let found = w.find(
            Lookup {
                hash: h,
                text: &check.key,
            },
            &held,
        );
        let decision = held.with_live(found, now_us, |state| {
            check.limit.check(state, now_us, check.cost)
        });
        Verdict {
            now_us,
            decisions: vec![decision],
            charges: Vec::new(),
        }
    }

    /// Forgets `key`: the next request finds a fresh key. Whether a live
    /// one was held.
    pub(crate) fn reset(&self, key: &str) -> bool {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(key);
        let guard = self.inner.collector.enter();
        let mut w = Writer::lock(&self.inner.shards[shard_of(h)]);
        let mut held = Held::new(&guard);
        let key = Lookup { hash: h, text: key };
        let Some(e) = w.find(key, &held) else {
            return false;
        };
        let live = held.expires_us(e) > now_us;
        w.remove(e, &mut held, key);
        live
    }
}
