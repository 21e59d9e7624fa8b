//! Candidate quotas in memory (`docs/rollout.md`, "Candidate quotas"): the
//! candidates of one tier key packed in that key's own entry, beside its
//! live state ([`Entry::Packed`]), each candidate's state with its own
//! expiry.
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
#[derive(Default)]
pub(super) struct Pack {
    slots: SmallVec<[Slot; SLOTS]>,
}

/// One candidate's state in a pack (no pointer to follow: a check reads
/// the pack's few cache lines and nothing else).
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
        self.slots.iter().map(|s| s.expires_us).max().unwrap_or(0)
    }

    /// Whether it holds no state.
    pub(super) fn is_empty(&self) -> bool {
        self.slots.is_empty()
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
            // Its own place first (the same candidates in the same order).
            let i = match self.slots.get(j) {
                Some(s) if s.tag == tag => Some(j),
                _ => self.slots.iter().position(|s| s.tag == tag),
            };
            // A token bucket in its slot: what follows, on its state where
            // it lies (not moved out and back).
            let in_place = i.and_then(|i| self.bucket_in_place::<O>(i, c, charge, now_us));
            if let Some(d) = in_place {
                decisions.decided(d);
                continue;
            }
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
            decisions.decided(d);
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
        }
    }

    /// Candidate `c`'s decision when it is a token bucket and slot `i`
    /// holds a bucket's state, charged there when `charge` and it allows
    /// (as [`Pack::decide`]'s general way would: its state if live, a new
    /// one past its expiry); `None`, with nothing changed, for any other.
    fn bucket_in_place<O: Decided>(
        &mut self,
        i: usize,
        c: &TierCheck,
        charge: bool,
        now_us: u64,
    ) -> Option<TierDecision> {
        let Limit::TokenBucket(b) = c.limit else {
            return None;
        };
        let slot = self.slots.get_mut(i)?;
        let State::Bucket(state) = &mut slot.state else {
            return None;
        };
        let live = (slot.expires_us > now_us).then_some(*state);
        let (d, charged) = if O::DETAILS {
            b.check(live, now_us, c.cost)
        } else {
            let (allowed, charged) = b.admits(live, now_us, c.cost);
            let d = TierDecision {
                allowed,
                limit: 0,
                remaining: 0,
                reset_after_us: 0,
                retry_after_us: 0,
                delay_us: 0,
            };
            (d, charged)
        };
        if charge && d.allowed {
            let (new, ttl_us) = charged?;
            *state = new;
            slot.expires_us = now_us.saturating_add(ttl_us);
        }
        Some(d)
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
        self.slots.retain(|s| s.expires_us > now_us);
        if self.slots.len() >= SLOTS {
            if let Some(first) = (0..self.slots.len()).min_by_key(|&j| self.slots[j].expires_us) {
                self.slots.swap_remove(first);
            }
        }
        self.slots.push(Slot {
            tag,
            state,
            expires_us,
        });
    }
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
