//! Per-key demand, for limits suggested from real traffic
//! ([`RateLimitHandle::suggest`](crate::RateLimitHandle::suggest), the admin
//! API's `GET /api/suggest/{tier}`, the CLI's `tiered-ratelimit suggest`).
//!
//! **Off by default**: turned on by
//! [`RateLimitLayerBuilder::demand`](crate::RateLimitLayerBuilder::demand)
//! or [`RateLimitHandle::set_demand`](crate::RateLimitHandle::set_demand);
//! off, a check pays one relaxed load.
//!
//! **What is counted.** Every check the engine plans for a request
//! (`engine/plan.rs`), allowed or denied (a 429 is demand too: enforcement
//! must not hide it), in the tier's cost units, per tier and plan, per key,
//! per *period*: the tier's (or plan's) quota period in whole seconds (at
//! least 1 s), aligned to the Unix epoch. Denylisted and allowlisted
//! requests are not checked, so not counted.
//!
//! **The request path** (no allocation, no lock): the key part's xxh3 hash,
//! one of four pre-sized tables per tier and plan (by period, modulo 4;
//! allocated on the slot's first request), a linear probe and an atomic add.
//! A table holds at most 3 072 keys a period on one instance; a key
//! beyond that, or a request whose period's table still holds a period
//! four back not yet flushed, is not counted (its cost is added to
//! `unsampled_requests`). A key whose count in the period crosses a power
//! of two from 32 up has its name kept (16 per table, in buffers allocated
//! with it), so heavy keys can be named; other keys are named `#<hash>`.
//!
//! **Fleet-wide.** Once a second a task takes what every table counted
//! since the last take (and empties the tables of finished periods) and
//! adds it to the period's per-key totals, fleet-wide on Redis
//! (`lua/demand.lua`: one script call a flush, for every tier, plan and
//! period it took; every key in the hash slot `{demand}`), so a key's
//! requests on several instances are summed before its peak is taken:
//!
//! | key | what | kept |
//! |---|---|---|
//! | `<prefix>:{demand}:<tier>:<plan or ->:p:<period_s>:<period>` | hash: key hash → the period's total | two periods and a minute |
//! | `…:<tier>:<plan>:<hour>:h` | hash: key hash → its highest total in the hour | 7 days and an hour |
//! | `…:<hour>:z` | sorted set: the hour's sample, by hash | the same |
//! | `…:<hour>:m` | hash: `requests`, `unsampled`, `full` | the same |
//! | `…:<hour>:n` | hash: key hash → key part, at most 256 | the same |
//!
//! An hour keeps the peaks of at most 1 024 keys: a bottom-k
//! sample by hash (the keys of smallest hash, whatever the instance or the
//! order they came in; exact below k keys); a key outside it gets no total.
//! Without Redis (the memory backend) the same store, by the same rules, is
//! kept in process. A period longer than an hour counts into the hour of
//! its flush (its running total).
//!
//! **The answer** reads the window's hours, takes each key's highest peak
//! (the bottom-k of the hours' samples when one was full), and buckets the
//! peaks log-spaced: integer edges one apart to 50, then at most 2 % apart;
//! see [`Suggestion`].
//!
//! **Bounds.** In process: four tables of 4 096 slots × 24 bytes (384 KiB)
//! per tier and plan that has seen a request, the 16 names' buffers, and
//! on the memory backend the store (at most 1 024 keys × 169
//! hours per tier and plan). On Redis: at most 1 024 fields in
//! each hour's hash and sorted set (about 200 bytes a key: about 200 KiB
//! an hour, 35 MB for 7 days per tier and plan at worst), and the period
//! hashes of the sampled keys.
//!
//! Nothing here changes a limit: a suggestion is only read.

pub(crate) mod answer;
pub(crate) mod buckets;
pub(crate) mod store;

pub use answer::{CurvePoint, LeftOut, SuggestError, Suggested, Suggestion};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

/// Slots of one table (a power of two).
pub(crate) const SLOTS: usize = 4096;
/// Keys one table holds in a period on one instance (¾ of its slots).
pub(crate) const MAX_KEYS: u64 = 3072;
/// Keys whose peaks one hour keeps per tier and plan: a bottom-k sample by
/// hash (the keys with the smallest hashes), the same keys on every
/// instance; exact below it.
pub(crate) const MAX_HOUR_KEYS: u64 = 1024;
/// Names one hour keeps per tier and plan.
pub(crate) const MAX_NAMES: u64 = 256;
/// Tables per slot: periods `p % TABLES`.
const TABLES: usize = 4;
/// Names a table keeps between flushes.
const TABLE_NAMES: usize = 16;
/// Longest name kept (bytes); longer keys are named by their hash.
const NAME_BYTES: usize = 128;
/// Probes before a key gives up a full neighbourhood.
const PROBES: usize = 32;
/// A table emptied and free for any period.
const CLEAN: u64 = u64::MAX;

/// The key part's hash as counted (never 0: 0 marks a free slot).
#[must_use]
pub(crate) fn hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes()) | 1
}

/// A key hash's rank in an hour's sample: its top 52 bits (exact in a
/// Redis sorted set's double), ties broken by the whole hash.
#[must_use]
pub(crate) fn score(h: u64) -> u64 {
    h >> 12
}

/// One period's counts on this instance, taken once a second.
#[doc(hidden)]
pub struct Table {
    /// The period counted (`CLEAN`: none yet).
    period: AtomicU64,
    used: AtomicU64,
    hashes: Box<[AtomicU64]>,
    /// The key's requests in the period so far.
    counts: Box<[AtomicU64]>,
    /// What of `counts` the flush took (only the flush writes it).
    flushed: Box<[AtomicU64]>,
    names: Mutex<Vec<(u64, String)>>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("period", &self.period.load(Relaxed))
            .field("used", &self.used.load(Relaxed))
            .finish_non_exhaustive()
    }
}

impl Default for Table {
    fn default() -> Self {
        Self {
            period: AtomicU64::new(CLEAN),
            used: AtomicU64::new(0),
            hashes: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            counts: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            flushed: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            names: Mutex::new(
                (0..TABLE_NAMES)
                    .map(|_| (0, String::with_capacity(NAME_BYTES)))
                    .collect(),
            ),
        }
    }
}

impl Table {
    /// Adds `cost` for key part `key` in `period` (answers whether it was
    /// counted): no allocation, no lock (but the names' mutex when the
    /// key's count crosses a power of two from 32 up). Public only for the
    /// allocation test (`tests/memory_allocations.rs`).
    #[doc(hidden)]
    pub fn add(&self, period: u64, key: &str, cost: u64) -> bool {
        let h = hash(key);
        let stamp = self.period.load(Relaxed);
        if stamp != period
            && (stamp != CLEAN
                || self
                    .period
                    .compare_exchange(CLEAN, period, Relaxed, Relaxed)
                    .is_err_and(|now| now != period))
        {
            return false;
        }
        #[allow(clippy::cast_possible_truncation)] // masked
        let mut i = (h as usize) & (SLOTS - 1);
        for _ in 0..PROBES {
            let at = self.hashes[i].load(Relaxed);
            let mine = if at == h {
                true
            } else if at == 0 {
                if self.used.fetch_add(1, Relaxed) >= MAX_KEYS {
                    self.used.fetch_sub(1, Relaxed);
                    return false;
                }
                match self.hashes[i].compare_exchange(0, h, Relaxed, Relaxed) {
                    Ok(_) => true,
                    Err(other) => {
                        self.used.fetch_sub(1, Relaxed);
                        other == h
                    }
                }
            } else {
                false
            };
            if mine {
                let old = self.counts[i].fetch_add(cost, Relaxed);
                let new = old.saturating_add(cost);
                if new >= 32 && old.leading_zeros() != new.leading_zeros() {
                    self.name(h, key);
                }
                return true;
            }
            i = (i + 1) & (SLOTS - 1);
        }
        false
    }

    #[cold]
    fn name(&self, h: u64, key: &str) {
        if key.len() > NAME_BYTES {
            return;
        }
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if names.iter().any(|(x, _)| *x == h) {
            return;
        }
        // A free entry, else the one after the last written (by hash bits).
        #[allow(clippy::cast_possible_truncation)]
        let i = names
            .iter()
            .position(|(x, _)| *x == 0)
            .unwrap_or((h >> 7) as usize % TABLE_NAMES);
        let e = &mut names[i];
        e.0 = h;
        e.1.clear();
        e.1.push_str(key);
    }

    /// Takes the counts so far: `(period, [(hash, count)], names)`; a
    /// table of a period before `current` is emptied and freed.
    fn take(&self, current: u64) -> Option<store::Taken> {
        let period = self.period.load(Relaxed);
        if period == CLEAN {
            return None;
        }
        let finished = period < current;
        let mut counts = Vec::new();
        for ((h, c), f) in self
            .hashes
            .iter()
            .zip(self.counts.iter())
            .zip(self.flushed.iter())
        {
            let hv = h.load(Relaxed);
            if hv == 0 {
                continue;
            }
            let now = c.load(Relaxed);
            let before = f.load(Relaxed);
            if now > before {
                counts.push((hv, now - before));
            }
            if finished {
                c.store(0, Relaxed);
                f.store(0, Relaxed);
                h.store(0, Relaxed);
            } else {
                f.store(now, Relaxed);
            }
        }
        let names = {
            let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            let out = names
                .iter()
                .filter(|(h, _)| *h != 0)
                .map(|(h, n)| (*h, n.clone()))
                .collect();
            if finished {
                for e in names.iter_mut() {
                    e.0 = 0;
                }
            }
            out
        };
        if finished {
            self.used.store(0, Relaxed);
            self.period.store(CLEAN, Relaxed);
        }
        Some(store::Taken {
            period,
            counts,
            names,
        })
    }
}

/// One tier's (or plan's) demand on this instance.
pub(crate) struct Slot {
    pub(crate) tier: Arc<str>,
    /// `None`: the tier's default quota.
    pub(crate) plan: Option<Arc<str>>,
    /// The period of the last request, in seconds.
    period_s: AtomicU64,
    tables: OnceLock<Box<[Table; TABLES]>>,
    unsampled: AtomicU64,
}

/// Every tier's and plan's demand on this instance, and its flush.
pub(crate) struct Demand {
    slots: Box<[Slot]>,
    /// Tier `i`'s default slot; its plan `j` is `offsets[i] + 1 + j`.
    offsets: Box<[usize]>,
    pub(crate) store: store::Store,
    /// The engine's clock (a test's manual clock).
    clock: crate::backend::clock::Clock,
    started: AtomicBool,
    /// Whether checks are recorded (`RateLimitLayerBuilder::demand`,
    /// `RateLimitHandle::set_demand`).
    pub(crate) enabled: AtomicBool,
    /// The flush task holds a `Weak` of this.
    me: std::sync::Weak<Demand>,
    /// Throttles the flush's failure log (once a minute).
    pub(crate) log: crate::util::throttle::LogThrottle,
}

impl Demand {
    /// Slots for `tiers`: `(name, plan names)`.
    pub(crate) fn new(
        tiers: &[(Arc<str>, Vec<Arc<str>>)],
        store: store::Store,
        clock: crate::backend::clock::Clock,
        enabled: bool,
    ) -> Arc<Self> {
        let mut slots = Vec::new();
        let mut offsets = Vec::with_capacity(tiers.len());
        for (tier, plans) in tiers {
            offsets.push(slots.len());
            for plan in std::iter::once(None).chain(plans.iter().cloned().map(Some)) {
                slots.push(Slot {
                    tier: tier.clone(),
                    plan,
                    period_s: AtomicU64::new(0),
                    tables: OnceLock::new(),
                    unsampled: AtomicU64::new(0),
                });
            }
        }
        Arc::new_cyclic(|me| Self {
            slots: slots.into_boxed_slice(),
            offsets: offsets.into_boxed_slice(),
            store,
            clock,
            started: AtomicBool::new(false),
            enabled: AtomicBool::new(enabled),
            me: me.clone(),
            log: crate::util::throttle::LogThrottle::new(std::time::Duration::from_secs(60)),
        })
    }

    /// Takes every table now and adds it to the store (the flush task's
    /// step; a suggestion runs one first, so it reads this instance's
    /// latest counts).
    ///
    /// # Errors
    /// The store (Redis) failed: what was taken is lost.
    pub(crate) async fn flush(&self) -> Result<(), String> {
        let now = self.clock.now_us();
        let taken = self.take(now);
        if taken.is_empty() {
            return Ok(());
        }
        self.store.apply(taken, now).await
    }

    /// The engine's clock now (epoch µs).
    pub(crate) fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// One planned check of tier `i` (plan `plan`, the position in the
    /// tier's plans) of key part `key` costing `cost`, under a quota of
    /// `period`, at `now_us` (epoch µs).
    #[inline]
    pub(crate) fn record(
        &self,
        i: usize,
        plan: Option<usize>,
        period: std::time::Duration,
        key: &str,
        cost: u64,
        now_us: u64,
    ) {
        if !self.started.load(Relaxed) {
            self.start();
        }
        let Some(&base) = self.offsets.get(i) else {
            return;
        };
        let Some(slot) = self.slots.get(base + plan.map_or(0, |p| p + 1)) else {
            return;
        };
        let period_s = period.as_secs().max(1);
        if slot.period_s.load(Relaxed) != period_s {
            slot.period_s.store(period_s, Relaxed);
        }
        let p = now_us / period_s.saturating_mul(1_000_000);
        let tables = slot.tables.get_or_init(Box::default);
        #[allow(clippy::cast_possible_truncation)] // modulo 4
        let t = &tables[(p % TABLES as u64) as usize];
        if !t.add(p, key, cost) {
            slot.unsampled.fetch_add(cost, Relaxed);
        }
    }

    /// The slot of `tier` (and `plan`).
    pub(crate) fn slot(&self, tier: &str, plan: Option<&str>) -> Option<&Slot> {
        self.slots
            .iter()
            .find(|s| &*s.tier == tier && s.plan.as_deref() == plan)
    }

    /// The period of `slot` (seconds; its last request's quota), or `fallback`.
    pub(crate) fn period_s(slot: &Slot, fallback: u64) -> u64 {
        match slot.period_s.load(Relaxed) {
            0 => fallback.max(1),
            p => p,
        }
    }

    /// Everything counted since the last take, per slot, at `now_us`.
    pub(crate) fn take(&self, now_us: u64) -> Vec<store::SlotTaken> {
        let mut out = Vec::new();
        for s in self.slots.iter() {
            let Some(tables) = s.tables.get() else {
                continue;
            };
            let period_s = s.period_s.load(Relaxed).max(1);
            let current = now_us / period_s.saturating_mul(1_000_000);
            let taken: Vec<store::Taken> = tables.iter().filter_map(|t| t.take(current)).collect();
            let unsampled = s.unsampled.swap(0, Relaxed);
            if !taken.is_empty() || unsampled > 0 {
                out.push(store::SlotTaken {
                    tier: s.tier.clone(),
                    plan: s.plan.clone(),
                    period_s,
                    taken,
                    unsampled,
                });
            }
        }
        out
    }

    fn start(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        if self.started.swap(true, Relaxed) {
            return;
        }
        store::spawn(self.me.clone());
    }
}

/// The request path's one call, from `engine/plan.rs`: tier `i`'s check
/// of `key` costing `cost` under its plan `plan` (of `plans`) or the tier's
/// `quota`, at `now_us()` (epoch µs; not read while recording is off: one
/// relaxed load is all a check pays then).
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn record<P>(
    demand: &Demand,
    i: usize,
    plans: &[P],
    plan: Option<&P>,
    quota: crate::Quota,
    plan_quota: Option<crate::Quota>,
    key: &str,
    cost: u64,
    now_us: impl FnOnce() -> u64,
) {
    if !demand.enabled.load(Relaxed) {
        return;
    }
    let pos = plan.and_then(|p| plans.iter().position(|x| std::ptr::eq(x, p)));
    let period = plan_quota.unwrap_or(quota).period();
    demand.record(i, pos, period, key, cost, now_us());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_counts_per_key_and_frees_finished_periods() {
        let t = Table::default();
        assert!(t.add(7, "a", 1));
        assert!(t.add(7, "a", 40));
        assert!(t.add(7, "b", 2));
        // Another period waits until this one is taken.
        assert!(!t.add(11, "a", 1));
        let mut got = t.take(7).unwrap();
        got.counts.sort_unstable();
        let mut want = vec![(hash("a"), 41), (hash("b"), 2)];
        want.sort_unstable();
        assert_eq!((got.period, got.counts), (7, want));
        assert_eq!(got.names, [(hash("a"), "a".to_owned())]);
        // Taken, not finished: counting goes on from zero.
        assert!(t.add(7, "a", 3));
        let got = t.take(8).unwrap();
        assert_eq!(got.counts, [(hash("a"), 3)]);
        assert!(t.take(8).is_none());
        assert!(t.add(11, "c", 1));
    }

    #[test]
    fn a_table_holds_at_most_max_keys() {
        let t = Table::default();
        let mut counted = 0;
        for k in 0..4000 {
            let key = format!("k{k}");
            if t.add(1, &key, 1) {
                counted += 1;
            }
        }
        assert!(counted <= MAX_KEYS, "{counted}");
        assert!(counted >= MAX_KEYS - 64, "{counted}");
    }
}
