//! Where per-key demand goes once a second: per period, every key's total
//! (summed over the fleet on Redis), and per hour, every key's peak total,
//! the requests and the names kept. The same rules in process
//! ([`Local`]) and on Redis (`lua/demand.lua`).

use super::answer::Window;
use super::{score, Demand, MAX_HOUR_KEYS, MAX_NAMES};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use std::time::Duration;

/// Microseconds in an hour.
pub(crate) const HOUR_US: u64 = 3_600_000_000;
/// Hours kept: 7 days and the hour in progress.
pub(crate) const KEEP_HOURS: u64 = 7 * 24 + 1;
/// How often the tables are taken.
pub(crate) const FLUSH: Duration = Duration::from_secs(1);

/// One table's counts since the last take.
#[derive(Debug, Default)]
pub(crate) struct Taken {
    pub(crate) period: u64,
    pub(crate) counts: Vec<(u64, u64)>,
    pub(crate) names: Vec<(u64, String)>,
}

/// One slot's tables taken.
pub(crate) struct SlotTaken {
    pub(crate) tier: Arc<str>,
    pub(crate) plan: Option<Arc<str>>,
    pub(crate) period_s: u64,
    pub(crate) taken: Vec<Taken>,
    pub(crate) unsampled: u64,
}

/// The hour a period's totals count in: its own (a period within an hour)
/// or, for a longer period, the hour of `now_us`.
pub(crate) fn hour_of(period: u64, period_s: u64, now_us: u64) -> u64 {
    let end_us = (period + 1).saturating_mul(period_s.saturating_mul(1_000_000));
    now_us.min(end_us.saturating_sub(1)) / HOUR_US
}

/// One hour of one slot, in process (as `lua/demand.lua` keeps it).
#[derive(Debug, Default)]
struct Hour {
    peaks: HashMap<u64, u64>,
    /// The sample by rank ([`score`], then the hash): a bottom-k.
    order: std::collections::BTreeSet<(u64, u64)>,
    names: HashMap<u64, String>,
    requests: u64,
    unsampled: u64,
    /// A key was left out of the sample (or replaced in it).
    full: bool,
}

/// A tier and its plan (`None`: the tier's default quota).
type SlotName = (Arc<str>, Option<Arc<str>>);

/// The in-process store (no Redis).
#[derive(Debug, Default)]
pub(crate) struct Local {
    /// (tier, plan, period_s, period) → key → total.
    periods: HashMap<(SlotName, u64, u64), HashMap<u64, u64>>,
    /// (tier, plan, hour) → the hour.
    hours: HashMap<(SlotName, u64), Hour>,
}

impl Local {
    fn apply(&mut self, taken: Vec<SlotTaken>, now_us: u64) {
        for s in taken {
            let this_hour = now_us / HOUR_US;
            let h = self
                .hours
                .entry(((s.tier.clone(), s.plan.clone()), this_hour))
                .or_default();
            h.unsampled = h.unsampled.saturating_add(s.unsampled);
            for t in s.taken {
                let hour = hour_of(t.period, s.period_s, now_us);
                let totals = self
                    .periods
                    .entry(((s.tier.clone(), s.plan.clone()), s.period_s, t.period))
                    .or_default();
                let h = self
                    .hours
                    .entry(((s.tier.clone(), s.plan.clone()), hour))
                    .or_default();
                for (k, n) in t.counts {
                    h.requests = h.requests.saturating_add(n);
                    let mut total = || {
                        let total = totals.entry(k).or_insert(0);
                        *total = total.saturating_add(n);
                        *total
                    };
                    if let Some(p) = h.peaks.get_mut(&k) {
                        *p = (*p).max(total());
                    } else if (h.order.len() as u64) < MAX_HOUR_KEYS {
                        h.order.insert((score(k), k));
                        h.peaks.insert(k, total());
                    } else {
                        h.full = true;
                        if let Some(&top) = h.order.last() {
                            if (score(k), k) < top {
                                h.order.remove(&top);
                                h.peaks.remove(&top.1);
                                h.order.insert((score(k), k));
                                h.peaks.insert(k, total());
                            }
                        }
                    }
                }
                for (k, name) in t.names {
                    if (h.names.len() as u64) < MAX_NAMES || h.names.contains_key(&k) {
                        h.names.insert(k, name);
                    }
                }
            }
        }
        // Periods kept two periods and a minute; hours 7 days and one.
        self.periods.retain(|(_, ps, p), _| {
            (p + 3)
                .saturating_mul(ps.saturating_mul(1_000_000))
                .saturating_add(60_000_000)
                > now_us
        });
        let oldest = (now_us / HOUR_US).saturating_sub(KEEP_HOURS);
        self.hours.retain(|(_, h), _| *h > oldest);
    }

    fn window(
        &self,
        tier: &str,
        plan: Option<&str>,
        hours: std::ops::RangeInclusive<u64>,
    ) -> Window {
        let mut w = Window::default();
        for hour in hours {
            let key = ((Arc::from(tier), plan.map(Arc::from)), hour);
            if let Some(h) = self.hours.get(&key) {
                w.add_hour(
                    h.peaks.iter().map(|(k, v)| (*k, *v)),
                    h.names.iter().map(|(k, v)| (*k, v.clone())),
                    h.requests,
                    h.unsampled,
                    h.full,
                );
            }
        }
        w
    }
}

/// One script call's arguments (`lua/demand.lua`).
#[cfg(feature = "redis")]
pub(crate) struct RedisAdd {
    pub(crate) period_key: String,
    pub(crate) period_ttl_ms: u64,
    pub(crate) hour_base: String,
    pub(crate) hour_ttl_s: u64,
    pub(crate) unsampled: u64,
    pub(crate) counts: Vec<(u64, u64)>,
    pub(crate) names: Vec<(u64, String)>,
}

/// Where the demand of a layer is kept.
pub(crate) enum Store {
    Local(Mutex<Local>),
    #[cfg(feature = "redis")]
    Redis {
        redis: crate::backend::RedisBackend,
        prefix: Arc<str>,
    },
}

/// The Redis keys of one slot's period and hour (`lua/demand.lua`'s
/// `KEYS`): every one in the hash slot of `{demand}`.
#[cfg(feature = "redis")]
pub(crate) fn redis_base(prefix: &str, tier: &str, plan: Option<&str>) -> String {
    format!("{prefix}:{{demand}}:{tier}:{}", plan.unwrap_or("-"))
}

impl Store {
    /// Redis for a Redis backend (fleet-wide), else in process.
    pub(crate) fn for_backend(backend: &crate::backend::Backend, prefix: &str) -> Self {
        #[cfg(feature = "redis")]
        if let crate::backend::Backend::Redis(redis) = backend {
            return Store::Redis {
                redis: redis.clone(),
                prefix: Arc::from(prefix),
            };
        }
        let _ = (backend, prefix);
        Store::Local(Mutex::default())
    }

    /// Adds what was taken at `now_us`.
    pub(crate) async fn apply(&self, taken: Vec<SlotTaken>, now_us: u64) -> Result<(), String> {
        match self {
            Store::Local(l) => {
                lock(l).apply(taken, now_us);
                Ok(())
            }
            #[cfg(feature = "redis")]
            Store::Redis { redis, prefix } => {
                let mut adds = Vec::new();
                for s in taken {
                    let base = redis_base(prefix, &s.tier, s.plan.as_deref());
                    let this_hour = now_us / HOUR_US;
                    let mut parts: Vec<(u64, Taken)> = s
                        .taken
                        .into_iter()
                        .map(|t| (hour_of(t.period, s.period_s, now_us), t))
                        .collect();
                    if s.unsampled > 0 {
                        parts.push((this_hour, Taken::default()));
                    }
                    let mut unsampled = s.unsampled;
                    for (hour, t) in parts {
                        adds.push(RedisAdd {
                            period_key: format!("{base}:p:{}:{}", s.period_s, t.period),
                            period_ttl_ms: s.period_s.saturating_mul(2000).saturating_add(60_000),
                            hour_base: format!("{base}:{hour}"),
                            hour_ttl_s: KEEP_HOURS * 3600,
                            unsampled: std::mem::take(&mut unsampled),
                            counts: t.counts,
                            names: t.names,
                        });
                    }
                }
                redis.demand_add(&adds).await.map_err(|e| e.to_string())
            }
        }
    }

    /// The window of `hours` of `tier` (and `plan`).
    pub(crate) async fn window(
        &self,
        tier: &str,
        plan: Option<&str>,
        hours: std::ops::RangeInclusive<u64>,
    ) -> Result<Window, String> {
        match self {
            Store::Local(l) => Ok(lock(l).window(tier, plan, hours)),
            #[cfg(feature = "redis")]
            Store::Redis { redis, prefix } => {
                let base = redis_base(prefix, tier, plan);
                let mut w = Window::default();
                for hour in hours {
                    let (peaks, names, requests, unsampled, full) = redis
                        .demand_hour(&format!("{base}:{hour}"))
                        .await
                        .map_err(|e| e.to_string())?;
                    w.add_hour(peaks, names, requests, unsampled, full);
                }
                Ok(w)
            }
        }
    }
}

/// Starts the flush task of `demand`: every [`FLUSH`], the tables are
/// taken and added to the store; it stops with the engine.
pub(crate) fn spawn(demand: Weak<Demand>) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(FLUSH).await;
            let Some(d) = demand.upgrade() else {
                return;
            };
            if let Err(e) = d.flush().await {
                if d.log.permit().is_some() {
                    tracing::warn!(error = %e, "per-key demand not stored for this interval");
                }
            }
        }
    });
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
