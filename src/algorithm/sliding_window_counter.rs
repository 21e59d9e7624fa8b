//! Sliding window counter: the current and previous fixed windows, with the
//! previous one weighted by how much of it still overlaps the sliding window
//! (the approximation Cloudflare described in 2017).
//!
//! O(1) state. The estimate at `e` µs into the current window is
//! `prev × (W − e) / W + cur`; a request passes when `estimate + cost ≤ limit`.
//! All of it is computed multiplied by `W`, in integers, so there is no
//! rounding. It assumes the previous window's requests were spread evenly:
//! when they were not, the true count in the last `W` can exceed the limit
//! (bounded by 2 × limit in the adversarial worst case; `docs/algorithms.md`
//! measures it against the exact log).

use super::{TierDecision, Window};

/// Stored state: the current window's start (epoch µs) and length, and the
/// costs counted in it and in the window before.
///
/// Read under a quota of another window length (a quota changed at run
/// time, a plan, an override), the state's own estimate at `now`, rounded
/// up, becomes the count of the new quota's current window (the previous
/// one empty): the used capacity carries over, placed at `now`, the latest
/// it can be, so it weighs at least as long as it would have. Under the
/// same window length both counts carry over as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterState {
    /// Start of the current window, epoch microseconds.
    pub start_us: u64,
    /// Cost admitted in the current window.
    pub current: u64,
    /// Cost admitted in the previous window.
    pub previous: u64,
    /// The windows' length, microseconds.
    pub window_us: u64,
}

impl CounterState {
    /// This state's estimate at `now_us` in its own windows, rounded up to
    /// a whole count (0 once both windows have passed, or for a window
    /// that starts after `now_us`).
    pub(crate) fn estimate_at(&self, now_us: u64) -> u64 {
        let (s, w) = (self.start_us, self.window_us);
        if w == 0 || now_us < s {
            return 0;
        }
        let (e, w, prev, cur) = (
            u128::from(now_us - s),
            u128::from(w),
            u128::from(self.previous),
            u128::from(self.current),
        );
        let scaled = if e < w {
            prev * (w - e) + cur * w
        } else if e < 2 * w {
            cur * (2 * w - e)
        } else {
            0
        };
        u64::try_from(scaled.div_ceil(w)).unwrap_or(u64::MAX)
    }
}

impl Window {
    /// `(window start, previous, current)` as seen at `now_us`.
    fn counters(&self, state: Option<CounterState>, now_us: u64) -> (u64, u64, u64) {
        let w = self.window_us;
        let start = now_us - now_us % w;
        match state {
            Some(s) if s.window_us != w => {
                (start, 0, s.estimate_at(now_us).min(self.most_carried()))
            }
            Some(s) if s.start_us == start => (start, s.previous, s.current),
            Some(s) if s.start_us + w == start => (start, s.current, 0),
            _ => (start, 0, 0),
        }
    }

    /// The largest count carried into this window from a state of another
    /// window length: `2^53 / window − limit − 1`, so that the Lua twin's
    /// `count × window` plus a cost stays exact (at least the limit, see
    /// [`Window::counter_is_exact`]).
    fn most_carried(&self) -> u64 {
        (super::MAX_EXACT / self.window_us)
            .saturating_sub(self.limit + 1)
            .max(self.limit)
    }

    /// The time (µs from now) at which the counters are back to zero.
    fn counter_reset(&self, start: u64, prev: u64, cur: u64, now_us: u64) -> u64 {
        if cur > 0 {
            start + 2 * self.window_us - now_us
        } else if prev > 0 {
            start + self.window_us - now_us
        } else {
            0
        }
    }

    /// Sliding-counter decision for `cost` at `now_us`.
    pub fn counter_check(
        &self,
        state: Option<CounterState>,
        now_us: u64,
        cost: u64,
    ) -> TierDecision {
        let w = self.window_us;
        let (start, prev, cur) = self.counters(state, now_us);
        let e = now_us - start;
        let cap = self.limit * w;
        let est = prev * (w - e) + cur * w;
        if est + cost * w <= cap {
            let est = est + cost * w;
            TierDecision {
                allowed: true,
                limit: self.limit,
                remaining: (cap - est) / w,
                reset_after_us: self.counter_reset(start, prev, cur + cost, now_us),
                retry_after_us: 0,
                delay_us: 0,
            }
        } else {
            let reset_after_us = self.counter_reset(start, prev, cur, now_us);
            let retry_after_us = if cost > self.limit {
                reset_after_us
            } else if cur + cost <= self.limit {
                // Later in this window, once the previous window's weight has
                // shrunk enough: prev × (W − e') ≤ (limit − cost − cur) × W.
                let room = (self.limit - cost - cur) * w;
                start + w - room / prev - now_us
            } else {
                // In the next window, where `cur` becomes the previous count.
                let room = (self.limit - cost) * w;
                let wait_in_next = room.checked_div(cur).map_or(0, |r| w.saturating_sub(r));
                start + w + wait_in_next - now_us
            };
            TierDecision {
                allowed: false,
                limit: self.limit,
                remaining: cap.saturating_sub(est) / w,
                reset_after_us,
                retry_after_us,
                delay_us: 0,
            }
        }
    }

    /// The state after admitting `cost` at `now_us`, and its time-to-live (µs).
    pub fn counter_charge(
        &self,
        state: Option<CounterState>,
        now_us: u64,
        cost: u64,
    ) -> (CounterState, u64) {
        let (start, prev, cur) = self.counters(state, now_us);
        let s = CounterState {
            start_us: start,
            current: cur + cost,
            previous: prev,
            window_us: self.window_us,
        };
        (s, self.counter_reset(start, prev, cur + cost, now_us))
    }
}
