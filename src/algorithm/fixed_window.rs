//! Fixed window: one counter per window, windows aligned to the Unix epoch.
//!
//! O(1) state (`window start, count`). Known behaviour, kept on purpose: a
//! client can spend a whole quota at the end of one window and another at the
//! start of the next, so up to **2 × limit** requests pass within a span much
//! shorter than the window (the "boundary burst").

use super::{Decision, Window};

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
    pub fn fixed_check(&self, state: Option<FixedWindowState>, now_us: u64, cost: u64) -> Decision {
        let start = self.window_start(now_us);
        let count = state.filter(|s| s.start_us == start).map_or(0, |s| s.count);
        let end_in = start + self.window_us - now_us;
        if count + cost <= self.limit {
            let after = count + cost;
            Decision {
                allowed: true,
                limit: self.limit,
                remaining: self.limit - after,
                reset_after_us: end_in,
                retry_after_us: 0,
                delay_us: 0,
            }
        } else {
            let reset_after_us = if count == 0 { 0 } else { end_in };
            Decision {
                allowed: false,
                limit: self.limit,
                remaining: self.limit - count.min(self.limit),
                reset_after_us,
                // The next window starts empty; a cost above the limit never
                // fits, and the wait we report for it is the reset.
                retry_after_us: if cost > self.limit {
                    reset_after_us
                } else {
                    end_in
                },
                delay_us: 0,
            }
        }
    }

    /// The state after admitting `cost` at `now_us`, and its time-to-live (µs).
    pub fn fixed_charge(
        &self,
        state: Option<FixedWindowState>,
        now_us: u64,
        cost: u64,
    ) -> (FixedWindowState, u64) {
        let start = self.window_start(now_us);
        let count = state.filter(|s| s.start_us == start).map_or(0, |s| s.count);
        (
            FixedWindowState {
                start_us: start,
                count: count + cost,
            },
            start + self.window_us - now_us,
        )
    }
}
