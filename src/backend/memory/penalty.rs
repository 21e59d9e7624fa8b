//! Penalty boxes in memory: the strike (or block) a penalty check writes
//! whether or not the request was charged (see
//! [`crate::algorithm::penalty`]).

use super::shard::{Entry, Shard, Slot};
use super::MemoryBackend;
use crate::algorithm::State;
use compact_str::CompactString;
use std::hash::BuildHasher;

impl MemoryBackend {
    /// Stores `state` under `key` (hash `h`, in the locked shard `g`) until
    /// `now_us + ttl_us`, replacing what is there.
    pub(super) fn store(
        &self,
        g: &mut Shard,
        h: u64,
        key: &str,
        state: State,
        now_us: u64,
        ttl_us: u64,
    ) {
        let expires_us = now_us.saturating_add(ttl_us);
        if let Some(s) = g.map.find_mut(h, |s| s.key == key) {
            s.entry.store(state, expires_us, now_us);
            return;
        }
        let hasher = &self.inner.hasher;
        g.map.insert_unique(
            h,
            Slot {
                key: CompactString::from(key),
                entry: Entry::new(state, expires_us, now_us),
            },
            |s| hasher.hash_one(s.key.as_str()),
        );
        if g.map.len() >= g.sweep_at {
            g.sweep(now_us, self.inner.max_per_shard);
        }
    }
}
