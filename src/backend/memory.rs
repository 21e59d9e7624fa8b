use super::clock::{Clock, ManualClock};
use super::{Charge, Shadow, TierCheck, TierRefund, Verdict};
use crate::algorithm::{Decision, Refund, State};
use compact_str::CompactString;
use hashbrown::HashTable;
use std::fmt;
// foldhash's quality variant: randomly seeded per process (so request-chosen
// keys cannot be aimed at one bucket of the table), and several times faster
// than SipHash on short keys.
use foldhash::quality::RandomState;
use smallvec::SmallVec;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

/// At most 64: a check locks its shards by the bits of a `u64`.
const SHARDS: usize = 64;
/// Stands in for a state while it is being replaced (never observed).
const PLACEHOLDER: State = State::Bucket(crate::algorithm::BucketState {
    tat_us: 0,
    frac: 0,
    unit: 0,
    rate: 0,
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
    /// Inline up to 24 bytes (most IP and user keys): a lookup compares it
    /// without following a pointer, and a new key allocates nothing more.
    key: CompactString,
    entry: Entry,
}

struct Entry {
    state: State,
    /// Epoch microseconds after which the bucket is full and the entry is
    /// meaningless.
    expires_us: u64,
}

impl Entry {
    /// Charges the live entry (`ready`: the state the check already computed)
    /// and returns the stored state.
    fn commit(&mut self, ready: Option<(State, u64)>, c: &TierCheck, now_us: u64) -> &State {
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
        self.check_reusing(checks, shadow, with_charges, Vec::new())
    }

    /// [`MemoryBackend::check`] with the decisions written into `decisions`
    /// (cleared first): a caller checking in a loop hands back the previous
    /// verdict's, and allocates nothing.
    pub(crate) fn check_reusing(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
        mut decisions: Vec<Decision>,
    ) -> Verdict {
        let now_us = self.inner.clock.now_us();
        let n = checks.len();
        // Scratch space per check: on the stack for up to 8 tiers (indexing a
        // SmallVec checks where its data lives on every access).
        let (mut hashes_a, mut hashes_v) = ([0u64; 8], Vec::new());
        let hashes = scratch(&mut hashes_a, &mut hashes_v, n);
        let mut shards = 0u64;
        for (h, c) in hashes.iter_mut().zip(checks) {
            *h = self.hash(&c.key);
            shards |= 1 << shard_of(*h);
        }
        // Lock in ascending shard order (the set bits, low to high): no two
        // requests can wait on each other.
        let mut locked: SmallVec<[MutexGuard<'_, Shard>; 8]> = SmallVec::new();
        let mut rest = shards;
        while rest != 0 {
            locked.push(lock(&self.inner.shards[rest.trailing_zeros() as usize]));
            rest &= rest - 1;
        }
        let guards = locked.as_mut_slice();
        // A shard's guard: the number of locked shards below it.
        let guard_of = |h: u64| (shards & ((1u64 << shard_of(h)) - 1)).count_ones() as usize;

        decisions.clear();
        decisions.reserve(n);
        // Per check, what the commit needs: where the key was found (so it
        // is not looked up again), and the token bucket's charged state,
        // which its check computes anyway. `None` for a new key, and for a
        // key listed earlier in the same check (a caller of Backend::check
        // may pass one; the layer's tiers never share a key): its second
        // charge must see the first, so it is computed at commit.
        let (mut found_a, mut found_v) = ([None; 8], Vec::new());
        let found = scratch(&mut found_a, &mut found_v, n);
        let (mut prepared_a, mut prepared_v) = ([const { None }; 8], Vec::new());
        let prepared: &mut [Option<(State, u64)>] = scratch(&mut prepared_a, &mut prepared_v, n);
        for (i, (c, &h)) in checks.iter().zip(hashes.iter()).enumerate() {
            let map = &guards[guard_of(h)].map;
            let bucket = map.find_bucket_index(h, |s| s.key == c.key);
            let state = bucket
                .and_then(|b| map.get_bucket(b))
                .filter(|s| s.entry.expires_us > now_us)
                .map(|s| &s.entry.state);
            let (d, charged) = c.limit.check_prepared(state, now_us, c.cost);
            decisions.push(d);
            let repeated = hashes[..i]
                .iter()
                .zip(checks)
                .any(|(&other, o)| other == h && o.key == c.key);
            if !repeated {
                found[i] = bucket;
                prepared[i] = charged;
            }
        }
        let mut charges = Vec::new();
        if shadow.commits(&decisions) {
            if with_charges {
                charges.resize(n, None);
            }
            let mut charge = |i: usize, c: &TierCheck, state: &State| {
                if with_charges {
                    charges[i] = Some(Charge {
                        at_us: now_us,
                        undo: c.limit.undo_of(state, now_us),
                        next_after_us: 0,
                    });
                }
            };
            // A shadow tier that would deny charges nothing. The keys found
            // first, by their bucket: inserting a key may move every bucket
            // of its table.
            for (i, c) in checks.iter().enumerate() {
                let Some(b) = found[i].filter(|_| decisions[i].allowed) else {
                    continue;
                };
                let g = &mut guards[guard_of(hashes[i])];
                if let Some(slot) = g.map.get_bucket_mut(b) {
                    charge(i, c, slot.entry.commit(prepared[i].take(), c, now_us));
                }
            }
            // Then, in order, the new keys and the keys listed twice.
            for (i, c) in checks.iter().enumerate() {
                if found[i].is_some() || !decisions[i].allowed {
                    continue;
                }
                let h = hashes[i];
                let g = &mut guards[guard_of(h)];
                if let Some(s) = g.map.find_mut(h, |s| s.key == c.key) {
                    charge(i, c, s.entry.commit(prepared[i].take(), c, now_us));
                    continue;
                }
                let (state, ttl_us) = prepared[i]
                    .take()
                    .unwrap_or_else(|| c.limit.charge(None, now_us, c.cost));
                charge(i, c, &state);
                let entry = Entry {
                    state,
                    expires_us: now_us.saturating_add(ttl_us),
                };
                let hasher = &self.inner.hasher;
                g.map.insert_unique(
                    h,
                    Slot {
                        key: CompactString::from(c.key.as_str()),
                        entry,
                    },
                    |s| hasher.hash_one(s.key.as_str()),
                );
                if g.map.len() >= g.sweep_at {
                    g.sweep(now_us, self.inner.max_per_shard);
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

/// `n` elements of `array` (each as it was), or of `vec` filled with
/// defaults when `n` is over its length.
fn scratch<'a, T: Default>(array: &'a mut [T; 8], vec: &'a mut Vec<T>, n: usize) -> &'a mut [T] {
    if n <= array.len() {
        &mut array[..n]
    } else {
        vec.resize_with(n, T::default);
        vec
    }
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

    /// More tiers than the check's stack scratch holds (8), with new keys,
    /// known keys, a key listed twice and keys longer than the 24 bytes
    /// kept inline: every one charged exactly once per listing.
    #[test]
    fn a_check_of_many_tiers_charges_each_once() {
        let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000));
        let tb = TokenBucket::new(5, 10_000_000, 5).unwrap();
        let long = "rl:api_key:0123456789abcdef0123456789abcdef";
        let mut keys: Vec<String> = (0..10).map(|i| format!("rl:t{i}:k")).collect();
        keys.push(long.to_owned());
        let checks: Vec<TierCheck> = keys.iter().map(|k| check(k, tb)).collect();
        assert!(m.check_all(&checks[..3]).allowed());
        let mut twice = checks.clone();
        twice.push(check("rl:t0:k", tb));
        let v = m.check_all(&twice);
        assert!(v.allowed());
        assert_eq!(v.charges.len(), 12);
        assert!(v.charges.iter().all(Option::is_some));
        let after: Vec<u64> = m
            .check_all(&checks)
            .decisions
            .iter()
            .map(|d| d.remaining)
            .collect();
        // t0: 1 + 2 (listed twice), t1, t2: 1 + 1, the rest 1, now 1 more.
        assert_eq!(after, [1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]);
        assert_eq!(m.len(), 11);
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
