//! The decision: the binding tier, its headers, the 429, shadow logging.

use super::decision::{Allow, Block, Decision, Denial, Details, Refunds};
use super::plan::Meta;
use super::state::Shared;
use crate::algorithm::TierDecision;
use crate::backend::Verdict;
use crate::observe::RequestDecision;
use crate::observe::{TierCount, TierOutcome};
use crate::response::{HeaderStyle, PolicyItem, RateLimitHeaders, Rejection, RejectionReason};
use std::sync::Arc;
use std::time::Duration;

/// The decision on a checked request: the binding tier, or the headers of
/// an allowed one with `refunds` (what [`outcome`](super::outcome) found
/// its charges call for).
pub(crate) fn decide(
    shared: &Shared,
    meta: &Meta,
    v: &Verdict,
    refunds: Option<Box<Refunds>>,
) -> Decision {
    let ds = &v.decisions;
    let tier_name = |i: usize| meta.tier_name(shared, i);
    // Would-be rejections by observing tiers: counted and logged, never enforced.
    let mut shadow_tiers = 0u64;
    for (i, d) in ds.iter().enumerate() {
        if !d.allowed && meta.shadow.contains(i) {
            if let Some(&t) = meta.tiers.get(i) {
                shadow_tiers |= 1 << t;
            }
            let tier = tier_name(i);
            if let Some(o) = &meta.observed {
                let key_hash = o.key_hashes.get(i).copied().unwrap_or(0);
                log_shadow(
                    shared.config.shadow_log_level,
                    &tier,
                    key_hash,
                    &o.endpoint,
                    d.retry_after_us,
                );
            }
        }
    }
    // Binding tier: the enforced denying tier with the longest wait (first
    // on a tie); one whose cost exceeds its capacity waits for ever.
    let mut binding: Option<(usize, &TierDecision, bool)> = None;
    for (i, d) in ds.iter().enumerate() {
        if d.allowed || meta.shadow.contains(i) {
            continue;
        }
        let never = never_fits(meta, i, d);
        if binding
            .is_none_or(|(_, b, b_never)| (never, d.retry_after_us) > (b_never, b.retry_after_us))
        {
            binding = Some((i, d, never));
        }
    }
    let Some((i, d, _)) = binding else {
        // Headers describe the tier with the least remaining (on a tie, the one
        // that takes longest to refill), among enforced tiers and, when asked
        // for, observing ones.
        let shown = ds
            .iter()
            .enumerate()
            .filter(|(i, _)| shared.config.shadow_headers || !meta.shadow.contains(*i))
            // A penalty box that lets a request through has no numbers.
            .filter(|(i, _)| {
                !(shared.config.penalties || shared.config.key_overrides) || !is_penalty(meta, *i)
            })
            .min_by(|(_, a), (_, b)| {
                a.remaining
                    .cmp(&b.remaining)
                    .then(b.reset_after_us.cmp(&a.reset_after_us))
            });
        let kind = if meta.fallback {
            RequestDecision::Fallback
        } else if shadow_tiers != 0 {
            RequestDecision::ShadowLimited
        } else {
            RequestDecision::Allowed
        };
        let request = (!meta.fallback).then_some(kind);
        count_tier_decisions(shared, meta, ds, None, request);
        // A request queued by shaping tiers waits for the latest slot.
        let delay_us = ds
            .iter()
            .filter(|d| d.allowed)
            .map(|d| d.delay_us)
            .max()
            .unwrap_or(0);
        let headers = match shared.config.header_style {
            HeaderStyle::None => None,
            _ if meta.headless => None,
            _ => shown.map(|(i, d)| {
                let mut h = headers_for(shared, meta, i, d, v.now_us, false);
                super::meters::attach(shared, meta, ds, false, &mut h);
                h
            }),
        };
        return Decision::Allow(Allow {
            kind,
            shadow_tiers,
            headers,
            delay: Duration::from_micros(delay_us),
            refunds,
            details: if meta.details { details(meta, v) } else { None },
            slots: None,
            reservation: None,
        });
    };
    count_tier_decisions(shared, meta, ds, Some(i), None);
    let violated = ds
        .iter()
        .enumerate()
        .filter(|(j, d)| !d.allowed && !meta.shadow.contains(*j))
        // A tier and its penalty box are one policy.
        .filter(|(j, _)| !(is_penalty(meta, *j) && *j > 0 && !ds[*j - 1].allowed))
        .map(|(j, _)| meta.tier_name(shared, j))
        .collect();
    let boxed = meta.sent.get(i).is_some_and(|c| c.limit.is_penalty());
    let mut denial = reject(
        shared,
        meta,
        (i, boxed),
        d,
        v.now_us,
        !meta.fallback,
        violated,
    );
    super::meters::attach(shared, meta, ds, true, &mut denial.headers);
    denial.shadow_tiers = shadow_tiers;
    denial.details = details(meta, v);
    Decision::Block(Block::Limited(denial))
}

/// Whether check `i`'s result `d` is a denial that no wait can lift: its
/// cost is above the capacity of its limit (and of the limit the backend
/// applied, which an override may have raised).
pub(crate) fn never_fits(meta: &Meta, i: usize, d: &TierDecision) -> bool {
    !d.allowed
        && meta.sent.get(i).is_some_and(|c| {
            !c.limit.is_penalty()
                && !c.limit.is_override()
                && c.cost > c.limit.capacity()
                && c.cost > d.limit
        })
}

/// The counter of requests denied because their cost exceeds the binding
/// tier's capacity (label `tier`).
pub(crate) const COST_EXCEEDS_CAPACITY: &str = "tiered_ratelimit_cost_exceeds_capacity_total";

/// Counts a request whose cost exceeds tier `t`'s capacity, and logs it
/// once per tier (a likely misconfiguration).
#[cold]
#[inline(never)]
fn count_never_fits(t: Option<&super::runtime::BuiltTier>, tier: &Arc<str>, limit: u64) {
    metrics::counter!(COST_EXCEEDS_CAPACITY, "tier" => tier.clone()).increment(1);
    let Some(t) = t else {
        return;
    };
    if t.cost_exceeded_logged
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        return;
    }
    tracing::warn!(target: super::LOG_TARGET,
        tier = %tier,
        capacity = limit,
        "rate limiter: tier \"{tier}\" denied a request whose cost exceeds its capacity of \
         {limit}: it can never pass, answered 429 without Retry-After (counted in \
         {COST_EXCEEDS_CAPACITY}); likely a misconfiguration: a burst below the largest cost \
         a client may send, or a cost function returning more than the burst \
         (logged once per tier)",
    );
}

/// Whether check `i` is a penalty box or an override's read (checks of
/// their tier's, with no numbers of their own when they allow).
pub(super) fn is_penalty(meta: &Meta, i: usize) -> bool {
    meta.sent
        .get(i)
        .is_some_and(|c| c.limit.is_penalty() || c.limit.is_override())
}

/// Counts every tier's decision on the request (one each) in
/// `tiered_ratelimit_tier_decisions_total`, but the binding tier's: its
/// `limited` is counted with the 429 ([`reject`]). And the request under
/// `request`, with the same lookup of the metric handles.
pub(crate) fn count_tier_decisions(
    shared: &Shared,
    meta: &Meta,
    ds: &[TierDecision],
    binding: Option<usize>,
    request: Option<RequestDecision>,
) {
    if let Some(d) = request {
        shared.telemetry.counts.add(d);
    }
    let Some(e) = &meta.endpoint else {
        if let Some(d) = request {
            shared.telemetry.metrics.count(d);
        }
        return;
    };
    let cells = ds.iter().enumerate().filter_map(|(i, d)| {
        let decision = match (d.allowed, meta.shadow.contains(i)) {
            _ if Some(i) == binding => return None,
            // A penalty box that lets the request through is its tier's
            // check counted once.
            (true, _)
                if (shared.config.penalties || shared.config.key_overrides)
                    && is_penalty(meta, i) =>
            {
                return None
            }
            (true, _) if d.remaining.saturating_mul(5) < d.limit => TierOutcome::NearLimit,
            (true, _) => TierOutcome::Allowed,
            (false, true) => TierOutcome::ShadowLimited,
            (false, false) => TierOutcome::LimitedNotBinding,
        };
        Some(TierCount {
            check: i,
            tier: usize::from(*meta.tiers.get(i)?),
            slot: meta.plan_slot(i).0,
            decision,
        })
    });
    shared
        .telemetry
        .metrics
        .count_tiers(request, e, cells, |i| {
            (
                meta.tier(shared, i).map_or("unknown", |t| &*t.name),
                meta.plan_slot(i).1,
            )
        });
}

/// The headers describing check `i`'s decision.
#[inline]
pub(crate) fn headers_for(
    shared: &Shared,
    meta: &Meta,
    i: usize,
    d: &TierDecision,
    now_us: u64,
    denied: bool,
) -> RateLimitHeaders {
    let policy = meta.tier_name(shared, i);
    let (q, period_us, refills) = meta.quotas.get(i).copied().unwrap_or((d.limit, 0, false));
    let policies = if shared.config.header_style.ietf() {
        policies(shared, meta)
    } else {
        Vec::new()
    };
    if denied {
        let retry_after = ceil_secs(d.retry_after_us).max(1);
        RateLimitHeaders {
            limit: d.limit,
            remaining: d.remaining,
            reset: ceil_secs(now_us.saturating_add(d.retry_after_us)),
            retry_after: Some(retry_after),
            reset_in: retry_after,
            // The binding tier has the longest wait of the denying tiers,
            // so `Retry-After` is never earlier than this `t`.
            window_in: retry_after,
            policy,
            policies,
            style: shared.config.header_style,
            meters: None,
        }
    } else {
        let reset = ceil_secs(now_us.saturating_add(d.reset_after_us));
        RateLimitHeaders {
            limit: d.limit,
            remaining: d.remaining,
            reset,
            retry_after: None,
            // Seconds until full, rounded up: never above the window.
            reset_in: ceil_secs(d.reset_after_us),
            window_in: ceil_secs(crate::response::effective_window_us(
                d.limit,
                d.remaining,
                d.reset_after_us,
                refills.then_some((q, period_us)),
            )),
            policy,
            policies,
            style: shared.config.header_style,
            meters: None,
        }
    }
}

/// The IETF `RateLimit-Policy` items of a request: each tier it checks
/// (once, though a penalty box or an override read adds a check of the
/// same tier), enforced ones and, with `shadow_headers`, observing ones,
/// in check order: the same whichever tier binds and whether the backend
/// or the deny cache answers.
fn policies(shared: &Shared, meta: &Meta) -> Vec<PolicyItem> {
    let mut seen = 0u64;
    let mut out = Vec::with_capacity(meta.quotas.len());
    for (j, &(quota, period_us, _)) in meta.quotas.iter().enumerate() {
        let Some(&t) = meta.tiers.get(j) else {
            continue;
        };
        let bit = 1u64.checked_shl(u32::from(t)).unwrap_or(0);
        if seen & bit != 0 || (!shared.config.shadow_headers && meta.shadow.contains(j)) {
            continue;
        }
        seen |= bit;
        let Some(tier) = shared.config.tiers.get(usize::from(t)) else {
            continue;
        };
        out.push(PolicyItem {
            name: tier.name.clone(),
            quota,
            // A concurrency tier's period is recorded as 0 (`Meta::quotas`).
            window: (period_us > 0).then(|| period_us.div_ceil(1_000_000)),
            unit: tier.unit.clone(),
        });
    }
    out
}

/// The denial by check `i` (`boxed`: a penalty box's check, blocking).
/// `count_limited`: count the request as `limited` (the deny cache and the
/// fallback count their own decision instead). `violated`: every enforced
/// denying tier, in tier order.
pub(crate) fn reject(
    shared: &Shared,
    meta: &Meta,
    (i, boxed): (usize, bool),
    d: &TierDecision,
    now_us: u64,
    count_limited: bool,
    violated: Vec<Arc<str>>,
) -> Denial {
    let tier = meta.tier_name(shared, i);
    let mut headers = headers_for(shared, meta, i, d, now_us, true);
    let reason = if never_fits(meta, i, d) {
        count_never_fits(meta.tier(shared, i), &tier, d.limit);
        // No wait lets it pass: no Retry-After to retry for ever on; the
        // reset fields say when the tier is full again (which is all a
        // smaller request needs).
        headers.retry_after = None;
        headers.reset_in = ceil_secs(d.reset_after_us);
        headers.window_in = headers.reset_in;
        headers.reset = ceil_secs(now_us.saturating_add(d.reset_after_us));
        RejectionReason::CostExceedsCapacity
    } else if boxed {
        RejectionReason::AbnormalUsage
    } else {
        RejectionReason::QuotaExceeded
    };
    let retry_after = match reason {
        RejectionReason::CostExceedsCapacity => 0,
        _ => headers.retry_after.unwrap_or(1),
    };
    if count_limited {
        shared.count(RequestDecision::Limited);
    }
    if let (Some(e), Some(t)) = (&meta.endpoint, meta.tiers.get(i)) {
        let c = TierCount {
            check: i,
            tier: usize::from(*t),
            slot: meta.plan_slot(i).0,
            decision: TierOutcome::Limited,
        };
        shared
            .telemetry
            .metrics
            .count_tiers(None, e, [c], |_| (&*tier, meta.plan_slot(i).1));
    }
    tracing::debug!(target: super::LOG_TARGET, tier = &*tier, retry_after, "request rate limited");
    let rejection = Rejection {
        tier,
        violated_policies: violated,
        limit: headers.limit,
        remaining: headers.remaining,
        reset: headers.reset,
        retry_after,
        docs_url: shared.config.docs_url.clone(),
        status: match (reason, meta.tier(shared, i)) {
            (RejectionReason::QuotaExceeded | RejectionReason::AbnormalUsage, Some(t)) => {
                t.exhausted_status
            }
            _ => 429,
        },
        reason,
    };
    Denial {
        check: i,
        shadow_tiers: 0,
        rejection,
        headers,
        details: None,
    }
}

/// Every check's result, when the front door asked for them.
#[inline]
fn details(meta: &Meta, v: &Verdict) -> Option<Box<Details>> {
    meta.details.then(|| {
        Box::new(Details {
            checks: meta
                .tiers
                .iter()
                .zip(&v.decisions)
                .map(|(&t, d)| (usize::from(t), *d))
                .collect(),
            never_fits: v
                .decisions
                .iter()
                .enumerate()
                .take(64)
                .filter(|(i, d)| never_fits(meta, *i, d))
                .fold(0, |m, (i, _)| m | 1 << i),
        })
    })
}

pub(crate) fn log_shadow(
    level: tracing::Level,
    tier: &str,
    key_hash: u64,
    endpoint: &str,
    retry_after_us: u64,
) {
    macro_rules! at {
        ($lvl:expr) => {
            tracing::event!(
                target: super::LOG_TARGET,
                $lvl,
                tier,
                key_hash = format_args!("{key_hash:016x}"),
                endpoint,
                retry_after_us,
                "shadow: request would have been rate limited"
            )
        };
    }
    match level {
        tracing::Level::ERROR => at!(tracing::Level::ERROR),
        tracing::Level::WARN => at!(tracing::Level::WARN),
        tracing::Level::INFO => at!(tracing::Level::INFO),
        tracing::Level::DEBUG => at!(tracing::Level::DEBUG),
        _ => at!(tracing::Level::TRACE),
    }
}

/// Seconds, rounded up.
pub(crate) fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}
