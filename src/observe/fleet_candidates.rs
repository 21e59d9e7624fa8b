//! Fleet-wide counts of the candidate quotas (docs/rollout.md, "Candidate
//! quotas"), on a single Redis, the way [`super::fleet`] flushes the
//! deny cache's 429s: each instance adds its counts to a per-process
//! accumulator (a lock and a few additions per request), and a background
//! task adds them to Redis in **one pipelined round trip** per flush
//! interval (default 1 s), off the request path:
//!
//! * `<prefix>:cand:<tier>:<hour>`, a hash: `<quota>|requests` and
//!   `<quota>|would_deny` per candidate (`live|…` for the live quota on
//!   the same requests), by `HINCRBY`;
//! * `<prefix>:cand:<tier>:<quota>:<hour>`, a sorted set of the key parts
//!   it would have denied, by `ZINCRBY` (the live quota's: `live`), trimmed
//!   to its 10 000 heaviest as the blocked-keys sets are.
//!
//! Both live 25 h. Their counts lag by one interval; a failed flush or a
//! crash loses that interval of one instance (logged at `warn`).

#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_imports))]

use super::flush_task::FlushTask;
use crate::backend::Backend;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The label of the live quota's counts.
pub(crate) const LIVE: &str = "live";

/// [`LIVE`], shared (an `Arc` clone per request, no allocation).
pub(crate) fn live() -> Arc<str> {
    static LIVE_ARC: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(LIVE));
    LIVE_ARC.clone()
}

/// One (hour, tier, quota)'s counts since the last flush.
#[derive(Debug, Default)]
struct Acc {
    requests: u64,
    would_deny: u64,
    keys: HashMap<String, u64>,
}

#[derive(Debug, Default)]
struct Pending {
    /// (hour, tier, quota label) → counts.
    entries: HashMap<(u64, Arc<str>, Arc<str>), Acc>,
    /// Distinct denied keys waiting, over all entries.
    keys: usize,
}

/// What one flush sends: the hash increments and the sets' increments.
pub(crate) struct Flush {
    /// (hash, [(field, increment)]).
    pub(crate) hashes: Vec<(String, Vec<(String, u64)>)>,
    /// (set, [(key part, increment)]).
    pub(crate) sets: Vec<(String, Vec<(String, u64)>)>,
}

/// `<prefix>:cand:<tier>:<hour>`.
pub(crate) fn hash_key(prefix: &str, tier: &str, hour: u64) -> String {
    format!("{prefix}:cand:{tier}:{hour}")
}

/// `<prefix>:cand:<tier>:<quota>:<hour>`.
pub(crate) fn set_key(prefix: &str, tier: &str, quota: &str, hour: u64) -> String {
    format!("{prefix}:cand:{tier}:{quota}:{hour}")
}

impl Pending {
    fn into_flush(self, prefix: &str) -> Flush {
        let mut hashes: HashMap<String, Vec<(String, u64)>> = HashMap::new();
        let mut sets = Vec::new();
        let mut entries: Vec<_> = self.entries.into_iter().collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for ((hour, tier, quota), acc) in entries {
            let h = hashes.entry(hash_key(prefix, &tier, hour)).or_default();
            h.push((format!("{quota}|requests"), acc.requests));
            h.push((format!("{quota}|would_deny"), acc.would_deny));
            if !acc.keys.is_empty() {
                let mut keys: Vec<(String, u64)> = acc.keys.into_iter().collect();
                keys.sort();
                sets.push((set_key(prefix, &tier, &quota, hour), keys));
            }
        }
        let mut hashes: Vec<_> = hashes.into_iter().collect();
        hashes.sort();
        Flush { hashes, sets }
    }
}

struct State {
    pending: Mutex<Pending>,
    max_keys: usize,
    key_prefix: Arc<str>,
}

/// The accumulator of one layer, and its flush task's handle.
pub(crate) struct FleetCandidates {
    state: Arc<State>,
    task: FlushTask,
}

impl FleetCandidates {
    /// Flushed every `interval` (at least 10 ms); at most `max_keys`
    /// distinct denied keys wait (past it a new key's denial still counts
    /// in `would_deny`, not in the set).
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

    /// One check of `quota` (a candidate's label, or [`LIVE`]) of `tier`
    /// on key part `key` at `now_us` (µs since the epoch): denied or not.
    pub(crate) fn record(
        &self,
        backend: &Backend,
        tier: &Arc<str>,
        quota: &Arc<str>,
        key: &str,
        denied: bool,
        now_us: u64,
    ) {
        if !self.task.started() {
            self.start(backend);
        }
        let mut p = lock(&self.state.pending);
        let Pending { entries, keys } = &mut *p;
        let acc = entries
            .entry((now_us / 3_600_000_000, tier.clone(), quota.clone()))
            .or_default();
        acc.requests += 1;
        if denied {
            acc.would_deny += 1;
            if let Some(c) = acc.keys.get_mut(key) {
                *c += 1;
            } else if *keys < self.state.max_keys {
                acc.keys.insert(key.to_owned(), 1);
                *keys += 1;
            }
        }
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
    if pending.entries.is_empty() {
        return;
    }
    let flush = pending.into_flush(&state.key_prefix);
    let limit = interval.max(Duration::from_secs(1));
    let failed = match tokio::time::timeout(limit, redis.add_candidates(&flush)).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(("error", e.to_string())),
        Err(_) => Some(("timeout", format!("no answer within {limit:?}"))),
    };
    if let Some((reason, error)) = failed {
        tracing::warn!(
            reason,
            error,
            "fleet-wide candidate-quota counts dropped for this interval"
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
    fn a_flush_names_its_hashes_and_sets() {
        let f = FleetCandidates::new(Arc::from("rl"), Duration::from_secs(1), 10);
        let b = Backend::Memory(crate::backend::MemoryBackend::new());
        let (t, q): (Arc<str>, Arc<str>) = (Arc::from("user"), Arc::from("5/1m"));
        let hour = 472_222 * 3_600_000_000;
        f.record(&b, &t, &q, "a", true, hour);
        f.record(&b, &t, &q, "a", true, hour + 1);
        f.record(&b, &t, &q, "b", false, hour + 2);
        let p = std::mem::take(&mut *lock(&f.state.pending));
        let flush = p.into_flush("rl");
        assert_eq!(
            flush.hashes,
            [(
                "rl:cand:user:472222".to_owned(),
                vec![
                    ("5/1m|requests".to_owned(), 3),
                    ("5/1m|would_deny".to_owned(), 2)
                ]
            )]
        );
        assert_eq!(
            flush.sets,
            [(
                "rl:cand:user:5/1m:472222".to_owned(),
                vec![("a".to_owned(), 2)]
            )]
        );
    }
}
