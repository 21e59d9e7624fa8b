//! Candidate quotas in memory (`docs/rollout.md`, "Candidate quotas"): the
//! candidates of one tier key packed in that key's own entry, beside its
//! live state ([`Entry::Packed`]): a token bucket's state in ticks, as
//! its cell would keep it (no expiry of its own, decided without a
//! division), every other one with its own expiry.
//!
//! A request's candidates of one tier key are one charge of its pack (not
//! one per candidate), found by the live check's own lookup when it runs
//! locked ([`Inline`]), else by one more lookup of the tier key, just
//! read: each is decided on its own state with its algorithm's
//! code ([`Limit::check_prepared`], [`Limit::charge`]), as it would be on a
//! key of its own, and by the same rule (charged when it allows and every
//! enforced check but its own tier's live one allows). A candidate's state
//! lives until its own time-to-live ends, exactly as its own key would;
//! the entry lives until the later of its live state's and its last
//! candidate's (what the sweep and the eviction read), and counts as one
//! key of [`max_keys`](super::MemoryBackend::max_keys), candidates and
//! all. The live state is kept as it would be without candidates (a
//! token or leaky bucket's in a cell, charged without a lock); a reset or
//! a refund that forgets it leaves the candidates' states.

use super::shard::{locked, shard_of, Entry, Held, Locked, Lookup, Writer, PLACEHOLDER};
use super::MemoryBackend;
use crate::algorithm::{Limit, State, TierDecision};
use crate::backend::TierCheck;
use smallvec::SmallVec;
use std::sync::Mutex;

/// The most states a pack holds: a tier's candidates (four). A fifth (a
/// candidate list changed at run time) takes the place of the state that
/// expires first, which hands that one a fresh key a little early.
const SLOTS: usize = 4;

/// The candidates' states of one tier key.
///
/// A token bucket's state is kept as a [`TatCell`](super::cell::TatCell)
/// keeps it, in [`Ticks`] from the pack's anchor: 32 bytes, decided without
/// a division and without an expiry of its own (a bucket past its TAT is
/// full, as its own key would have expired). Four such states are two
/// cache lines. Every other state (another algorithm; a bucket the ticks
/// cannot express: a clock stepped back before the anchor, a quota of
/// another unit or rate under the same name, a TAT too far to count) is a
/// [`Slot`] of `slots`. A candidate's state is in one of the two, never
/// both; together they hold at most [`SLOTS`].
#[derive(Default)]
pub(super) struct Pack {
    buckets: SmallVec<[Ticks; SLOTS]>,
    /// Epoch µs the buckets' ticks count from: at or before each one's TAT
    /// (the clock when the first of them was stored).
    anchor_us: u64,
    slots: Vec<Slot>,
}

/// One token bucket candidate's state: its TAT is `anchor_us + ticks /
/// rate` µs, in units of `1 / rate` µs (the bucket's own, `unit` units a
/// token, as [`BucketState`](crate::algorithm::BucketState) keeps it). It
/// means something while `ticks` is past the clock's ticks (`(now −
/// anchor) × rate`): the bucket is then `ticks − now` units short of full.
struct Ticks {
    /// The candidate's [`tag`].
    tag: u64,
    ticks: u64,
    unit: u64,
    rate: u64,
}

impl Ticks {
    /// `now_us` in this bucket's ticks from `anchor_us`, if it is not
    /// before the anchor and fits.
    #[inline]
    fn now(&self, anchor_us: u64, now_us: u64) -> Option<u64> {
        now_us
            .checked_sub(anchor_us)
            .and_then(|d| d.checked_mul(self.rate))
    }

    /// Epoch µs after which the bucket is full (its TAT, rounded up): its
    /// own key's expiry.
    fn expires_us(&self, anchor_us: u64) -> u64 {
        anchor_us.saturating_add(self.ticks.div_ceil(self.rate))
    }

    /// The state as the algorithm keeps it, in a slot of its own.
    fn slot(&self, anchor_us: u64) -> Slot {
        Slot {
            tag: self.tag,
            state: State::Bucket(crate::algorithm::BucketState {
                tat_us: anchor_us + self.ticks / self.rate,
                frac: self.ticks % self.rate,
                unit: self.unit,
                rate: self.rate,
            }),
            expires_us: self.expires_us(anchor_us),
        }
    }
}

/// One candidate's state in a pack, as the algorithm keeps it.
struct Slot {
    /// The [`tag`] of the candidate's key past its tier key (`{c:80/1m}`):
    /// what names it.
    tag: u64,
    state: State,
    /// Epoch µs after which the state means what no state means (its own
    /// key would have expired).
    expires_us: u64,
}

/// The candidates of one live check, for the live check to decide on the
/// pack of the entry it finds ([`Pack::decide`]).
pub(super) struct Inline<'a> {
    /// The live check's index.
    pub(super) live: usize,
    pub(super) group: &'a [TierCheck],
    /// Each candidate's [`tag`].
    pub(super) tags: &'a [u64],
    /// Where their decisions go: `None`, after the live ones in the
    /// verdict; else only their denials, here.
    pub(super) denials: Option<&'a mut Denials>,
    /// Whether they were decided.
    pub(super) done: bool,
}

/// Where [`Pack::decide`] puts each candidate's decision, in order.
pub(super) trait Decided {
    /// Whether it reads more of a decision than `allowed` (else a token
    /// bucket's is given with its other figures left at 0).
    const DETAILS: bool;
    fn decided(&mut self, d: TierDecision);
}

impl Decided for Vec<TierDecision> {
    const DETAILS: bool = true;
    #[inline]
    fn decided(&mut self, d: TierDecision) {
        self.push(d);
    }
}

/// Which candidates denied, for a caller that counts their decisions and
/// reads nothing else of them
/// ([`check_with_packs`](MemoryBackend::check_with_packs)): bit `k` set
/// when the `k`-th candidate decided denied it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Denials {
    pub(crate) bits: u64,
    /// Candidates decided so far (at most 64 are told apart).
    pub(crate) n: u32,
}

impl Decided for Denials {
    const DETAILS: bool = false;
    #[inline]
    fn decided(&mut self, d: TierDecision) {
        if !d.allowed {
            self.bits |= 1u64.checked_shl(self.n).unwrap_or(0);
        }
        self.n = self.n.saturating_add(1);
    }
}

/// What names a candidate in its pack: the hash of its key past its tier
/// key (`{c:80/1m}`, a configured quota's, never a request's), without a
/// per-store seed, so a caller can compute it once per candidate (the
/// engine does, when it builds the tier) and name candidates by it.
pub(crate) fn tag(suffix: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(suffix.as_bytes())
}

impl Pack {
    /// Epoch µs after which no state of the pack means anything (0: it
    /// holds none).
    pub(super) fn expires_us(&self) -> u64 {
        let buckets = self.buckets.iter().map(|b| b.expires_us(self.anchor_us));
        let slots = self.slots.iter().map(|s| s.expires_us);
        buckets.chain(slots).max().unwrap_or(0)
    }

    /// Whether it holds no state.
    pub(super) fn is_empty(&self) -> bool {
        self.buckets.is_empty() && self.slots.is_empty()
    }

    /// Decides each of `group` (candidates of one tier key, each named by
    /// its tag in `tags`) on its own state, each decision given to
    /// `decisions`; `charge`: every enforced check but their tier's live
    /// one allowed, so each that allows is charged.
    pub(super) fn decide<O: Decided>(
        &mut self,
        group: &[TierCheck],
        tags: &[u64],
        charge: bool,
        now_us: u64,
        decisions: &mut O,
    ) {
        for (j, (c, &tag)) in group.iter().zip(tags).enumerate() {
            if let Limit::TokenBucket(b) = c.limit {
                if let Some(d) = self.bucket::<O>(j, tag, b, c.cost, charge, now_us) {
                    decisions.decided(d);
                    continue;
                }
            } else if let Some(k) = self.buckets.iter().position(|t| t.tag == tag) {
                // Another algorithm under a bucket's name: its state, as
                // the algorithm keeps it, decides (as none).
                self.move_to_slot(k);
            }
            let d = self.general(c, tag, charge, now_us);
            decisions.decided(d);
        }
    }

    /// Token bucket `b`'s decision for `cost` on its [`Ticks`] (named
    /// `tag`, looked for at `j` first), stored there when `charge` and it
    /// allows (a bucket without a state starts its ticks, when it has no
    /// slot); `None`, with the state moved to a slot when it had ticks,
    /// when the ticks cannot decide it (the slot's way then does). As
    /// [`TatCell::decide`](super::cell::TatCell::decide) does, on the same
    /// numbers: the bucket is `ticks − now` short of full, or full once
    /// expired.
    #[inline]
    fn bucket<O: Decided>(
        &mut self,
        j: usize,
        tag: u64,
        b: crate::algorithm::TokenBucket,
        cost: u64,
        charge: bool,
        now_us: u64,
    ) -> Option<TierDecision> {
        let k = match self.buckets.get(j) {
            Some(t) if t.tag == tag => Some(j),
            _ => self.buckets.iter().position(|t| t.tag == tag),
        };
        let Some(k) = k else {
            if self.slots.iter().any(|s| s.tag == tag) {
                return None;
            }
            return self.bucket_new::<O>(tag, b, cost, charge, now_us);
        };
        let anchor_us = self.anchor_us;
        let t = &mut self.buckets[k];
        let fits = t.unit == b.unit && t.rate == b.rate;
        let missing = match t.now(anchor_us, now_us) {
            Some(now) if fits && t.ticks.saturating_sub(now) <= b.capacity => {
                Some((now, t.ticks.saturating_sub(now)))
            }
            _ => None,
        };
        let Some((now, missing)) = missing else {
            self.move_to_slot(k);
            return None;
        };
        let (d, used) = decision::<O>(b, missing, cost);
        if let (true, Some(used)) = (charge, used) {
            match now.checked_add(used) {
                Some(ticks) => t.ticks = ticks,
                None => {
                    self.move_to_slot(k);
                    return None;
                }
            }
        }
        Some(d)
    }

    /// Moves bucket `k`'s state to a slot, as the algorithm keeps it.
    fn move_to_slot(&mut self, k: usize) {
        let t = self.buckets.swap_remove(k);
        self.slots.push(t.slot(self.anchor_us));
    }

    /// [`Pack::bucket`] of a bucket with no state in the pack (a full
    /// bucket), its charge stored as new ticks; `None` when they cannot
    /// hold it (the slot's way then decides).
    fn bucket_new<O: Decided>(
        &mut self,
        tag: u64,
        b: crate::algorithm::TokenBucket,
        cost: u64,
        charge: bool,
        now_us: u64,
    ) -> Option<TierDecision> {
        let (d, used) = decision::<O>(b, 0, cost);
        let Some(used) = used.filter(|_| charge) else {
            return Some(d);
        };
        self.drop_expired(now_us);
        if self.buckets.is_empty() {
            self.anchor_us = now_us;
        }
        let mut t = Ticks {
            tag,
            ticks: 0,
            unit: b.unit,
            rate: b.rate,
        };
        t.ticks = t.now(self.anchor_us, now_us)?.checked_add(used)?;
        self.make_room();
        self.buckets.push(t);
        Some(d)
    }

    /// Candidate `c`'s decision on its [`Slot`] (named `tag`), stored there
    /// when `charge` and it allows.
    fn general(&mut self, c: &TierCheck, tag: u64, charge: bool, now_us: u64) -> TierDecision {
        let i = self.slots.iter().position(|s| s.tag == tag);
        let state = i
            .and_then(|i| self.slots.get(i))
            .filter(|s| s.expires_us > now_us)
            .map(|s| &s.state);
        // A state written under another quota of the same name (a
        // calendar's, whose bounds move with the months; any other
        // candidate's quota is its name's): stored whatever the
        // decision, as on a key of its own.
        let carried = match c.limit {
            Limit::Calendar(_) => c.limit.carry(state, now_us),
            _ => None,
        };
        let (d, ready) = c.limit.check_prepared(state, now_us, c.cost);
        let write = if charge && d.allowed {
            Some(ready.unwrap_or_else(|| {
                let old = i.and_then(|i| self.take(i, now_us));
                c.limit.charge(old, now_us, c.cost)
            }))
        } else {
            carried
        };
        if let Some((state, ttl_us)) = write {
            self.put(i, tag, state, now_us.saturating_add(ttl_us), now_us);
        }
        d
    }

    /// Slot `i`'s state if live, taken (not cloned: a sliding log may be
    /// long); it is written again at once.
    fn take(&mut self, i: usize, now_us: u64) -> Option<State> {
        let s = self.slots.get_mut(i).filter(|s| s.expires_us > now_us)?;
        Some(std::mem::replace(&mut s.state, PLACEHOLDER))
    }

    /// Stores `state` as slot `i`'s, or in a new slot named `tag`.
    fn put(&mut self, i: Option<usize>, tag: u64, state: State, expires_us: u64, now_us: u64) {
        if let Some(s) = i.and_then(|i| self.slots.get_mut(i)) {
            s.state = state;
            s.expires_us = expires_us;
            return;
        }
        self.drop_expired(now_us);
        self.make_room();
        self.slots.push(Slot {
            tag,
            state,
            expires_us,
        });
    }

    /// Forgets the states expired at `now_us` (their own keys would be
    /// gone).
    fn drop_expired(&mut self, now_us: u64) {
        let anchor_us = self.anchor_us;
        self.buckets.retain(|t| t.expires_us(anchor_us) > now_us);
        self.slots.retain(|s| s.expires_us > now_us);
    }

    /// Room for one more state: with [`SLOTS`] already, the one that
    /// expires first is forgotten.
    fn make_room(&mut self) {
        if self.buckets.len() + self.slots.len() < SLOTS {
            return;
        }
        let anchor_us = self.anchor_us;
        let bucket = (0..self.buckets.len()).min_by_key(|&k| self.buckets[k].expires_us(anchor_us));
        let slot = (0..self.slots.len()).min_by_key(|&k| self.slots[k].expires_us);
        let bucket_us = bucket.map_or(u64::MAX, |k| self.buckets[k].expires_us(anchor_us));
        let slot_us = slot.map_or(u64::MAX, |k| self.slots[k].expires_us);
        match (bucket, slot) {
            (Some(k), _) if bucket_us <= slot_us => {
                self.buckets.swap_remove(k);
            }
            (_, Some(k)) => {
                self.slots.swap_remove(k);
            }
            _ => {}
        }
    }
}

/// Token bucket `b`'s decision for `cost` on a bucket `missing` units short
/// of full, and when it allows the units it is short after the charge:
/// [`TokenBucket::check_missing`](crate::algorithm::TokenBucket::check_missing),
/// or only whether it allows when the caller reads nothing else.
#[inline(always)]
fn decision<O: Decided>(
    b: crate::algorithm::TokenBucket,
    missing: u64,
    cost: u64,
) -> (TierDecision, Option<u64>) {
    if O::DETAILS {
        return b.check_missing(missing, cost);
    }
    let used = b.admits_missing(missing, cost);
    let d = TierDecision {
        allowed: used.is_some(),
        limit: 0,
        remaining: 0,
        reset_after_us: 0,
        retry_after_us: 0,
        delay_us: 0,
    };
    (d, used)
}

impl MemoryBackend {
    /// The candidates `group` of the tier key `live_key` (each key is
    /// `live_key` then its suffix, or each named by its [`tag`] in `tags`
    /// when given), decided on the pack in `live_key`'s entry, one lookup
    /// under its shard's mutex; `charge`: each that allows is charged.
    /// Their decisions are given to `decisions`, in order.
    ///
    /// A key's first candidate state moves its live state into a new
    /// [`Packed`] entry beside the pack, as it is (a cell a lock-free check
    /// holds is frozen for the move: that check goes to the locked path
    /// and finds the new entry).
    pub(super) fn check_pack(
        &self,
        live_key: &str,
        group: &[TierCheck],
        tags: Option<&[u64]>,
        charge: bool,
        now_us: u64,
        decisions: &mut impl Decided,
    ) {
        let of_keys: SmallVec<[u64; SLOTS]>;
        let tags = match tags {
            Some(t) => t,
            None => {
                of_keys = group
                    .iter()
                    .map(|c| tag(c.key.get(live_key.len()..).unwrap_or("")))
                    .collect();
                &of_keys
            }
        };
        let h = self.hash(live_key);
        let guard = self.inner.collector.enter();
        let mut w = Writer::lock(&self.inner.shards[shard_of(h)]);
        let mut held = Held::new(&guard);
        let lookup = Lookup {
            hash: h,
            text: live_key,
        };
        let found = w.find(lookup, &held);
        if let Some(Entry::Packed(p)) = found {
            locked(&p.pack).decide(group, tags, charge, now_us, decisions);
            return;
        }
        // No pack yet: one beside the live state, once it holds a state.
        let mut pack = Pack::default();
        pack.decide(group, tags, charge, now_us, decisions);
        if pack.is_empty() {
            return;
        }
        let live = match found {
            Some(e) => held.moved(e, now_us),
            None => Entry::absent(),
        };
        let entry = Entry::Packed(Box::new(Packed {
            live,
            pack: Mutex::new(pack),
        }));
        w.insert(found, &mut held, lookup, entry, now_us);
    }
}

/// Whether `group`'s keys are each `live_key` then a suffix (the keys the
/// engine plans, `<tier key>{c:<quota>}`): only such candidates are packed.
pub(super) fn packable(live_key: &str, group: &[TierCheck]) -> bool {
    group
        .iter()
        .all(|c| c.key.len() > live_key.len() && c.key.starts_with(live_key))
}

/// A tier key's live state and its candidates' [`Pack`], in one entry.
/// `live` is a `Cell` or a `Locked` state, never itself `Packed`; a key
/// whose candidates have a state and it none holds an expired `Locked`
/// one ([`Entry::absent`]). Its cell, if any, is charged without a lock as
/// any other; the pack is read and written by writers only, as a `Locked`
/// state is. The entry lives until the later of the two expiries.
pub(super) struct Packed {
    pub(super) live: Entry,
    pub(super) pack: Mutex<Pack>,
}

impl<'g> Held<'g> {
    /// A new entry holding `entry`'s live state as it is (absent if
    /// expired), to be stored in its place (a cell: frozen here, then
    /// [`FROZEN`] once replaced; a `Locked` state: moved out, its writers
    /// being this one).
    pub(super) fn moved(&mut self, entry: &'g Entry, now_us: u64) -> Entry {
        match entry.live() {
            Entry::Cell(cell) => {
                let ticks = self.ticks(cell);
                let expires_us = cell.expires_us(ticks);
                if expires_us > now_us {
                    Entry::new(cell.state(ticks), expires_us, now_us)
                } else {
                    Entry::absent()
                }
            }
            Entry::Locked(m) => {
                let mut l = locked(m);
                let expires_us = l.expires_us;
                if expires_us > now_us {
                    let state = std::mem::replace(&mut l.state, PLACEHOLDER);
                    l.expires_us = 0;
                    Entry::Locked(Box::new(Mutex::new(Locked { state, expires_us })))
                } else {
                    Entry::absent()
                }
            }
            Entry::Packed(_) => Entry::absent(),
        }
    }
}
