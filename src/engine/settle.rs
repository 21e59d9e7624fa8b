//! Requests priced by their response: the reservation an admitted request
//! holds on its priced tiers, and its settle once the actual cost is known.
//!
//! At admission a priced tier is checked with the request's **estimate** as
//! its cost, in the same one backend call as every other tier, all or
//! nothing: a request denied by any tier reserves nothing. The engine keeps
//! each priced tier's check and [`Charge`] in a [`Reservation`]; the front
//! door settles it when the response has ended ([`Reservation::settle`]):
//! `actual − estimate` is given back when negative (the refund of that
//! part, [`Limit::refund`](crate::algorithm::Limit::refund)) and charged
//! whatever the state when positive ([`Limit::debt`](crate::algorithm::Limit::debt)),
//! so a key that overshot is in **debt**: denied until refill repays it,
//! `Remaining` 0, `Retry-After` the exact wait. An actual equal to the
//! estimate (or unknown: a body dropped or failed) costs no call.
//!
//! Under a per-key override the settle is sent after the override's read,
//! and the backend runs it under the override it reads, as the check did.
//! In lease mode an estimate spent from the instance's lease settles there:
//! a refund goes back into the lease while it lives (no call), a debt is
//! charged on the shared bucket.
//!
//! The bound (`docs/algorithms.md`, "Priced requests"): when every estimate
//! covers its actual, a tier never admits more than its quota; otherwise
//! it admits at most the quota plus Σ (actual − estimate) of the requests
//! whose settle has not landed yet, and once every settle has landed the
//! tier holds exactly what it would hold had each request been charged its
//! actual cost at admission (on a clock that did not move; with refill, a
//! refund gives back only what refill has not already absorbed).

use super::plan::Meta;
use super::state::Shared;
use super::token_lease::taken::LocalSpend;
use crate::backend::{Backend, Charge, TierCheck, TierRefund, Verdict};
#[cfg(feature = "redis")]
use crate::error::BackendError;
use std::sync::Arc;
#[cfg(feature = "redis")]
use std::time::Duration;

/// A settle sent to Redis that failed is tried again this many times, after
/// these waits, each attempt bounded by the backend timeout (then counted
/// in `tiered_ratelimit_settle_failures_total` and dropped: the request
/// stays charged at its estimate). So a settle is done with at most
/// 2.1 s + 4 × the backend timeout after its response ended.
#[cfg(feature = "redis")]
const RETRY_WAITS: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(400),
    Duration::from_millis(1600),
];

/// Whether a priced tier can run as configured: an algorithm that can
/// settle ([`Limit::settles`](crate::algorithm::Limit::settles)), without
/// refunds by status.
///
/// # Errors
/// [`ConfigError::Priced`](crate::error::ConfigError::Priced), naming the field.
pub(crate) fn check_priced(
    t: &super::spec::TierSpec,
    limit: &crate::algorithm::Limit,
) -> Result<(), crate::error::ConfigError> {
    let refuse = |field, reason: &str| crate::error::ConfigError::Priced {
        tier: t.name.clone(),
        field,
        reason: reason.to_owned(),
    };
    if !limit.settles() {
        return Err(refuse(
            "algorithm",
            "a priced tier takes token_bucket or fixed_window only",
        ));
    }
    if t.skip_failed || t.skip_successful {
        return Err(refuse(
            "skip_failed_requests",
            "a priced tier settles by its actual cost, not by status",
        ));
    }
    Ok(())
}

/// An admitted request's charges on its priced tiers, at their estimates.
pub(crate) struct Reservation {
    backend: Backend,
    /// How long a front door waits for a settle it awaits (the backend
    /// timeout); the retries then go on in the background.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    timeout: std::time::Duration,
    tiers: smallvec::SmallVec<[Reserved; 2]>,
}

/// A settle on Redis a front door may await (the HTTP layer does, before
/// the response head goes out, when the actual is in it): its first
/// attempt, bounded by the backend timeout; a failure or a timeout hands it
/// to the background retries.
pub(crate) type Landing = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// One priced tier's reservation.
pub(crate) struct Reserved {
    /// The tier's index (as the front door's tiers are numbered).
    pub(crate) tier: usize,
    /// The tier's name (what the headers' `policy` names).
    pub(crate) name: Arc<str>,
    /// The estimate charged, in the tier's cost units.
    pub(crate) estimate: u64,
    check: TierCheck,
    held: Held,
    /// The tier's override read (a tier taking per-key overrides): sent
    /// just before the settle, so that the settle runs under the key's
    /// override as the admission did.
    override_read: Option<TierCheck>,
}

/// Where a reservation's estimate was charged.
enum Held {
    /// On the backend, by the request's check.
    Backend(Charge),
    /// From this instance's token lease of the key (lease mode): a refund
    /// goes back to the lease; a debt is charged on the shared bucket.
    Lease(LocalSpend),
}

impl Reserved {
    /// Microseconds this tier takes to refill `units` of cost, for the
    /// algorithms whose reset moves with what is charged (token bucket,
    /// leaky bucket: `units × unit ÷ rate`, rounded up); `None` for the
    /// windows, whose reset is the window's end whatever the charge.
    pub(crate) fn refill_us(&self, units: u64) -> Option<u64> {
        use crate::algorithm::Limit;
        let b = match &self.check.limit {
            Limit::TokenBucket(b) => b,
            Limit::LeakyBucket(g) => &g.bucket,
            _ => return None,
        };
        let units = u128::from(units) * u128::from(b.unit);
        let us = units.div_ceil(u128::from(b.rate.max(1)));
        Some(u64::try_from(us).unwrap_or(u64::MAX))
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.tiers.iter().map(|t| (&*t.name, t.estimate)))
            .finish()
    }
}

impl Reservation {
    /// The reservations of a charged request on its priced tiers, if any.
    pub(crate) fn of(shared: &Shared, meta: &Meta, v: &Verdict) -> Option<Box<Reservation>> {
        if !shared.config.priced() {
            return None;
        }
        let mut tiers = smallvec::SmallVec::new();
        for (i, (check, &t)) in meta.sent.iter().zip(&meta.tiers).enumerate() {
            // An override's read (just before its tier's check, of the
            // same tier) is no reservation: its tier's carries it.
            if check.limit.is_override() {
                continue;
            }
            let Some(built) = shared.config.tiers.get(usize::from(t)).filter(|b| b.priced) else {
                continue;
            };
            // Charged on the backend, or spent from a lease (no charge).
            let held = match v.charges.get(i).copied().flatten() {
                Some(c) => Held::Backend(c),
                None => match meta.leased.as_ref().and_then(|l| l.spend_of(i)) {
                    Some(l) => Held::Lease(l),
                    None => continue,
                },
            };
            let override_read = meta.override_read(i);
            tiers.push(Reserved {
                tier: usize::from(t),
                name: built.name.clone(),
                estimate: check.cost,
                check: check.clone(),
                held,
                override_read: override_read.cloned(),
            });
        }
        (!tiers.is_empty()).then(|| {
            Box::new(Reservation {
                backend: shared.backend.clone(),
                timeout: shared.config.backend_timeout,
                tiers,
            })
        })
    }

    /// The priced tiers reserved on.
    pub(crate) fn tiers(&self) -> &[Reserved] {
        &self.tiers
    }

    /// Settles every reservation: `actual(tier)` is the tier's actual cost
    /// (`None`: unknown, settled at the estimate, no call). Never waits:
    /// in memory at once, on Redis in a task of its own, retried
    /// ([`RETRY_WAITS`]) when it fails.
    pub(crate) fn settle(self, actual: impl Fn(usize) -> Option<u64>) {
        if let Some(landing) = self.settle_awaitable(actual) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(landing);
                }
                #[cfg(feature = "redis")]
                Err(_) => settle_failed(&BackendError::NoRuntime),
                #[cfg(not(feature = "redis"))]
                Err(_) => drop(landing),
            }
        }
    }

    /// [`Reservation::settle`], for a caller that awaits the settle's
    /// landing: in memory applied at once (`None` back), on Redis the
    /// [`Landing`] to await (`None` when no tier's actual differs from its
    /// estimate: no call).
    pub(crate) fn settle_awaitable(self, actual: impl Fn(usize) -> Option<u64>) -> Option<Landing> {
        let mut settles = Vec::new();
        for r in self.tiers {
            let Some(a) = actual(r.tier) else {
                continue;
            };
            let charge = match r.held {
                Held::Backend(c) => c,
                Held::Lease(l) if a < r.estimate => {
                    // Back to the lease: no call.
                    l.give_back(r.estimate - a);
                    continue;
                }
                // A debt, on the shared bucket (it reads no charge).
                Held::Lease(_) => Charge {
                    at_us: 0,
                    undo: 0,
                    next_after_us: 0,
                },
            };
            if let Some(s) = settle_of(r.check, charge, r.estimate, a) {
                if let Some(read) = r.override_read {
                    // Read by the backend before the settle, which it
                    // then runs under the key's override.
                    settles.push(TierRefund {
                        check: read,
                        charge,
                        debt: false,
                    });
                }
                settles.push(s);
            }
        }
        if settles.is_empty() {
            return None;
        }
        match self.backend {
            Backend::Memory(m) => {
                m.refund(&settles);
                None
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => Some(Box::pin(land(r, settles, self.timeout))),
        }
    }
}

/// The settle of one tier charged `estimate` whose actual cost is
/// `actual`: a refund of the difference, a debt of the excess (clamped so
/// that the backend's arithmetic stays exact), or nothing.
pub(crate) fn settle_of(
    mut check: TierCheck,
    charge: Charge,
    estimate: u64,
    actual: u64,
) -> Option<TierRefund> {
    let (cost, debt) = match actual.cmp(&estimate) {
        std::cmp::Ordering::Equal => return None,
        std::cmp::Ordering::Less => (estimate - actual, false),
        std::cmp::Ordering::Greater => ((actual - estimate).min(check.limit.max_debt()), true),
    };
    check.cost = cost;
    Some(TierRefund {
        check,
        charge,
        debt,
    })
}

/// A settle's first attempt (in the instance's next batched call:
/// `backend/redis/settle.rs`, at most one call per 10 ms whatever the number
/// of settles), bounded by `timeout`; a failure (or a
/// timeout, which may have landed: a retry could then settle twice, so a
/// timed-out attempt is not retried) goes on in the background.
#[cfg(feature = "redis")]
async fn land(r: crate::backend::RedisBackend, settles: Vec<TierRefund>, timeout: Duration) {
    let first =
        match tokio::time::timeout(timeout, r.settle_batched(settles.clone(), timeout)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => return settle_failed(&BackendError::Timeout(timeout)),
        };
    if matches!(first, BackendError::Timeout(_)) {
        return settle_failed(&first);
    }
    let retries = async move {
        let mut last = first;
        for wait in RETRY_WAITS {
            tokio::time::sleep(wait).await;
            // Each attempt bounded as the first: a Redis that is down may
            // take longer than that to refuse (reconnecting), and the
            // retries must end.
            match tokio::time::timeout(timeout, r.settle_batched(settles.clone(), timeout)).await {
                Ok(Ok(())) => return,
                // Sent but unanswered: it may have landed.
                Ok(Err(e @ BackendError::Timeout(_))) => return settle_failed(&e),
                Err(_) => return settle_failed(&BackendError::Timeout(timeout)),
                Ok(Err(e)) => last = e,
            }
        }
        settle_failed(&last);
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(retries);
        }
        Err(_) => settle_failed(&BackendError::NoRuntime),
    }
}

/// A settle that did not land after its retries: the request stays charged
/// at its estimate. Counted always, logged at most once a second.
#[cfg(feature = "redis")]
fn settle_failed(e: &BackendError) {
    metrics::counter!(crate::observe::SETTLE_FAILURES, "kind" => e.kind()).increment(1);
    static LOG: std::sync::OnceLock<crate::util::throttle::LogThrottle> =
        std::sync::OnceLock::new();
    let log = LOG.get_or_init(|| crate::util::throttle::LogThrottle::new(Duration::from_secs(1)));
    if let Some(suppressed) = log.permit() {
        tracing::warn!(target: super::LOG_TARGET,
            error = %e,
            suppressed,
            "rate limiter: a priced request's settle failed after its retries; \
             the request stays charged at its estimate"
        );
    }
}
