//! [`Decision`]: what the engine decided for one request, as types. A front
//! door turns it into its protocol's answer (the tower layer: the inner
//! service's response with headers, a 429, a 403, a 503).

use super::plan::Meta;
use super::runtime::RefundOn;
use super::state::Shared;
use crate::backend::{Backend, TierRefund, Verdict};
#[cfg(feature = "redis")]
use crate::error::BackendError;
use crate::observe::RequestDecision;
use crate::response::{RateLimitHeaders, Rejection};
use crate::rollout::DenyStatus;
use std::time::Duration;

/// The engine's decision on one request.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Let the request through.
    Allow(Allow),
    /// Answer it without running it.
    Block(Block),
}

/// Why a request is answered without running it.
// Returned and turned into an answer at once, never stored: boxing the
// denial would cost every 429 an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Block {
    /// An enforced tier denies it: answer with the rejection (a 429).
    Limited(Denial),
    /// The denylist names its client: refuse it with this status.
    Denylisted(DenyStatus),
    /// The backend could not decide and the failure policy is `Closed`
    /// (or a key extractor could not run under it): a 503.
    Unavailable,
}

/// An allowed request.
#[derive(Debug)]
pub(crate) struct Allow {
    /// Why it passes: `Allowed`, `ShadowLimited`, `Skipped`, `Allowlisted`,
    /// `FailOpen` or `Fallback`.
    pub(crate) kind: RequestDecision,
    /// Bit per tier index: the observing tiers (shadow, canary keys not
    /// enforced) that would have denied it.
    pub(crate) shadow_tiers: u64,
    /// The binding tier's numbers (none when no tier applied, on fail-open,
    /// or with [`HeaderStyle::None`](crate::response::HeaderStyle::None)).
    pub(crate) headers: Option<RateLimitHeaders>,
    /// How long a shaping tier queued the request before it may run.
    pub(crate) delay: Duration,
    /// The charges to give back once the request's result is known.
    pub(crate) refunds: Option<Box<Refunds>>,
    /// Every check's result, when the front door asked
    /// ([`Facts::DETAILS`](super::Facts::DETAILS)) and a backend decided.
    /// Only the descriptor front door asks (feature `descriptor`).
    #[cfg_attr(not(feature = "descriptor"), allow(dead_code))]
    pub(crate) details: Option<Box<Details>>,
    /// The concurrency slots it holds: released when dropped (the front
    /// door keeps them until the response is over).
    pub(crate) slots: Option<Box<super::slots::Slots>>,
    /// Its reservations on priced tiers, settled by the front door when the
    /// response ends (`None`: no priced tier charged it).
    pub(crate) reservation: Option<Box<super::settle::Reservation>>,
}

/// Every check's result (for a front door that answers per check): the
/// tier of each check, in planned order, with its decision.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "descriptor"), allow(dead_code))]
pub(crate) struct Details {
    /// Per check: its tier index, and the tier's decision.
    pub(crate) checks: Vec<(usize, crate::algorithm::TierDecision)>,
    /// Bit per check: a denial whose cost exceeds the tier's capacity
    /// (see `decide::never_fits`).
    pub(crate) never_fits: u64,
}

impl Allow {
    /// Allowed with no tier's numbers (skipped, allowlisted, fail-open).
    pub(crate) fn bare(kind: RequestDecision) -> Self {
        Self {
            kind,
            shadow_tiers: 0,
            headers: None,
            delay: Duration::ZERO,
            refunds: None,
            details: None,
            slots: None,
            reservation: None,
        }
    }
}

/// A denied request: the binding tier's rejection and its headers.
#[derive(Debug)]
pub(crate) struct Denial {
    /// The check (in planned order) of the binding tier.
    pub(crate) check: usize,
    /// Bit per tier index: the observing tiers that denied it too.
    pub(crate) shadow_tiers: u64,
    pub(crate) rejection: Rejection,
    pub(crate) headers: RateLimitHeaders,
    /// As [`Allow::details`] (none when the deny cache answered).
    pub(crate) details: Option<Box<Details>>,
}

/// The refunds a passed request may get once its result is known: the
/// charges of its tiers with `skip_failed_requests` (given back when it
/// failed) and `skip_successful_requests` (when it succeeded).
pub(crate) struct Refunds {
    pub(crate) backend: Backend,
    pub(crate) on_failure: Vec<TierRefund>,
    pub(crate) on_success: Vec<TierRefund>,
}

impl std::fmt::Debug for Refunds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refunds")
            .field("on_failure", &self.on_failure.len())
            .field("on_success", &self.on_success.len())
            .finish_non_exhaustive()
    }
}

impl Refunds {
    /// The refunds of a charged request, if any of its tiers asks for them.
    pub(crate) fn of(shared: &Shared, meta: &Meta, v: &Verdict) -> Option<Box<Refunds>> {
        if !shared.config.refunds() {
            return None;
        }
        let mut r = Refunds {
            backend: shared.backend.clone(),
            on_failure: Vec::new(),
            on_success: Vec::new(),
        };
        for (i, charge) in v.charges.iter().enumerate() {
            // Only tiers this request was charged on (allowed, not denied
            // in shadow mode, and the request committed).
            let (Some(charge), Some(check)) = (charge, meta.sent.get(i)) else {
                continue;
            };
            // An override's read is no refund of its own: its tier's
            // refund carries it (below).
            if check.limit.is_override() {
                continue;
            }
            let Some(t) = meta.tier(shared, i) else {
                continue;
            };
            let list = match t.refund_on {
                RefundOn::Failure => &mut r.on_failure,
                RefundOn::Success => &mut r.on_success,
                RefundOn::Never => continue,
            };
            // Under a per-key override the backend reads it first and
            // refunds under it, as the check was charged (the same order
            // as a priced tier's settle, engine/settle.rs).
            if let Some(read) = meta.override_read(i) {
                list.push(TierRefund {
                    check: read.clone(),
                    charge: *charge,
                    debt: false,
                });
            }
            list.push(TierRefund {
                check: check.clone(),
                charge: *charge,
                debt: false,
            });
        }
        if r.on_failure.is_empty() && r.on_success.is_empty() {
            None
        } else {
            Some(Box::new(r))
        }
    }

    /// Gives back the charges the request's result calls for (`failed`: for
    /// HTTP, a status ≥ 400), without delaying its response: in memory at
    /// once (one shard lock per key, as brief as a check's), on Redis in a
    /// task of its own.
    pub(crate) fn settle(self, failed: bool) {
        let refunds = if failed {
            self.on_failure
        } else {
            self.on_success
        };
        if refunds.is_empty() {
            return;
        }
        match self.backend {
            Backend::Memory(m) => m.refund(&refunds),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        if let Err(e) = r.refund(&refunds).await {
                            refund_failed(&e);
                        }
                    });
                }
                Err(_) => refund_failed(&BackendError::NoRuntime),
            },
        }
    }
}

/// A refund by result that did not land: the request keeps its charge
/// (capacity is under-used until it refills; nothing is over-admitted).
/// Counted always, logged at most once a second.
#[cfg(feature = "redis")]
pub(crate) fn refund_failed(e: &BackendError) {
    metrics::counter!(
        "tiered_ratelimit_refund_failures_total",
        "kind" => e.kind()
    )
    .increment(1);
    static LOG: std::sync::OnceLock<crate::util::throttle::LogThrottle> =
        std::sync::OnceLock::new();
    let log = LOG.get_or_init(|| crate::util::throttle::LogThrottle::new(Duration::from_secs(1)));
    if let Some(suppressed) = log.permit() {
        tracing::warn!(target: super::LOG_TARGET,
            error = %e,
            suppressed,
            "rate limiter: refund by response status failed; the request keeps its charge"
        );
    }
}
