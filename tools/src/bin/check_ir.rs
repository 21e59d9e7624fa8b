//! `check_ir <mode> <keys> <checks>`: stores `keys` live keys
//! `rl:ip:<IPv4>` (one token-bucket tier: 1000/s, a burst of 10^9, on a
//! stopped clock) and makes `checks` checks cycling through them, as
//! `memory_check/<n>` of `benches/hot_path.rs` does. Modes: `ours`,
//! `governor` (its keyed limiter, DashMap), `pingora_rate`; `ours_window`
//! (a sliding window counter on the same keys: the write-locked path),
//! `ours_new_keys` (every check a key not held: a flood); and two threads
//! on keys of their own: `ours_2_threads` (one store), `ours_2_stores` (a
//! store each) and `governor_2_threads` (`checks` checks each); and the
//! store designs apart from the engine, `proto_locked`, `proto_papaya`,
//! `proto_scc`, `proto_flat`, `proto_fingerprint` and their `_2_threads`
//! (see the `proto` module). Run under callgrind twice with different
//! `checks` by `benches/check_ir.sh`: the difference of the totals divided
//! by the difference of the checks is the instructions of one check, setup
//! excluded. Every mode prints (stderr) `loop cpu ns per check: <ns>`, the
//! process's CPU time from the first check to the last divided by the
//! checks (of both threads in a two-thread mode), which
//! `benches/check_time.sh` reports. `ours` prints the process's resident
//! memory once its keys are stored (stderr, KiB).
//!
//! Switches (environment): `PROTO_SERIAL=1` (`ours` and `proto_*`): each
//! check's key depends on the last check's answer, so checks do not
//! overlap in the CPU (a server's one check a request) and the figure is a
//! latency; `PROTO_HUGE=1` (`proto_flat`, `proto_fingerprint`): their array
//! in huge pages; `PROTO_SMAPS=1` (`proto_*`): print the resident and
//! huge-page memory once the keys are stored.

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::num::NonZeroU32;
use std::time::Duration;

use tiered_ratelimit::algorithm::{Limit, TokenBucket};
use tiered_ratelimit::backend::{ManualClock, MemoryBackend, TierCheck, Verdict};

const S: u64 = 1_000_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: check_ir <ours|ours_window|ours_new_keys|ours_2_threads|ours_2_stores|\
                 governor|governor_2_threads|pingora_rate|proto_locked|proto_papaya|proto_scc|\
                 proto_flat|proto_fingerprint|\
                 proto_<locked|papaya|scc|flat|fingerprint>_2_threads> <keys> <checks>";
    let (Some(which), Some(keys), Some(checks)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let (Ok(keys), Ok(checks)) = (keys.parse::<u32>(), checks.parse::<u64>()) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let limit = Limit::TokenBucket(TokenBucket::new(1000, S, 1_000_000_000).expect("a quota"));
    let n = keys.max(1) as usize;
    let mut cycle = {
        let mut i = 0usize;
        move || {
            i += 1;
            if i == n {
                i = 0;
            }
            i
        }
    };
    // `keys` keys `rl:ip:<IPv4>` from the address `first` on.
    let keys_from = |first: u32| -> Vec<TierCheck> {
        (0..keys.max(1))
            .map(|i| TierCheck {
                key: format!("rl:ip:{}", Ipv4Addr::from(first + i)),
                limit,
                cost: 1,
            })
            .collect()
    };
    let keys_of = keys_from(0x0a00_0000);
    match which.as_str() {
        "ours" => {
            let store = MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                .max_keys(4_000_000);
            let mut verdict = Verdict::default();
            for c in &keys_of {
                store.check_into(std::slice::from_ref(c), &mut verdict);
            }
            eprintln!("resident after filling {keys} keys: {} KiB", resident_kib());
            loop_starts();
            if std::env::var_os("PROTO_SERIAL").is_some() {
                // Each key waits for the last check's answer (see `proto`).
                let mut i = 0usize;
                for _ in 0..checks {
                    let last = usize::from(black_box(&verdict).allowed());
                    i += 1 + (last ^ 1);
                    if i >= n {
                        i = 0;
                    }
                    store.check_into(std::slice::from_ref(&keys_of[i]), &mut verdict);
                }
            } else {
                for _ in 0..checks {
                    let c = &keys_of[cycle()];
                    store.check_into(std::slice::from_ref(c), &mut verdict);
                    black_box(&verdict);
                }
            }
        }
        "ours_window" => {
            // The locked path: a sliding window counter (10^9 a second) on
            // the same keys, checked under its shard's write lock.
            let window = Limit::SlidingWindowCounter(tiered_ratelimit::algorithm::Window {
                limit: 1_000_000_000,
                window_us: S,
            });
            let keys_of: Vec<TierCheck> = keys_of
                .into_iter()
                .map(|c| TierCheck { limit: window, ..c })
                .collect();
            let store = MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                .max_keys(4_000_000);
            let mut verdict = Verdict::default();
            for c in &keys_of {
                store.check_into(std::slice::from_ref(c), &mut verdict);
            }
            loop_starts();
            for _ in 0..checks {
                store.check_into(std::slice::from_ref(&keys_of[cycle()]), &mut verdict);
                black_box(&verdict);
            }
        }
        "ours_new_keys" => {
            // A key flood: every check a key the store does not hold (after
            // the `keys` held ones), inserted under the write lock; past
            // `max_keys` (4·10^6) the sweeps evict.
            let store = MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                .max_keys(4_000_000);
            let mut verdict = Verdict::default();
            for c in &keys_of {
                store.check_into(std::slice::from_ref(c), &mut verdict);
            }
            let mut c = keys_of[0].clone();
            loop_starts();
            for i in 0..checks {
                use std::fmt::Write as _;
                c.key.clear();
                let _ = write!(c.key, "rl:ip:{}", Ipv4Addr::from(0x2000_0000 + i as u32));
                store.check_into(std::slice::from_ref(&c), &mut verdict);
                black_box(&verdict);
            }
        }
        "ours_2_threads" | "ours_2_stores" => {
            // Two threads, each cycling through its own `keys` keys
            // (`checks` checks each): the CPU time per check with the other
            // thread running, against `ours` alone. `ours_2_threads` shares one
            // store; `ours_2_stores` gives each thread a store of its own,
            // so that nothing is shared: what the host gives two threads
            // at all, the ceiling for the shared store.
            let new_store = || {
                MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                    .max_keys(4_000_000)
            };
            let shared = new_store();
            let own = [new_store(), new_store()];
            let stores = if which == "ours_2_threads" {
                [&shared, &shared]
            } else {
                [&own[0], &own[1]]
            };
            let other = keys_from(0x0b00_0000);
            let mut verdict = Verdict::default();
            for (store, set) in stores.into_iter().zip([&keys_of, &other]) {
                for c in set {
                    store.check_into(std::slice::from_ref(c), &mut verdict);
                }
            }
            two_threads([&keys_of, &other], checks, |t, c, verdict| {
                stores[t].check_into(std::slice::from_ref(c), verdict);
            });
        }
        "governor_2_threads" => {
            // governor's keyed limiter shared by two threads, as
            // `ours_2_threads`.
            let limiter = governor_limiter();
            let other = keys_from(0x0b00_0000);
            for c in keys_of.iter().chain(&other) {
                let _ = limiter.check_key(&c.key);
            }
            two_threads([&keys_of, &other], checks, |_, c, _| {
                black_box(limiter.check_key(&c.key).is_ok());
            });
        }
        "governor" => {
            let limiter = governor_limiter();
            for c in &keys_of {
                let _ = limiter.check_key(&c.key);
            }
            loop_starts();
            for _ in 0..checks {
                black_box(limiter.check_key(&keys_of[cycle()].key).is_ok());
            }
        }
        "pingora_rate" => {
            let rate = pingora_limits::rate::Rate::new(Duration::from_secs(1));
            for c in &keys_of {
                rate.observe(&c.key, 1);
            }
            loop_starts();
            for _ in 0..checks {
                black_box(rate.observe(&keys_of[cycle()].key, 1));
            }
        }
        m if m.starts_with("proto_") => proto::run(m, &keys_of, &keys_from(0x0b00_0000), checks),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    }
    if let Some(start) = LOOP_START.get() {
        let ns = cpu_ns().saturating_sub(*start);
        // Two-thread modes make `checks` checks in each thread.
        let made = if which.contains("_2_") {
            2 * checks
        } else {
            checks
        };
        eprintln!(
            "loop cpu ns per check: {:.1}",
            ns as f64 / made.max(1) as f64
        );
    }
}

static LOOP_START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// The checks' loop starts: the process's CPU time from here on, divided by
/// the checks, is printed at the end (`loop cpu ns per check`).
fn loop_starts() {
    let _ = LOOP_START.set(cpu_ns());
}

fn cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64
}

type Governor = governor::RateLimiter<
    String,
    governor::state::keyed::DashMapStateStore<String>,
    governor::clock::FakeRelativeClock,
    governor::middleware::NoOpMiddleware<governor::nanos::Nanos>,
>;

/// governor's keyed limiter (its default DashMap store) with the quota of
/// ours: 1000/s, a burst of 10^9, on a stopped clock.
fn governor_limiter() -> Governor {
    let quota = governor::Quota::per_second(NonZeroU32::new(1000).expect("nonzero"))
        .allow_burst(NonZeroU32::new(1_000_000_000).expect("nonzero"));
    governor::RateLimiter::dashmap_with_clock(quota, governor::clock::FakeRelativeClock::default())
}

/// Two threads, started together, thread `t` making `checks` checks
/// cycling through `sets[t]` with `check(t, key, its verdict buffer)`.
fn two_threads<F>(sets: [&Vec<TierCheck>; 2], checks: u64, check: F)
where
    F: Fn(usize, &TierCheck, &mut Verdict) + Sync,
{
    let start = std::sync::Barrier::new(2);
    loop_starts();
    std::thread::scope(|scope| {
        for (t, set) in sets.into_iter().enumerate() {
            let (start, check) = (&start, &check);
            scope.spawn(move || {
                let mut verdict = Verdict::default();
                start.wait();
                let mut i = 0;
                for _ in 0..checks {
                    i += 1;
                    if i == set.len() {
                        i = 0;
                    }
                    check(t, &set[i], &mut verdict);
                    black_box(&verdict);
                }
            });
        }
    });
}

/// This process's resident set, KiB (`/proc/self/statm`, 4 KiB pages; 0
/// where there is none).
fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

/// The ceiling of a store design, measured apart from the engine (issue
/// 30): a token bucket of the same quota as one TAT in an `AtomicU64`,
/// charged by compare-and-swap, in five tables: `proto_locked` (64
/// read-write-locked hashbrown shards, the memory backend's layout without
/// its engine), `proto_papaya` (papaya's lock-free map: a lookup writes no
/// shared word) and `proto_scc` (scc's `HashIndex`, read without locks);
/// and two layouts no crate offers, to measure what a check at 10^6 keys
/// could cost at best: `proto_flat` (one 64-byte line a key: the key inline
/// and the cell, open addressing) and `proto_fingerprint` (16 bytes a key:
/// a hash instead of the key, not exact), each optionally in huge pages.
/// `proto_<table>_2_threads` runs two threads on keys of their own, as
/// `ours_2_threads`.
mod proto {
    use super::{two_threads, S};
    use compact_str::CompactString;
    use std::hint::black_box;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::RwLock;
    use tiered_ratelimit::backend::TierCheck;

    /// 1000/s: one token is 1000 µs; a burst of 10^9 tokens.
    const EMISSION_US: u64 = 1000;
    const TOLERANCE_US: u64 = 1_000_000_000 * EMISSION_US;
    const NOW_US: u64 = 1_700_000_000 * S;

    /// GCRA on one cell: charge one token if the bucket allows it.
    #[inline]
    fn charge(cell: &AtomicU64) -> bool {
        let mut seen = cell.load(Ordering::Acquire);
        loop {
            let tat = seen.max(NOW_US) + EMISSION_US;
            if tat - NOW_US > TOLERANCE_US {
                return false;
            }
            match cell.compare_exchange_weak(seen, tat, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => seen = now,
            }
        }
    }

    trait Table: Sync {
        fn insert(&self, key: &str);
        fn check(&self, key: &str) -> bool;
    }

    #[repr(align(128))]
    struct Padded<T>(T);

    struct Slot {
        key: CompactString,
        tat: AtomicU64,
    }

    struct Locked {
        shards: Vec<Padded<RwLock<hashbrown::HashTable<Slot>>>>,
        hasher: foldhash::quality::RandomState,
    }

    impl Table for Locked {
        fn insert(&self, key: &str) {
            use std::hash::BuildHasher;
            let h = self.hasher.hash_one(key);
            let mut shard = self.shards[((h >> 32) % 64) as usize]
                .0
                .write()
                .expect("lock");
            shard.insert_unique(
                h,
                Slot {
                    key: key.into(),
                    tat: AtomicU64::new(0),
                },
                |s| self.hasher.hash_one(&s.key),
            );
        }
        #[inline]
        fn check(&self, key: &str) -> bool {
            use std::hash::BuildHasher;
            let h = self.hasher.hash_one(key);
            let shard = self.shards[((h >> 32) % 64) as usize]
                .0
                .read()
                .expect("lock");
            shard
                .find(h, |s| s.key == key)
                .is_some_and(|s| charge(&s.tat))
        }
    }

    struct Papaya(papaya::HashMap<CompactString, AtomicU64, foldhash::quality::RandomState>);

    impl Table for Papaya {
        fn insert(&self, key: &str) {
            self.0.pin().insert(key.into(), AtomicU64::new(0));
        }
        #[inline]
        fn check(&self, key: &str) -> bool {
            self.0.pin().get(key).is_some_and(charge)
        }
    }

    struct Scc(scc::HashIndex<CompactString, AtomicU64, foldhash::quality::RandomState>);

    impl Table for Scc {
        fn insert(&self, key: &str) {
            let _ = self.0.insert_sync(key.into(), AtomicU64::new(0));
        }
        #[inline]
        fn check(&self, key: &str) -> bool {
            self.0.peek_with(key, |_, tat| charge(tat)).unwrap_or(false)
        }
    }

    /// The two layouts no crate offers: one array of slots (a key's hash, its
    /// cell and, in `proto_flat`, the key itself), open addressing with
    /// linear probing, at most half full, in huge pages when
    /// `PROTO_HUGE=1` ([`huge_array`]), so that a check at 10^6 keys takes
    /// no page walk either.
    struct Open<S> {
        slots: *mut S,
        mask: usize,
        hasher: foldhash::quality::RandomState,
    }

    // SAFETY: a slot is atomics, and bytes written before any check reads
    // them.
    unsafe impl<S> Sync for Open<S> {}

    /// A slot of an [`Open`] table.
    trait OpenSlot {
        /// The key's hash (0: empty).
        fn hash(&self) -> &AtomicU64;
        fn tat(&self) -> &AtomicU64;
        /// Whether this slot, of `key`'s hash, is `key`'s.
        fn holds(&self, key: &str) -> bool;
        /// Writes `key` into an empty slot (before its hash).
        fn write_key(&mut self, key: &str);
    }

    /// `proto_flat`: 64 bytes, one cache line a key (the key inline).
    #[repr(C, align(64))]
    struct Line {
        hash: AtomicU64,
        tat: AtomicU64,
        len: u8,
        key: [u8; 47],
    }

    impl OpenSlot for Line {
        fn hash(&self) -> &AtomicU64 {
            &self.hash
        }
        fn tat(&self) -> &AtomicU64 {
            &self.tat
        }
        #[inline]
        fn holds(&self, key: &str) -> bool {
            usize::from(self.len) == key.len() && &self.key[..key.len()] == key.as_bytes()
        }
        fn write_key(&mut self, key: &str) {
            assert!(key.len() <= 47, "proto_flat holds keys of up to 47 bytes");
            self.len = key.len() as u8;
            self.key[..key.len()].copy_from_slice(key.as_bytes());
        }
    }

    /// `proto_fingerprint`: 16 bytes, a 64-bit keyed hash of the key (no
    /// key text: two keys of one hash would share a bucket) and the cell:
    /// the smallest slot of any store that tells 10^6 keys apart, sized to
    /// fit a 32 MiB L3.
    struct Fingerprint {
        hash: AtomicU64,
        tat: AtomicU64,
    }

    impl OpenSlot for Fingerprint {
        fn hash(&self) -> &AtomicU64 {
            &self.hash
        }
        fn tat(&self) -> &AtomicU64 {
            &self.tat
        }
        fn holds(&self, _: &str) -> bool {
            true
        }
        fn write_key(&mut self, _: &str) {}
    }

    impl<S: OpenSlot> Open<S> {
        fn new(keys: usize) -> Self {
            let slots = (keys * 2).next_power_of_two().max(64);
            Open {
                slots: huge_array(slots * std::mem::size_of::<S>()).cast(),
                mask: slots - 1,
                hasher: Default::default(),
            }
        }

        /// `key`'s hash (never 0), and its slot's index: the slot holding
        /// it, or the first empty one on its probe (`false`).
        #[inline]
        fn find(&self, key: &str) -> (u64, usize, bool) {
            use std::hash::BuildHasher;
            let h = self.hasher.hash_one(key) | 1;
            let mut i = h as usize & self.mask;
            loop {
                // SAFETY: i <= mask, inside the mapping.
                let s = unsafe { &*self.slots.add(i) };
                match s.hash().load(Ordering::Acquire) {
                    0 => return (h, i, false),
                    sh if sh == h && s.holds(key) => return (h, i, true),
                    _ => i = (i + 1) & self.mask,
                }
            }
        }
    }

    impl<S: OpenSlot> Table for Open<S> {
        fn insert(&self, key: &str) {
            let (h, i, found) = self.find(key);
            if !found {
                // SAFETY: an empty slot inside the mapping, written before
                // any check reads it (inserts run before the checks).
                let s = unsafe { &mut *self.slots.add(i) };
                s.write_key(key);
                s.hash().store(h, Ordering::Release);
            }
        }
        #[inline]
        fn check(&self, key: &str) -> bool {
            match self.find(key) {
                // SAFETY: as in `find`.
                (_, i, true) => charge(unsafe { &*self.slots.add(i) }.tat()),
                _ => false,
            }
        }
    }

    /// `bytes` of zeroed memory aligned to 2 MiB, in huge pages when
    /// `PROTO_HUGE=1` (`madvise(MADV_HUGEPAGE)` before the first touch).
    fn huge_array(bytes: usize) -> *mut u8 {
        const HUGE: usize = 2 << 20;
        let len = bytes + HUGE;
        // SAFETY: an anonymous private mapping (zeroed), never unmapped.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(base != libc::MAP_FAILED, "mmap");
        let aligned = (base as usize).next_multiple_of(HUGE);
        if std::env::var_os("PROTO_HUGE").is_some() {
            // SAFETY: a range inside the mapping above.
            let r = unsafe { libc::madvise(aligned as *mut _, bytes, libc::MADV_HUGEPAGE) };
            assert_eq!(r, 0, "madvise");
        }
        aligned as *mut u8
    }

    pub(super) fn run(mode: &str, keys: &[TierCheck], other: &[TierCheck], checks: u64) {
        let threads = mode.ends_with("_2_threads");
        // The keys the table will hold (the arrays are sized for them).
        let held = keys.len() + if threads { other.len() } else { 0 };
        let table: Box<dyn Table> = match mode.trim_end_matches("_2_threads") {
            "proto_locked" => Box::new(Locked {
                shards: (0..64).map(|_| Padded(RwLock::default())).collect(),
                hasher: Default::default(),
            }),
            "proto_papaya" => Box::new(Papaya(papaya::HashMap::with_hasher(Default::default()))),
            "proto_flat" => Box::new(Open::<Line>::new(held)),
            "proto_fingerprint" => Box::new(Open::<Fingerprint>::new(held)),
            "proto_scc" => Box::new(Scc(scc::HashIndex::with_hasher(Default::default()))),
            _ => {
                eprintln!("unknown mode {mode}");
                std::process::exit(2);
            }
        };
        run_on(&*table, threads, keys, other, checks);
    }

    fn run_on(
        table: &dyn Table,
        threads: bool,
        keys: &[TierCheck],
        other: &[TierCheck],
        checks: u64,
    ) {
        for c in keys.iter().chain(if threads { other } else { &[] }) {
            table.insert(&c.key);
        }
        super::loop_starts();
        if std::env::var_os("PROTO_SMAPS").is_some() {
            let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
            for line in smaps
                .lines()
                .filter(|l| l.starts_with("AnonHugePages") || l.starts_with("Rss"))
            {
                eprintln!("{line}");
            }
        }
        if threads {
            let (a, b) = (keys.to_vec(), other.to_vec());
            two_threads([&a, &b], checks, |_, c, _| {
                black_box(table.check(&c.key));
            });
        } else {
            let n = keys.len();
            let mut i = 0;
            let mut allowed = 0u64;
            // `PROTO_SERIAL=1`: the next key waits for this check's answer
            // (a latency, as in a server's one check a request, not a
            // throughput of overlapped checks).
            let serial = usize::from(std::env::var_os("PROTO_SERIAL").is_some());
            let mut last = 1usize;
            for _ in 0..checks {
                i += 1 + (serial & (last ^ 1));
                if i >= n {
                    i = 0;
                }
                last = usize::from(black_box(table.check(&keys[i].key)));
                allowed += last as u64;
            }
            // Every check finds its key and is allowed (burst 10^9).
            assert_eq!(allowed, checks, "checks allowed");
        }
    }
}
