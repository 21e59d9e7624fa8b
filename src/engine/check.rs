//! One request's check, start to decision: the engine's state machine.
//!
//! [`Engine::start`] runs every step that needs no waiting — gate, plan,
//! deny cache, circuit breaker, and on the memory backend the check itself —
//! and returns the [`Decision`] at once when it can. Otherwise it returns a
//! [`Pending`] check, in one of two states:
//!
//! * **waiting** for another request's probe of a lapsed deny-cache key
//!   (bounded by the backend timeout), then the cache again, then the
//!   backend;
//! * **checking**: the backend call is in flight (bounded by what is left
//!   of the backend timeout).
//!
//! A front door polls it with [`Pending::poll_decide`], giving the same
//! request's facts (the local fallback plans the request again).

use super::decision::{Allow, Block, Decision};
use super::deny::{deny_cached, Cached};
use super::facts::Facts;
use super::outcome::{outcome, outcome_in};
use super::plan::{plan, Meta, Planned, Purpose};
use super::state::Shared;
use crate::backend::{Backend, Check, CheckFuture, TierCheck, Verdict};
use crate::engine::breaker::Permit;
use crate::error::BackendError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

/// The decision engine: the built tiers, their runtime settings and the
/// backend, shared by every front door of one layer. Cloning is cheap (an
/// `Arc`).
#[derive(Clone)]
pub(crate) struct Engine {
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.shared.backend.name())
            .field("tiers", &self.shared.config.tiers.len())
            .finish_non_exhaustive()
    }
}

/// How a request's decision began.
// `Pending` holds the request's meta inline (see `State`): boxing it would
// cost every Redis check an allocation; a `Done` is moved once.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Step {
    /// Decided without waiting.
    Done(Decision),
    /// Waiting for a probe or the backend: poll it.
    Pending(Pending),
}

impl Engine {
    /// With a fleet-wide control key on Redis, before this instance's first
    /// read of the control hash: a wait for it, at most the backend timeout
    /// (a starting instance decides under the fleet's settings, not only
    /// the configured ones). `None` once read, and without a control key.
    #[inline]
    pub(crate) fn settings_wait(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        self.shared.config.control.as_ref()?;
        self.settings_wait_slow()
    }

    /// [`settings_wait`](Self::settings_wait) with a control key.
    #[cold]
    #[inline(never)]
    fn settings_wait_slow(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        let shared = &self.shared;
        if shared.live.fleet.is_read() {
            return None;
        }
        super::watch::control_hash_key(shared)?;
        if shared.live.control_started.get().is_none() {
            super::watch::start(&self.shared);
        }
        // No Tokio runtime to read it in: nothing to wait for.
        shared.live.control_started.get()?;
        let shared = self.shared.clone();
        Some(Box::pin(async move {
            let timeout = shared.config.backend_timeout;
            let _ = tokio::time::timeout(timeout, shared.live.fleet.ready()).await;
        }))
    }

    /// Starts deciding the request of `facts`; `started` is when it reached
    /// the front door (the backend timeout counts from there).
    #[inline]
    pub(crate) fn start(&self, facts: &impl Facts, started: Instant) -> Step {
        self.start_inspected(facts, started, |_, _| {})
    }

    /// Plans the request of `facts` as [`start`](Self::start) would and
    /// shows its checks to `inspect`, without deciding, charging or
    /// counting it (replay's "which tiers, which keys"). Nothing is shown
    /// when no check is planned (passed, refused or failed before any).
    pub(crate) fn plan_only(&self, facts: &impl Facts, inspect: impl FnOnce(&[TierCheck], &Meta)) {
        let mut meta = Meta::default();
        if let Planned::Check(checks) = plan(&self.shared, facts, Purpose::Inspect, &mut meta) {
            inspect(&checks, &meta);
        }
    }

    /// [`start`](Self::start), showing the planned checks and the tier index
    /// of each to `inspect` before they go further (replay's report).
    pub(crate) fn start_inspected(
        &self,
        facts: &impl Facts,
        started: Instant,
        inspect: impl FnOnce(&[TierCheck], &Meta),
    ) -> Step {
        let shared = &*self.shared;
        if shared.config.control.is_some() && shared.live.control_started.get().is_none() {
            super::watch::start(&self.shared);
        }
        // The request's meta lives here from plan to outcome, never moved
        // (but into a pending check's state).
        let mut meta = Meta::default();
        let result = match plan(shared, facts, Purpose::Check, &mut meta) {
            Planned::Pass(decision) => {
                shared.count(decision);
                return Step::Done(Decision::Allow(Allow::bare(decision)));
            }
            Planned::Refuse(status) => {
                return Step::Done(Decision::Block(Block::Denylisted(status)))
            }
            Planned::Failed(e) => Err(e),
            Planned::Check(checks) => {
                let live = checks.len() - meta.live_of.len();
                inspect(&checks[..live], &meta);
                // One reading of the clock for the deny-cache lookup and
                // the call that follows at once (the cache is off on the
                // memory backend, which reads no clock for it). A request
                // with candidates is always checked: they count every
                // request (docs/rollout.md, "Candidate quotas").
                let now = shared.guards.deny_cache.enabled().then(Instant::now);
                let cached = if now.is_some() && meta.live_of.is_empty() && meta.packs.is_empty() {
                    deny_cached(shared, &checks, &meta, true, now)
                } else {
                    Cached::Check(None)
                };
                match cached {
                    Cached::Deny(denial) => {
                        return Step::Done(Decision::Block(Block::Limited(denial)))
                    }
                    Cached::Wait(probe) => {
                        return Step::Pending(Pending {
                            state: State::Waiting {
                                wait: Box::pin(probe.wait(shared.config.backend_timeout)),
                                waiter: Box::new((checks, std::mem::take(&mut meta))),
                                started,
                            },
                        });
                    }
                    Cached::Check(None) => {}
                    Cached::Check(probe) => meta.probe = probe,
                }
                match begin(
                    shared,
                    checks,
                    &mut meta,
                    started,
                    shared.config.backend_timeout,
                    now,
                ) {
                    Begun::Ready(result) => result,
                    Begun::Pending(check) => {
                        return Step::Pending(Pending {
                            state: checking(shared, check, std::mem::take(&mut meta)),
                        });
                    }
                }
            }
        };
        let mut result = result;
        super::candidates::take(shared, &mut meta, &mut result);
        Step::Done(outcome(shared, &meta, result, facts))
    }
}

/// A check that waits for a probe or the backend.
pub(crate) struct Pending {
    state: State,
}

// `Checking` holds its meta inline: boxing it would cost every Redis check
// an allocation, for the rare `Waiting`'s sake.
#[allow(clippy::large_enum_variant)]
enum State {
    /// Waiting for another request's answer on a lapsed deny-cache key.
    Waiting {
        wait: Pin<Box<dyn Future<Output = ()> + Send>>,
        // Boxed: a rare state, kept from growing every pending check.
        waiter: Box<(Vec<TierCheck>, Meta)>,
        started: Instant,
    },
    /// The backend call is in flight.
    Checking {
        check: CheckFuture,
        meta: Meta,
        /// The check's span, made when the call was sent (`None` while no
        /// subscriber takes debug spans): entered while the call is polled.
        span: Option<tracing::Span>,
        /// The concurrency checks' slot ids while no answer says whether
        /// they were taken: released if the request is dropped now or the
        /// call fails (see [`super::slots`]).
        unanswered: Option<Box<super::slots::Slots>>,
    },
    Done,
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Waiting { .. } => "waiting",
            State::Checking { .. } => "checking",
            State::Done => "done",
        };
        f.debug_struct("Pending").field("state", &state).finish()
    }
}

impl Pending {
    /// Polls the check to its decision. `facts` are the request's, as given
    /// to [`Engine::start`].
    ///
    /// # Panics
    /// When polled again after it returned its decision.
    pub(crate) fn poll_decide(
        &mut self,
        cx: &mut Context<'_>,
        engine: &Engine,
        facts: &impl Facts,
    ) -> Poll<Decision> {
        let shared = &*engine.shared;
        loop {
            match &mut self.state {
                State::Waiting { wait, .. } => {
                    ready!(wait.as_mut().poll(cx));
                    let State::Waiting {
                        waiter, started, ..
                    } = std::mem::replace(&mut self.state, State::Done)
                    else {
                        unreachable!("state was Waiting");
                    };
                    let (checks, meta) = *waiter;
                    match resume(shared, checks, meta, started) {
                        Resumed::Deny(denial) => {
                            return Poll::Ready(Decision::Block(Block::Limited(denial)))
                        }
                        Resumed::Begun(Begun::Pending(check), meta) => {
                            self.state = checking(shared, check, meta);
                        }
                        Resumed::Begun(Begun::Ready(mut result), mut meta) => {
                            super::candidates::take(shared, &mut meta, &mut result);
                            return Poll::Ready(outcome(shared, &meta, result, facts));
                        }
                    }
                }
                State::Checking {
                    check,
                    meta,
                    span,
                    unanswered,
                } => {
                    let mut result = {
                        let _entered = span.as_ref().map(|s| s.enter());
                        ready!(check.as_mut().poll(cx))
                    };
                    let mut meta = std::mem::take(meta);
                    super::candidates::take(shared, &mut meta, &mut result);
                    let span = span.take();
                    // An answer: the slots taken are the response's now
                    // (outcome). An error: released (dropped below).
                    if let (Ok(_), Some(u)) = (&result, unanswered.as_mut()) {
                        u.disarm();
                    }
                    self.state = State::Done;
                    return Poll::Ready(outcome_in(shared, &meta, result, facts, span));
                }
                State::Done => panic!("Pending polled after its decision"),
            }
        }
    }
}

/// The state of a check whose call is in flight.
fn checking(shared: &Shared, check: CheckFuture, meta: Meta) -> State {
    let unanswered = super::slots::Slots::unanswered(shared, &meta);
    State::Checking {
        check,
        meta,
        span: super::outcome::check_span(shared),
        unanswered,
    }
}

/// How a backend call began.
enum Begun {
    /// Decided already (the memory backend, an open circuit, a command that
    /// could not be built).
    Ready(Result<Verdict, BackendError>),
    /// In flight.
    Pending(CheckFuture),
}

/// Starts the backend call for `checks` (past the deny cache). `started`:
/// when the request reached the front door; `timeout`: the call's bound
/// (less than `backend_timeout` after a wait for a probe); `now`: the clock
/// as the caller read it a moment ago, if it did.
fn begin(
    shared: &Shared,
    mut checks: Vec<TierCheck>,
    meta: &mut Meta,
    started: Instant,
    timeout: Duration,
    now: Option<Instant>,
) -> Begun {
    meta.started = Some(started);
    // Lease mode: the checks this instance's leases cover are decided here;
    // the call carries the others (none: no call, no breaker).
    // Lease mode: what this instance's token leases answer locally.
    let leased = shared
        .guards
        .leases
        .as_ref()
        .and_then(|pool| pool.take(&checks, &meta.tiers, meta.shadow));
    let local = leased.as_ref().map_or(0, |t| t.count());
    if let Some(t) = leased.as_ref().filter(|t| t.all(checks.len())) {
        let verdict = t.verdict(shared.local_clock.now_us());
        meta.sent = checks;
        meta.leased = leased;
        return Begun::Ready(Ok(verdict));
    }
    meta.permit = shared.guards.breaker.permit();
    if meta.permit == Permit::Reject {
        return Begun::Ready(Err(BackendError::CircuitOpen));
    }
    #[allow(irrefutable_let_patterns)] // without the `redis` feature
    if let Backend::Memory(m) = &shared.backend {
        // Only for the latency histogram, which an unobserved check skips.
        if !meta.quiet {
            meta.backend_started = Some(Instant::now());
        }
        // Synchronous: keep the checks themselves, no copies; the verdict's
        // vectors are a spare's, given back once the request is decided.
        let mut verdict = super::spare::verdict();
        if !meta.packs.is_empty() {
            // Each tier's candidate checks, built with it.
            let tiers = &shared.config.tiers;
            let group = |&(live, tier): &(u8, u8)| {
                tiers
                    .get(usize::from(tier))
                    .map(|t| crate::backend::PackGroup {
                        live: usize::from(live),
                        checks: &t.unit_candidates.checks,
                        tags: &t.unit_candidates.tags,
                    })
            };
            let (shadow, refunds) = (meta.shadow, shared.config.refunds());
            let denials = &mut meta.denials;
            match meta.packs.as_slice() {
                [one] => {
                    let groups = group(one);
                    let groups = groups.as_slice();
                    m.check_with_packs(&checks, shadow, groups, refunds, &mut verdict, denials);
                }
                more => {
                    let groups: Vec<_> = more.iter().filter_map(group).collect();
                    m.check_with_packs(&checks, shadow, &groups, refunds, &mut verdict, denials);
                }
            }
        } else if meta.live_of.is_empty() {
            m.check_reusing(&checks, meta.shadow, shared.config.refunds(), &mut verdict);
        } else {
            // The candidates' keys are left empty: named by their tags.
            m.check_with_candidates(
                &checks,
                meta.shadow,
                &meta.live_of,
                &meta.tags,
                shared.config.refunds(),
                &mut verdict,
            );
        }
        meta.sent = checks;
        Begun::Ready(Ok(verdict))
    } else {
        // One reading of the clock for the call: the latency histogram's
        // start, the deny cache's send time, the hour of the blocked-keys
        // set and the script's deadline (a read costs ~60 ns in a VM;
        // perf/README.md, "Redis mode's app-side cost").
        let sent = now.unwrap_or_else(Instant::now);
        if !meta.quiet {
            meta.backend_started = Some(sent);
        }
        // For the deny cache (off on the memory backend).
        meta.sent_us = shared.local_clock.at(sent);
        if shared.guards.deny_cache.enabled() {
            let live = checks.len() - meta.live_of.len();
            let cost = checks[..live]
                .iter()
                .fold(0u64, |n, c| n.saturating_add(c.cost));
            meta.flight = Some(shared.guards.deny_cache.start_flight(cost));
        }
        let blocked = shared.blocked_set(meta.sent_us);
        let sets = blocked
            .as_deref()
            .map(|b| (&*b.blocked, &*b.shadow_limited));
        let check = match &leased {
            Some(t) if local > 0 => {
                let (rest, shadow) = t.rest(&mut checks, meta.shadow);
                // The command is built here: the keys come back at once.
                let check = shared.backend.start_check(
                    &rest,
                    shadow,
                    &[],
                    shared.config.refunds(),
                    sets,
                    Some(timeout),
                    sent,
                );
                t.restore(&mut checks, rest);
                check
            }
            _ => shared.backend.start_check(
                &checks,
                meta.shadow,
                &meta.live_of,
                shared.config.refunds(),
                sets,
                Some(timeout),
                sent,
            ),
        };
        meta.sent = checks;
        meta.leased = leased;
        match check {
            Check::Ready(result) => Begun::Ready(result),
            Check::Pending(fut) => Begun::Pending(fut),
        }
    }
}

/// What a request that waited for another's probe does next.
// `Begun` holds the request's meta inline, as `State` does.
#[allow(clippy::large_enum_variant)]
enum Resumed {
    /// Answered from the deny cache.
    Deny(super::decision::Denial),
    Begun(Begun, Meta),
}

/// After the wait for a probe: the deny cache again (the probe's answer is
/// in it now), then the backend.
fn resume(shared: &Shared, checks: Vec<TierCheck>, mut meta: Meta, started: Instant) -> Resumed {
    // The wait counts against `backend_timeout`, the most the layer may add
    // to a request: the check gets what is left (none: the failure policy).
    let now = Instant::now();
    let timeout = shared
        .config
        .backend_timeout
        .saturating_sub(now.saturating_duration_since(started));
    match deny_cached(shared, &checks, &meta, false, Some(now)) {
        Cached::Deny(denial) => Resumed::Deny(denial),
        // Nothing left: a timeout, without sending a check that could
        // charge after the request gave up on it.
        _ if timeout.is_zero() => {
            meta.started = Some(started);
            let timed_out = Err(BackendError::Timeout(shared.config.backend_timeout));
            Resumed::Begun(Begun::Ready(timed_out), meta)
        }
        Cached::Wait(_) => {
            let begun = begin(shared, checks, &mut meta, started, timeout, Some(now));
            Resumed::Begun(begun, meta)
        }
        Cached::Check(probe) => {
            meta.probe = probe;
            let begun = begin(shared, checks, &mut meta, started, timeout, Some(now));
            Resumed::Begun(begun, meta)
        }
    }
}
