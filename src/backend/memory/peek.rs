//! Peek and reset of one key: its shard locked only while the key is read
//! or removed.

use super::shard::{lock, read, shard_of};
use super::MemoryBackend;
use crate::backend::{TierCheck, Verdict};

impl MemoryBackend {
    /// The decision `check` would get now, with nothing charged
    /// ([`Limit::check`](crate::algorithm::Limit::check) of the stored state).
    pub(crate) fn peek(&self, check: &TierCheck) -> Verdict {
        let now_us = self.inner.clock.now_us();
        let h = self.hash(&check.key);
        let g = read(&self.inner.shards[shard_of(h)]);
        let state = g
            .map
            .find(h, |s| s.key == check.key)
            .and_then(|s| s.entry.live(now_us));
        let decision = check.limit.check(state.as_deref(), now_us, check.cost);
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
        let mut g = lock(&self.inner.shards[shard_of(h)]);
        match g.map.find_entry(h, |s| s.key == key) {
            Ok(slot) => {
                let live = slot.get().entry.expires_us() > now_us;
                slot.remove();
                live
            }
            Err(_) => false,
        }
    }
}
