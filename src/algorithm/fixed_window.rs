//! Fixed window: one counter per window, windows aligned to the Unix epoch.
//!
//! O(1) state (`window start, count`). Known behaviour, kept on purpose: a
//! client can spend a whole quota at the end of one window and another at the
//! start of the next, so up to **2 × limit** requests pass within a span much
//! shorter than the window (the "boundary burst").

use super::{TierDecision, Window};

/// Stored state: the window's start (epoch µs) and the cost counted in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Start of the counted window, epoch microseconds (a multiple of the window).
    pub start_us: u64,
    /// Cost admitted in that window.
    pub count: u64,
}

impl Window {
    fn window_start(&self, now_us: u64) -> u64 {
        now_us - now_us % self.window_us
    }

    /// Fixed-window decision for `cost` at `now_us`.
    pub fn fixed_check(
        &self,
        state: Option<FixedWindowState>,
        now_us: u64,
        cost: u64,
    ) -> TierDecision {
        let start = self.window_start(now_us);
        decide_in(
            self.limit,
            (start, start + self.window_us),
            state,
            now_us,
            cost,
        )
    }

    /// The state after admitting `cost` at `now_us`, and its time-to-live (µs).
    pub fn fixed_charge(
        &self,
        state: Option<FixedWindowState>,
        now_us: u64,
        cost: u64,
    ) -> (FixedWindowState, u64) {
        let start = self.window_start(now_us);
        charge_in((start, start + self.window_us), state, now_us, cost)
    }
}

/// The decision for `cost` at `now_us` in the window `[start, end)` (epoch
/// µs) of `limit`: what a fixed window and a calendar window
/// ([`super::calendar::CalendarWindow`]) share.
pub(crate) fn decide_in(
    limit: u64,
    (start, end): (u64, u64),
    state: Option<FixedWindowState>,
    now_us: u64,
    cost: u64,
) -> TierDecision {
    let count = state.filter(|s| s.start_us == start).map_or(0, |s| s.count);
    let end_in = end.saturating_sub(now_us);
    if count + cost <= limit {
        let after = count + cost;
        TierDecision {
            allowed: true,
            limit,
            remaining: limit - after,
            reset_after_us: end_in,
            retry_after_us: 0,
            delay_us: 0,
        }
    } else {
        let reset_after_us = if count == 0 { 0 } else { end_in };
        TierDecision {
            allowed: false,
            limit,
            remaining: limit - count.min(limit),
            reset_after_us,
            // The next window starts empty; a cost above the limit never
            // fits, and the wait we report for it is the reset.
            retry_after_us: if cost > limit { reset_after_us } else { end_in },
            delay_us: 0,
        }
    }
}

/// The state after admitting `cost` at `now_us` in the window `[start,
/// end)`, and its time-to-live (µs): until the window ends.
pub(crate) fn charge_in(
    (start, end): (u64, u64),
    state: Option<FixedWindowState>,
    now_us: u64,
    cost: u64,
) -> (FixedWindowState, u64) {
    let count = state.filter(|s| s.start_us == start).map_or(0, |s| s.count);
    (
        FixedWindowState {
            start_us: start,
            count: count + cost,
        },
        end.saturating_sub(now_us),
    )
}
