//! Fixed window: one counter per window, windows aligned to the Unix epoch.
//!
//! O(1) state (`window start, count`). Known behaviour, kept on purpose: a
//! client can spend a whole quota at the end of one window and another at the
//! start of the next, so up to **2 × limit** requests pass within a span much
//! shorter than the window (the "boundary burst").

use super::{TierDecision, Window};

/// Stored state: the counted window, `[start_us, end_us)` (epoch µs), and
/// the cost counted in it.
///
/// Read under any quota (the one it was written under, or another after a
/// quota change at run time, a plan, an override), a state whose window is
/// still open at `now` (`start_us ≤ now < end_us`) **keeps its count**: the
/// count goes against the quota's limit in the quota's own window of `now`
/// (the same window, with the same boundary, when the window length is
/// unchanged). A state whose window has closed counts as none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Start of the counted window, epoch microseconds.
    pub start_us: u64,
    /// Cost admitted in that window.
    pub count: u64,
    /// End of the counted window (exclusive), epoch microseconds.
    pub end_us: u64,
}

impl FixedWindowState {
    /// The count of `state` at `now_us`: its count while its window is
    /// open, else 0.
    pub(crate) fn count_at(state: Option<FixedWindowState>, now_us: u64) -> u64 {
        match state {
            Some(s) if s.start_us <= now_us && now_us < s.end_us => s.count,
            _ => 0,
        }
    }
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
/// µs) of `limit`, given `state` ([`FixedWindowState`]: its count while
/// its window is open): what a fixed window and a calendar window
/// ([`super::calendar::CalendarWindow`]) share.
pub(crate) fn decide_in(
    limit: u64,
    (_, end): (u64, u64),
    state: Option<FixedWindowState>,
    now_us: u64,
    cost: u64,
) -> TierDecision {
    let count = FixedWindowState::count_at(state, now_us);
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
    let count = FixedWindowState::count_at(state, now_us);
    (
        FixedWindowState {
            start_us: start,
            count: count + cost,
            end_us: end,
        },
        end.saturating_sub(now_us),
    )
}
