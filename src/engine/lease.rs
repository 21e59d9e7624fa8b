//! Concurrency leases of one admitted request: a fresh lease id for every
//! check of a concurrency tier, and [`Leases`], the guard a front door
//! keeps until the response is over (the HTTP front door: until its body
//! has been sent or dropped). Dropping the guard releases every slot; while
//! it lives, a task renews the leases every half lease.
//!
//! While the backend call that may take the slots is in flight, an
//! [`Leases::unanswered`] guard (no renewal) holds every concurrency
//! check's lease id: a request dropped then (its client gone), or whose
//! call ends in an error (a timeout, a broken connection: the script may
//! have run), releases them at once — a `ZREM` of an id the script never
//! added removes nothing, and on one connection it runs after the script.

use super::plan::Meta;
use crate::algorithm::{Concurrency, Limit};
use crate::backend::{Backend, Verdict};
use std::time::Duration;

/// The slots an admitted request holds on its concurrency tiers: released
/// when dropped (memory: at once; Redis: one `ZREM` per slot, in a task of
/// its own), renewed every half lease while held.
pub(crate) struct Leases {
    backend: Backend,
    held: smallvec::SmallVec<[(String, Concurrency); 1]>,
    renewal: Option<tokio::task::AbortHandle>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("held", &self.held.len())
            .finish_non_exhaustive()
    }
}

impl Leases {
    /// The leases a request was charged on `backend` (none when it was not
    /// charged, or has no concurrency tier).
    pub(crate) fn of(backend: &Backend, meta: &Meta, v: &Verdict) -> Option<Box<Leases>> {
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
                held.push((c.key.clone(), limit));
            }
        }
        if held.is_empty() {
            return None;
        }
        let mut leases = Box::new(Leases {
            backend: backend.clone(),
            held,
            renewal: None,
        });
        leases.renewal = leases.start_renewal();
        Some(leases)
    }

    /// Every concurrency check of a call about to be sent (allowed or not:
    /// nobody knows yet), released when dropped and not renewed. `None`
    /// when the call has no concurrency check.
    pub(crate) fn unanswered(
        backend: &Backend,
        sent: &[crate::backend::TierCheck],
    ) -> Option<Box<Leases>> {
        let held: smallvec::SmallVec<[(String, Concurrency); 1]> = sent
            .iter()
            .filter_map(|c| match c.limit {
                Limit::Concurrency(limit) => Some((c.key.clone(), limit)),
                _ => None,
            })
            .collect();
        (!held.is_empty()).then(|| {
            Box::new(Leases {
                backend: backend.clone(),
                held,
                renewal: None,
            })
        })
    }

    /// Forgets the slots without releasing them (the call answered: the
    /// slots it took, if any, now belong to [`Leases::of`]'s guard).
    pub(crate) fn disarm(mut self: Box<Self>) {
        self.held.clear();
    }

    /// A task renewing every lease each half lease, while the guard lives.
    fn start_renewal(&self) -> Option<tokio::task::AbortHandle> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let every = self.held.iter().map(|(_, c)| c.lease_us).min()? / 2;
        let (backend, held) = (self.backend.clone(), self.held.clone());
        let task = rt.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(every.max(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is at once
            loop {
                tick.tick().await;
                for (key, c) in &held {
                    renew(&backend, key, c).await;
                }
            }
        });
        Some(task.abort_handle())
    }
}

async fn renew(backend: &Backend, key: &str, c: &Concurrency) {
    match backend {
        Backend::Memory(m) => {
            m.renew(key, c);
        }
        #[cfg(feature = "redis")]
        Backend::Redis(r) => {
            if let Err(e) = r.renew(key, c).await {
                tracing::debug!(target: super::LOG_TARGET, error = %e, "rate limiter: lease renewal failed");
            }
        }
    }
}

impl Drop for Leases {
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
                for (key, c) in &held {
                    m.release(key, c.lease);
                }
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => {
                // Without a runtime the slots come back when their leases
                // expire.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let r = r.clone();
                    rt.spawn(async move {
                        for (key, c) in &held {
                            if let Err(e) = r.release(key, c.lease).await {
                                tracing::debug!(target: super::LOG_TARGET, error = %e, "rate limiter: lease release failed; it expires after its lease");
                            }
                        }
                    });
                }
            }
        }
    }
}
