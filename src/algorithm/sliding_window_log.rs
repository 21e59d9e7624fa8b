//! Sliding window log: the timestamp (and cost) of every admitted request.
//!
//! Exact: at no instant do the admitted costs within the last window exceed
//! the limit, whatever the pattern. Memory is O(limit) per key: one entry per
//! admitted request (an entry carries its cost, so a request of cost 5 is one
//! entry, not five). Denied requests are not logged.
//!
//! An entry logged at `t` counts while `now < t + window`.

use super::{TierDecision, Window};
use std::collections::VecDeque;

/// Stored state: admitted `(timestamp µs, cost)` entries, oldest first.
pub type LogState = VecDeque<(u64, u64)>;

impl Window {
    fn live<'a>(
        &self,
        log: Option<&'a LogState>,
        now_us: u64,
    ) -> impl Iterator<Item = &'a (u64, u64)> + Clone {
        let window = self.window_us;
        log.into_iter()
            .flatten()
            .filter(move |(t, _)| t + window > now_us)
    }

    /// Sliding-log decision for `cost` at `now_us`.
    pub fn log_check(&self, log: Option<&LogState>, now_us: u64, cost: u64) -> TierDecision {
        let live = self.live(log, now_us);
        let used: u64 = live.clone().map(|(_, c)| c).sum();
        let newest = live.clone().map(|(t, _)| *t).max();
        if used + cost <= self.limit {
            TierDecision {
                allowed: true,
                limit: self.limit,
                remaining: self.limit - used - cost,
                // The new entry is the newest; all are gone a window from now.
                reset_after_us: self.window_us,
                retry_after_us: 0,
                delay_us: 0,
            }
        } else {
            let reset_after_us = newest.map_or(0, |t| t + self.window_us - now_us);
            let retry_after_us = if cost > self.limit {
                reset_after_us
            } else {
                // Oldest first: the instant enough cost has left the window.
                let need = used + cost - self.limit;
                let mut freed = 0;
                let mut at = reset_after_us;
                for (t, c) in live {
                    freed += c;
                    if freed >= need {
                        at = t + self.window_us - now_us;
                        break;
                    }
                }
                at
            };
            TierDecision {
                allowed: false,
                limit: self.limit,
                remaining: self.limit.saturating_sub(used),
                reset_after_us,
                retry_after_us,
                delay_us: 0,
            }
        }
    }

    /// Logs `cost` at `now_us` (dropping expired entries); returns the
    /// time-to-live (µs) of the log.
    pub fn log_charge(&self, log: &mut LogState, now_us: u64, cost: u64) -> u64 {
        while log
            .front()
            .is_some_and(|(t, _)| t + self.window_us <= now_us)
        {
            log.pop_front();
        }
        log.push_back((now_us, cost));
        self.window_us
    }
}
