//! [`MemoryBackend`]: buckets in this process's memory, spread over 64
//! shards, each a lock-free table and a mutex for its writers; token and
//! leaky buckets charged by compare-and-swap without a lock.

mod cell;
mod check;
mod fast;
mod overrides;
mod pack;
pub(crate) use self::check::PackGroup;
pub(crate) use self::pack::tag as candidate_tag;
pub(crate) use self::pack::Denials;
#[cfg(test)]
mod pack_tests;
mod peek;
mod shard;
mod slot;
#[cfg(test)]
mod tests;

use self::shard::{sweep_threshold, Shard, Writes, MIN_SWEEP};
use super::clock::{Clock, ManualClock};
use std::fmt;
// foldhash's quality variant: randomly seeded per process (so request-chosen
// keys cannot be aimed at one bucket of the table), and several times faster
// than SipHash on short keys.
use foldhash::quality::RandomState;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

/// At most 64: a check locks its shards by the bits of a `u64`.
const SHARDS: usize = 64;

/// A shard on cache lines of its own (128 bytes: the pair of lines that
/// x86's adjacent-line prefetcher fetches together): a writer takes its
/// shard's mutex by writing the lock word, and without the padding that
/// write would take the line (and the table's pointer, which every lookup
/// reads) from threads checking keys of the neighbouring shards.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Buckets in this process's memory: no network, no shared state between app
/// servers (each server enforces the full quota on its own).
///
/// * **Exact and atomic**: a request is charged on every tier or on none.
///   The token and leaky buckets of keys already held keep their state (the
///   theoretical arrival time) in one atomic integer: a check looks each
///   key up in its shard's lock-free table (papaya's map: no lock, no
///   shared word written), decides every tier on their values, and once
///   every enforced tier allows, charges each by compare-and-swap (so
///   requests on one shard, or one key, do not wait for each other, and
///   checks on two cores do not pass a lock's cache line between them).
///   When a swap finds the value moved the tier is decided again; if an
///   enforced tier then denies, the charges already made are given back
///   and the check runs locked. A concurrent request may briefly see such
///   a charge before it is given back (and be denied for it). New keys,
///   the window algorithms and a key listed twice are checked with the
///   shards' writer mutexes held together (in index order, so concurrent
///   requests cannot deadlock); such a writer freezes the cells it decides
///   on, and a lock-free check meeting a frozen cell waits on the mutex.
/// * **Clock**: tokio's monotonic clock, anchored to the wall clock once at
///   construction for the `X-RateLimit-Reset` epoch seconds. Tests can pause it
///   (`#[tokio::test(start_paused = true)]`) or use a [`ManualClock`].
/// * **Bounded memory**: a bucket is forgotten once it would be full again
///   (its time-to-live, exactly as on Redis); expired entries are swept
///   whenever a shard doubles in size, and at most
///   [`max_keys`](MemoryBackend::max_keys) buckets are kept (default
///   1 000 000): past that, the buckets closest to full are evicted first,
///   which hands those keys a full bucket a little early. A bucket takes
///   one allocation of its key (inline up to 24 bytes) and state, and a
///   slot of a table that grows by doubling: about 98 MB of resident
///   memory for 10^6 keys, measured (perf/README.md). A tier key's
///   candidate quotas live in its entry, beside its bucket (no key of
///   their own: the key counts once), which is swept or evicted by the
///   later of its bucket's and its candidates' expiries.
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
    shards: Box<[Padded<Shard>]>,
    /// The tables' epoch collector (entries a writer removed are freed once
    /// no check that may still read them is running), one for all shards
    /// so a check of several enters once.
    collector: Arc<seize::Collector>,
    hasher: RandomState,
    clock: Clock,
    max_per_shard: usize,
    /// Per-key overrides ([`handle`](crate::handle#per-key-overrides)), kept apart from the rate
    /// state: set by an operator, few, never swept.
    overrides: std::sync::Mutex<overrides::Store>,
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
        let collector = Arc::new(seize::Collector::new());
        let shards = (0..SHARDS)
            .map(|_| {
                Padded(Shard {
                    table: papaya::HashMap::builder()
                        .hasher(Default::default())
                        .shared_collector(Arc::clone(&collector))
                        // Every insert runs under the shard's mutex: the
                        // writer that grows the table copies it whole, and
                        // lookups never search two tables.
                        .resize_mode(papaya::ResizeMode::Blocking)
                        .build(),
                    writes: Mutex::new(Writes {
                        sweep_at: sweep_threshold(MIN_SWEEP, max_per_shard),
                        max: max_per_shard,
                    }),
                })
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                collector,
                hasher: RandomState::default(),
                clock,
                max_per_shard,
                overrides: std::sync::Mutex::default(),
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
        self.inner.shards.iter().map(|s| s.table.len()).sum()
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
}
