//! The backend step: the circuit breaker, then one backend call for all of a
//! request's checks (or a wait for another request's probe, then the call).

use super::deny::{deny_cached, Cached};
use super::plan::Meta;
use super::runtime::Shared;
use crate::backend::CheckFuture;
use crate::backend::{Backend, Check, TierCheck, Verdict};
use crate::breaker::Permit;
use crate::error::BackendError;
use bytes::Bytes;
use http::Response;
use std::time::{Duration, Instant};

/// How a backend check began.
pub(crate) enum Started {
    /// Decided already (the memory backend, an open circuit, a command that
    /// could not be built).
    Ready(Result<Verdict, BackendError>),
    /// In flight.
    Pending(CheckFuture),
}

/// Starts the backend check of `checks` (past the deny cache). `started`:
/// when the request reached the layer; `timeout`: the backend call's bound
/// (less than `backend_timeout` after a wait for a probe).
pub(crate) fn start(
    shared: &Shared,
    checks: Vec<TierCheck>,
    meta: &mut Meta,
    started: Instant,
    timeout: Duration,
) -> Started {
    meta.started = Some(started);
    meta.permit = shared.breaker.permit();
    if meta.permit == Permit::Reject {
        return Started::Ready(Err(BackendError::CircuitOpen));
    }
    meta.backend_started = Some(Instant::now());
    #[allow(irrefutable_let_patterns)] // without the `redis` feature
    if let Backend::Memory(m) = &shared.backend {
        // Synchronous: keep the checks themselves, no copies.
        let verdict = m.check(&checks, meta.shadow, shared.refunds());
        meta.sent = checks;
        Started::Ready(Ok(verdict))
    } else {
        // For the deny cache (off on the memory backend).
        meta.sent_us = shared.local_clock.now_us();
        let blocked = shared.blocked_set();
        let check = shared.backend.start_check(
            &checks,
            meta.shadow,
            shared.refunds(),
            blocked.as_deref(),
            Some(timeout),
        );
        meta.sent = checks;
        match check {
            Check::Ready(result) => Started::Ready(result),
            Check::Pending(fut) => Started::Pending(fut),
        }
    }
}

/// What a request that waited for another's probe does next.
pub(crate) enum Resumed {
    /// Answered from the deny cache.
    Respond(Response<Bytes>),
    Started(Started, Meta),
}

/// After the wait for a probe: the deny cache again (the probe's answer is
/// in it now), then the backend.
pub(crate) fn resume(
    shared: &Shared,
    checks: Vec<TierCheck>,
    mut meta: Meta,
    started: Instant,
) -> Resumed {
    // The wait counts against `backend_timeout`, the most the layer may add
    // to a request: the check gets what is left (none: the failure policy).
    let timeout = shared.backend_timeout.saturating_sub(started.elapsed());
    match deny_cached(shared, &checks, &meta, false) {
        Cached::Respond(res) => Resumed::Respond(res),
        // Nothing left: a timeout, without sending a check that could
        // charge after the request gave up on it.
        _ if timeout.is_zero() => {
            meta.started = Some(started);
            let timed_out = Err(BackendError::Timeout(shared.backend_timeout));
            Resumed::Started(Started::Ready(timed_out), meta)
        }
        Cached::Wait(_) => {
            let started = start(shared, checks, &mut meta, started, timeout);
            Resumed::Started(started, meta)
        }
        Cached::Check(probe) => {
            meta.probe = probe;
            let started = start(shared, checks, &mut meta, started, timeout);
            Resumed::Started(started, meta)
        }
    }
}
