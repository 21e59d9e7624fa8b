//! [`RateLimitService`]: the tower service the layer wraps around yours.

use crate::engine::{Decision, Step};
use crate::http::front::Front;
use crate::http::future::ResponseFuture;
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
    front: Arc<Front>,
}

impl<S: Clone> Clone for RateLimitService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            front: self.front.clone(),
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
    pub(crate) fn new(inner: S, front: Arc<Front>) -> Self {
        Self { inner, front }
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
    type Response = Response<crate::http::body::ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if let Some(wait) = self.front.engine.settings_wait() {
            // Readiness is not held through the wait (as through a
            // shaping delay): an unreadied clone is polled ready after it.
            let unreadied = self.take_ready_inner().clone();
            return ResponseFuture::load(wait, unreadied, req, self.front.clone());
        }
        self.call_now(req)
    }
}

impl<S: Clone> RateLimitService<S> {
    /// [`call`](Service::call) once the fleet-wide settings are read (or
    /// need not be).
    #[inline]
    pub(crate) fn call_now<ReqBody, ResBody>(
        &mut self,
        req: Request<ReqBody>,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        ReqBody: Send + 'static,
    {
        let started = std::time::Instant::now();
        let (parts, body) = req.into_parts();
        let front = &*self.front;
        match front.engine.start(&front.facts(&parts), started) {
            Step::Done(Decision::Allow(mut allow)) => {
                let mut req = Request::from_parts(parts, body);
                let pricing = front.pricing(&mut allow, &mut req);
                if allow.delay.is_zero() {
                    ResponseFuture::call(self.inner.call(req), allow, pricing)
                } else {
                    // Readiness is not held through the delay: the readied
                    // service is dropped (releasing what its readiness
                    // reserved, e.g. a concurrency permit or a buffer slot)
                    // and an unreadied clone is polled ready after the wait.
                    let unreadied = self.take_ready_inner().clone();
                    ResponseFuture::delay(allow, unreadied, req, pricing)
                }
            }
            Step::Done(Decision::Block(block)) => {
                ResponseFuture::respond(front.respond(block, &parts))
            }
            Step::Pending(pending) => {
                let front = self.front.clone();
                ResponseFuture::decide(pending, self.take_ready_inner(), parts, body, front)
            }
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

/// The service keeps the name tonic routes it by (feature `grpc`).
#[cfg(feature = "grpc")]
impl<S: tonic::server::NamedService> tonic::server::NamedService for RateLimitService<S> {
    const NAME: &'static str = S::NAME;
}
