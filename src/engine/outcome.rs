//! What a backend answer (or error) becomes: breaker and deny-cache
//! bookkeeping, observation, the decision, the failure policy, refunds.

use super::decide::decide;
use super::decision::{Allow, Block, Decision, Refunds};
use super::deny::feed_deny_cache;
use super::facts::Facts;
use super::plan::{plan, Meta, Planned, Purpose};
use super::runtime::FailurePolicy;
use super::state::Shared;
use crate::backend::{Backend, TierCheck, Verdict};
use crate::error::BackendError;
use crate::observe;
use crate::observe::topn::Kind;
use crate::observe::RequestDecision;

/// Turns a backend result into the request's decision. `facts` are asked
/// again only by the local fallback.
pub(crate) fn outcome(
    shared: &Shared,
    meta: &Meta,
    result: Result<Verdict, BackendError>,
    facts: &impl Facts,
) -> Decision {
    outcome_in(shared, meta, result, facts, None)
}

/// [`outcome`], in the check's span when the call made one before it was
/// sent ([`check_span`]: then the span's life covers the wait for the
/// backend).
pub(crate) fn outcome_in(
    shared: &Shared,
    meta: &Meta,
    result: Result<Verdict, BackendError>,
    facts: &impl Facts,
    sent_in: Option<tracing::Span>,
) -> Decision {
    // Lease mode: the local decisions join the backend's answer (a denial
    // or an error gives the local spending back).
    let local_only = meta.leased.as_ref().is_some_and(|t| t.all(meta.sent.len()));
    let result = match &meta.leased {
        Some(t) if !local_only => t.merge(result, meta.sent.len(), meta.shadow),
        _ => result,
    };
    // One span per check, with every tier's result as a field (formatted
    // only when a subscriber wants the span). Not even made while no
    // subscriber takes debug spans: a disabled span still costs its
    // callsite's checks, and with tracing's `log` feature a record of its
    // fields and of each enter and exit; and then no `Span` is dropped
    // either (`None`).
    let span = sent_in.or_else(|| check_span(shared));
    if let Some(s) = &span {
        record_check(s, shared, meta, &result);
    }
    let _entered = span.as_ref().filter(|s| !s.is_none()).map(|s| s.enter());
    // `None` when unobserved (`begin` then read no clock): one reading for
    // the backend's latency, the deny cache and the observation of the
    // answer.
    let answered = (!meta.quiet).then(std::time::Instant::now);
    let backend_latency = meta
        .backend_started
        .zip(answered)
        .map(|(t, now)| now.saturating_duration_since(t));
    let decided = match result {
        Ok(mut v) => {
            if !local_only {
                shared.guards.breaker.success(meta.permit);
            }
            if shared.config.penalties {
                penalty_limits(meta, &mut v);
            }
            if shared.config.key_overrides {
                crate::backend::override_rule::apply_codes(&meta.sent, &mut v.decisions);
            }
            // (The memory backend has no deny cache and no flight.)
            if meta.flight.is_some() || shared.guards.deny_cache.enabled() {
                feed_deny_cache(shared, meta, &v, answered);
            }
            if let Some(now) = answered {
                observe_decisions(shared, meta, &v, now);
            }
            // Only charged tiers have refunds: none for a denied request.
            let refunds = if shared.config.refunds() {
                Refunds::of(shared, meta, &v)
            } else {
                None
            };
            let mut d = decide(shared, meta, &v, refunds);
            if let (Decision::Allow(a), true) = (&mut d, shared.config.priced()) {
                a.reservation = super::settle::Reservation::of(shared, meta, &v);
            }
            let d = if shared.config.concurrency {
                with_slots(d, shared, &shared.backend, meta, &v)
            } else {
                d
            };
            // The memory check's verdict came from the spares (`begin`).
            if matches!(shared.backend, Backend::Memory(_)) {
                super::spare::give_back_verdict(v);
            }
            d
        }
        Err(e) => {
            if !matches!(e, BackendError::CircuitOpen | BackendError::Key(_)) {
                shared.guards.breaker.failure(meta.permit);
            }
            // A request none of whose checked tiers is enforced (shadow
            // mode, globally or per tier) is never blocked by the limiter,
            // not even when the backend cannot decide. (A key that could not
            // be computed leaves the plan unfinished: the policy decides.)
            let shadow_only = !meta.tiers.is_empty()
                && !matches!(e, BackendError::Key(_))
                && (0..meta.tiers.len()).all(|i| meta.shadow.contains(i));
            let d = if !shadow_only {
                fail(shared, &e, facts)
            } else {
                fail_shadow(shared, &e)
            };
            if !meta.quiet && (shadow_only || shared.config.failure_policy == FailurePolicy::Open) {
                observe_fail_open(shared, meta);
            }
            d
        }
    };
    if !meta.quiet {
        shared
            .telemetry
            .metrics
            .latency(backend_latency, meta.started);
        if shared.live.plans.running() {
            if let Some(t) = meta.started {
                shared.live.plans.latency.record(t.elapsed());
            }
        }
    }
    decided
}

/// The check's span (`rate_limit_check`), or `None` while no subscriber
/// takes debug spans: a disabled span still costs its callsite's checks,
/// and with tracing's `log` feature a record of its fields and of each
/// enter and exit. Made when the call is sent (its life then covers the
/// wait for the backend) or, for a check decided at once, with the answer.
pub(crate) fn check_span(shared: &Shared) -> Option<tracing::Span> {
    let debug = tracing::Level::DEBUG;
    (debug <= tracing::level_filters::STATIC_MAX_LEVEL
        && debug <= tracing::level_filters::LevelFilter::current())
    .then(|| new_check_span(shared))
}

#[cold]
#[inline(never)]
fn new_check_span(shared: &Shared) -> tracing::Span {
    tracing::debug_span!(target: super::LOG_TARGET,
        "rate_limit_check",
        backend = shared.backend.name(),
        tiers = tracing::field::Empty,
        error = tracing::field::Empty
    )
}

/// The tiers' results (or the error) recorded in the check's span, when a
/// subscriber takes it.
#[cold]
#[inline(never)]
fn record_check(
    span: &tracing::Span,
    shared: &Shared,
    meta: &Meta,
    result: &Result<Verdict, BackendError>,
) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(v) => {
            let mut out = String::new();
            for (i, d) in v.decisions.iter().enumerate() {
                let name = meta.tier(shared, i).map_or("?", |t| &*t.name);
                let what = match (d.allowed, meta.shadow.contains(i)) {
                    (true, _) => "allowed",
                    (false, true) => "shadow_limited",
                    (false, false) => "limited",
                };
                use std::fmt::Write;
                let _ = write!(
                    out,
                    "{}{name}={what}/{}",
                    if i > 0 { "," } else { "" },
                    d.remaining
                );
            }
            span.record("tiers", out.as_str());
        }
        Err(e) => {
            span.record("error", tracing::field::display(e));
        }
    }
}

/// Counts a request passed unchecked (fail open) for each tier it would
/// have been checked against, so the page's chart shows the period.
fn observe_fail_open(shared: &Shared, meta: &Meta) {
    let Some(e) = &meta.endpoint else {
        return;
    };
    let now_s = shared.local_clock.now_us() / 1_000_000;
    let mut seen = 0u64;
    for &t in &meta.tiers {
        let t = usize::from(t);
        let bit = 1u64 << (t % 64);
        if seen & bit == 0 {
            seen |= bit;
            shared.telemetry.observer.record_fail_open(e, t, now_s);
        }
    }
}

/// Feeds the anomaly series and the top-N sketches. Rejections by a tier
/// (enforced or shadow) count as blocked for that tier's sketch; allowed
/// requests with less than 20 % of a tier's capacity left as near-limit.
#[inline]
pub(crate) fn observe_decisions(
    shared: &Shared,
    meta: &Meta,
    v: &Verdict,
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))] answered: std::time::Instant,
) {
    // The memory backend decided on this same clock a moment ago; a Redis
    // answer is observed when it came (`answered`, read for its latency).
    let now_us = match shared.backend {
        Backend::Memory(_) => v.now_us,
        #[cfg(feature = "redis")]
        Backend::Redis(_) => shared.local_clock.at(answered),
    };
    let now_s = now_us / 1_000_000;
    // The bucket is closed (if due) once for the request, not per tier.
    if meta.endpoint.is_some() {
        shared.telemetry.observer.roll(now_s);
    }
    for (i, d) in v.decisions.iter().enumerate() {
        let Some(tier) = meta.tiers.get(i).map(|&t| usize::from(t)) else {
            continue;
        };
        let shadow = meta.shadow.contains(i);
        if let Some(e) = &meta.endpoint {
            shared.telemetry.observer.record_rolled(
                e,
                tier,
                !d.allowed && !shadow,
                !d.allowed && shadow,
            );
        }
        let near = d.allowed && d.remaining.saturating_mul(5) < d.limit;
        if d.allowed && !near {
            continue;
        }
        let (Some(TierCheck { key, cost, .. }), Some(t)) =
            (meta.sent.get(i), shared.config.tiers.get(tier))
        else {
            continue;
        };
        let part = key.get(t.key_base.len()..).unwrap_or(key);
        let part = part
            .strip_suffix(crate::algorithm::PENALTY_KEY_SUFFIX)
            .unwrap_or(part);
        if !d.allowed {
            if let Some(g) = shared.live.plans.guarded(tier) {
                g.denied(part);
            }
        }
        // A tier not enforced for the key (shadow, a canary's other keys)
        // did not refuse it: its would-be denial is counted apart.
        let kind = if d.allowed {
            Kind::NearLimit
        } else if shadow {
            Kind::ShadowLimited
        } else {
            Kind::Blocked
        };
        shared
            .telemetry
            .observer
            .sketch(tier, kind, part, *cost, now_s);
    }
}

/// A penalty box's decision shows its tier's limit (the check before it),
/// everywhere from here on: headers, the deny cache.
#[inline]
fn penalty_limits(meta: &Meta, v: &mut Verdict) {
    for i in 1..v.decisions.len().min(meta.sent.len()) {
        if meta.sent[i].limit.is_penalty() {
            v.decisions[i].limit = v.decisions[i - 1].limit;
        }
    }
}

/// An allowed request's concurrency slots (taken on `backend`), for the
/// front door to hold until the response is over.
#[inline]
fn with_slots(
    mut d: Decision,
    shared: &Shared,
    backend: &Backend,
    meta: &Meta,
    v: &Verdict,
) -> Decision {
    if let Decision::Allow(a) = &mut d {
        a.slots = super::slots::Slots::of(shared, backend, meta, v);
    }
    d
}

/// The failure policy's decision when the backend (or a key extractor)
/// could not decide.
/// The backend could not decide a request whose checked tiers are all in
/// shadow mode: it passes whatever the failure policy (shadow mode never
/// blocks), counted as failed open, without rate-limit headers.
fn fail_shadow(shared: &Shared, e: &BackendError) -> Decision {
    let backend = shared.backend.name();
    observe::count_backend_error(e.kind(), backend);
    if let Some(suppressed) = shared.telemetry.failure_log.permit() {
        tracing::warn!(target: super::LOG_TARGET,
            error = %e,
            backend,
            suppressed,
            "rate limiter could not decide; every tier is in shadow mode: passing"
        );
    }
    shared.count(RequestDecision::FailOpen);
    Decision::Allow(Allow::bare(RequestDecision::FailOpen))
}

pub(crate) fn fail(shared: &Shared, e: &BackendError, facts: &impl Facts) -> Decision {
    let backend = shared.backend.name();
    observe::count_backend_error(e.kind(), backend);
    let policy = shared.config.failure_policy;
    if let Some(suppressed) = shared.telemetry.failure_log.permit() {
        tracing::warn!(target: super::LOG_TARGET,
            error = %e,
            backend,
            // As a policy file writes it, not Rust's `Debug` (`Open`).
            policy = match policy {
                FailurePolicy::Open => "open",
                FailurePolicy::Closed => "closed",
                FailurePolicy::Fallback => "fallback",
            },
            suppressed,
            "rate limiter could not decide; applying failure policy"
        );
    }
    match policy {
        FailurePolicy::Open => {
            shared.count(RequestDecision::FailOpen);
            Decision::Allow(Allow::bare(RequestDecision::FailOpen))
        }
        FailurePolicy::Closed => {
            shared.count(RequestDecision::FailClosed);
            Decision::Block(Block::Unavailable)
        }
        FailurePolicy::Fallback => {
            shared.count(RequestDecision::Fallback);
            let Some(local) = &shared.guards.fallback else {
                return Decision::Allow(Allow::bare(RequestDecision::Fallback));
            };
            let mut meta = Meta::default();
            match plan(shared, facts, Purpose::Fallback, &mut meta) {
                Planned::Check(checks) => {
                    meta.fallback = true;
                    let mut v = local.check(&checks, meta.shadow, false);
                    meta.sent = checks;
                    penalty_limits(&meta, &mut v);
                    let local = crate::backend::Backend::Memory(local.clone());
                    with_slots(decide(shared, &meta, &v, None), shared, &local, &meta, &v)
                }
                Planned::Refuse(status) => Decision::Block(Block::Denylisted(status)),
                // An extractor failed: nothing local can decide either.
                Planned::Pass(_) | Planned::Failed(_) => {
                    Decision::Allow(Allow::bare(RequestDecision::Fallback))
                }
            }
        }
    }
}
