//! The store's shards: each a lock-free table of buckets by key (papaya's
//! map), a mutex that only writers take, and the sweep that keeps the
//! table bounded.

use super::cell::{TatCell, FROZEN, GONE};
use super::pack::Packed;
use super::SHARDS;
use crate::algorithm::{Refund, State};
use crate::backend::TierCheck;
use compact_str::CompactString;
use smallvec::SmallVec;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};

pub(super) const MIN_SWEEP: usize = 1024;

/// The table of one shard. papaya's map: a lookup takes no lock and writes
/// no shared word (its entries are reclaimed by epochs, `seize`), so checks
/// of held buckets on two cores do not move a lock's line between them.
/// Keyed by the key's hash, computed once per check (it also picks the
/// shard) and passed through: the map does not hash the key again.
pub(super) type Table = papaya::HashMap<Key, Entry, nohash_hasher::BuildNoHashHasher<u64>>;

/// One shard: its table, and the writers' mutex.
///
/// Every write to the table (a new key, a removal, an entry replaced) and
/// every decision that is not a lone compare-and-swap on a cell (the
/// window algorithms, slots, strikes, refunds, sweeps, and a request
/// whose tiers the lock-free path could not charge) runs under `writes`,
/// taken in ascending shard order across a request's shards (so two
/// requests cannot wait on each other). A writer freezes the cells it
/// decides on ([`Held`]): the lock-free path, meeting a frozen cell, takes
/// the mutex in turn.
pub(super) struct Shard {
    pub(super) table: Table,
    pub(super) writes: Mutex<Writes>,
}

/// What only the shard's writers touch.
pub(super) struct Writes {
    /// The table's size at which the next new key sweeps it.
    pub(super) sweep_at: usize,
    /// The shard's share of the store's `max_keys`.
    pub(super) max: usize,
}

/// A key in a table: its text (inline up to 24 bytes, most IP and user
/// keys: a new key allocates nothing more than its entry) and its hash.
pub(super) struct Key {
    hash: u64,
    text: CompactString,
}

impl From<Lookup<'_>> for Key {
    fn from(key: Lookup<'_>) -> Self {
        Self {
            hash: key.hash,
            text: CompactString::from(key.text),
        }
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.text == other.text
    }
}

impl Eq for Key {}

impl nohash_hasher::IsEnabled for Key {}

/// A key looked up by its text, with the hash the check computed.
#[derive(Clone, Copy)]
pub(super) struct Lookup<'a> {
    pub(super) hash: u64,
    pub(super) text: &'a str,
}

impl Hash for Lookup<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl papaya::Equivalent<Key> for Lookup<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        self.text == key.text
    }
}

impl nohash_hasher::IsEnabled for Lookup<'_> {}

/// A state only writers read and write, with its expiry.
pub(super) struct Locked {
    pub(super) state: State,
    /// Epoch microseconds after which the bucket is full (or its window
    /// empty) and the entry is meaningless.
    pub(super) expires_us: u64,
}

/// A bucket's state: in a [`TatCell`] (token and leaky buckets, charged by
/// compare-and-swap without a lock), or as a [`State`] with its expiry
/// (every other algorithm, and a bucket state no cell can express), read
/// and written by the shard's writers only. The mutex of a `Locked` entry
/// is never contended (its writers hold the shard's); it only lets them
/// change the state in place, so a check of a held key allocates nothing.
///
/// A tier key with candidate quotas holds them in its own entry, beside
/// its live state: [`Entry::Packed`] (`pack.rs`); one lookup finds both.
pub(super) enum Entry {
    Cell(TatCell),
    Locked(Box<Mutex<Locked>>),
    Packed(Box<Packed>),
}

impl Entry {
    /// The entry for `state`, which expires at `expires_us`: a cell when one
    /// can hold it ([`Entry::cell`]), else a `Locked` state.
    pub(super) fn new(state: State, expires_us: u64, now_us: u64) -> Self {
        match Self::cell(&state, expires_us, now_us) {
            Some(cell) => Entry::Cell(cell),
            None => Entry::Locked(Box::new(Mutex::new(Locked { state, expires_us }))),
        }
    }

    /// A cell holding `state`, when it can and its expiry is the TAT's
    /// (as every charge and refund of a bucket sets it).
    fn cell(state: &State, expires_us: u64, now_us: u64) -> Option<TatCell> {
        TatCell::new(state, now_us).filter(|c| c.expires_us(c.load()) == expires_us)
    }

    /// No live state: the `live` of a [`Packed`] entry whose key has none
    /// (expired at 0, so read as absent).
    pub(super) fn absent() -> Self {
        Entry::Locked(Box::new(Mutex::new(Locked {
            state: PLACEHOLDER,
            expires_us: 0,
        })))
    }

    /// The entry of the key's live state: its own, or a `Packed` one's.
    #[inline]
    pub(super) fn live(&self) -> &Entry {
        match self {
            Entry::Packed(p) => &p.live,
            e => e,
        }
    }

    /// The key's cell, if its live state is in one (what the lock-free
    /// path charges).
    #[inline]
    pub(super) fn tat_cell(&self) -> Option<&TatCell> {
        match self.live() {
            Entry::Cell(cell) => Some(cell),
            _ => None,
        }
    }
}

/// A `Locked` entry's state, or a [`Pack`](super::pack::Pack) (a poisoned mutex still holds a
/// whole state: every write to it is a single assignment).
pub(super) fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a writer holds while it works: the epoch guard under which the
/// entries it read from the tables stay valid, and the cells it has
/// frozen, each with the ticks it is released at (the ticks it held,
/// nothing written, until the writer stores new ones). Dropping it
/// releases them all, so a denial or any early exit restores every cell
/// as it was; it must drop before the shards' mutexes. A cell whose entry
/// the writer replaced by one that carries its state stays [`FROZEN`] (a
/// lock-free give-back that meets it refunds the key's new entry); one
/// whose entry it removed is released [`GONE`] (its charges left with it).
/// Either way a lock-free check still holding it goes to the locked path.
pub(super) struct Held<'g> {
    guard: &'g seize::LocalGuard<'g>,
    cells: SmallVec<[(&'g TatCell, u64); 8]>,
}

impl<'g> Held<'g> {
    pub(super) fn new(guard: &'g seize::LocalGuard<'g>) -> Self {
        Self {
            guard,
            cells: SmallVec::new(),
        }
    }

    /// The ticks of `cell`, which this writer freezes on its first visit.
    pub(super) fn ticks(&mut self, cell: &'g TatCell) -> u64 {
        if let Some(&mut (_, ticks)) = self.find(cell) {
            return ticks;
        }
        let ticks = cell.freeze();
        self.cells.push((cell, ticks));
        ticks
    }

    fn find(&mut self, cell: &TatCell) -> Option<&mut (&'g TatCell, u64)> {
        self.cells.iter_mut().find(|(c, _)| std::ptr::eq(*c, cell))
    }

    /// Releases `cell` at `ticks` when the writer is done ([`FROZEN`]:
    /// its entry was replaced; [`GONE`]: removed).
    fn set(&mut self, cell: &'g TatCell, ticks: u64) {
        match self.find(cell) {
            Some(held) => held.1 = ticks,
            None => {
                cell.freeze();
                self.cells.push((cell, ticks));
            }
        }
    }

    /// Whether this writer holds `cell` frozen.
    fn holds(&self, cell: &TatCell) -> bool {
        self.cells.iter().any(|(c, _)| std::ptr::eq(*c, cell))
    }

    /// `f` of the state of `entry` if live at `now_us` (a cell frozen here;
    /// a `Locked` state borrowed, not cloned, under its mutex).
    pub(super) fn with_live<R>(
        &mut self,
        entry: Option<&'g Entry>,
        now_us: u64,
        f: impl FnOnce(Option<&State>) -> R,
    ) -> R {
        match entry.map(Entry::live) {
            None | Some(Entry::Packed(_)) => f(None),
            Some(Entry::Cell(cell)) => {
                let ticks = self.ticks(cell);
                let state = (cell.expires_us(ticks) > now_us).then(|| cell.state(ticks));
                f(state.as_ref())
            }
            Some(Entry::Locked(m)) => {
                let l = locked(m);
                f((l.expires_us > now_us).then_some(&l.state))
            }
        }
    }

    /// The expiry (epoch µs) of `entry`'s live state (a cell frozen here).
    pub(super) fn expires_us(&mut self, entry: &'g Entry) -> u64 {
        match entry.live() {
            Entry::Cell(cell) => cell.expires_us(self.ticks(cell)),
            Entry::Locked(m) => locked(m).expires_us,
            Entry::Packed(_) => 0,
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for &(cell, ticks) in &self.cells {
            cell.release(ticks);
        }
    }
}

/// One locked shard as its writer sees it: the shard and its held mutex.
pub(super) struct Writer<'g> {
    pub(super) shard: &'g Shard,
    pub(super) writes: MutexGuard<'g, Writes>,
}

impl<'g> Writer<'g> {
    pub(super) fn lock(shard: &'g Shard) -> Self {
        // A panic under the mutex leaves no half-written entry (cells are
        // restored by `Held`'s drop; every other write is one insert, one
        // removal or one assignment), so a poisoned mutex is still usable.
        let writes = shard
            .writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Self { shard, writes }
    }

    /// The key's entry, valid while `held`'s guard lives.
    pub(super) fn find<'e>(&self, key: Lookup<'_>, held: &Held<'e>) -> Option<&'e Entry> {
        self.shard.table.get(&key, held.guard)
    }

    /// Charges `entry`, `c.key`'s (hash `hash`; `ready`: the state the
    /// check already computed), and returns the charge's undo value
    /// ([`Limit::undo_of`](crate::algorithm::Limit::undo_of), or a full
    /// bucket's for a token bucket charge not taken:
    /// [`Limit::charge_undo`](crate::algorithm::Limit::charge_undo)).
    pub(super) fn commit<'e>(
        &mut self,
        entry: &'e Entry,
        held: &mut Held<'e>,
        hash: u64,
        c: &TierCheck,
        ready: Option<(State, u64)>,
        now_us: u64,
    ) -> u64 {
        let (state, ttl_us, undo) = match ready {
            Some((state, ttl_us)) => {
                let undo = c.limit.undo_of(&state, now_us);
                (state, ttl_us, undo)
            }
            None => {
                let old = match entry.live() {
                    // Taken, not cloned: a sliding log may be long.
                    Entry::Locked(m) => {
                        let mut l = locked(m);
                        (l.expires_us > now_us)
                            .then(|| std::mem::replace(&mut l.state, PLACEHOLDER))
                    }
                    Entry::Cell(_) => held.with_live(Some(entry), now_us, |s| s.cloned()),
                    Entry::Packed(_) => None,
                };
                c.limit.charge_undo(old, now_us, c.cost)
            }
        };
        let key = Lookup { hash, text: &c.key };
        let expires_us = now_us.saturating_add(ttl_us);
        self.store(Some(entry), held, key, state, expires_us, now_us);
        undo
    }

    /// Stores `state`, expiring at `expires_us`, as `key`'s live state
    /// (`found`, if it has an entry): in place when the entry can hold it
    /// (a cell: the ticks it is released at; a `Locked` state no cell can
    /// hold: written into its place), else as a new entry that replaces it
    /// (with the key's candidates, if it has any). A new key sweeps the
    /// table when it has doubled.
    pub(super) fn store<'e>(
        &mut self,
        found: Option<&'e Entry>,
        held: &mut Held<'e>,
        key: Lookup<'_>,
        state: State,
        expires_us: u64,
        now_us: u64,
    ) {
        let entry = match found.map(Entry::live) {
            Some(Entry::Cell(cell)) => {
                let ticks = cell.ticks_of_state(&state);
                if let Some(ticks) = ticks.filter(|&t| cell.expires_us(t) == expires_us) {
                    held.set(cell, ticks);
                    return;
                }
                // Replaced by an entry that carries its state.
                held.set(cell, FROZEN);
                Entry::new(state, expires_us, now_us)
            }
            Some(Entry::Locked(m)) => match Entry::cell(&state, expires_us, now_us) {
                Some(cell) => Entry::Cell(cell),
                None => {
                    // Written into its place: no allocation.
                    *locked(m) = Locked { state, expires_us };
                    return;
                }
            },
            Some(Entry::Packed(_)) | None => Entry::new(state, expires_us, now_us),
        };
        self.insert(found, held, key, entry, now_us);
    }

    /// Inserts `entry` as `key`'s, replacing `found` (a cell replaced stays
    /// [`FROZEN`]: a lock-free check holding it goes to the locked path).
    /// A live state replacing a `Packed` entry's takes its candidates
    /// along. A new key sweeps the table when it has doubled.
    pub(super) fn insert<'e>(
        &mut self,
        found: Option<&'e Entry>,
        held: &mut Held<'e>,
        key: Lookup<'_>,
        entry: Entry,
        now_us: u64,
    ) {
        if let Some(cell) = found.and_then(Entry::tat_cell) {
            held.set(cell, FROZEN);
        }
        let entry = match (found, entry) {
            (Some(Entry::Packed(p)), live @ (Entry::Cell(_) | Entry::Locked(_))) => {
                Entry::Packed(Box::new(Packed {
                    live,
                    pack: Mutex::new(std::mem::take(&mut *locked(&p.pack))),
                }))
            }
            (_, entry) => entry,
        };
        self.shard.table.insert(Key::from(key), entry, held.guard);
        if found.is_none() && self.shard.table.len() >= self.writes.sweep_at {
            self.sweep(held, now_us);
        }
    }

    /// Removes `entry`, `key`'s live state (its cell released [`GONE`]):
    /// the entry leaves the table, or, if the key's candidates hold
    /// states, stays for them with no live state.
    pub(super) fn remove<'e>(&mut self, entry: &'e Entry, held: &mut Held<'e>, key: Lookup<'_>) {
        if let Some(cell) = entry.tat_cell() {
            held.set(cell, GONE);
        }
        if let Entry::Packed(p) = entry {
            let pack = std::mem::take(&mut *locked(&p.pack));
            if !pack.is_empty() {
                let kept = Entry::Packed(Box::new(Packed {
                    live: Entry::absent(),
                    pack: Mutex::new(pack),
                }));
                self.shard.table.insert(Key::from(key), kept, held.guard);
                return;
            }
        }
        self.shard.table.remove(&key, held.guard);
    }

    /// Gives back `r`'s charge of its key (hash `hash`) under `limit` (the
    /// check's, or its override's), or with `r.debt` charges its cost
    /// whatever the state ([`Limit::refund`], [`Limit::debt`]).
    ///
    /// [`Limit::refund`]: crate::algorithm::Limit::refund
    /// [`Limit::debt`]: crate::algorithm::Limit::debt
    pub(super) fn refund(
        &mut self,
        held: &mut Held<'_>,
        hash: u64,
        limit: crate::algorithm::Limit,
        r: &crate::backend::TierRefund,
        now_us: u64,
    ) {
        let c = &r.check;
        let key = Lookup { hash, text: &c.key };
        let found = self.find(key, held);
        if r.debt {
            let debt = held.with_live(found, now_us, |s| limit.debt(s, now_us, c.cost));
            if let Some((state, ttl_us)) = debt {
                let expires_us = now_us.saturating_add(ttl_us);
                self.store(found, held, key, state, expires_us, now_us);
            }
            return;
        }
        let Some(e) = found else {
            return;
        };
        let refund = held.with_live(found, now_us, |s| {
            limit.refund(s, now_us, r.charge.at_us, c.cost, r.charge.undo)
        });
        match refund {
            Refund::Keep => {}
            Refund::Delete => self.remove(e, held, key),
            Refund::Store(state, ttl_us) => {
                let expires_us = match ttl_us {
                    Some(ttl_us) => now_us.saturating_add(ttl_us),
                    None => held.expires_us(e),
                };
                self.store(found, held, key, state, expires_us, now_us);
            }
        }
    }

    /// Drops expired buckets; if still over `max` (the shard's share of
    /// `max_keys`), drops the buckets that expire soonest (closest to full)
    /// down to 90% of `max`. A cell leaves the table [`GONE`] (by
    /// compare-and-swap from the ticks judged: if a charge arrived since,
    /// it is judged again); cells `held` by this writer stay.
    pub(super) fn sweep(&mut self, held: &Held<'_>, now_us: u64) {
        let (max, guard) = (self.writes.max, held.guard);
        let table = &self.shard.table;
        table.retain(|_, e| !retire_if(e, held, |exp| exp <= now_us), guard);
        if table.len() > max {
            let keep = max - max / 10;
            let mut expiries: Vec<u64> = table
                .iter(guard)
                .filter_map(|(_, e)| expiry(e, held))
                .collect();
            let cut = expiries.len().saturating_sub(keep);
            if cut > 0 {
                let (_, &mut threshold, _) = expiries.select_nth_unstable(cut);
                table.retain(|_, e| !retire_if(e, held, |exp| exp < threshold), guard);
                // Ties at the threshold may leave a few extra; remove
                // arbitrary ones.
                let mut extra = table.len().saturating_sub(keep);
                table.retain(
                    |_, e| {
                        let tie = extra > 0 && retire_if(e, held, |exp| exp == threshold);
                        extra -= usize::from(tie);
                        !tie
                    },
                    guard,
                );
            }
        }
        self.writes.sweep_at = sweep_threshold(table.len() * 2, max);
    }
}

/// Stands in for a state while it is being replaced (never observed).
pub(super) const PLACEHOLDER: State = State::FixedWindow(crate::algorithm::FixedWindowState {
    start_us: 0,
    count: 0,
    end_us: 0,
});

/// An entry's expiry (a `Packed` one's: the later of its live state's and
/// its candidates'), `None` for a cell this writer holds (it stays).
fn expiry(entry: &Entry, held: &Held<'_>) -> Option<u64> {
    match entry {
        Entry::Cell(cell) if held.holds(cell) => None,
        Entry::Cell(cell) => cell.live_ticks().map(|t| cell.expires_us(t)),
        Entry::Locked(m) => Some(locked(m).expires_us),
        Entry::Packed(p) => {
            let live = expiry(&p.live, held)?;
            Some(live.max(locked(&p.pack).expires_us()))
        }
    }
}

/// Whether `entry` leaves the table: `leaves` of its expiry (a `Packed`
/// one's: the later of its live state's and its candidates'); a cell that
/// leaves is marked [`GONE`] first, from the ticks judged (a charge that
/// lands first has it judged again).
fn retire_if(entry: &Entry, held: &Held<'_>, leaves: impl Fn(u64) -> bool) -> bool {
    retire_after(entry, held, 0, leaves)
}

/// [`retire_if`] of an entry whose candidates' states expire at
/// `pack_us` (0: none).
fn retire_after(
    entry: &Entry,
    held: &Held<'_>,
    pack_us: u64,
    leaves: impl Fn(u64) -> bool,
) -> bool {
    match entry {
        Entry::Cell(cell) if held.holds(cell) => false,
        Entry::Cell(cell) => loop {
            let Some(ticks) = cell.live_ticks() else {
                return false;
            };
            if !leaves(cell.expires_us(ticks).max(pack_us)) {
                return false;
            }
            if cell.retire_from(ticks) {
                return true;
            }
        },
        Entry::Locked(m) => leaves(locked(m).expires_us.max(pack_us)),
        Entry::Packed(p) => {
            let pack_us = locked(&p.pack).expires_us();
            retire_after(&p.live, held, pack_us, leaves)
        }
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

/// Whether a check's limit is one a cell decides (token and leaky buckets).
pub(super) fn cell_limit(c: &TierCheck) -> bool {
    matches!(
        c.limit,
        crate::algorithm::Limit::TokenBucket(_) | crate::algorithm::Limit::LeakyBucket(_)
    )
}
