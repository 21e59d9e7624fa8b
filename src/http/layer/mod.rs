//! [`RateLimitLayer`] and its builder: the code form of a [`Policy`](crate::policy::Policy).

mod build;
mod builder;

pub use self::builder::RateLimitLayerBuilder;
use crate::engine::Shared;
use crate::http::front::Front;
use crate::http::service::RateLimitService;
use std::fmt;
use std::sync::Arc;

/// A tower [`Layer`](tower_layer::Layer) that rate-limits every request by a
/// list of tiers.
///
/// Tiers are checked in the order added; a request passes only if every tier
/// that applies to it allows it, and then it is charged on all of them (a
/// request denied by one tier consumes nothing anywhere). See the crate docs
/// for the full HTTP contract.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::get, Router};
/// use tiered_ratelimit::{key::{ClientIp, Global}, Quota, RateLimitLayer, Tier};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(1000).burst(2000)))
///     .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(300)))
///     .backend_timeout(Duration::from_millis(50))
///     .build()
///     .expect("valid rate-limit configuration");
/// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer);
/// ```
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    /// The engine's state (also `front.engine`'s), for handles and replay.
    pub(crate) shared: Arc<Shared>,
    /// The HTTP front door every service of this layer decides through.
    pub(crate) front: Arc<Front>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tiers: Vec<&str> = self.shared.config.tiers.iter().map(|t| &*t.name).collect();
        f.debug_struct("RateLimitLayer")
            .field("backend", &self.shared.backend.name())
            .field("tiers", &tiers)
            .field("failure_policy", &self.shared.config.failure_policy)
            .field("backend_timeout", &self.shared.config.backend_timeout)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A builder with the defaults: in-memory backend, key prefix `rl`,
    /// [`FailurePolicy::Open`](crate::FailurePolicy::Open), 100 ms backend timeout, no docs URL.
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder::default()
    }

    /// The tier names, in check order.
    pub fn tier_names(&self) -> impl Iterator<Item = &str> {
        self.shared.config.tiers.iter().map(|t| &*t.name)
    }

    /// A handle to change modes, quotas and lists at run time, without
    /// rebuilding the router. Every clone of the layer (and every service
    /// it made) sees the changes from the next request on.
    pub fn handle(&self) -> crate::handle::RateLimitHandle {
        crate::handle::RateLimitHandle::new(self.shared.clone(), Some(self.front.lists.clone()))
    }

    /// The companion layer that reads the request body for the priced tiers
    /// estimating from a JSON field ([`Estimate::json`](crate::priced::Estimate::json)),
    /// to stack **outside** this one (in axum: the later `.layer`). Without
    /// such tiers it passes every request on untouched, its body unread.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tiered_ratelimit::priced::{Actual, Estimate};
    /// use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
    ///
    /// let limit = RateLimitLayer::builder()
    ///     .tier(Tier::new("tokens", Global, Quota::per_minute(100_000)).priced(
    ///         Estimate::json("max_tokens", 1000, 32_000).max_body_bytes(1 << 20),
    ///         Actual::header("x-usage-tokens"),
    ///     ))
    ///     .build()
    ///     .expect("valid rate-limit configuration");
    /// let app: Router = Router::new()
    ///     .route("/v1/chat/completions", post(|body: String| async move { body }))
    ///     .layer(limit.clone())
    ///     .layer(limit.json_body());
    /// ```
    pub fn json_body(&self) -> crate::priced::JsonBodyLayer {
        crate::priced::JsonBodyLayer::new(self.front.json_body.clone())
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.front.clone())
    }
}
