//! The two ways a replayed request is decided.
//!
//! * **layer**: the request goes through a real axum `Router` with the
//!   layer added by `Router::layer`, exactly as in an app, and the decision
//!   is read from the response (a [`Rejection`] in its extensions means 429).
//!   The reference, at about 0.3 million requests per second.
//! * **direct**: the layer's own engine, called with the request's head as
//!   the HTTP front door reads it (the same gate, plan, check on the memory
//!   backend and decision), without a router, a body or a response. Several
//!   times faster; its decisions are tested to be the layer's, request by
//!   request (`tests/replay.rs`).
//!
//! Both fill the [`Planner`]: which tiers applied and under which key, for
//! the report. The direct engine shows it the engine's own plan; next to the
//! router, the engine plans the request once more without counting it.

use crate::backend::TierCheck;
use crate::engine::plan::{plan, Planned, Purpose};
use crate::engine::{Block, Decision as EngineDecision, Step};
use crate::front::Front;
use crate::observe::RequestDecision;
use crate::response::Rejection;
use crate::{DecisionCounts, RateLimitHandle, RateLimitLayer};
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use http::request::Parts;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use tower::Service;

/// What the layer decided for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Passed every applicable tier (`delayed`: a shaping tier queued it;
    /// `shadow_limited`: an observing tier would have rejected it).
    Allowed {
        /// Held by a `leaky_bucket_shape` tier before being passed.
        delayed: bool,
        /// A shadow or not-enforced canary tier would have rejected it.
        shadow_limited: bool,
    },
    /// Would be answered 429; `tier` is the binding tier (the
    /// [`Rejection`]'s).
    Rejected {
        /// The binding tier's name.
        tier: Arc<str>,
    },
    /// On the allowlist: not limited.
    Allowlisted,
    /// On the denylist: refused before any tier (403 or 429).
    Denylisted,
    /// No tier applied.
    Skipped,
    /// An extractor could not run; passed under `failure_policy = "open"`.
    FailOpen,
    /// An extractor could not run; 503 under `failure_policy = "closed"`.
    FailClosed,
}

/// The checks the engine planned for the current request: tier and storage
/// key each, with buffers reused from request to request.
pub(crate) struct Planner {
    pub(crate) front: Arc<Front>,
    /// `keys[..n]` are this request's storage keys; the rest keep their
    /// buffers.
    keys: Vec<String>,
    pub(crate) n: usize,
    /// Tier index of each check.
    pub(crate) tiers: Vec<usize>,
}

impl Planner {
    pub(crate) fn new(layer: &RateLimitLayer) -> Self {
        let n = layer.shared.tiers.len();
        Self {
            front: layer.front.clone(),
            keys: vec![String::new(); n],
            n: 0,
            tiers: vec![0; n],
        }
    }

    /// Records the engine's plan.
    fn record(&mut self, checks: &[TierCheck], tiers: &[u8]) {
        self.n = 0;
        for (c, &t) in checks.iter().zip(tiers) {
            let (Some(key), Some(tier)) = (self.keys.get_mut(self.n), self.tiers.get_mut(self.n))
            else {
                break;
            };
            key.clear();
            key.push_str(&c.key);
            *tier = usize::from(t);
            self.n += 1;
        }
    }

    /// Plans `parts` as the engine does, counting nothing (for the layer
    /// engine, whose router plans it again for real).
    pub(crate) fn inspect(&mut self, parts: &Parts) {
        let front = self.front.clone();
        match plan(&front.engine.shared, &front.facts(parts), Purpose::Inspect) {
            Planned::Check(checks, meta) => self.record(&checks, &meta.tiers),
            _ => self.n = 0,
        }
    }

    /// The storage key part (after `<prefix>:<tier>:`) of check `k`.
    pub(crate) fn key_part(&self, k: usize) -> &str {
        let t = &self.front.engine.shared.tiers[self.tiers[k]];
        self.keys[k].get(t.key_base.len()..).unwrap_or_default()
    }

    /// The key check `k` of `parts` was planned with, as its extractor
    /// returns it (before storage escaping): for display.
    pub(crate) fn raw_key(&self, k: usize, parts: &Parts) -> String {
        self.front
            .tiers
            .get(self.tiers[k])
            .and_then(|t| t.key.extract(parts).ok().flatten())
            .unwrap_or_default()
    }

    /// The check index of tier `tier`, if it was planned.
    pub(crate) fn check_of_tier(&self, tier: usize) -> Option<usize> {
        self.tiers[..self.n].iter().position(|&t| t == tier)
    }
}

/// The per-request result of an engine: the decision, the check (index
/// into the planner's) of the binding tier when rejected, and the tiers (by
/// index) whose observing checks would have rejected.
pub(crate) struct Outcome {
    pub(crate) decision: Decision,
    pub(crate) binding_check: Option<usize>,
    /// Bit per tier index; only the direct engine knows them.
    pub(crate) shadow_tiers: u64,
}

/// The direct engine: the layer's engine, called without HTTP.
pub(crate) struct Direct;

impl Direct {
    /// Decides `parts` with the layer's engine, recording its plan in
    /// `planner`.
    pub(crate) fn decide(&mut self, planner: &mut Planner, parts: &Parts) -> Outcome {
        let front = planner.front.clone();
        planner.n = 0;
        let step = front.engine.start_inspected(
            &front.facts(parts),
            std::time::Instant::now(),
            |checks, meta| planner.record(checks, &meta.tiers),
        );
        let decision = match step {
            Step::Done(d) => d,
            // The memory backend decides at once and has no deny cache:
            // nothing waits. Should that change, the request passes as the
            // layer's fail-open would.
            Step::Pending(_) => {
                return Outcome {
                    decision: Decision::FailOpen,
                    binding_check: None,
                    shadow_tiers: 0,
                }
            }
        };
        match decision {
            EngineDecision::Allow(a) => Outcome {
                decision: match a.kind {
                    RequestDecision::Skipped => Decision::Skipped,
                    RequestDecision::Allowlisted => Decision::Allowlisted,
                    RequestDecision::FailOpen | RequestDecision::Fallback => Decision::FailOpen,
                    _ => Decision::Allowed {
                        delayed: !a.delay.is_zero(),
                        shadow_limited: a.shadow_tiers != 0,
                    },
                },
                binding_check: None,
                shadow_tiers: a.shadow_tiers,
            },
            EngineDecision::Block(Block::Limited(d)) => Outcome {
                decision: Decision::Rejected {
                    tier: d.rejection.tier,
                },
                binding_check: Some(d.check),
                shadow_tiers: d.shadow_tiers,
            },
            EngineDecision::Block(Block::Denylisted(_)) => Outcome {
                decision: Decision::Denylisted,
                binding_check: None,
                shadow_tiers: 0,
            },
            EngineDecision::Block(Block::Unavailable) => Outcome {
                decision: Decision::FailClosed,
                binding_check: None,
                shadow_tiers: 0,
            },
        }
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
            handle: layer.handle(),
            runtime,
        })
    }

    /// Sends `req` through the app. The planner has planned the same request
    /// (for the binding tier's key).
    pub(crate) fn decide(&mut self, planner: &Planner, req: http::Request<Body>) -> Outcome {
        let _rt = self.runtime.enter();
        let before = self.handle.counts();
        let mut fut = std::pin::pin!(self.router.call(req));
        let polled = fut.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        let after = self.handle.counts();
        let delta = |f: fn(&DecisionCounts) -> u64| f(&after) > f(&before);
        let shadow_limited = delta(|c| c.shadow_limited);
        let decision = match polled {
            // A shaping tier holds the request: it was allowed and charged.
            Poll::Pending => Decision::Allowed {
                delayed: true,
                shadow_limited,
            },
            Poll::Ready(Err(e)) => match e {},
            Poll::Ready(Ok(res)) => {
                if let Some(r) = res.extensions().get::<Rejection>() {
                    Decision::Rejected {
                        tier: r.tier.clone(),
                    }
                } else if delta(|c| c.denylisted) {
                    Decision::Denylisted
                } else if delta(|c| c.fail_closed) {
                    Decision::FailClosed
                } else if delta(|c| c.fail_open) {
                    Decision::FailOpen
                } else if delta(|c| c.allowlisted) {
                    Decision::Allowlisted
                } else if delta(|c| c.allowed) || shadow_limited {
                    Decision::Allowed {
                        delayed: false,
                        shadow_limited,
                    }
                } else {
                    Decision::Skipped
                }
            }
        };
        let binding_check = match &decision {
            Decision::Rejected { tier } => planner
                .front
                .engine
                .shared
                .tiers
                .iter()
                .position(|t| t.name == *tier)
                .and_then(|i| planner.check_of_tier(i)),
            _ => None,
        };
        Outcome {
            decision,
            binding_check,
            shadow_tiers: 0,
        }
    }
}
