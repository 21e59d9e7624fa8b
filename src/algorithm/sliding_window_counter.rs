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

/// Stored state: the current window's start (epoch µs) and the costs counted
/// in it and in the window before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterState {
    /// Start of the current window, epoch microseconds.
    pub start_us: u64,
    /// Cost admitted in the current window.
    pub current: u64,
    /// Cost admitted in the previous window.
    pub previous: u64,
}

impl Window {
    /// `(window start, previous, current)` as seen at `now_us`.
    fn counters(&self, state: Option<CounterState>, now_us: u64) -> (u64, u64, u64) {
        let w = self.window_us;
        let start = now_us - now_us % w;
        match state {
            Some(s) if s.start_us == start => (start, s.previous, s.current),
            Some(s) if s.start_us + w == start => (start, s.current, 0),
            _ => (start, 0, 0),
        }
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
        };
        (s, self.counter_reset(start, prev, cur + cost, now_us))
    }
}
