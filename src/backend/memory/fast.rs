//! The check of token and leaky buckets that exist: their shards
//! read-locked, each key charged by compare-and-swap on its [`TatCell`], a
//! charge given back when a later tier turns out to deny.

use super::cell::{Charged, TatCell};
use super::shard::{read, shard_of, Entry, Shard};
use super::MemoryBackend;
use crate::algorithm::{Decision, Limit};
use crate::backend::{Charge, Shadow, TierCheck};
use smallvec::SmallVec;
use std::sync::RwLockReadGuard;

/// One tier on the way: its cell, the ticks it was decided on, and the
/// ticks its charge writes (`None`: not allowed, not charged).
struct Step<'a> {
    cell: &'a TatCell,
    seen: u64,
    charged: Option<Charged>,
}

impl MemoryBackend {
    /// [`check_fast`](Self::check_fast) for a request of one tier (the
    /// layer's default): one shard's read lock, one lookup, one
    /// compare-and-swap, with none of the bookkeeping of several tiers
    /// (the guards and steps of each, the charges to give back). The same
    /// answer as the general path: false when the locked check must decide
    /// (another algorithm, a new key, a state the cell cannot express).
    #[inline]
    pub(super) fn check_one_fast(
        &self,
        c: &TierCheck,
        shadow: Shadow,
        with_charges: bool,
        out: (&mut Vec<Decision>, &mut Vec<Option<Charge>>),
        now_us: u64,
        hash: u64,
    ) -> bool {
        if !matches!(c.limit, Limit::TokenBucket(_) | Limit::LeakyBucket(_)) {
            return false;
        }
        let (decisions, charges) = out;
        let shard = read(&self.inner.shards[shard_of(hash)]);
        let Some(Entry::Cell(cell)) = shard
            .map
            .find(hash, |s| s.key == c.key)
            .map(|slot| &slot.entry)
        else {
            return false;
        };
        let mut seen = cell.load();
        loop {
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
    /// The shards are only read-locked (in ascending order, as the locked
    /// check write-locks them), so requests on the same shard or the same
    /// key run at once; each tier is decided on a load of its cell, and
    /// charged, once every enforced tier allows, by a compare-and-swap from
    /// the ticks it was decided on. A swap that finds the cell moved decides
    /// again on what it holds. A concurrent request may see a charge that
    /// is then given back, and be denied for it: one that the locked path
    /// would have admitted a moment later.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_fast(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
        decisions: &mut Vec<Decision>,
        charges: &mut Vec<Option<Charge>>,
        now_us: u64,
        hashes: &[u64],
        shards: u64,
    ) -> bool {
        let eligible = |(i, c): (usize, &TierCheck)| {
            matches!(c.limit, Limit::TokenBucket(_) | Limit::LeakyBucket(_))
                && !hashes[..i]
                    .iter()
                    .zip(checks)
                    .any(|(&h, o)| h == hashes[i] && o.key == c.key)
        };
        if !checks.iter().enumerate().all(eligible) {
            return false;
        }
        let mut locked: SmallVec<[RwLockReadGuard<'_, Shard>; 8]> = SmallVec::new();
        let mut rest = shards;
        while rest != 0 {
            locked.push(read(&self.inner.shards[rest.trailing_zeros() as usize]));
            rest &= rest - 1;
        }
        let guard_of = |h: u64| (shards & ((1u64 << shard_of(h)) - 1)).count_ones() as usize;

        decisions.clear();
        decisions.reserve_exact(checks.len());
        let mut steps: SmallVec<[Step<'_>; 8]> = SmallVec::new();
        for (c, &h) in checks.iter().zip(hashes) {
            let Some(Entry::Cell(cell)) = locked[guard_of(h)]
                .map
                .find(h, |s| s.key == c.key)
                .map(|slot| &slot.entry)
            else {
                return false;
            };
            let seen = cell.load();
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
                match step.cell.decide(&c.limit, now_seen, now_us, c.cost) {
                    Some((d, charged)) if d.allowed || shadow.contains(i) => {
                        decisions[i] = d;
                        step.charged = charged;
                    }
                    _ => {
                        for s in &steps[..i] {
                            if let Some(new) = s.charged {
                                s.cell.give_back(s.seen, new.ticks, now_us);
                            }
                        }
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
}
