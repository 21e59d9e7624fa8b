//! What one request spent locally ([`Taken`]), and its merge with the
//! backend's answer for the other checks: a denial or an error gives the
//! local spending back (all or nothing across tiers). A priced tier's
//! estimate spent locally is settled through its [`LocalSpend`].

use super::entry::Entry;
use super::pool::Inner;
use crate::algorithm::TierDecision;
use crate::backend::{Shadow, TierCheck, Verdict};
use crate::error::BackendError;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What one request spent locally, for the merge with the backend's answer.
pub(crate) struct Taken {
    pub(super) pool: Arc<Inner>,
    /// Checks decided locally (by index).
    pub(super) mask: u64,
    pub(super) spent: SmallVec<[(Arc<Entry>, u64); 4]>,
    pub(super) decisions: SmallVec<[(usize, TierDecision); 4]>,
    /// Leased checks that went to the backend: their answer updates `seen`.
    pub(super) sent: SmallVec<[(usize, Arc<Entry>); 4]>,
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken").field("mask", &self.mask).finish()
    }
}

impl Taken {
    /// Whether every check was decided locally (no backend call).
    pub(crate) fn all(&self, n: usize) -> bool {
        n <= 64 && self.mask.count_ones() as usize == n
    }

    /// How many checks were decided locally.
    pub(crate) fn count(&self) -> usize {
        self.mask.count_ones() as usize
    }

    /// The checks the backend call carries (those not decided locally, in
    /// order) and their shadow bits. Their keys are moved out of `checks`
    /// (no copy); [`restore`](Self::restore) puts them back.
    pub(crate) fn rest(
        &self,
        checks: &mut [TierCheck],
        shadow: Shadow,
    ) -> (Vec<TierCheck>, Shadow) {
        let mut rest = Vec::with_capacity(checks.len().saturating_sub(self.count()));
        let mut bits = 0u64;
        for (i, c) in checks.iter_mut().enumerate() {
            if !self.local(i) {
                if shadow.contains(i) && rest.len() < 64 {
                    bits |= 1 << rest.len();
                }
                rest.push(TierCheck {
                    key: std::mem::take(&mut c.key),
                    limit: c.limit,
                    cost: c.cost,
                    home: c.home,
                });
            }
        }
        (rest, Shadow(bits))
    }

    /// Gives `checks` back the keys [`rest`](Self::rest) moved out.
    pub(crate) fn restore(&self, checks: &mut [TierCheck], rest: Vec<TierCheck>) {
        let mut rest = rest.into_iter();
        for (i, c) in checks.iter_mut().enumerate() {
            if !self.local(i) {
                if let Some(r) = rest.next() {
                    c.key = r.key;
                }
            }
        }
    }

    /// Whether check `i` was decided locally.
    pub(crate) fn local(&self, i: usize) -> bool {
        i < 64 && self.mask & (1 << i) != 0
    }

    /// The verdict of a request decided wholly from local leases.
    pub(crate) fn verdict(&self, now_us: u64) -> Verdict {
        self.admitted();
        let mut decisions: Vec<TierDecision> = Vec::with_capacity(self.decisions.len());
        decisions.extend(self.decisions.iter().map(|(_, d)| *d));
        Verdict {
            now_us,
            decisions,
            charges: Vec::new(),
        }
    }

    /// The backend's answer for the checks not spent locally, merged with
    /// the local decisions into one verdict over all `n` checks (in order).
    /// A denial or an error gives the local spending back.
    pub(crate) fn merge(
        &self,
        result: Result<Verdict, BackendError>,
        n: usize,
        shadow: Shadow,
    ) -> Result<Verdict, BackendError> {
        let remote = match result {
            Ok(v) => v,
            Err(e) => {
                self.give_back();
                return Err(e);
            }
        };
        if self.all(n) {
            return Ok(remote);
        }
        let mut decisions = Vec::with_capacity(n);
        let mut charges = Vec::new();
        let mut local = self.decisions.iter();
        let mut from = remote.decisions.into_iter();
        let mut from_charges = remote.charges.into_iter();
        let with_charges = from_charges.len() > 0;
        for i in 0..n {
            if self.local(i) {
                let Some((_, d)) = local.next() else {
                    self.give_back();
                    return Err(BackendError::Reply(
                        "lease merge: local decision missing".into(),
                    ));
                };
                decisions.push(*d);
                if with_charges {
                    charges.push(None);
                }
            } else {
                let Some(d) = from.next() else {
                    self.give_back();
                    return Err(BackendError::Reply("lease merge: short reply".into()));
                };
                if let Some((_, e)) = self.sent.iter().find(|(j, _)| *j == i) {
                    // The shared bucket's count, for the next lease's size
                    // and the headers.
                    e.seen.store(d.remaining, Ordering::Release);
                }
                decisions.push(d);
                if with_charges {
                    charges.push(from_charges.next().flatten());
                }
            }
        }
        if shadow.commits(&decisions) {
            self.admitted();
        } else {
            self.give_back();
        }
        Ok(Verdict {
            now_us: remote.now_us,
            decisions,
            charges,
        })
    }

    /// The lease check `i` was spent from, if it was decided locally (a
    /// priced tier's reservation: `engine/settle.rs`).
    pub(crate) fn spend_of(&self, i: usize) -> Option<LocalSpend> {
        if !self.local(i) {
            return None;
        }
        let k = self.decisions.iter().position(|(j, _)| *j == i)?;
        self.spent.get(k).map(|(e, _)| LocalSpend {
            pool: self.pool.clone(),
            entry: e.clone(),
        })
    }

    pub(super) fn admitted(&self) {
        self.pool
            .local
            .fetch_add(self.count() as u64, Ordering::Relaxed);
    }

    pub(super) fn give_back(&self) {
        for (e, cost) in &self.spent {
            e.unspend(*cost);
        }
    }
}

/// A priced request's estimate spent from a lease, for its settle: a
/// refund goes back to the lease while it lives (its tokens left the
/// shared bucket already); a debt is charged on the shared bucket, sent as
/// any settle.
pub(crate) struct LocalSpend {
    pool: Arc<Inner>,
    entry: Arc<Entry>,
}

impl LocalSpend {
    /// Gives `n` unused tokens back to the lease, unless it has expired
    /// (then they are dropped: the shared bucket under-admits them until
    /// refill, as a lost lease). Whether they went back.
    pub(crate) fn give_back(&self, n: u64) -> bool {
        let now = self.pool.clock.now_us();
        if now >= self.entry.expires_us.load(Ordering::Acquire) {
            return false;
        }
        self.entry.unspend(n);
        true
    }
}
