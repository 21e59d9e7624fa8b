//! The store's shards: each a table of buckets by key, its entries' expiry,
//! and the sweep that keeps it bounded.

use super::SHARDS;
use crate::algorithm::State;
use crate::backend::TierCheck;
use compact_str::CompactString;
use hashbrown::HashTable;
use std::sync::{Mutex, MutexGuard};

/// Stands in for a state while it is being replaced (never observed).
const PLACEHOLDER: State = State::Bucket(crate::algorithm::BucketState {
    tat_us: 0,
    frac: 0,
    unit: 0,
    rate: 0,
});
pub(super) const MIN_SWEEP: usize = 1024;

/// One shard: buckets by key, in a table addressed by the key's hash, which
/// a check computes once per key (it also picks the shard).
#[derive(Default)]
pub(super) struct Shard {
    pub(super) map: HashTable<Slot>,
    pub(super) sweep_at: usize,
}

pub(super) struct Slot {
    /// Inline up to 24 bytes (most IP and user keys): a lookup compares it
    /// without following a pointer, and a new key allocates nothing more.
    pub(super) key: CompactString,
    pub(super) entry: Entry,
}

pub(super) struct Entry {
    pub(super) state: State,
    /// Epoch microseconds after which the bucket is full and the entry is
    /// meaningless.
    pub(super) expires_us: u64,
}

impl Entry {
    /// Charges the live entry (`ready`: the state the check already computed)
    /// and returns the stored state.
    pub(super) fn commit(
        &mut self,
        ready: Option<(State, u64)>,
        c: &TierCheck,
        now_us: u64,
    ) -> &State {
        let (state, ttl_us) = match ready {
            Some(ready) => ready,
            None => {
                let old = std::mem::replace(&mut self.state, PLACEHOLDER);
                let old = (self.expires_us > now_us).then_some(old);
                c.limit.charge(old, now_us, c.cost)
            }
        };
        self.state = state;
        self.expires_us = now_us.saturating_add(ttl_us);
        &self.state
    }
}

impl Shard {
    /// Drops expired buckets; if still over `max`, drops the buckets that
    /// expire soonest (closest to full) down to 90% of `max`.
    pub(super) fn sweep(&mut self, now_us: u64, max: usize) {
        self.map.retain(|s| s.entry.expires_us > now_us);
        if self.map.len() > max {
            let keep = max - max / 10;
            let mut expiries: Vec<u64> = self.map.iter().map(|s| s.entry.expires_us).collect();
            let cut = expiries.len() - keep;
            let (_, &mut threshold, _) = expiries.select_nth_unstable(cut);
            self.map.retain(|s| s.entry.expires_us >= threshold);
            // Ties at the threshold may leave a few extra; remove arbitrary ones.
            let mut extra = self.map.len().saturating_sub(keep);
            self.map.retain(|s| {
                if extra > 0 && s.entry.expires_us == threshold {
                    extra -= 1;
                    false
                } else {
                    true
                }
            });
        }
        self.sweep_at = sweep_threshold(self.map.len() * 2, max);
    }
}

/// The shard of a key's hash: bits the table itself does not use (it indexes
/// by the low bits and tags entries with the top seven).
pub(super) fn shard_of(hash: u64) -> usize {
    ((hash >> 32) as usize) % SHARDS
}

/// Sweep when a shard doubles, but never let it pass `max`.
pub(super) fn sweep_threshold(target: usize, max: usize) -> usize {
    target.max(MIN_SWEEP).min(max.saturating_add(1))
}

pub(super) fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a shard half-written (every
    // write is a single insert), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
