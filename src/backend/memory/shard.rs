//! The store's shards: each a table of buckets by key, its entries' expiry,
//! and the sweep that keeps it bounded.

use super::cell::TatCell;
use super::SHARDS;
use crate::algorithm::State;
use crate::backend::TierCheck;
use compact_str::CompactString;
use hashbrown::HashTable;
use std::borrow::Cow;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(super) const MIN_SWEEP: usize = 1024;

/// One shard: buckets by key, in a table addressed by the key's hash, which
/// a check computes once per key (it also picks the shard).
#[derive(Default)]
pub(super) struct Shard {
    pub(super) map: HashTable<Slot>,
    pub(super) sweep_at: usize,
}

/// One key's bucket: 64 bytes, aligned to a cache line, so a lookup at
/// 10^6 keys (tables far larger than the cache) misses one line, not two:
/// the key compared and the cell charged are on the line the probe reads.
#[repr(align(64))]
pub(super) struct Slot {
    /// Inline up to 24 bytes (most IP and user keys): a lookup compares it
    /// without following a pointer, and a new key allocates nothing more.
    pub(super) key: CompactString,
    pub(super) entry: Entry,
}

/// A state only the locked path reads and writes, with its expiry: boxed so
/// that every [`Slot`] stays one cache line (the window algorithms' and the
/// leases' states are larger than a cell). Replaced in place, so a check of
/// a held key allocates nothing.
pub(super) struct Locked {
    pub(super) state: State,
    /// Epoch microseconds after which the bucket is full (or its window
    /// empty) and the entry is meaningless.
    pub(super) expires_us: u64,
}

/// A bucket's state: in a [`TatCell`] (token and leaky buckets, charged by
/// compare-and-swap under the shard's read lock), or as a [`State`] with
/// its expiry (every other algorithm, and a bucket state no cell can
/// express), written under the shard's write lock only.
pub(super) enum Entry {
    Cell(TatCell),
    Locked(Box<Locked>),
}

impl Entry {
    /// The entry for `state`, which expires at `expires_us`: a cell when it
    /// can hold the state and its expiry is the TAT's (as every charge and
    /// refund of a bucket sets it).
    pub(super) fn new(state: State, expires_us: u64, now_us: u64) -> Self {
        match TatCell::new(&state, now_us) {
            Some(cell) if cell.expires_us(cell.load()) == expires_us => Entry::Cell(cell),
            _ => Entry::Locked(Box::new(Locked { state, expires_us })),
        }
    }

    pub(super) fn expires_us(&self) -> u64 {
        match self {
            Entry::Cell(cell) => cell.expires_us(cell.load()),
            Entry::Locked(l) => l.expires_us,
        }
    }

    /// The state, if the entry has not expired at `now_us`.
    pub(super) fn live(&self, now_us: u64) -> Option<Cow<'_, State>> {
        match self {
            Entry::Cell(cell) => {
                let ticks = cell.load();
                (cell.expires_us(ticks) > now_us).then(|| Cow::Owned(cell.state(ticks)))
            }
            Entry::Locked(l) => (l.expires_us > now_us).then_some(Cow::Borrowed(&l.state)),
        }
    }

    /// Stores `state`, expiring at `expires_us` (under the write lock).
    pub(super) fn store(&mut self, state: State, expires_us: u64, now_us: u64) {
        match self {
            Entry::Cell(cell) => {
                if let Some(ticks) = cell.ticks_of_state(&state) {
                    if cell.expires_us(ticks) == expires_us {
                        cell.set(ticks);
                        return;
                    }
                }
            }
            // A bucket's state a cell can hold goes back to a cell; any
            // other (every window algorithm's) is written into its box: no
            // allocation.
            Entry::Locked(l) => {
                match TatCell::new(&state, now_us) {
                    Some(cell) if cell.expires_us(cell.load()) == expires_us => {
                        *self = Entry::Cell(cell);
                    }
                    _ => **l = Locked { state, expires_us },
                }
                return;
            }
        }
        *self = Entry::new(state, expires_us, now_us);
    }

    /// Charges the live entry (`ready`: the state the check already
    /// computed) and returns the charge's undo value
    /// ([`Limit::undo_of`](crate::algorithm::Limit::undo_of)).
    pub(super) fn commit(
        &mut self,
        ready: Option<(State, u64)>,
        c: &TierCheck,
        now_us: u64,
    ) -> u64 {
        let (state, ttl_us) = match ready {
            Some(ready) => ready,
            None => {
                let old = match self {
                    // Taken, not cloned: a sliding log may be long.
                    Entry::Locked(l) if l.expires_us > now_us => {
                        Some(std::mem::replace(&mut l.state, PLACEHOLDER))
                    }
                    _ => self.live(now_us).map(Cow::into_owned),
                };
                c.limit.charge(old, now_us, c.cost)
            }
        };
        let undo = c.limit.undo_of(&state, now_us);
        self.store(state, now_us.saturating_add(ttl_us), now_us);
        undo
    }
}

/// Stands in for a state while it is being replaced (never observed).
const PLACEHOLDER: State = State::FixedWindow(crate::algorithm::FixedWindowState {
    start_us: 0,
    count: 0,
});

impl Shard {
    /// Drops expired buckets; if still over `max`, drops the buckets that
    /// expire soonest (closest to full) down to 90% of `max`.
    pub(super) fn sweep(&mut self, now_us: u64, max: usize) {
        self.map.retain(|s| s.entry.expires_us() > now_us);
        if self.map.len() > max {
            let keep = max - max / 10;
            let mut expiries: Vec<u64> = self.map.iter().map(|s| s.entry.expires_us()).collect();
            let cut = expiries.len() - keep;
            let (_, &mut threshold, _) = expiries.select_nth_unstable(cut);
            self.map.retain(|s| s.entry.expires_us() >= threshold);
            // Ties at the threshold may leave a few extra; remove arbitrary ones.
            let mut extra = self.map.len().saturating_sub(keep);
            self.map.retain(|s| {
                if extra > 0 && s.entry.expires_us() == threshold {
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

// A panic while holding the lock cannot leave a shard half-written (every
// write is a single insert or store), so a poisoned lock is still usable.
pub(super) fn lock(m: &RwLock<Shard>) -> RwLockWriteGuard<'_, Shard> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn read(m: &RwLock<Shard>) -> RwLockReadGuard<'_, Shard> {
    m.read().unwrap_or_else(|e| e.into_inner())
}
