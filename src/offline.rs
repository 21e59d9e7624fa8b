//! [`Offline`]: the layer's engine deciding request heads without a server,
//! a front door for tools (the `tiered-ratelimit replay` command of the
//! workspace's `cli` crate runs it per log line).
//!
//! It reads a request exactly as the tower layer does (the same key
//! extractors, cost and plan functions, methods, lists, modes and quotas)
//! and decides it with the same engine, counting it in the layer's
//! [`DecisionCounts`](crate::observe::DecisionCounts). It is not traffic:
//! it feeds none of the operator's view (per-endpoint metrics and anomaly
//! series, top-N sketches, latency), and no response is built.
//! It needs a backend that decides without waiting: the in-memory one
//! (usually with a [`ManualClock`](crate::backend::ManualClock) that follows
//! the replayed log's time). The example builds a request head with the
//! `http` crate (axum re-exports it as `axum::http`).
//!
//! ```
//! use tiered_ratelimit::offline::{Checks, Admission};
//! use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
//!
//! let layer = RateLimitLayer::builder()
//!     .tier(Tier::new("global", Global, Quota::per_minute(2)))
//!     .build()
//!     .expect("valid configuration");
//! let offline = layer.offline().expect("the memory backend decides at once");
//! let (parts, ()) = http::Request::get("/").body(()).unwrap().into_parts();
//! let mut checks = Checks::default();
//! for _ in 0..2 {
//!     let d = offline.decide(&parts, &mut checks);
//!     assert!(matches!(d.decision, Admission::Allowed { .. }));
//! }
//! let d = offline.decide(&parts, &mut checks);
//! assert!(matches!(d.decision, Admission::Rejected { ref tier } if &**tier == "global"));
//! assert_eq!(d.binding_check, Some(0));
//! assert_eq!(checks.len(), 1);
//! assert_eq!(checks.tier(0), 0);
//! assert_eq!(checks.key_part(0), "all"); // `Global`'s one key
//! ```

use crate::backend::{Backend, TierCheck};
use crate::engine::Facts;
use crate::engine::{self, Block, Step};
use crate::http::front::{Front, HttpFacts};
use crate::http::layer::RateLimitLayer;
use crate::key::{KeyError, KeyWriter};
use crate::observe::RequestDecision;
use http::request::Parts;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

/// What the layer decided for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Admission {
    /// Passed every applicable tier.
    Allowed {
        /// Held by a `leaky_bucket_shape` tier before being passed.
        delayed: bool,
        /// A shadow or not-enforced canary tier would have rejected it.
        shadow_limited: bool,
    },
    /// Would be answered 429.
    Rejected {
        /// The binding tier's name (the [`Rejection`](crate::response::Rejection)'s).
        tier: Arc<str>,
    },
    /// On the allowlist: not limited.
    Allowlisted,
    /// On the denylist: refused before any tier (403 or 429).
    Denylisted,
    /// No tier applied.
    Skipped,
    /// An extractor could not run; passed under `FailurePolicy::Open`.
    FailOpen,
    /// An extractor could not run; 503 under `FailurePolicy::Closed`.
    FailClosed,
}

/// One request's decision, with what a report needs beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Outcome {
    /// The decision.
    pub decision: Admission,
    /// When rejected: the check (index into the [`Checks`]) of the binding
    /// tier.
    pub binding_check: Option<usize>,
    /// A bit per tier index (`1 << tier`): the observing tiers (shadow, or
    /// canary keys not enforced) that would have rejected the request.
    pub shadow_tiers: u64,
}

impl Outcome {
    /// An outcome read elsewhere (a real router's response, say).
    pub fn new(decision: Admission, binding_check: Option<usize>, shadow_tiers: u64) -> Self {
        Self {
            decision,
            binding_check,
            shadow_tiers,
        }
    }
}

/// The checks the engine planned for a request, in tier order: the tier
/// (its index in the layer's tier list) and storage key of each. Reused from
/// request to request (its buffers are kept).
#[derive(Debug, Default, Clone)]
pub struct Checks {
    /// `(tier index, storage key)`; `[..n]` are the current request's.
    checks: Vec<(usize, String)>,
    n: usize,
    /// `<prefix>:<tier>:` length per tier, to cut the key part.
    bases: Arc<[usize]>,
}

impl Checks {
    fn record(&mut self, bases: &Arc<[usize]>, checks: &[TierCheck], tiers: &[u8]) {
        if !Arc::ptr_eq(&self.bases, bases) {
            self.bases = bases.clone();
        }
        self.n = 0;
        for (c, &t) in checks.iter().zip(tiers) {
            if self.checks.len() == self.n {
                self.checks.push((0, String::new()));
            }
            let slot = &mut self.checks[self.n];
            slot.0 = usize::from(t);
            slot.1.clear();
            slot.1.push_str(&c.key);
            self.n += 1;
        }
    }

    /// How many tiers checked the request (0: none applied, or it was
    /// decided before any tier).
    #[inline]
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether no tier checked the request.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The tier index of check `k`.
    ///
    /// # Panics
    /// When `k >= len()`.
    #[inline]
    pub fn tier(&self, k: usize) -> usize {
        self.checks[..self.n][k].0
    }

    /// The storage key part of check `k` (after `<prefix>:<tier>:`, escaped
    /// or hashed as stored; see [`storage_key_part`](crate::key::storage_key_part)).
    ///
    /// # Panics
    /// When `k >= len()`.
    #[inline]
    pub fn key_part(&self, k: usize) -> &str {
        let (tier, key) = &self.checks[..self.n][k];
        let base = self.bases.get(*tier).copied().unwrap_or(0);
        key.get(base..).unwrap_or_default()
    }

    /// The check of tier `tier`, if that tier checked the request.
    #[inline]
    pub fn check_of_tier(&self, tier: usize) -> Option<usize> {
        self.checks[..self.n].iter().position(|c| c.0 == tier)
    }
}

/// A layer's engine for request heads (see the [module docs](self)).
/// Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Offline {
    front: Arc<Front>,
    bases: Arc<[usize]>,
    /// The arrival time handed to the engine for every request: an
    /// unobserved check reads it nowhere (it only feeds the latency
    /// histogram and a wait for a deny-cache probe, neither of which an
    /// offline check on the memory backend has), so the clock is read once
    /// here rather than once per request.
    arrival: Instant,
}

impl RateLimitLayer {
    /// The layer's engine for deciding request heads without a server, or
    /// `None` when the backend must be awaited (Redis).
    pub fn offline(&self) -> Option<Offline> {
        if !matches!(self.shared.backend, Backend::Memory(_)) {
            return None;
        }
        let bases = self
            .shared
            .config
            .tiers
            .iter()
            .map(|t| t.key_base.len())
            .collect();
        Some(Offline {
            front: self.front.clone(),
            bases,
            arrival: Instant::now(),
        })
    }
}

impl Offline {
    /// Decides the request with head `parts` as the layer would now (and
    /// charges it, counts it, observes it), filling `checks` with the
    /// checks planned for it.
    pub fn decide(&self, parts: &Parts, checks: &mut Checks) -> Outcome {
        let front = &*self.front;
        checks.n = 0;
        let step = front.engine.start_inspected(
            &Unobserved(front.facts(parts)),
            self.arrival,
            |planned, meta| checks.record(&self.bases, planned, &meta.tiers),
        );
        let decision = match step {
            Step::Done(d) => d,
            // The memory backend decides at once and has no deny cache
            // (`offline` refuses any other): nothing waits.
            Step::Pending(_) => {
                return Outcome {
                    decision: Admission::FailOpen,
                    binding_check: None,
                    shadow_tiers: 0,
                }
            }
        };
        let (decision, binding_check, shadow_tiers) = match decision {
            engine::Decision::Allow(a) => {
                let d = match a.kind {
                    RequestDecision::Skipped => Admission::Skipped,
                    RequestDecision::Allowlisted => Admission::Allowlisted,
                    RequestDecision::FailOpen | RequestDecision::Fallback => Admission::FailOpen,
                    _ => Admission::Allowed {
                        delayed: !a.delay.is_zero(),
                        shadow_limited: a.shadow_tiers != 0,
                    },
                };
                (d, None, a.shadow_tiers)
            }
            engine::Decision::Block(Block::Limited(d)) => (
                Admission::Rejected {
                    tier: d.rejection.tier,
                },
                Some(d.check),
                d.shadow_tiers,
            ),
            engine::Decision::Block(Block::Denylisted(_)) => (Admission::Denylisted, None, 0),
            engine::Decision::Block(Block::Unavailable) => (Admission::FailClosed, None, 0),
        };
        Outcome {
            decision,
            binding_check,
            shadow_tiers,
        }
    }

    /// Plans the request with head `parts` as [`decide`](Self::decide) would,
    /// without deciding, charging or counting it: which tiers would check
    /// it, under which keys (for a report next to a real router that decides
    /// the same request).
    pub fn plan(&self, parts: &Parts, checks: &mut Checks) {
        let front = &*self.front;
        checks.n = 0;
        front
            .engine
            .plan_only(&Unobserved(front.facts(parts)), |planned, meta| {
                checks.record(&self.bases, planned, &meta.tiers);
            });
    }

    /// The key tier `tier`'s extractor returns for `parts`, before storage
    /// escaping (for display; empty when it has none or fails).
    pub fn raw_key(&self, tier: usize, parts: &Parts) -> String {
        self.front
            .tiers
            .get(tier)
            .and_then(|t| t.key.extract(parts).ok().flatten())
            .unwrap_or_default()
    }
}

/// The layer's own facts of a request, not fed to the operator's view
/// (metrics, anomaly series, top-N, latency): a replayed request decides as
/// the layer would and is counted in the layer's decision counts, but it is
/// not traffic.
struct Unobserved<'a>(HttpFacts<'a>);

impl Facts for Unobserved<'_> {
    const OBSERVED: bool = false;
    const HEADERS: bool = false;

    #[inline]
    fn standing(&self) -> crate::rollout::Standing {
        self.0.standing()
    }
    #[inline]
    fn cost(&self, tier: usize) -> Option<u64> {
        self.0.cost(tier)
    }
    #[inline]
    fn key(&self, tier: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        self.0.key(tier, key)
    }
    #[inline]
    fn plan(&self, tier: usize) -> Option<Cow<'_, str>> {
        self.0.plan(tier)
    }
    #[inline]
    fn endpoint(&self) -> (&str, &str) {
        self.0.endpoint()
    }
}
