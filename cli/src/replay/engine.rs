//! The two ways a replayed request is decided.
//!
//! * **layer**: the request goes through a real axum `Router` with the
//!   layer added by `Router::layer`, exactly as in an app, and the decision
//!   is read from the response (a [`Rejection`] in its extensions means 429).
//!   The reference, at about 0.3 million requests per second.
//! * **direct**: the layer's own engine through [`Offline`], with the
//!   request's head read as the layer reads it (the same gate, plan, check
//!   on the memory backend and decision), without a router, a body or a
//!   response. Several times faster; its decisions are tested to be the
//!   layer's, request by request (`tests/replay.rs`).
//!
//! Both fill [`Checks`]: which tiers applied and under which key, for the
//! report. The direct engine gets the engine's own plan; next to the router,
//! [`Offline::plan`] plans the request once more without counting it.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use http::request::Parts;
use std::future::Future;
use std::task::{Context, Poll, Waker};
use tiered_ratelimit::offline::{Admission, Checks, Offline, Outcome};
use tiered_ratelimit::response::Rejection;
use tiered_ratelimit::{observe::DecisionCounts, RateLimitHandle, RateLimitLayer};
use tower::Service;

/// The direct engine: the layer's engine, called without HTTP.
#[derive(Debug)]
pub(crate) struct Direct;

impl Direct {
    /// Decides `parts` with the layer's engine, recording its plan.
    pub(crate) fn decide(
        &mut self,
        offline: &Offline,
        checks: &mut Checks,
        parts: &Parts,
    ) -> Outcome {
        offline.decide(parts, checks)
    }
}

/// Put on responses of the app behind the layer: the request got through.
#[derive(Debug, Clone, Copy)]
struct Reached;

/// The status the log recorded, for the app behind the layer to answer with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoggedStatus(pub(crate) u16);

async fn app(req: http::Request<Body>) -> Response {
    let status = req
        .extensions()
        .get::<LoggedStatus>()
        .and_then(|s| http::StatusCode::from_u16(s.0).ok())
        .unwrap_or(http::StatusCode::OK);
    let mut res = status.into_response();
    res.extensions_mut().insert(Reached);
    res
}

/// The layer engine: a real axum app.
pub(crate) struct Layer {
    router: axum::Router,
    tier_names: Vec<String>,
    handle: RateLimitHandle,
    /// For shaping delays (`tokio::time::sleep` needs a timer).
    runtime: tokio::runtime::Runtime,
}

impl Layer {
    pub(crate) fn new(layer: &RateLimitLayer, routes: &[String]) -> std::io::Result<Self> {
        let mut router = axum::Router::new();
        for r in routes {
            router = router.route(r, any(app));
        }
        let router = router.fallback(app).layer(layer.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        Ok(Self {
            router,
            tier_names: layer.tier_names().map(str::to_owned).collect(),
            handle: layer.handle(),
            runtime,
        })
    }

    /// Sends `req` through the app. `checks` hold the same request's plan
    /// (for the binding tier's key).
    pub(crate) fn decide(&mut self, checks: &Checks, req: http::Request<Body>) -> Outcome {
        let _rt = self.runtime.enter();
        let before = self.handle.counts();
        let mut fut = std::pin::pin!(self.router.call(req));
        let polled = fut.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        let after = self.handle.counts();
        let delta = |f: fn(&DecisionCounts) -> u64| f(&after) > f(&before);
        let shadow_limited = delta(|c| c.shadow_limited);
        let decision = match polled {
            // A shaping tier holds the request: it was allowed and charged.
            Poll::Pending => Admission::Allowed {
                delayed: true,
                shadow_limited,
            },
            Poll::Ready(Err(e)) => match e {},
            Poll::Ready(Ok(res)) => {
                if let Some(r) = res.extensions().get::<Rejection>() {
                    Admission::Rejected {
                        tier: r.tier.clone(),
                    }
                } else if delta(|c| c.denylisted) {
                    Admission::Denylisted
                } else if delta(|c| c.fail_closed) {
                    Admission::FailClosed
                } else if delta(|c| c.fail_open) {
                    Admission::FailOpen
                } else if delta(|c| c.allowlisted) {
                    Admission::Allowlisted
                } else if delta(|c| c.allowed) || shadow_limited {
                    Admission::Allowed {
                        delayed: false,
                        shadow_limited,
                    }
                } else {
                    Admission::Skipped
                }
            }
        };
        let binding_check = match &decision {
            Admission::Rejected { tier } => self
                .tier_names
                .iter()
                .position(|t| **t == **tier)
                .and_then(|i| checks.check_of_tier(i)),
            _ => None,
        };
        Outcome::new(decision, binding_check, 0)
    }
}
