//! A quota change: the state a key keeps when it is checked under another
//! quota than the one that wrote it ([`Limit::carry`]): its used capacity,
//! per algorithm. `docs/rollout.md` ("A quota change: nothing free") states
//! the rule; `lua/common.lua` (`carry_units`) and each algorithm's Lua twin
//! apply it on Redis.

use super::{div_ceil, CalendarWindow, FixedWindowState, Limit, State, TatState, TokenBucket};

impl Limit {
    /// The state `state` becomes under this limit at `now_us` when it was
    /// written under another quota (a quota changed at run time, a plan's,
    /// an override's; `docs/rollout.md`, "A quota change"), and its
    /// time-to-live (µs): the used capacity at `now_us` in this quota's
    /// terms ([`BucketState`](super::BucketState), [`TatState`], [`FixedWindowState`],
    /// [`CounterState`](super::CounterState): a sliding log's entries mean the same under any
    /// window). `None` when there is nothing to carry: no state, a state of
    /// this quota, of another algorithm, or one that means no use.
    ///
    /// Both backends store what this returns at the first check of the key
    /// under the new quota, whatever its decision (it is not a charge), so
    /// that from then on the key refills at the new quota's rate and every
    /// `Retry-After` the new quota computes holds. [`Limit::check`] on
    /// `state` at `now_us` decides as on the carried state.
    pub fn carry(&self, state: Option<&State>, now_us: u64) -> Option<(State, u64)> {
        match (self, state?) {
            (Limit::TokenBucket(b), State::Bucket(s)) if !b.reads(s) => {
                let missing = b.missing(Some(*s), now_us);
                (missing > 0).then(|| {
                    (
                        State::Bucket(b.state_at(missing, now_us)),
                        div_ceil(missing, b.rate),
                    )
                })
            }
            (Limit::LeakyBucket(g), State::Tat(s))
                if (s.rate, s.unit) != (g.bucket.rate, g.bucket.unit) =>
            {
                let (rate, backlog) = (g.bucket.rate, g.backlog_of(s, now_us)?);
                (backlog > 0).then(|| {
                    let t = TatState {
                        tat_us: now_us + backlog / rate,
                        frac: backlog % rate,
                        rate,
                        unit: g.bucket.unit,
                    };
                    (State::Tat(t), div_ceil(backlog, rate))
                })
            }
            (Limit::FixedWindow(w), State::FixedWindow(s)) => {
                let start = now_us - now_us % w.window_us;
                carry_window(s, (start, start + w.window_us), now_us, 0)
            }
            (Limit::Calendar(c), State::FixedWindow(s)) => {
                carry_window(s, c.window(now_us), now_us, CalendarWindow::TTL_MARGIN_US)
            }
            (Limit::SlidingWindowCounter(w), State::Counter(s)) if s.window_us != w.window_us => {
                let (s, ttl) = w.counter_charge(Some(*s), now_us, 0);
                (s.current > 0).then_some((State::Counter(s), ttl))
            }
            _ => None,
        }
    }
}

/// A window's state carried into the window `current` of another quota
/// (see [`Limit::carry`]): its count while its own window is open, when
/// that is not `current`.
fn carry_window(
    s: &FixedWindowState,
    (start, end): (u64, u64),
    now_us: u64,
    margin_us: u64,
) -> Option<(State, u64)> {
    if (s.start_us, s.end_us) == (start, end) {
        return None;
    }
    let count = FixedWindowState::count_at(Some(*s), now_us);
    (count > 0).then(|| {
        let carried = FixedWindowState {
            start_us: start,
            count,
            end_us: end,
        };
        (State::FixedWindow(carried), end - now_us + margin_us)
    })
}

/// The used capacity of a bucket carried over a quota change: `units` of a
/// quota of `from_unit` units per token, in units of a quota of `to_unit`
/// per token (the same tokens: `units × to_unit / from_unit`), rounded up
/// (a fraction of a unit goes against the client) and at most 2^52
/// ([`TokenBucket::MAX_CAPACITY_UNITS`]). Twin of `carry_units` in
/// `lua/common.lua`; `docs/rollout.md` ("A quota change") states the rule.
pub(crate) fn carry_units(units: u64, from_unit: u64, to_unit: u64) -> u64 {
    const MOST: u64 = TokenBucket::MAX_CAPACITY_UNITS;
    if from_unit == to_unit || from_unit == 0 {
        return units;
    }
    let carried = (u128::from(units) * u128::from(to_unit)).div_ceil(u128::from(from_unit));
    u64::try_from(carried).map_or(MOST, |c| c.min(MOST))
}
