use super::clock::{Clock, ManualClock};
use super::{Charge, Shadow, TierCheck, TierRefund, Verdict};
use crate::algorithm::{Refund, State};
use hashbrown::HashTable;
use std::fmt;
// foldhash's quality variant: randomly seeded per process (so request-chosen
// keys cannot be aimed at one bucket of the table), and several times faster
// than SipHash on short keys.
use foldhash::quality::RandomState;
use smallvec::SmallVec;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

const SHARDS: usize = 64;
/// Stands in for a state while it is being replaced (never observed).
const PLACEHOLDER: State = State::Bucket(crate::algorithm::BucketState {
    tokens: 0,
    updated_us: 0,
    unit: 0,
});
const MIN_SWEEP: usize = 1024;

/// Buckets in this process's memory: no network, no shared state between app
/// servers (each server enforces the full quota on its own).
///
/// * **Exact and atomic**: the keys of one request's tiers are locked together
///   (shards locked in index order, so concurrent requests cannot deadlock),
///   so a request is charged on every tier or on none.
/// * **Clock**: tokio's monotonic clock, anchored to the wall clock once at
///   construction for the `X-RateLimit-Reset` epoch seconds. Tests can pause it
///   (`#[tokio::test(start_paused = true)]`) or use a [`ManualClock`].
/// * **Bounded memory**: a bucket is forgotten once it would be full again
///   (its time-to-live, exactly as on Redis); expired entries are swept
///   whenever a shard doubles in size, and at most
///   [`max_keys`](MemoryBackend::max_keys) buckets are kept (default
///   1 000 000): past that, the buckets closest to full are evicted first,
///   which hands those keys a full bucket a little early.
///
/// ```
/// use tiered_ratelimit::backend::MemoryBackend;
/// let store = MemoryBackend::new().max_keys(100_000);
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Clock,
    max_per_shard: usize,
}

/// One shard: buckets by key, in a table addressed by the key's hash, which
/// a check computes once per key (it also picks the shard).
#[derive(Default)]
struct Shard {
    map: HashTable<Slot>,
    sweep_at: usize,
}

struct Slot {
    key: String,
    entry: Entry,
}

struct Entry {
    state: State,
    /// Epoch microseconds after which the bucket is full and the entry is
    /// meaningless.
    expires_us: u64,
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("len", &self.len())
            .field("max_keys", &(self.inner.max_per_shard * SHARDS))
            .finish_non_exhaustive()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// An empty store on tokio's monotonic clock, keeping at most 1 000 000
    /// buckets.
    #[must_use]
    pub fn new() -> Self {
        Self::with_clock(Clock::monotonic(), 1_000_000)
    }

    /// An empty store on a [`ManualClock`] (for tests and replay).
    #[must_use]
    pub fn with_manual_clock(clock: ManualClock) -> Self {
        Self::with_clock(Clock::Manual(clock), 1_000_000)
    }

    fn with_clock(clock: Clock, max_keys: usize) -> Self {
        let max_per_shard = max_keys.div_ceil(SHARDS).max(1);
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: HashTable::new(),
                    sweep_at: sweep_threshold(MIN_SWEEP, max_per_shard),
                })
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: RandomState::default(),
                clock,
                max_per_shard,
            }),
        }
    }

    /// Keeps at most about `max_keys` buckets (rounded up to a multiple of the
    /// shard count, 64). Call before sharing the store.
    #[must_use]
    pub fn max_keys(self, max_keys: usize) -> Self {
        Self::with_clock(self.inner.clock.clone(), max_keys)
    }

    /// Buckets currently held (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn clock(&self) -> Clock {
        self.inner.clock.clone()
    }

    /// The store's clock reading, in epoch microseconds.
    pub fn now_us(&self) -> u64 {
        self.inner.clock.now_us()
    }

    fn hash(&self, key: &str) -> u64 {
        self.inner.hasher.hash_one(key)
    }

    /// Checks, and charges when every enforced tier allows. `with_charges`:
    /// fill [`Verdict::charges`] (what refunds need; skipped, with its
    /// allocation, when no tier refunds).
    pub(crate) fn check(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
    ) -> Verdict {
        let now_us = self.inner.clock.now_us();
        let hashes: SmallVec<[u64; 8]> = checks.iter().map(|c| self.hash(&c.key)).collect();
        let idx: SmallVec<[usize; 8]> = hashes.iter().map(|&h| shard_of(h)).collect();
        let mut order = idx.clone();
        order.sort_unstable();
        order.dedup();
        // Lock in ascending shard order: no two requests can wait on each other.
        let mut guards: SmallVec<[(usize, MutexGuard<'_, Shard>); 8]> = order
            .iter()
            .map(|&i| (i, lock(&self.inner.shards[i])))
            .collect();
        let guard_of = |shard: usize| order.binary_search(&shard).unwrap_or(0);

        let mut decisions = Vec::with_capacity(checks.len());
        // The token bucket's check computes the charged state too: kept, so
        // the commit does not compute it again.
        let mut prepared: SmallVec<[Option<(State, u64)>; 8]> = SmallVec::new();
        let mut charges = Vec::new();
        for (i, ((c, &shard), &h)) in checks.iter().zip(&idx).zip(&hashes).enumerate() {
            let map = &guards[guard_of(shard)].1.map;
            let state = map
                .find(h, |s| s.key == c.key)
                .filter(|s| s.entry.expires_us > now_us)
                .map(|s| &s.entry.state);
            let (d, charged) = c.limit.check_prepared(state, now_us, c.cost);
            decisions.push(d);
            // A key charged twice in one check (a caller of Backend::check
            // may pass one; the layer's tiers never share a key): the second
            // charge must see the first, so it is computed at commit.
            let repeated = hashes[..i]
                .iter()
                .zip(checks)
                .any(|(&other, o)| other == h && o.key == c.key);
            prepared.push(if repeated { None } else { charged });
        }
        if shadow.commits(&decisions) {
            if with_charges {
                charges.reserve(checks.len());
            }
            let mut charge = |c: &TierCheck, state: Option<&State>| {
                if with_charges {
                    charges.push(state.map(|state| Charge {
                        at_us: now_us,
                        undo: c.limit.undo_of(state, now_us),
                        next_after_us: 0,
                    }));
                }
            };
            for ((((c, &shard), &h), d), ready) in checks
                .iter()
                .zip(&idx)
                .zip(&hashes)
                .zip(&decisions)
                .zip(prepared)
            {
                if !d.allowed {
                    charge(c, None);
                    continue; // a shadow tier that would deny charges nothing
                }
                let g = &mut guards[guard_of(shard)].1;
                match g.map.find_mut(h, |s| s.key == c.key).map(|s| &mut s.entry) {
                    Some(e) => {
                        let (state, ttl_us) = match ready {
                            Some(ready) => ready,
                            None => {
                                let old = std::mem::replace(&mut e.state, PLACEHOLDER);
                                let old = (e.expires_us > now_us).then_some(old);
                                c.limit.charge(old, now_us, c.cost)
                            }
                        };
                        charge(c, Some(&state));
                        e.state = state;
                        e.expires_us = now_us.saturating_add(ttl_us);
                    }
                    None => {
                        let (state, ttl_us) =
                            ready.unwrap_or_else(|| c.limit.charge(None, now_us, c.cost));
                        charge(c, Some(&state));
                        let entry = Entry {
                            state,
                            expires_us: now_us.saturating_add(ttl_us),
                        };
                        let hasher = &self.inner.hasher;
                        g.map.insert_unique(
                            h,
                            Slot {
                                key: c.key.clone(),
                                entry,
                            },
                            |s| hasher.hash_one(s.key.as_str()),
                        );
                        if g.map.len() >= g.sweep_at {
                            g.sweep(now_us, self.inner.max_per_shard);
                        }
                    }
                }
            }
        }
        Verdict {
            now_us,
            decisions,
            charges,
        }
    }

    /// Gives back charges (see [`Limit::refund`](crate::algorithm::Limit::refund)),
    /// one key at a time, each under its shard's lock only while it is
    /// rewritten.
    pub(crate) fn refund(&self, refunds: &[TierRefund]) {
        let now_us = self.inner.clock.now_us();
        for r in refunds {
            let c = &r.check;
            let h = self.hash(&c.key);
            let mut g = lock(&self.inner.shards[shard_of(h)]);
            let Ok(mut slot) = g.map.find_entry(h, |s| s.key == c.key) else {
                continue;
            };
            let e = &mut slot.get_mut().entry;
            let state = (e.expires_us > now_us).then_some(&e.state);
            match c
                .limit
                .refund(state, now_us, r.charge.at_us, c.cost, r.charge.undo)
            {
                Refund::Keep => {}
                Refund::Delete => {
                    slot.remove();
                }
                Refund::Store(state, ttl_us) => {
                    e.state = state;
                    if let Some(ttl_us) = ttl_us {
                        e.expires_us = now_us.saturating_add(ttl_us);
                    }
                }
            }
        }
    }
}

impl Shard {
    /// Drops expired buckets; if still over `max`, drops the buckets that
    /// expire soonest (closest to full) down to 90% of `max`.
    fn sweep(&mut self, now_us: u64, max: usize) {
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
fn shard_of(hash: u64) -> usize {
    ((hash >> 32) as usize) % SHARDS
}

/// Sweep when a shard doubles, but never let it pass `max`.
fn sweep_threshold(target: usize, max: usize) -> usize {
    target.max(MIN_SWEEP).min(max.saturating_add(1))
}

fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a shard half-written (every
    // write is a single insert), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Limit, TokenBucket};

    fn check(key: &str, tb: TokenBucket) -> TierCheck {
        TierCheck {
            key: key.to_owned(),
            limit: Limit::TokenBucket(tb),
            cost: 1,
        }
    }

    impl MemoryBackend {
        fn check_all(&self, checks: &[TierCheck]) -> Verdict {
            self.check(checks, Shadow::NONE, true)
        }
    }

    #[test]
    fn all_or_nothing_across_tiers() {
        let clock = ManualClock::new(1_000_000_000_000);
        let m = MemoryBackend::with_manual_clock(clock);
        let wide = TokenBucket::new(10, 60_000_000, 10).unwrap();
        let narrow = TokenBucket::new(1, 60_000_000, 1).unwrap();
        let v = m.check_all(&[check("rl:g:all", wide), check("rl:u:a", narrow)]);
        assert!(v.allowed());
        let v = m.check_all(&[check("rl:g:all", wide), check("rl:u:a", narrow)]);
        assert!(!v.allowed());
        assert_eq!(v.decisions[1].remaining, 0);
        // The global tier was not charged for the denied request: 10 - 1 - 1.
        let v = m.check_all(&[check("rl:g:all", wide)]);
        assert_eq!(v.decisions[0].remaining, 8);
    }

    /// A key listed twice in one check is charged twice (the second charge
    /// sees the first), as it was before the token bucket's state was kept
    /// from the decision.
    #[test]
    fn a_key_listed_twice_is_charged_twice() {
        let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000));
        let tb = TokenBucket::new(10, 10_000_000, 10).unwrap();
        let v = m.check(&[check("k", tb), check("k", tb)], Shadow::NONE, true);
        assert!(v.allowed());
        // Both decided on the full bucket; both charged.
        assert_eq!(v.decisions[0].remaining, 9);
        assert_eq!(v.decisions[1].remaining, 9);
        let next = m.check(&[check("k", tb)], Shadow::NONE, true);
        assert_eq!(next.decisions[0].remaining, 7);
    }

    #[test]
    fn memory_stays_bounded_under_a_key_flood() {
        let clock = ManualClock::new(1_000_000_000_000);
        let m = MemoryBackend::with_manual_clock(clock.clone()).max_keys(64 * 100);
        let tb = TokenBucket::new(1, 3_600_000_000, 1).unwrap();
        for i in 0..100_000u32 {
            let v = m.check_all(&[check(&format!("rl:ip:{i}"), tb)]);
            assert!(v.allowed());
        }
        assert!(m.len() <= 64 * (100 + 1), "len {}", m.len());
        // After an hour every bucket is full again and sweeps drop them all.
        clock.advance(std::time::Duration::from_secs(3601));
        for i in 0..64 * 1100u32 {
            m.check_all(&[check(&format!("rl:ip:new{i}"), tb)]);
        }
        assert!(m.len() <= 64 * 101);
    }
}
