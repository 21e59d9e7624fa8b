//! [`RateLimitService`]: the tower service the layer wraps around yours.

use crate::algorithm::Decision;
use crate::backend::{Check, Shadow, TierCheck, Verdict};
use crate::error::BackendError;
use crate::future::ResponseFuture;
use crate::key::storage_key_part_into;
use crate::layer::{FailurePolicy, Shared};
use crate::observe;
use crate::response::{unavailable, RateLimitHeaders, Rejection};
use bytes::Bytes;
use http::{Request, Response};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
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
}

/// What to do with a request after its check.
pub(crate) enum Outcome {
    /// Call the inner service (after `delay`, when a shaping tier queued the
    /// request), then add these headers (none on fail-open).
    Pass(Option<RateLimitHeaders>, Duration),
    /// Answer with this response instead (429 or 503).
    Respond(Response<Bytes>),
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
        let (parts, body) = req.into_parts();
        let planned = plan(&self.shared, &parts);
        let req = Request::from_parts(parts, body);
        let (result, tiers) = match planned {
            Ok(None) => {
                observe::count_decision("skipped");
                return ResponseFuture::call(self.inner.call(req), None);
            }
            Ok(Some((checks, tiers))) => {
                match self.shared.backend.start_check(checks, Shadow::NONE) {
                    Check::Ready(result) => (result, tiers),
                    Check::Pending(fut) => {
                        let timeout = self.shared.backend_timeout;
                        let fut = Box::pin(async move {
                            match tokio::time::timeout(timeout, fut).await {
                                Ok(r) => r,
                                Err(_) => Err(BackendError::Timeout(timeout)),
                            }
                        });
                        let inner = self.take_ready_inner();
                        return ResponseFuture::check(fut, inner, req, self.shared.clone(), tiers);
                    }
                }
            }
            Err(e) => (Err(e), Vec::new()),
        };
        match outcome(&self.shared, &tiers, result) {
            Outcome::Pass(headers, delay) if delay.is_zero() => {
                ResponseFuture::call(self.inner.call(req), headers)
            }
            Outcome::Pass(headers, delay) => {
                let inner = self.take_ready_inner();
                ResponseFuture::delay(delay, inner, req, headers)
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

/// The checks for a request: one per tier whose extractor returns a key, with
/// the indices of those tiers. `None` when no tier applies.
#[allow(clippy::type_complexity)]
fn plan(
    shared: &Shared,
    parts: &http::request::Parts,
) -> Result<Option<(Vec<TierCheck>, Vec<u16>)>, BackendError> {
    let mut checks = Vec::with_capacity(shared.tiers.len());
    let mut tiers = Vec::with_capacity(shared.tiers.len());
    for (i, t) in shared.tiers.iter().enumerate() {
        let cost = match &t.cost_fn {
            Some(f) => f(parts),
            None => t.cost,
        };
        if cost == 0 {
            continue;
        }
        let Some(part) = t.key.extract(parts)? else {
            continue;
        };
        let mut key =
            String::with_capacity(t.key_base.len() + part.len().min(crate::key::MAX_KEY_PART));
        key.push_str(&t.key_base);
        storage_key_part_into(&mut key, part.as_bytes());
        checks.push(TierCheck {
            key,
            limit: t.limit,
            cost,
        });
        // build() caps tiers far below u16::MAX in practice; saturate anyway.
        tiers.push(u16::try_from(i).unwrap_or(u16::MAX));
    }
    Ok((!checks.is_empty()).then_some((checks, tiers)))
}

/// Seconds, rounded up.
fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// Turns a backend result into what the client gets.
pub(crate) fn outcome(
    shared: &Shared,
    tiers: &[u16],
    result: Result<Verdict, BackendError>,
) -> Outcome {
    match result {
        Ok(v) => decide(shared, tiers, &v),
        Err(e) => fail(shared, &e),
    }
}

fn decide(shared: &Shared, tiers: &[u16], v: &Verdict) -> Outcome {
    let ds = &v.decisions;
    if v.allowed() {
        // Binding tier: least remaining; on a tie, the one that takes longest to refill.
        let Some(d) = ds.iter().min_by(|a, b| {
            a.remaining
                .cmp(&b.remaining)
                .then(b.reset_after_us.cmp(&a.reset_after_us))
        }) else {
            return Outcome::Pass(None, Duration::ZERO);
        };
        observe::count_decision("allowed");
        // A request queued by shaping tiers waits for the latest slot.
        let delay_us = ds.iter().map(|d| d.delay_us).max().unwrap_or(0);
        return Outcome::Pass(
            Some(RateLimitHeaders {
                limit: d.limit,
                remaining: d.remaining,
                reset: ceil_secs(v.now_us.saturating_add(d.reset_after_us)),
                retry_after: None,
            }),
            Duration::from_micros(delay_us),
        );
    }
    // Binding tier: the denying tier with the longest wait (first on a tie).
    let mut binding: Option<(usize, &Decision)> = None;
    for (i, d) in ds.iter().enumerate().filter(|(_, d)| !d.allowed) {
        if binding.is_none_or(|(_, b)| d.retry_after_us > b.retry_after_us) {
            binding = Some((i, d));
        }
    }
    let Some((i, d)) = binding else {
        return Outcome::Pass(None, Duration::ZERO);
    };
    let tier = tiers
        .get(i)
        .and_then(|&t| shared.tiers.get(usize::from(t)))
        .map(|t| t.name.clone())
        .unwrap_or_else(|| Arc::from("unknown"));
    let retry_after = ceil_secs(d.retry_after_us).max(1);
    let headers = RateLimitHeaders {
        limit: d.limit,
        remaining: d.remaining,
        reset: ceil_secs(v.now_us.saturating_add(d.retry_after_us)),
        retry_after: Some(retry_after),
    };
    observe::count_limited(&tier);
    tracing::debug!(tier = &*tier, retry_after, "request rate limited");
    let rejection = Rejection {
        tier,
        limit: headers.limit,
        remaining: headers.remaining,
        reset: headers.reset,
        retry_after,
        docs_url: shared.docs_url.clone(),
    };
    let mut res = shared.on_rejection.response(&rejection);
    headers.write(res.headers_mut());
    res.extensions_mut().insert(rejection);
    Outcome::Respond(res)
}

fn fail(shared: &Shared, e: &BackendError) -> Outcome {
    let backend = shared.backend.name();
    observe::count_backend_error(e.kind(), backend);
    let policy = shared.failure_policy;
    if let Some(suppressed) = shared.failure_log.permit() {
        tracing::warn!(
            error = %e,
            backend,
            ?policy,
            suppressed,
            "rate limiter could not decide; applying failure policy"
        );
    }
    match policy {
        FailurePolicy::Open => {
            observe::count_decision("fail_open");
            Outcome::Pass(None, Duration::ZERO)
        }
        FailurePolicy::Closed => {
            observe::count_decision("fail_closed");
            Outcome::Respond(unavailable())
        }
    }
}
