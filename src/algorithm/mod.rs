//! Pure, clock-free models of the rate-limiting algorithms.
//!
//! Each algorithm is a pair of functions of `(parameters, stored state, now,
//! cost)`: a *check* giving the [`TierDecision`], and a *charge* giving the state
//! to store once every tier of the request has allowed it (all or nothing).
//! Nothing here does I/O or reads a clock: the memory backend calls these
//! functions directly, and the Redis Lua scripts in `lua/` are line-by-line
//! twins of them, so tests use this module as the oracle for both backends.
//!
//! All time is integer **microseconds** and all state is integer, so nothing
//! drifts however many operations a key sees. See `docs/algorithms.md` for
//! the trade-offs and measured costs.

// The models, one module each (private: their types are re-exported below,
// each at one path; the module comments say how each algorithm works, and
// docs/algorithms.md compares them).
pub(crate) mod calendar;
mod carry;
pub(crate) mod concurrency;
pub(crate) mod fixed_window;
pub(crate) mod gcra;
pub(crate) mod kind;
pub(crate) mod penalty;
mod settle;
pub(crate) use carry::carry_units;
pub(crate) mod sliding_window_counter;
pub(crate) mod sliding_window_log;
pub(crate) mod token_bucket;

#[cfg(not(feature = "calendar"))]
pub(crate) use calendar::Calendar;
#[cfg(feature = "calendar")]
#[cfg_attr(docsrs, doc(cfg(feature = "calendar")))]
pub use calendar::{time_zone_names, Calendar};
pub use calendar::{CalendarError, CalendarPeriod, CalendarWindow};
pub use concurrency::{Concurrency, SlotState, DEFAULT_SLOT_TTL_US, RETRY_ESTIMATE_US};
pub use fixed_window::FixedWindowState;
pub use gcra::{Gcra, TatState};
pub use penalty::{PenaltyBox, PenaltyOutcome, PenaltyState, PENALTY_KEY_SUFFIX};
pub use sliding_window_counter::CounterState;
pub use sliding_window_log::LogState;
pub use token_bucket::{BucketState, TokenBucket};

/// The outcome of checking one tier for one request.
///
/// Durations are integer microseconds, relative to the `now` the check ran at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierDecision {
    /// Whether this tier admits the request (and, if every tier does, charges it).
    pub allowed: bool,
    /// The tier's capacity in whole requests (the burst, or the window's limit).
    pub limit: u64,
    /// Whole requests left after this decision (after charging, when allowed;
    /// untouched, when denied). Never above `limit`. When another tier denies
    /// the request, nothing is charged and an allowing tier's `remaining` is
    /// what it *would* have left.
    pub remaining: u64,
    /// Microseconds until the tier is back to its full capacity.
    pub reset_after_us: u64,
    /// Microseconds until this request's cost would be admitted; `0` when
    /// allowed. For a cost above the tier's capacity (which can never pass)
    /// it is `reset_after_us`: the time until the tier is full again.
    pub retry_after_us: u64,
    /// Microseconds the request must wait before it is passed (shaping leaky
    /// bucket only; `0` otherwise).
    pub delay_us: u64,
}

/// A window-based limit: at most `limit` cost per `window_us` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Cost admitted per window.
    pub limit: u64,
    /// Window length, microseconds.
    pub window_us: u64,
}

impl Window {
    /// The largest `limit` of a fixed window or sliding log (2^52 − 1): the
    /// Lua twin adds a cost of up to `limit + 1` (the layer clamps costs to
    /// the capacity + 1) to a count of up to `limit`, and `2 × limit + 1`
    /// must stay at or below [`MAX_EXACT`].
    pub const MAX_LIMIT: u64 = (MAX_EXACT - 1) / 2;

    /// Whether the sliding window counter's scaled values stay exact:
    /// `(2 × limit + 1) × window_us ≤ 2^53` (an estimate of up to
    /// `limit × window_us` plus a cost of up to `(limit + 1) × window_us`).
    pub fn counter_is_exact(&self) -> bool {
        (u128::from(self.limit) * 2 + 1) * u128::from(self.window_us) <= u128::from(MAX_EXACT)
    }
}

/// Every value the Redis scripts handle must stay at or below 2^53: Lua
/// numbers are doubles, exact for every integer up to there.
pub const MAX_EXACT: u64 = 1 << 53;

/// The longest period (window) of any algorithm, in microseconds: 2^51 µs,
/// about 71 years. Timestamps the scripts compute reach `now + 2 × period`
/// (the sliding counter's reset), which stays at or below 2^53 while the
/// clock is below 2^52 µs (the year 2112).
pub const MAX_PERIOD_US: u64 = 1 << 51;

/// One tier's algorithm with its integer parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Limit {
    /// A fixed window: at most `limit` per window, the count starting over
    /// at each window's start.
    FixedWindow(Window),
    /// A fixed window over calendar boundaries ([`Calendar`]).
    Calendar(CalendarWindow),
    /// A sliding window log: every admission's time kept ([`LogState`]).
    SlidingWindowLog(Window),
    /// A sliding window counter: the previous window's count weighted by
    /// its overlap ([`CounterState`]).
    SlidingWindowCounter(Window),
    /// A token bucket ([`TokenBucket`]).
    TokenBucket(TokenBucket),
    /// A leaky bucket as GCRA ([`Gcra`]: police or shape).
    LeakyBucket(Gcra),
    /// Requests in flight ([`Concurrency`]).
    Concurrency(Concurrency),
    /// A tier's penalty box ([`PenaltyBox`]), checked right after the tier.
    Penalty(PenaltyBox),
    /// A per-key override's read (see [`handle`](crate::handle#per-key-overrides)), checked
    /// right before its tier: always allows, never charged.
    Override,
}

/// The stored state of one key, per algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum State {
    /// Fixed window.
    FixedWindow(FixedWindowState),
    /// Sliding window log.
    Log(LogState),
    /// Sliding window counter.
    Counter(CounterState),
    /// Token bucket.
    Bucket(BucketState),
    /// GCRA.
    Tat(TatState),
    /// Concurrency slots.
    Slots(SlotState),
    /// A penalty box's strikes and block.
    Penalty(PenaltyState),
}

impl Limit {
    /// The capacity in whole requests (what `X-RateLimit-Limit` shows).
    pub fn capacity(&self) -> u64 {
        match self {
            Limit::FixedWindow(w) | Limit::SlidingWindowLog(w) | Limit::SlidingWindowCounter(w) => {
                w.limit
            }
            Limit::Calendar(c) => c.limit,
            Limit::TokenBucket(b) => b.burst(),
            Limit::LeakyBucket(g) => g.bucket.burst(),
            Limit::Concurrency(c) => c.limit,
            Limit::Penalty(p) => p.capacity(),
            Limit::Override => 0,
        }
    }

    /// The decision for `cost` at `now_us` given the stored `state` (`None`
    /// for a key never seen or expired; a state of another algorithm counts
    /// as none).
    pub fn check(&self, state: Option<&State>, now_us: u64, cost: u64) -> TierDecision {
        match (self, state) {
            (Limit::FixedWindow(w), s) => w.fixed_check(fixed(s), now_us, cost),
            (Limit::Calendar(c), s) => c.check(fixed(s), now_us, cost),
            (Limit::SlidingWindowLog(w), Some(State::Log(l))) => w.log_check(Some(l), now_us, cost),
            (Limit::SlidingWindowLog(w), _) => w.log_check(None, now_us, cost),
            (Limit::SlidingWindowCounter(w), s) => w.counter_check(counter(s), now_us, cost),
            (Limit::TokenBucket(b), s) => b.check(bucket(s), now_us, cost).0,
            (Limit::LeakyBucket(g), s) => g.check(tat(s), now_us, cost),
            // One slot per request, whatever its cost.
            (Limit::Concurrency(c), Some(State::Slots(l))) => c.check(Some(l), now_us),
            (Limit::Concurrency(c), _) => c.check(None, now_us),
            // Alone (a peek), a penalty box only says whether it blocks.
            (Limit::Penalty(p), Some(State::Penalty(s))) => p.check(Some(s), now_us, true).0,
            (Limit::Penalty(p), _) => p.check(None, now_us, true).0,
            (Limit::Override, _) => TierDecision {
                allowed: true,
                limit: 0,
                remaining: 0,
                reset_after_us: 0,
                retry_after_us: 0,
                delay_us: 0,
            },
        }
    }

    /// [`Limit::check`], and for the algorithms whose check computes the
    /// charged state anyway (the token bucket), that state and its
    /// time-to-live: exactly what [`Limit::charge`] would return for the
    /// same arguments, so a caller that charges can skip recomputing it.
    pub(crate) fn check_prepared(
        &self,
        state: Option<&State>,
        now_us: u64,
        cost: u64,
    ) -> (TierDecision, Option<(State, u64)>) {
        match self {
            Limit::TokenBucket(b) => {
                let (d, charged) = b.check(bucket(state), now_us, cost);
                (d, charged.map(|(s, ttl)| (State::Bucket(s), ttl)))
            }
            _ => (self.check(state, now_us, cost), None),
        }
    }

    /// Charges `cost` at `now_us` (only after [`Limit::check`] allowed it on
    /// every tier): the state to store and its time-to-live in microseconds
    /// (the time until the key would mean the same as no key).
    pub fn charge(&self, state: Option<State>, now_us: u64, cost: u64) -> (State, u64) {
        match self {
            Limit::FixedWindow(w) => {
                let (s, ttl) = w.fixed_charge(fixed(state.as_ref()), now_us, cost);
                (State::FixedWindow(s), ttl)
            }
            Limit::Calendar(c) => {
                let (s, ttl) = c.charge(fixed(state.as_ref()), now_us, cost);
                (State::FixedWindow(s), ttl)
            }
            Limit::SlidingWindowLog(w) => {
                let mut log = match state {
                    Some(State::Log(l)) => l,
                    _ => LogState::new(),
                };
                let ttl = w.log_charge(&mut log, now_us, cost);
                (State::Log(log), ttl)
            }
            Limit::SlidingWindowCounter(w) => {
                let (s, ttl) = w.counter_charge(counter(state.as_ref()), now_us, cost);
                (State::Counter(s), ttl)
            }
            Limit::TokenBucket(b) => {
                let (s, ttl, _) = bucket_charge(b, state, now_us, cost);
                (s, ttl)
            }
            Limit::LeakyBucket(g) => {
                let (s, ttl) = g.charge(tat(state.as_ref()), now_us, cost);
                (State::Tat(s), ttl)
            }
            // A penalty box is not charged (its strikes are written by
            // `Limit::penalty_check`, whatever the commit): what is there stays.
            Limit::Penalty(p) => match state {
                Some(State::Penalty(s)) => {
                    let ttl = p.ttl(&s, now_us);
                    (State::Penalty(s), ttl)
                }
                _ => (State::Penalty(PenaltyState::default()), 0),
            },
            // Never charged (the memory check skips it): nothing to keep.
            Limit::Override => (State::Penalty(PenaltyState::default()), 0),
            Limit::Concurrency(c) => {
                let slots = match state {
                    Some(State::Slots(l)) => Some(l),
                    _ => None,
                };
                let (s, ttl) = c.charge(slots, now_us);
                (State::Slots(s), ttl)
            }
        }
    }
}

impl Limit {
    /// Whether this is a penalty box (never charged).
    pub fn is_penalty(&self) -> bool {
        matches!(self, Limit::Penalty(_))
    }

    /// Whether this is an override's read (never charged).
    pub fn is_override(&self) -> bool {
        matches!(self, Limit::Override)
    }

    /// A penalty box's check (see [`PenaltyBox`]), given whether the check just
    /// before it (its tier's) allowed the request: the decision and the
    /// state to store now, whatever the commit (`None`: none). `None` for
    /// any other limit.
    pub fn penalty_check(
        &self,
        state: Option<&State>,
        now_us: u64,
        tier_allowed: bool,
    ) -> Option<(TierDecision, Option<(State, u64)>)> {
        let Limit::Penalty(p) = self else {
            return None;
        };
        let s = match state {
            Some(State::Penalty(s)) => Some(s),
            _ => None,
        };
        let (d, write) = p.check(s, now_us, tier_allowed);
        Some((d, write.map(|(s, ttl)| (State::Penalty(s), ttl))))
    }
}

fn fixed(s: Option<&State>) -> Option<FixedWindowState> {
    match s {
        Some(State::FixedWindow(f)) => Some(*f),
        _ => None,
    }
}
fn counter(s: Option<&State>) -> Option<CounterState> {
    match s {
        Some(State::Counter(c)) => Some(*c),
        _ => None,
    }
}
/// A token bucket's charge (see [`Limit::charge`]): the state to store, its
/// time-to-live (µs), and whether the cost was taken. Not taken when the
/// bucket no longer fits it after all (a key listed twice, its later
/// charge on the bucket the earlier emptied): what was there is kept, until
/// it is full again. (A time-to-live of 0 here stored the bucket as
/// expired: full again at once.)
fn bucket_charge(
    b: &TokenBucket,
    state: Option<State>,
    now_us: u64,
    cost: u64,
) -> (State, u64, bool) {
    match b.check(bucket(state.as_ref()), now_us, cost) {
        (_, Some((s, ttl))) => (State::Bucket(s), ttl, true),
        (d, None) => (
            state.unwrap_or(State::Bucket(b.state_at(0, now_us))),
            d.reset_after_us,
            false,
        ),
    }
}

fn bucket(s: Option<&State>) -> Option<BucketState> {
    match s {
        Some(State::Bucket(b)) => Some(*b),
        _ => None,
    }
}
fn tat(s: Option<&State>) -> Option<TatState> {
    match s {
        Some(State::Tat(t)) => Some(*t),
        _ => None,
    }
}

/// `ceil(a / b)` for `b > 0`.
pub(crate) const fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// What a refund does to a stored key (see [`Limit::refund`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refund {
    /// Nothing to give back (refill or a new window absorbed the charge, or
    /// the stored value is not this charge's): leave the key alone.
    Keep,
    /// The key now means what no key means (full bucket, empty window):
    /// delete it.
    Delete,
    /// Store this state, with this time-to-live in microseconds (`None`:
    /// keep the key's current expiry).
    Store(State, Option<u64>),
}

impl Limit {
    /// What [`Limit::charge`]'s resulting `state` gives a later refund (the
    /// `undo` of `lua/refund.lua`): token bucket, the tokens left in units;
    /// leaky bucket, the backlog after the charge in ticks; others, 0 (the
    /// Redis sliding log uses the member's sequence number instead, which
    /// the in-memory log does not need).
    pub fn undo_of(&self, state: &State, now_us: u64) -> u64 {
        match (self, state) {
            (Limit::TokenBucket(b), State::Bucket(s)) => {
                b.capacity.saturating_sub(b.missing(Some(*s), now_us))
            }
            (Limit::LeakyBucket(_), State::Tat(t)) => {
                t.tat_us.saturating_sub(now_us).saturating_mul(t.rate) + t.frac
            }
            _ => 0,
        }
    }

    /// [`Limit::charge`] and the charge's undo value: [`Limit::undo_of`] the
    /// state it stores, or, for a token bucket that no longer fits (a key
    /// listed twice) and keeps its state, a full bucket's (`capacity`), so
    /// that giving the charge back gives nothing back (as
    /// `token_bucket_charge` in lua/token_bucket.lua answers).
    pub(crate) fn charge_undo(
        &self,
        state: Option<State>,
        now_us: u64,
        cost: u64,
    ) -> (State, u64, u64) {
        let (s, ttl, taken) = match self {
            Limit::TokenBucket(b) => bucket_charge(b, state, now_us, cost),
            _ => {
                let (s, ttl) = self.charge(state, now_us, cost);
                (s, ttl, true)
            }
        };
        let undo = match self {
            Limit::TokenBucket(b) if !taken => b.capacity,
            _ => self.undo_of(&s, now_us),
        };
        (s, ttl, undo)
    }

    /// Gives back a charge of `cost` made at `charged_at_us` (its `undo` as
    /// [`Limit::undo_of`] returned it), at `now_us`, given the key's stored
    /// `state` (`None`: no key, or expired). The twin of `lua/refund.lua`:
    /// gives back what the charge still takes away, never more. Refill or a
    /// new window may already have absorbed part of it; that part is not
    /// given back, so a refund never admits more than if the request had
    /// never been charged at all. A state of another algorithm or window,
    /// or one its bucket does not read ([`TokenBucket::reads`],
    /// [`Gcra`]'s rate), is left alone.
    pub fn refund(
        &self,
        state: Option<&State>,
        now_us: u64,
        charged_at_us: u64,
        cost: u64,
        undo: u64,
    ) -> Refund {
        match (self, state) {
            (_, None) => Refund::Keep,
            (Limit::FixedWindow(_) | Limit::Calendar(_), Some(State::FixedWindow(s))) => {
                // The charge's window: a window carried over a quota
                // change is not it, and is left alone.
                let (start, end) = match self {
                    Limit::FixedWindow(w) => {
                        let start = charged_at_us - charged_at_us % w.window_us;
                        (start, start + w.window_us)
                    }
                    Limit::Calendar(c) => c.window(charged_at_us),
                    _ => return Refund::Keep,
                };
                if (s.start_us, s.end_us) != (start, end) {
                    return Refund::Keep;
                }
                match s.count.checked_sub(cost).filter(|&c| c > 0) {
                    None => Refund::Delete,
                    Some(count) => Refund::Store(
                        State::FixedWindow(FixedWindowState {
                            start_us: start,
                            count,
                            end_us: end,
                        }),
                        None,
                    ),
                }
            }
            (Limit::SlidingWindowLog(_), Some(State::Log(log))) => {
                let Some(at) = log
                    .iter()
                    .position(|&(t, c)| t == charged_at_us && c == cost)
                else {
                    return Refund::Keep;
                };
                let mut log = log.clone();
                log.remove(at);
                if log.is_empty() {
                    Refund::Delete
                } else {
                    Refund::Store(State::Log(log), None)
                }
            }
            (Limit::SlidingWindowCounter(w), Some(State::Counter(s))) => {
                let start = charged_at_us - charged_at_us % w.window_us;
                let mut s = *s;
                if s.window_us != w.window_us {
                    return Refund::Keep;
                }
                if s.start_us == start {
                    s.current = s.current.saturating_sub(cost);
                } else if s.start_us == start + w.window_us {
                    // A later request opened the next window: this charge
                    // is in `previous`.
                    s.previous = s.previous.saturating_sub(cost);
                } else {
                    return Refund::Keep;
                }
                if s.current == 0 && s.previous == 0 {
                    Refund::Delete
                } else {
                    Refund::Store(State::Counter(s), None)
                }
            }
            (Limit::TokenBucket(b), Some(State::Bucket(s))) => {
                let cost = cost.saturating_mul(b.unit);
                // Without this charge the bucket would have been full after
                // (capacity - left - cost) / rate µs.
                let elapsed = now_us
                    .saturating_sub(charged_at_us)
                    .min(div_ceil(b.capacity, b.rate));
                let back = b
                    .capacity
                    .saturating_sub(undo)
                    .saturating_sub(elapsed * b.rate)
                    .min(cost);
                if back == 0 || !b.reads(s) {
                    return Refund::Keep;
                }
                // Refill to now exactly as the check does, then add back.
                let missing = b.missing(Some(*s), now_us).saturating_sub(back);
                if missing == 0 {
                    Refund::Delete
                } else {
                    Refund::Store(
                        State::Bucket(b.state_at(missing, now_us)),
                        Some(div_ceil(missing, b.rate)),
                    )
                }
            }
            // A concurrency charge is its slot: the refund releases it.
            (Limit::Concurrency(c), Some(State::Slots(l))) => {
                match Concurrency::release(l, c.slot, now_us) {
                    None => Refund::Delete,
                    Some(left) if left.len() == l.len() => Refund::Keep,
                    Some(left) => Refund::Store(State::Slots(left), None),
                }
            }
            (Limit::LeakyBucket(g), Some(State::Tat(s))) => {
                let (rate, cost) = (g.bucket.rate, cost.saturating_mul(g.bucket.unit));
                // Without this charge the backlog would have drained after
                // (after - cost) / rate µs.
                let elapsed = now_us
                    .saturating_sub(charged_at_us)
                    .min(div_ceil(undo, rate));
                let back = undo.saturating_sub(elapsed * rate).min(cost);
                if back == 0 || s.tat_us < now_us || s.rate != rate || s.unit != g.bucket.unit {
                    return Refund::Keep;
                }
                let Some(backlog) = g.backlog_of(s, now_us) else {
                    return Refund::Keep;
                };
                let backlog = backlog.saturating_sub(back);
                if backlog == 0 {
                    Refund::Delete
                } else {
                    Refund::Store(
                        State::Tat(TatState {
                            tat_us: now_us + backlog / rate,
                            frac: backlog % rate,
                            rate,
                            unit: g.bucket.unit,
                        }),
                        Some(div_ceil(backlog, rate)),
                    )
                }
            }
            _ => Refund::Keep,
        }
    }
}
