//! Fleet-wide counts of the 429s that the local deny cache answers.
//!
//! A rejection the backend makes is added to the hourly sorted set
//! `<prefix>:blocked:<hour>` by its own script call (`lua/check.lua`). A 429
//! answered by the deny cache makes no call, so the heaviest abusers — whose
//! requests the cache answers — would be missing from
//! [`RateLimitHandle::top_blocked_fleet`](crate::RateLimitHandle::top_blocked_fleet).
//! Those 429s are added here instead, to a per-process accumulator (storage
//! key → cost, per hour of the denial's time), and a background task adds
//! them to the same hourly sets in **one pipelined round trip** (`ZINCRBY`
//! per key, then the script's trim to 10 000 members and `EXPIRE` of 25 h
//! per set) at most once per flush interval (default 1 s). A request only
//! takes a lock and adds to a map; it never waits for Redis.
//!
//! Bounds, all counted in `tiered_ratelimit_fleet_blocked_dropped_total`
//! (cost units, label `reason`) and logged at `warn` at most once per flush:
//! * at most `max_keys` distinct (hour, key) pairs wait for a flush (default
//!   10 000, the size of an hourly set): a 429 for a new key beyond that is
//!   not counted fleet-wide (`reason="overflow"`); keys already waiting keep
//!   counting;
//! * a flush that fails (`reason="error"`) or that Redis does not answer in
//!   `max(interval, 1 s)` (`reason="timeout"`) is dropped, never retried: that
//!   interval's counts are lost, never counted twice (a timed-out flush sent
//!   to a Redis that was only frozen may still be applied when it resumes);
//! * a crash loses the interval not yet flushed; dropping the layer flushes
//!   once more and stops the task.

// Without the `redis` feature there is no fleet-wide set to flush to: the
// accumulator is never created, and its flushing half is unused.
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_imports))]

use super::flush_task::FlushTask;
use crate::backend::Backend;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Counter of the cached 429s flushed to the hourly sets, in cost units.
pub(crate) const FLUSHED: &str = "tiered_ratelimit_fleet_blocked_flushed_total";
/// Counter of the cached 429s not counted fleet-wide, in cost units, by
/// `reason` (`overflow`, `error`, `timeout`).
pub(crate) const DROPPED: &str = "tiered_ratelimit_fleet_blocked_dropped_total";

/// Microseconds in an hour: the hourly sets' bucket.
const HOUR_US: u64 = 3_600_000_000;

/// The accumulator of one layer, and the handle of its flush task.
pub(crate) struct FleetBlocked {
    state: Arc<State>,
    task: FlushTask,
}

struct State {
    pending: Mutex<Pending>,
    max_keys: usize,
    key_prefix: Arc<str>,
}

/// What waits for the next flush.
#[derive(Debug, Default)]
struct Pending {
    /// (hour since the epoch, storage key → cost); normally one hour, two
    /// around an hour boundary.
    hours: Vec<(u64, HashMap<String, u64>)>,
    /// Distinct (hour, key) pairs in `hours`.
    keys: usize,
    /// Cost of the 429s not kept: their key would have exceeded the bound.
    overflow: u64,
}

impl Pending {
    /// Adds `cost` to `key` in `hour`; beyond `max_keys` pairs, to the
    /// overflow instead.
    fn add(&mut self, hour: u64, key: &str, cost: u64, max_keys: usize) {
        let i = match self.hours.iter().position(|(h, _)| *h == hour) {
            Some(i) => i,
            None => {
                self.hours.push((hour, HashMap::new()));
                self.hours.len() - 1
            }
        };
        let map = &mut self.hours[i].1;
        if let Some(c) = map.get_mut(key) {
            *c = c.saturating_add(cost);
        } else if self.keys < max_keys {
            map.insert(key.to_owned(), cost);
            self.keys += 1;
        } else {
            self.overflow = self.overflow.saturating_add(cost);
        }
    }

    /// The sets to add to, named for `prefix`: `(set, [(key, cost)])`,
    /// oldest hour first.
    fn into_sets(mut self, prefix: &str) -> Vec<(String, Vec<(String, u64)>)> {
        self.hours.sort_by_key(|(h, _)| *h);
        self.hours
            .into_iter()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(h, keys)| {
                let mut keys: Vec<(String, u64)> = keys.into_iter().collect();
                keys.sort();
                (format!("{prefix}:blocked:{h}"), keys)
            })
            .collect()
    }
}

impl FleetBlocked {
    /// An accumulator of at most `max_keys` pending keys, flushed every
    /// `interval` (at least 10 ms), into `<key_prefix>:blocked:<hour>`.
    pub(crate) fn new(key_prefix: Arc<str>, interval: Duration, max_keys: usize) -> Self {
        Self {
            state: Arc::new(State {
                pending: Mutex::new(Pending::default()),
                max_keys,
                key_prefix,
            }),
            task: FlushTask::new(interval),
        }
    }

    /// Counts one cached 429 of `cost` for storage key `key` at local time
    /// `now_us` (µs since the epoch: its hour names the set). Starts the
    /// flush task on first use inside a tokio runtime (a layer may be built
    /// outside one); until then the counts wait, bounded.
    pub(crate) fn record(&self, backend: &Backend, key: &str, cost: u64, now_us: u64) {
        if !self.task.started() {
            self.start(backend);
        }
        lock(&self.state.pending).add(now_us / HOUR_US, key, cost, self.state.max_keys);
    }

    fn start(&self, backend: &Backend) {
        #[cfg(feature = "redis")]
        if let Backend::Redis(redis) = backend {
            let (state, interval) = (self.state.clone(), self.task.interval());
            self.task.start(redis, move |redis| {
                let state = state.clone();
                async move { flush(&state, &redis, interval).await }
            });
        }
        #[cfg(not(feature = "redis"))]
        let _ = backend;
    }
}

/// Sends what is pending in one pipelined call; on failure drops it.
#[cfg(feature = "redis")]
async fn flush(state: &State, redis: &crate::backend::RedisBackend, interval: Duration) {
    let pending = std::mem::take(&mut *lock(&state.pending));
    let overflow = pending.overflow;
    let sets = pending.into_sets(&state.key_prefix);
    let cost: u64 = sets
        .iter()
        .flat_map(|(_, keys)| keys.iter().map(|(_, c)| *c))
        .fold(0, u64::saturating_add);
    if overflow > 0 {
        metrics::counter!(DROPPED, "reason" => "overflow").increment(overflow);
    }
    let failed = if sets.is_empty() {
        None
    } else {
        let limit = interval.max(Duration::from_secs(1));
        match tokio::time::timeout(limit, redis.add_blocked(&sets)).await {
            Ok(Ok(())) => {
                metrics::counter!(FLUSHED).increment(cost);
                None
            }
            Ok(Err(e)) => Some(("error", e.to_string())),
            Err(_) => Some(("timeout", format!("no answer within {limit:?}"))),
        }
    };
    if let Some((reason, _)) = &failed {
        metrics::counter!(DROPPED, "reason" => *reason).increment(cost);
    }
    // At most one line per flush, so at most one per interval.
    if failed.is_some() || overflow > 0 {
        let (reason, error) = failed.unwrap_or(("", String::new()));
        tracing::warn!(
            lost_cost = if reason.is_empty() { 0 } else { cost },
            reason,
            error,
            overflow_cost = overflow,
            max_keys = state.max_keys,
            "fleet-wide blocked-key counts of cached 429s dropped for this interval"
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_is_bounded_and_split_by_hour() {
        let mut p = Pending::default();
        p.add(7, "rl:user:a", 1, 3);
        p.add(7, "rl:user:b", 2, 3);
        p.add(8, "rl:user:a", 5, 3);
        // Full: a new key overflows, the keys already there still count.
        p.add(8, "rl:user:c", 4, 3);
        p.add(7, "rl:user:a", 3, 3);
        p.add(8, "rl:user:a", 1, 3);
        assert_eq!(p.keys, 3);
        assert_eq!(p.overflow, 4);
        let sets = Pending {
            hours: p.hours.into_iter().rev().collect(),
            ..Pending::default()
        }
        .into_sets("rl");
        assert_eq!(
            sets,
            [
                (
                    "rl:blocked:7".to_owned(),
                    vec![("rl:user:a".to_owned(), 4), ("rl:user:b".to_owned(), 2)]
                ),
                ("rl:blocked:8".to_owned(), vec![("rl:user:a".to_owned(), 6)]),
            ]
        );
    }
}
