//! The two ways a replayed request is decided.
//!
//! * **layer**: the request goes through a real axum `Router` with the
//!   layer added by `Router::layer`, exactly as in an app, and the decision
//!   is read from the response (a [`Rejection`] in its extensions means 429).
//!   The reference, at about 0.3 million requests per second.
//! * **direct**: the layer's own planning code (the service's `gate` and
//!   `plan_tier`, over the built layer's tiers, extractors, modes, lists,
//!   plans and limits) and the memory backend's check, called without HTTP.
//!   Several times faster; its decisions are tested to be the layer's,
//!   request by request (`tests/replay.rs`).
//!
//! Both share the [`Planner`]: the layer engine uses it only to know which
//! tiers applied and under which key, for the report.

use crate::backend::{MemoryBackend, Shadow, TierCheck};
use crate::engine::plan::{gate, plan_tier, Gate};
use crate::engine::runtime::{FailurePolicy, Runtime, Shared};
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

/// What planning gave.
pub(crate) enum Planned {
    /// Passed before any tier: mode off, or no tier applies (`Skipped`), or
    /// allowlisted.
    Pass(Decision),
    Denylisted,
    /// `checks[..n]` are to be checked.
    Check,
    /// An extractor failed.
    Failed,
}

/// The layer's `plan` step (`service.rs`), over the layer's own tiers and
/// runtime settings, with buffers reused from request to request.
pub(crate) struct Planner {
    pub(crate) shared: Arc<Shared>,
    rt: Arc<Runtime>,
    /// `checks[..n]` are this request's; the rest keep their buffers.
    pub(crate) checks: Vec<TierCheck>,
    pub(crate) n: usize,
    /// Tier index of each check.
    pub(crate) tiers: Vec<usize>,
    pub(crate) shadow: Shadow,
}

impl Planner {
    pub(crate) fn new(layer: &RateLimitLayer) -> Self {
        let shared = layer.shared.clone();
        let rt = shared.runtime.load_full();
        let n = shared.tiers.len();
        let placeholder = rt.tiers.first().map(|r| r.limit);
        let checks = placeholder
            .map(|limit| {
                (0..n)
                    .map(|_| TierCheck {
                        key: String::new(),
                        limit,
                        cost: 1,
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            shared,
            rt,
            checks,
            n: 0,
            tiers: vec![0; n],
            shadow: Shadow::NONE,
        }
    }

    /// Which tiers check `parts`, with which keys and limits: the service's
    /// own steps ([`gate`], then [`plan_tier`] per tier), without the
    /// local fallback.
    pub(crate) fn plan(&mut self, parts: &Parts) -> Planned {
        let shared = &*self.shared;
        let rt = &*self.rt;
        // The fleet-wide control key's overrides (none without `[control]`).
        let ov = shared.overrides.load();
        self.n = 0;
        self.shadow = Shadow::NONE;
        let global = match gate(shared, rt, &ov, parts) {
            Gate::Off => return Planned::Pass(Decision::Skipped),
            Gate::Denylisted => return Planned::Denylisted,
            Gate::Allowlisted => return Planned::Pass(Decision::Allowlisted),
            Gate::Tiers(global) => global,
        };
        for (i, (t, r)) in shared.tiers.iter().zip(rt.tiers.iter()).enumerate() {
            let k = self.n;
            let c = &mut self.checks[k];
            let tp = match plan_tier((i, t, r), &ov, global, parts, false, &mut c.key) {
                Ok(Some(tp)) => tp,
                Ok(None) => continue,
                // As the service: an extractor error leaves the tier
                // undecided, and only fail-closed turns that into a refusal.
                Err(_) if shared.failure_policy != crate::FailurePolicy::Closed => continue,
                Err(_) => return Planned::Failed,
            };
            c.limit = tp.limit;
            c.cost = tp.cost;
            if !tp.enforced {
                self.shadow.0 |= 1 << k;
            }
            self.tiers[k] = i;
            self.n += 1;
        }
        if self.n == 0 {
            Planned::Pass(Decision::Skipped)
        } else {
            Planned::Check
        }
    }

    /// The storage key part (after `<prefix>:<tier>:`) of check `k`.
    pub(crate) fn key_part(&self, k: usize) -> &str {
        let t = &self.shared.tiers[self.tiers[k]];
        &self.checks[k].key[t.key_base.len()..]
    }

    /// The key check `k` of `parts` was planned with, as its extractor
    /// returns it (before storage escaping): for display.
    pub(crate) fn raw_key(&self, k: usize, parts: &Parts) -> String {
        let t = &self.shared.tiers[self.tiers[k]];
        t.key.extract(parts).ok().flatten().unwrap_or_default()
    }

    /// The check index of tier `tier`, if it was planned.
    pub(crate) fn check_of_tier(&self, tier: usize) -> Option<usize> {
        self.tiers[..self.n].iter().position(|&t| t == tier)
    }

    fn failure(&self) -> Decision {
        // Only an extractor can fail here (the memory backend cannot), and
        // a local fallback cannot decide without that key either: it passes.
        match self.shared.failure_policy {
            FailurePolicy::Open | FailurePolicy::Fallback => Decision::FailOpen,
            FailurePolicy::Closed => Decision::FailClosed,
        }
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

/// The direct engine: planning plus the memory backend's check.
pub(crate) struct Direct {
    memory: MemoryBackend,
    /// The last verdict's decisions, reused by the next check.
    spare: Vec<crate::algorithm::Decision>,
}

impl Direct {
    pub(crate) fn new(memory: MemoryBackend) -> Self {
        Self {
            memory,
            spare: Vec::new(),
        }
    }

    /// Decides a planned request as the service's `decide` does.
    pub(crate) fn decide(&mut self, planner: &Planner, planned: Planned) -> Outcome {
        let (decision, binding_check, shadow_tiers) = match planned {
            Planned::Pass(d) => (d, None, 0),
            Planned::Denylisted => (Decision::Denylisted, None, 0),
            Planned::Failed => (planner.failure(), None, 0),
            Planned::Check => self.check(planner),
        };
        Outcome {
            decision,
            binding_check,
            shadow_tiers,
        }
    }

    fn check(&mut self, p: &Planner) -> (Decision, Option<usize>, u64) {
        let spare = std::mem::take(&mut self.spare);
        let v = self
            .memory
            .check_reusing(&p.checks[..p.n], p.shadow, false, spare);
        let result = Self::verdict(p, &v.decisions);
        self.spare = v.decisions;
        result
    }

    fn verdict(p: &Planner, ds: &[crate::algorithm::Decision]) -> (Decision, Option<usize>, u64) {
        let mut shadow_tiers = 0u64;
        let mut enforced_denial = false;
        for (i, d) in ds.iter().enumerate() {
            if !d.allowed {
                if p.shadow.contains(i) {
                    shadow_tiers |= 1 << p.tiers[i];
                } else {
                    enforced_denial = true;
                }
            }
        }
        if !enforced_denial {
            let delay = ds
                .iter()
                .filter(|d| d.allowed)
                .map(|d| d.delay_us)
                .max()
                .unwrap_or(0);
            let decision = Decision::Allowed {
                delayed: delay > 0,
                shadow_limited: shadow_tiers != 0,
            };
            return (decision, None, shadow_tiers);
        }
        // Binding tier: the enforced denying tier with the longest wait
        // (first on a tie).
        let mut binding: Option<(usize, u64)> = None;
        for (i, d) in ds.iter().enumerate() {
            if d.allowed || p.shadow.contains(i) {
                continue;
            }
            if binding.is_none_or(|(_, b)| d.retry_after_us > b) {
                binding = Some((i, d.retry_after_us));
            }
        }
        let Some((i, _)) = binding else {
            return (
                Decision::Allowed {
                    delayed: false,
                    shadow_limited: shadow_tiers != 0,
                },
                None,
                shadow_tiers,
            );
        };
        let tier = p.shared.tiers[p.tiers[i]].name.clone();
        (Decision::Rejected { tier }, Some(i), shadow_tiers)
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
