//! The check of token and leaky buckets that exist, without a lock: each
//! key looked up in its shard's lock-free table and charged by
//! compare-and-swap on its [`TatCell`], a charge given back when a later
//! tier turns out to deny. A frozen cell (a writer holds it) sends the
//! request to the locked check.

use super::cell::{storable, Charged, TatCell, GONE};
use super::shard::{cell_limit, shard_of, Entry, Held, Lookup, Writer};
use super::MemoryBackend;
use crate::algorithm::TierDecision;
use crate::backend::{Charge, Shadow, TierCheck, TierRefund};
use smallvec::SmallVec;

/// One tier on the way: its cell, the ticks it was decided on, and the
/// ticks its charge writes (`None`: not allowed, not charged).
pub(super) struct Step<'a> {
    pub(super) cell: &'a TatCell,
    pub(super) seen: u64,
    pub(super) charged: Option<Charged>,
}

impl MemoryBackend {
    /// [`check_fast`](Self::check_fast) for a request of one tier (the
    /// layer's default): one lookup and one compare-and-swap, no lock,
    /// with none of the bookkeeping of several tiers (the steps of each,
    /// the charges to give back). The same answer as the general path:
    /// false when the locked check must decide (another algorithm, a new
    /// key, a state the cell cannot express, a frozen cell).
    #[inline]
    pub(super) fn check_one_fast(
        &self,
        c: &TierCheck,
        shadow: Shadow,
        with_charges: bool,
        out: (&mut Vec<TierDecision>, &mut Vec<Option<Charge>>),
        now_us: u64,
        hash: u64,
    ) -> bool {
        if !cell_limit(c) {
            return false;
        }
        let (decisions, charges) = out;
        let guard = self.inner.collector.enter();
        let key = Lookup { hash, text: &c.key };
        let Some(cell) = self.inner.shards[shard_of(hash)]
            .table
            .get(&key, &guard)
            .and_then(Entry::tat_cell)
        else {
            return false;
        };
        let mut seen = cell.load();
        loop {
            if storable(seen).is_none() {
                return false;
            }
            let Some((d, charged)) = cell.decide(&c.limit, seen, now_us, c.cost) else {
                return false;
            };
            decisions.clear();
            decisions.push(d);
            if !(d.allowed || shadow.contains(0)) {
                // Denied: nothing charged, no charge listed.
                return true;
            }
            let Some(new) = charged else {
                // A shadow tier that would deny charges nothing.
                if with_charges {
                    charges.push(None);
                }
                return true;
            };
            match cell.swap_from(seen, new.ticks) {
                Ok(()) => {
                    if with_charges {
                        charges.push(Some(Charge {
                            at_us: now_us,
                            undo: new.undo,
                            next_after_us: 0,
                        }));
                    }
                    return true;
                }
                // Another request charged (or a weak swap failed): decide
                // again on what the cell holds now. Nothing of this request
                // is charged yet, so its denial is final, as on the locked
                // path.
                Err(now_seen) => seen = now_seen,
            }
        }
    }

    /// The check when every tier is a token or leaky bucket whose key exists
    /// (in a cell of its quota) and no key is listed twice: false when it
    /// is not, or when a race turns an enforced tier to a denial after an
    /// earlier tier was charged (those charges are given back first); the
    /// locked check then decides. True when decided: `decisions` holds one
    /// decision per check, and `charges` (left empty until then) one charge
    /// per check when `with_charges` and the request was charged.
    ///
    /// No lock is taken, so requests on the same shard or the same key run
    /// at once; each tier is decided on a load of its cell, and
    /// charged, once every enforced tier allows, by a compare-and-swap from
    /// the ticks it was decided on. A swap that finds the cell moved decides
    /// again on what it holds; one that finds it frozen gives back what
    /// was charged and leaves the request to the locked check. A
    /// concurrent request may see a charge that is then given back, and be
    /// denied for it: one that the locked path would have admitted a
    /// moment later.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_fast(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
        decisions: &mut Vec<TierDecision>,
        charges: &mut Vec<Option<Charge>>,
        now_us: u64,
        hashes: &[u64],
    ) -> bool {
        let eligible = |(i, c): (usize, &TierCheck)| {
            cell_limit(c)
                && !hashes[..i]
                    .iter()
                    .zip(checks)
                    .any(|(&h, o)| h == hashes[i] && o.key == c.key)
        };
        if !checks.iter().enumerate().all(eligible) {
            return false;
        }
        let guard = self.inner.collector.enter();
        decisions.clear();
        decisions.reserve_exact(checks.len());
        let mut steps: SmallVec<[Step<'_>; 8]> = SmallVec::new();
        for (c, &h) in checks.iter().zip(hashes) {
            let key = Lookup {
                hash: h,
                text: &c.key,
            };
            let Some(cell) = self.inner.shards[shard_of(h)]
                .table
                .get(&key, &guard)
                .and_then(Entry::tat_cell)
            else {
                return false;
            };
            let seen = cell.load();
            if storable(seen).is_none() {
                return false;
            }
            let Some((d, charged)) = cell.decide(&c.limit, seen, now_us, c.cost) else {
                return false;
            };
            decisions.push(d);
            steps.push(Step {
                cell,
                seen,
                charged,
            });
        }
        if !shadow.commits(decisions) {
            return true;
        }
        for i in 0..steps.len() {
            let c = &checks[i];
            let step = &mut steps[i];
            while let Some(new) = step.charged {
                let Err(now_seen) = step.cell.swap_from(step.seen, new.ticks) else {
                    break;
                };
                // Another request charged (or a weak swap failed): decide
                // again on what the cell holds now.
                step.seen = now_seen;
                let again = storable(now_seen)
                    .and_then(|seen| step.cell.decide(&c.limit, seen, now_us, c.cost));
                match again {
                    Some((d, charged)) if d.allowed || shadow.contains(i) => {
                        decisions[i] = d;
                        step.charged = charged;
                    }
                    _ => {
                        self.give_back(&checks[..i], hashes, &steps[..i], now_us);
                        return false;
                    }
                }
            }
        }
        if with_charges {
            if charges.capacity() < steps.len() {
                // At its size at once (a verdict of the owned API's is new).
                *charges = Vec::with_capacity(steps.len());
            }
            charges.extend(steps.iter().map(|s| {
                s.charged.map(|new| Charge {
                    at_us: now_us,
                    undo: new.undo,
                    next_after_us: 0,
                })
            }));
        }
        true
    }

    /// Gives back the charges of `steps` (of `checks`, whose keys hash to
    /// `hashes`, charged at `charged_us`), each by what has not refilled
    /// since. A cell found frozen or gone is settled under its shard's
    /// mutex, once its writer is done: a cell released by its writer is
    /// given back as before; one whose entry left the table took the
    /// charge with it (nothing to give back); one whose entry was replaced
    /// by an entry carrying its state has the key's entry refunded, as
    /// [`refund`](Self::refund) does. The undo is never lost, and never
    /// lands on a key made anew after a reset or an eviction.
    pub(super) fn give_back(
        &self,
        checks: &[TierCheck],
        hashes: &[u64],
        steps: &[Step<'_>],
        charged_us: u64,
    ) {
        let now_us = self.inner.clock.now_us().max(charged_us);
        for ((c, &h), s) in checks.iter().zip(hashes).zip(steps) {
            let Some(new) = s.charged else {
                continue;
            };
            if s.cell.give_back(s.seen, new.ticks, now_us) {
                continue;
            }
            let guard = self.inner.collector.enter();
            let mut w = Writer::lock(&self.inner.shards[shard_of(h)]);
            if s.cell.give_back(s.seen, new.ticks, now_us) || s.cell.load() == GONE {
                continue;
            }
            let mut held = Held::new(&guard);
            let refund = TierRefund {
                check: c.clone(),
                charge: Charge {
                    at_us: charged_us,
                    undo: new.undo,
                    next_after_us: 0,
                },
                debt: false,
            };
            w.refund(&mut held, h, c.limit, &refund, now_us);
        }
    }
}
