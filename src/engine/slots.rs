//! Concurrency slots of one admitted request: a fresh slot id for every
//! check of a concurrency tier, and [`Slots`], the guard a front door
//! keeps until the response is over (the HTTP front door: until its body
//! has been sent or dropped). Dropping the guard releases every slot; while
//! it lives, a task renews the slots every half TTL.
//!
//! While the backend call that may take the slots is in flight, an
//! [`Slots::unanswered`] guard (no renewal) holds every concurrency
//! check's slot id: a request dropped then (its client gone), or whose
//! call ends in an error (a timeout, a broken connection: the script may
//! have run), releases them at once — a `ZREM` of an id the script never
//! added removes nothing, and on one connection it runs after the script.

use super::plan::Meta;
use super::state::Shared;
use crate::algorithm::{Concurrency, Limit};
use crate::backend::{Backend, Verdict};
use crate::util::throttle::LogThrottle;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

/// Slots that lapsed while their request was still running (every
/// renewal failed until the slot ran out, or the backend no longer held
/// it), by `tier`: the tier may have admitted one request too many.
pub(crate) const LAPSES: &str = "tiered_ratelimit_concurrency_lapses_total";

/// The first wait before a failed renewal is tried again; it doubles up to
/// an eighth of the slot TTL (and at most [`MAX_RETRY_WAIT`]).
const MIN_RETRY_WAIT: Duration = Duration::from_millis(5);
const MAX_RETRY_WAIT: Duration = Duration::from_millis(200);

/// One slot a request holds: its storage key, the tier's limit (with the
/// slot id) and the tier's name (the metric's label).
type Held = (String, Concurrency, Arc<str>);

/// The slots an admitted request holds on its concurrency tiers: released
/// when dropped (memory: at once; Redis: one `ZREM` per slot, in a task of
/// its own), renewed every half TTL while held.
pub(crate) struct Slots {
    backend: Backend,
    held: smallvec::SmallVec<[Held; 1]>,
    renewal: Option<tokio::task::AbortHandle>,
    /// Bounds each renewal call (the layer's `backend_timeout`).
    timeout: Duration,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots")
            .field("held", &self.held.len())
            .finish_non_exhaustive()
    }
}

impl Slots {
    /// The slots a request was charged on `backend` (none when it was not
    /// charged, or has no concurrency tier).
    pub(crate) fn of(
        shared: &Shared,
        backend: &Backend,
        meta: &Meta,
        v: &Verdict,
    ) -> Option<Box<Slots>> {
        let mut held = smallvec::SmallVec::new();
        let mut committed = None;
        for (i, c) in meta.sent.iter().enumerate() {
            let Limit::Concurrency(limit) = c.limit else {
                continue;
            };
            // Charged: every enforced tier allowed, and this one did.
            if !*committed.get_or_insert_with(|| meta.shadow.commits(&v.decisions)) {
                return None;
            }
            if v.decisions.get(i).is_some_and(|d| d.allowed) {
                held.push((c.key.clone(), limit, tier_name(shared, meta, i)));
            }
        }
        if held.is_empty() {
            return None;
        }
        let mut slots = Box::new(Slots {
            backend: backend.clone(),
            held,
            renewal: None,
            timeout: shared.config.backend_timeout,
        });
        slots.renewal = slots.start_renewal();
        Some(slots)
    }

    /// Every concurrency check of a call about to be sent (allowed or not:
    /// nobody knows yet), released when dropped and not renewed. `None`
    /// when the call has no concurrency check.
    pub(crate) fn unanswered(shared: &Shared, meta: &Meta) -> Option<Box<Slots>> {
        // A layer without a concurrency tier pays no scan of its checks.
        if !shared.config.concurrency {
            return None;
        }
        let held: smallvec::SmallVec<[Held; 1]> = meta
            .sent
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c.limit {
                Limit::Concurrency(limit) => {
                    Some((c.key.clone(), limit, tier_name(shared, meta, i)))
                }
                _ => None,
            })
            .collect();
        (!held.is_empty()).then(|| {
            Box::new(Slots {
                backend: shared.backend.clone(),
                held,
                renewal: None,
                timeout: shared.config.backend_timeout,
            })
        })
    }

    /// Forgets the slots without releasing them (the call answered: the
    /// slots it took, if any, now belong to [`Slots::of`]'s guard).
    pub(crate) fn disarm(&mut self) {
        self.held.clear();
    }

    /// A task renewing every slot each half TTL, while the guard lives.
    /// A renewal that fails (a dropped connection, a timeout) is tried
    /// again, backing off from 5 ms, until the slot would lapse; a slot
    /// that lapses all the same (or that the backend no longer holds) is
    /// counted in [`LAPSES`], logged at `warn`, and no longer renewed.
    fn start_renewal(&self) -> Option<tokio::task::AbortHandle> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let every = self.held.iter().map(|(_, c, _)| c.ttl_us).min()? / 2;
        let (backend, held, timeout) = (self.backend.clone(), self.held.clone(), self.timeout);
        let task = rt.spawn(async move {
            let start = Instant::now();
            // Until when each slot holds without another renewal (on the
            // local clock, from when the call that took or renewed it was
            // sent: never later than the backend's); `None` once lapsed.
            let mut until: smallvec::SmallVec<[Option<Instant>; 1]> = held
                .iter()
                .map(|(_, c, _)| Some(start + Duration::from_micros(c.ttl_us)))
                .collect();
            let mut tick = tokio::time::interval(Duration::from_micros(every.max(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is at once
            loop {
                tick.tick().await;
                for ((key, c, tier), until) in held.iter().zip(until.iter_mut()) {
                    let Some(u) = *until else { continue };
                    *until = renew_until_lapse(&backend, key, c, tier, u, timeout).await;
                }
            }
        });
        Some(task.abort_handle())
    }
}

/// The name of the tier of `meta`'s check `i`.
fn tier_name(shared: &Shared, meta: &Meta, i: usize) -> Arc<str> {
    meta.tiers
        .get(i)
        .and_then(|&t| shared.config.tiers.get(usize::from(t)))
        .map_or_else(|| Arc::from("unknown"), |t| t.name.clone())
}

/// Renews `key`'s slot, again after a failure until `until` (when the
/// slot lapses without a renewal); the slot's new end, or `None` when it
/// lapsed (counted and logged).
async fn renew_until_lapse(
    backend: &Backend,
    key: &str,
    c: &Concurrency,
    tier: &Arc<str>,
    until: Instant,
    timeout: Duration,
) -> Option<Instant> {
    let slot = Duration::from_micros(c.ttl_us);
    let most = (slot / 8).clamp(Duration::from_millis(1), MAX_RETRY_WAIT);
    let mut wait = MIN_RETRY_WAIT.min(most);
    loop {
        let sent = Instant::now();
        let left = until.saturating_duration_since(sent);
        if left.is_zero() {
            lapsed(tier, "every renewal failed until the slot ran out");
            return None;
        }
        let bound = left.min(timeout);
        let error = match tokio::time::timeout(bound, renew(backend, key, c)).await {
            Ok(Ok(true)) => return Some(sent + slot),
            Ok(Ok(false)) => {
                lapsed(tier, "the backend no longer held the slot");
                return None;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("timed out after {bound:?}"),
        };
        tracing::debug!(target: super::LOG_TARGET, tier = &**tier, error, "rate limiter: slot renewal failed; trying again");
        tokio::time::sleep(wait.min(until.saturating_duration_since(Instant::now()))).await;
        wait = (wait * 2).min(most);
    }
}

/// Counts and logs (at most once a second) a slot that lapsed while its
/// request ran.
fn lapsed(tier: &Arc<str>, why: &'static str) {
    metrics::counter!(LAPSES, "tier" => tier.to_string()).increment(1);
    static LOG: OnceLock<LogThrottle> = OnceLock::new();
    if let Some(suppressed) = LOG
        .get_or_init(|| LogThrottle::new(Duration::from_secs(1)))
        .permit()
    {
        tracing::warn!(target: super::LOG_TARGET, tier = &**tier, why, suppressed,
            "rate limiter: a running request's concurrency slot lapsed; the tier may admit one request too many");
    }
}

/// One renewal: whether the backend still held the slot (and now holds it
/// for another TTL from its clock).
async fn renew(
    backend: &Backend,
    key: &str,
    c: &Concurrency,
) -> Result<bool, crate::error::BackendError> {
    match backend {
        Backend::Memory(m) => Ok(m.renew(key, c)),
        #[cfg(feature = "redis")]
        Backend::Redis(r) => r.renew(key, c).await,
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if let Some(r) = self.renewal.take() {
            r.abort();
        }
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return;
        }
        match &self.backend {
            Backend::Memory(m) => {
                for (key, c, _) in &held {
                    m.release(key, c.slot);
                }
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => {
                // Without a runtime the slots come back when their TTLs
                // expire.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let r = r.clone();
                    rt.spawn(async move {
                        for (key, c, _) in &held {
                            if let Err(e) = r.release(key, c.slot).await {
                                tracing::debug!(target: super::LOG_TARGET, error = %e, "rate limiter: slot release failed; it expires after its TTL");
                            }
                        }
                    });
                }
            }
        }
    }
}
