//! [`RateLimitService`]: the tower service the layer wraps around yours.

use crate::engine::check::{start, Started};
use crate::engine::decide::Outcome;
use crate::engine::deny::{deny_cached, Cached};
use crate::engine::outcome::outcome;
use crate::engine::plan::{plan, Meta, Planned};
use crate::engine::runtime::Shared;
use crate::future::{ResponseFuture, Waiter};
use http::{Request, Response};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;

/// Rate-limits requests before they reach `S`. Built by
/// [`RateLimitLayer`](crate::RateLimitLayer).
///
/// `poll_ready` forwards to the inner service: limiting never shows up as
/// back-pressure, only as `429` responses.
pub struct RateLimitService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: Clone> Clone for RateLimitService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimitService<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the limiter, returning the wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
{
    type Response = Response<crate::response::ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let started = std::time::Instant::now();
        let shared = &self.shared;
        if shared.control.is_some() && shared.control_started.get().is_none() {
            crate::engine::watch::start(shared);
        }
        let (parts, body) = req.into_parts();
        let (result, meta) = match plan(shared, &parts, false) {
            Planned::Pass(decision) => {
                shared.count(decision);
                let req = Request::from_parts(parts, body);
                return ResponseFuture::call(self.inner.call(req), None, None);
            }
            Planned::Refuse(res) => return ResponseFuture::respond(res),
            Planned::Failed(e) => (Err(e), Meta::default()),
            Planned::Check(checks, mut meta) => {
                match deny_cached(shared, &checks, &meta, true) {
                    Cached::Respond(res) => return ResponseFuture::respond(res),
                    Cached::Wait(probe) => {
                        let wait = Box::pin(probe.wait(shared.backend_timeout));
                        let waiter = Waiter {
                            service: self.take_ready_inner(),
                            request: Request::from_parts(parts, body),
                            shared: self.shared.clone(),
                            checks,
                            meta,
                            started,
                        };
                        return ResponseFuture::wait(wait, waiter);
                    }
                    Cached::Check(probe) => meta.probe = probe,
                }
                match start(shared, checks, &mut meta, started, shared.backend_timeout) {
                    Started::Ready(result) => (result, meta),
                    Started::Pending(fut) => {
                        let shared = shared.clone();
                        let req = Request::from_parts(parts, body);
                        let inner = self.take_ready_inner();
                        return ResponseFuture::check(fut, inner, req, shared, meta);
                    }
                }
            }
        };
        let decided = outcome(shared, &meta, result, &parts);
        let req = Request::from_parts(parts, body);
        match decided {
            Outcome::Pass(headers, delay, refunds) if delay.is_zero() => {
                ResponseFuture::call(self.inner.call(req), headers, refunds)
            }
            Outcome::Pass(headers, delay, refunds) => {
                let inner = self.take_ready_inner();
                ResponseFuture::delay(delay, inner, req, headers, refunds)
            }
            Outcome::Respond(res) => ResponseFuture::respond(res),
        }
    }
}

impl<S: Clone> RateLimitService<S> {
    /// The readied inner service, for a future that calls it later; a clone
    /// takes its place (the tower pattern for services called after an await).
    fn take_ready_inner(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}
