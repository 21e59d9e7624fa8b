//! A token bucket's or leaky bucket's state as one `AtomicU64`: its
//! theoretical arrival time (TAT), which a check updates by
//! compare-and-swap without a lock, and which a writer freezes while it
//! decides on it.

use crate::algorithm::{div_ceil, BucketState, Limit, State, TatState, TierDecision};
use std::sync::atomic::{AtomicU64, Ordering};

/// The ticks of a frozen cell: a writer (under its shard's mutex) is
/// deciding on it, or its entry was replaced by one that carries its state
/// (a quota change, a state no cell can express). No TAT is stored as this
/// value or [`GONE`] (a charge that would reach them goes through the
/// locked path, which stores a [`State`]); a lock-free check that loads
/// either, or whose compare-and-swap meets it, takes the locked path.
pub(super) const FROZEN: u64 = u64::MAX;

/// The ticks of a cell whose entry has left the table (swept, evicted,
/// reset, refunded to nothing): its charges left with it, so a lock-free
/// give-back that meets it has nothing to give back.
pub(super) const GONE: u64 = u64::MAX - 1;

/// `ticks` if a cell may store them (neither [`FROZEN`] nor [`GONE`]).
pub(super) fn storable(ticks: u64) -> Option<u64> {
    (ticks < GONE).then_some(ticks)
}

/// What an allowed check writes: the cell's new ticks, and the charge's
/// undo value ([`Limit::undo_of`]), which the check computes on the way
/// (what [`TatCell::undo`] of those ticks would compute again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Charged {
    pub(super) ticks: u64,
    pub(super) undo: u64,
}

/// The TAT of one bucket, `anchor_us + ticks / rate` µs, in one atomic.
///
/// Both algorithms keep the TAT as whole microseconds plus a remainder in
/// units of `1 / rate` µs ([`BucketState`], [`TatState`]); here it is one
/// integer of such units (ticks) counted from `anchor_us`, so it is exact
/// and fits a single compare-and-swap. The anchor, the rate and (token
/// bucket) the unit never change while the cell lives: a state they cannot
/// express (another quota, a clock stepped back past the anchor, a TAT more
/// than 2^64 ticks away) goes through the locked path, which stores a new
/// cell or a [`State`].
pub(super) struct TatCell {
    kind: Kind,
    rate: u64,
    anchor_us: u64,
    ticks: AtomicU64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A token bucket of this many units per token.
    Bucket { unit: u64 },
    /// A leaky bucket (GCRA) of this many ticks per token.
    Leaky { unit: u64 },
}

impl TatCell {
    /// A cell holding `state`, when it is a token or leaky bucket's that the
    /// cell can express; anchored at the earlier of its TAT and `now_us`.
    pub(super) fn new(state: &State, now_us: u64) -> Option<Self> {
        let (kind, tat_us, frac, rate) = match *state {
            State::Bucket(s) => (Kind::Bucket { unit: s.unit }, s.tat_us, s.frac, s.rate),
            State::Tat(s) => (Kind::Leaky { unit: s.unit }, s.tat_us, s.frac, s.rate),
            _ => return None,
        };
        if rate == 0 || frac >= rate {
            return None;
        }
        let anchor_us = tat_us.min(now_us);
        let cell = Self {
            kind,
            rate,
            anchor_us,
            ticks: AtomicU64::new(0),
        };
        let ticks = cell.ticks_of(tat_us, frac)?;
        cell.ticks.store(ticks, Ordering::Relaxed);
        Some(cell)
    }

    /// The TAT `tat_us + frac / rate` in ticks from the anchor, if it fits.
    fn ticks_of(&self, tat_us: u64, frac: u64) -> Option<u64> {
        tat_us
            .checked_sub(self.anchor_us)?
            .checked_mul(self.rate)?
            .checked_add(frac)
            .and_then(storable)
    }

    /// `now_us` in ticks from the anchor (0 before it, saturating past 2^64).
    fn ticks_at(&self, now_us: u64) -> u64 {
        now_us
            .saturating_sub(self.anchor_us)
            .saturating_mul(self.rate)
    }

    /// The current ticks (for a check about to decide on them; [`FROZEN`]
    /// while a writer holds the cell, [`GONE`] once it has left the table).
    pub(super) fn load(&self) -> u64 {
        self.ticks.load(Ordering::Acquire)
    }

    /// The current ticks, unless frozen or gone.
    pub(super) fn live_ticks(&self) -> Option<u64> {
        storable(self.load())
    }

    /// Freezes the cell for a writer holding its shard's mutex: the ticks it
    /// held. (Under the mutex no cell of the table is frozen by another.)
    pub(super) fn freeze(&self) -> u64 {
        let ticks = self.ticks.swap(FROZEN, Ordering::AcqRel);
        debug_assert_ne!(ticks, FROZEN, "a cell of the table frozen twice");
        ticks
    }

    /// Marks the cell [`GONE`] if it still holds `ticks` (a writer judged
    /// them, and is removing its entry).
    pub(super) fn retire_from(&self, ticks: u64) -> bool {
        self.ticks
            .compare_exchange(ticks, GONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Unfreezes the cell at `ticks` (its writer is done), or leaves it
    /// [`FROZEN`] or [`GONE`] for good.
    pub(super) fn release(&self, ticks: u64) {
        self.ticks.store(ticks, Ordering::Release);
    }

    /// Epoch µs after which the bucket is full (its TAT, rounded up): what
    /// the charge's time-to-live gave the entry.
    pub(super) fn expires_us(&self, ticks: u64) -> u64 {
        self.anchor_us.saturating_add(div_ceil(ticks, self.rate))
    }

    /// The state at `ticks`, as the algorithm keeps it.
    pub(super) fn state(&self, ticks: u64) -> State {
        let (tat_us, frac) = (self.anchor_us + ticks / self.rate, ticks % self.rate);
        match self.kind {
            Kind::Bucket { unit } => State::Bucket(BucketState {
                tat_us,
                frac,
                unit,
                rate: self.rate,
            }),
            Kind::Leaky { unit } => State::Tat(TatState {
                tat_us,
                frac,
                rate: self.rate,
                unit,
            }),
        }
    }

    /// `limit`'s decision for `cost` at `now_us` on the bucket at `ticks`
    /// (expired: as no key), and when allowed the ticks to store and the
    /// charge's undo value. `None`
    /// when the cell cannot answer: another algorithm, unit or rate, or a
    /// charged TAT it cannot express (the locked path then decides).
    ///
    /// In ticks the bucket is `ticks − now` short of full (0 once expired),
    /// and a charge moves it to `now + the units it is short after`: the
    /// algorithms decide on that number ([`TokenBucket::check_missing`],
    /// [`Gcra::check_backlog`]), with no conversion of the TAT to µs and
    /// back. Before the anchor, or a token bucket further from full than
    /// its capacity (a clock stepped back), they decide on the state
    /// itself.
    ///
    /// [`TokenBucket::check_missing`]: crate::algorithm::TokenBucket::check_missing
    /// [`Gcra::check_backlog`]: crate::algorithm::Gcra::check_backlog
    #[inline(always)]
    pub(super) fn decide(
        &self,
        limit: &Limit,
        ticks: u64,
        now_us: u64,
        cost: u64,
    ) -> Option<(TierDecision, Option<Charged>)> {
        // `now_us` in ticks; expired (`expires_us(ticks) <= now_us`) when
        // `ticks` is not past it.
        let now = now_us
            .checked_sub(self.anchor_us)
            .and_then(|d| d.checked_mul(self.rate));
        match (limit, self.kind, now) {
            (Limit::TokenBucket(b), Kind::Bucket { unit }, Some(now))
                if unit == b.unit && b.rate == self.rate =>
            {
                let missing = ticks.saturating_sub(now);
                if missing > b.capacity {
                    return self.decide_on_state(limit, ticks, now_us, cost);
                }
                match b.check_missing(missing, cost) {
                    (d, None) => Some((d, None)),
                    (d, Some(used)) => Some((
                        d,
                        Some(Charged {
                            ticks: storable(now.checked_add(used)?)?,
                            // The units the charge left (`Limit::undo_of`).
                            undo: b.capacity - used,
                        }),
                    )),
                }
            }
            (Limit::LeakyBucket(g), Kind::Leaky { unit }, Some(now))
                if g.bucket.rate == self.rate && g.bucket.unit == unit =>
            {
                let backlog = ticks.saturating_sub(now);
                let d = g.check_backlog(backlog, cost);
                if !d.allowed {
                    return Some((d, None));
                }
                let after = backlog.checked_add(cost.checked_mul(g.bucket.unit)?)?;
                Some((
                    d,
                    Some(Charged {
                        ticks: storable(now.checked_add(after)?)?,
                        // The backlog the charge left (`Limit::undo_of`).
                        undo: after,
                    }),
                ))
            }
            _ => self.decide_on_state(limit, ticks, now_us, cost),
        }
    }

    /// [`TatCell::decide`] through the state the algorithms keep.
    #[cold]
    fn decide_on_state(
        &self,
        limit: &Limit,
        ticks: u64,
        now_us: u64,
        cost: u64,
    ) -> Option<(TierDecision, Option<Charged>)> {
        // Not yet expired: `expires_us(ticks) > now_us`, without a division.
        let live = now_us
            .checked_sub(self.anchor_us)
            .is_none_or(|d| d.checked_mul(self.rate).is_some_and(|t| ticks > t));
        let (tat_us, frac) = (self.anchor_us + ticks / self.rate, ticks % self.rate);
        match (limit, self.kind) {
            (Limit::TokenBucket(b), Kind::Bucket { unit })
                if unit == b.unit && b.rate == self.rate =>
            {
                let state = live.then_some(BucketState {
                    tat_us,
                    frac,
                    unit,
                    rate: self.rate,
                });
                match b.check(state, now_us, cost) {
                    (d, None) => Some((d, None)),
                    (d, Some((s, _))) => {
                        Some((d, Some(self.charged(limit, s.tat_us, s.frac, now_us)?)))
                    }
                }
            }
            (Limit::LeakyBucket(g), Kind::Leaky { unit })
                if g.bucket.rate == self.rate && g.bucket.unit == unit =>
            {
                let state = live.then_some(TatState {
                    tat_us,
                    frac,
                    rate: self.rate,
                    unit,
                });
                let d = g.check(state, now_us, cost);
                if !d.allowed {
                    return Some((d, None));
                }
                let (s, _) = g.charge(state, now_us, cost);
                Some((d, Some(self.charged(limit, s.tat_us, s.frac, now_us)?)))
            }
            _ => None,
        }
    }

    /// The charge to the TAT `tat_us + frac / rate`, if the cell can hold it.
    fn charged(&self, limit: &Limit, tat_us: u64, frac: u64, now_us: u64) -> Option<Charged> {
        let ticks = self.ticks_of(tat_us, frac)?;
        Some(Charged {
            ticks,
            undo: self.undo(limit, ticks, now_us),
        })
    }

    /// [`Limit::undo_of`] the state at `ticks`, charged at `now_us`: for
    /// both algorithms, in ticks, what the charge left (the token bucket's
    /// units left, the leaky bucket's backlog).
    #[inline]
    pub(super) fn undo(&self, limit: &Limit, ticks: u64, now_us: u64) -> u64 {
        let now = now_us
            .checked_sub(self.anchor_us)
            .and_then(|d| d.checked_mul(self.rate))
            .filter(|&now| now <= ticks);
        match (limit, self.kind, now) {
            (Limit::TokenBucket(b), Kind::Bucket { unit }, Some(now))
                if unit == b.unit && b.rate == self.rate && ticks - now <= b.capacity =>
            {
                b.capacity - (ticks - now)
            }
            (Limit::LeakyBucket(g), Kind::Leaky { unit }, Some(now))
                if g.bucket.rate == self.rate && g.bucket.unit == unit =>
            {
                ticks - now
            }
            _ => limit.undo_of(&self.state(ticks), now_us),
        }
    }

    /// Stores `new` if the cell still holds `old`; else returns what it
    /// holds ([`FROZEN`] or [`GONE`]: a writer holds it, or it has left the
    /// table).
    pub(super) fn swap_from(&self, old: u64, new: u64) -> Result<(), u64> {
        self.ticks
            .compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }

    /// Gives back a charge this check made at `now_us` that moved the cell
    /// from `old` to `new`: the TAT goes back by what the charge added
    /// (`new − max(old, now)`), never before `now_us`. This is
    /// [`Limit::refund`] at the charge's own instant (nothing refilled yet:
    /// all of it is given back), applied to whatever other requests have
    /// charged since. `now_us` is the clock when giving back (a charge made
    /// earlier gives back only what has not refilled since). False when
    /// the cell is frozen or gone: the caller settles under the shard's
    /// mutex.
    #[must_use]
    pub(super) fn give_back(&self, old: u64, new: u64, now_us: u64) -> bool {
        let floor = self.ticks_at(now_us);
        let back = new.saturating_sub(old.max(floor));
        self.ticks
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                storable(cur).map(|cur| cur.saturating_sub(back).max(floor.min(cur)))
            })
            .is_ok()
    }

    /// The ticks of `state` in this cell, if it is of this cell's kind, unit
    /// and rate and fits.
    pub(super) fn ticks_of_state(&self, state: &State) -> Option<u64> {
        match (state, self.kind) {
            (State::Bucket(s), Kind::Bucket { unit }) if s.unit == unit && s.rate == self.rate => {
                self.ticks_of(s.tat_us, s.frac)
            }
            (State::Tat(s), Kind::Leaky { unit }) if s.rate == self.rate && s.unit == unit => {
                self.ticks_of(s.tat_us, s.frac)
            }
            _ => None,
        }
    }
}
