//! The HTTP front door's two halves around the engine: reading a request's
//! [`Facts`] from its head ([`HttpFacts`], with the tiers' key extractors,
//! cost and plan functions and methods), and turning the engine's
//! decision into a response ([`Front::respond`]).
//!
//! The tower service ([`crate::http::service`]) and replay both decide through
//! this module, so both read a request the same way.

use crate::engine::{Block, Engine, Facts};
use crate::http::tier::{CostFn, PlanFn};
use crate::key::{route_of, ClientIp, KeyError, KeyExtractor, KeyWriter};
use crate::response::{json_response, unavailable, OnRejection, RejectionReason, X_SHOULD_RETRY};
use crate::rollout::{AccessLists, DenyStatus, Plan, Standing};
use bytes::Bytes;
use http::request::Parts;
use http::Response;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// One tier as the HTTP front door reads it.
pub(crate) struct HttpTier {
    pub(crate) key: Arc<dyn KeyExtractor>,
    /// The tier's fixed cost, used without a cost function.
    pub(crate) cost: u64,
    pub(crate) cost_fn: Option<CostFn>,
    /// `None`: every method but OPTIONS.
    pub(crate) methods: Option<Box<[http::Method]>>,
    pub(crate) plan_fn: Option<PlanFn>,
}

impl HttpTier {
    #[inline]
    fn counts_method(&self, m: &http::Method) -> bool {
        match &self.methods {
            None => m != http::Method::OPTIONS,
            Some(ms) => ms.contains(m),
        }
    }
}

/// The HTTP front door of one layer: the engine, how to read requests for
/// it, and how to answer for it.
pub(crate) struct Front {
    pub(crate) engine: Engine,
    /// One per engine tier, in the same order.
    pub(crate) tiers: Box<[HttpTier]>,
    pub(crate) client_ip: ClientIp,
    /// The allow- and denylists (shared with the layer's handles).
    pub(crate) lists: Arc<AccessLists>,
    pub(crate) on_rejection: Arc<dyn OnRejection>,
    /// Per tier: the header (or trailer) of a priced tier's actual cost
    /// (`None`: not priced, or reported through `Usage` only).
    pub(crate) actual_headers: Arc<[Option<http::HeaderName>]>,
    /// The request body fields priced tiers estimate from (`None`: none).
    pub(crate) json_body: Option<Arc<crate::http::json_body::JsonSpec>>,
    /// How blocked requests are answered: HTTP, gRPC, or by content type.
    #[cfg(feature = "grpc")]
    pub(crate) protocol: crate::http::grpc::Protocol,
}

impl fmt::Debug for Front {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Front")
            .field("engine", &self.engine)
            .field("client_ip", &self.client_ip)
            .finish_non_exhaustive()
    }
}

impl Front {
    /// The facts of a request with head `parts`.
    pub(crate) fn facts<'a>(&'a self, parts: &'a Parts) -> HttpFacts<'a> {
        HttpFacts { front: self, parts }
    }

    /// The pricing of an allowed request with a reservation on priced tiers
    /// (its [`Usage`](crate::priced::Usage) handle put in the request's
    /// extensions), if it has one.
    pub(crate) fn pricing<B>(
        &self,
        allow: &mut crate::engine::Allow,
        request: &mut http::Request<B>,
    ) -> Option<Box<crate::http::priced::Pricing>> {
        let r = allow.reservation.take()?;
        Some(crate::http::priced::Pricing::start(
            r,
            self.actual_headers.clone(),
            request.extensions_mut(),
        ))
    }

    /// The response the layer answers a blocked request (with head
    /// `parts`) with: the rejection (429, its body from [`OnRejection`], the
    /// headers added after, the [`Rejection`](crate::response::Rejection) in
    /// the extensions), the denylist's 403 or 429, or the 503; or their gRPC
    /// forms ([`crate::http::grpc`]) for a gRPC request.
    pub(crate) fn respond(&self, block: Block, parts: &Parts) -> Response<Bytes> {
        #[cfg(feature = "grpc")]
        if self.protocol.grpc(parts) {
            return crate::http::grpc::respond(block);
        }
        #[cfg(not(feature = "grpc"))]
        let _ = parts;
        match block {
            Block::Limited(d) => {
                let mut res = self.on_rejection.response(&d.rejection);
                if d.rejection.status != 429 {
                    *res.status_mut() = d.rejection.http_status();
                }
                d.headers.write(res.headers_mut());
                if d.rejection.reason == RejectionReason::CostExceedsCapacity {
                    // No wait lets it pass: SDKs that retry every 429 (OpenAI's,
                    // Cloudflare's) stop on this, whatever the header style.
                    res.headers_mut()
                        .insert(X_SHOULD_RETRY, http::HeaderValue::from_static("false"));
                }
                res.extensions_mut().insert(d.rejection);
                res
            }
            Block::Denylisted(status) => denied_by_list(status),
            Block::Unavailable => unavailable(),
        }
    }
}

/// A request's facts read from its head.
pub(crate) struct HttpFacts<'a> {
    front: &'a Front,
    parts: &'a Parts,
}

impl Facts for HttpFacts<'_> {
    #[inline]
    fn standing(&self) -> Standing {
        self.front.lists.standing(self.parts, &self.front.client_ip)
    }

    #[inline]
    fn cost(&self, tier: usize) -> Option<u64> {
        let t = self.front.tiers.get(tier)?;
        if !t.counts_method(&self.parts.method) {
            return None;
        }
        Some(match &t.cost_fn {
            Some(f) => f(self.parts),
            None => t.cost,
        })
    }

    #[inline]
    fn key(&self, tier: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        match self.front.tiers.get(tier) {
            Some(t) => t.key.extract_into(self.parts, key),
            None => Ok(false),
        }
    }

    fn plan(&self, tier: usize) -> Option<Cow<'_, str>> {
        match &self.front.tiers.get(tier)?.plan_fn {
            Some(f) => f(self.parts).map(Cow::Owned),
            None => self
                .parts
                .extensions
                .get::<Plan>()
                .map(|p| Cow::Borrowed(p.0.as_str())),
        }
    }

    fn endpoint(&self) -> (&str, &str) {
        route_of(self.parts)
    }
}

/// The answer to a denylisted request.
pub(crate) fn denied_by_list(status: DenyStatus) -> Response<Bytes> {
    #[derive(serde::Serialize)]
    struct Body {
        error: &'static str,
    }
    match status {
        DenyStatus::Forbidden => {
            json_response(http::StatusCode::FORBIDDEN, &Body { error: "forbidden" })
        }
        DenyStatus::TooManyRequests => {
            let mut res = json_response(
                status.status(),
                &Body {
                    error: "rate_limit_exceeded",
                },
            );
            res.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("3600"),
            );
            res
        }
    }
}
