//! Tiered HTTP rate limiting for [tower](https://docs.rs/tower) and [axum](https://docs.rs/axum).
//!
//! A [`RateLimitLayer`] takes keys from each request — global, client IP,
//! user, API key, endpoint, or your own — and checks every tier in one atomic
//! step, against Redis (one Lua script call per request, whatever the number
//! of tiers) or an in-process store. Allowed responses carry
//! `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`;
//! denied requests get a JSON `429` with `Retry-After` (see [`response`] for
//! the exact contract).
//!
//! ```no_run
//! use std::{net::SocketAddr, time::Duration};
//! use axum::{routing::get, Router};
//! use tiered_ratelimit::{
//!     backend::RedisBackend,
//!     key::{ApiKey, ClientIp, Endpoint, Global, User},
//!     FailurePolicy, Quota, RateLimitLayer, Tier,
//! };
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder()
//!     .backend(RedisBackend::from_url("redis://127.0.0.1:6379/")?)
//!     .tier(Tier::new("global", Global, Quota::per_second(1000).burst(2000)))
//!     .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(300)))
//!     .tier(Tier::new("user", User, Quota::per_minute(100)))
//!     .tier(Tier::new("api_key", ApiKey::header("x-api-key"), Quota::per_hour(10_000)))
//!     .tier(Tier::new("endpoint", Endpoint, Quota::new(50, Duration::from_secs(10))))
//!     .failure_policy(FailurePolicy::Open)
//!     .backend_timeout(Duration::from_millis(100))
//!     .docs_url("https://example.com/docs/rate-limits")
//!     // build() + one PING: an unreachable Redis is logged (a WARN under
//!     // Open) or refused (under Closed) at start-up, not on first use.
//!     .build_checked()
//!     .await?;
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! // ClientIp needs the peer address:
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(()) }
//! ```
//!
//! # Semantics
//! * Tiers are checked in the order added; a request passes only if every
//!   tier that applies allows it, and is then charged on all of them. **All
//!   or nothing**: a request denied by one tier consumes nothing anywhere.
//! * A tier whose extractor returns `None` does not apply (an anonymous
//!   request skips the `user` tier); a request no tier applies to passes
//!   untouched, without headers.
//! * Token bucket: capacity = burst (default = limit), refill = limit / period,
//!   in exact integer arithmetic ([`algorithm::TokenBucket`]).
//! * Time: Redis scripts read Redis `TIME`; the memory backend uses a
//!   monotonic clock.
//! * Storage keys: `<prefix>:<tier>:<key part>`, the key part escaped or
//!   hashed ([`key`]); each key expires when its bucket would be full again.
//! * Backend failure or timeout: [`FailurePolicy`].
//!
//! # Features
//! Items behind a feature say so (on docs.rs, a badge naming it). The list,
//! from `Cargo.toml`:
//!
#![cfg_attr(feature = "document-features", doc = document_features::document_features!())]
//!
//! # One path per type
//! Every public item has one path, in the module of its concept ([`key`],
//! [`rollout`], [`response`], [`handle`], [`observe`], [`algorithm`], …),
//! or at the crate root for what a layer is built from: the layer, its
//! builder, service, future and body ([`RateLimitLayer`], …), [`Tier`],
//! [`Quota`], [`Algorithm`], [`Penalty`], [`FailurePolicy`],
//! [`CircuitBreaker`], the [`EngineBuilder`] and the errors. One documented
//! re-export is the exception: [`RateLimitHandle`], which
//! [`RateLimitLayer::handle`] returns, is at the root as well as in its
//! module, [`handle`] (the control plane: peek, reset and lift, per-key
//! overrides, the fleet-wide control key). [`algorithm`] holds the pure
//! models' types (`algorithm::TokenBucket`, `algorithm::Gcra`, …) and
//! [`token_lease`] is lease mode's contract (its settings and guarantees).
//!
//! Items that exist only for this crate's tests (a TTL slack for Redis on a
//! manual clock, raw refunds of a backend's charges, abandoning leases) are
//! behind the internal `__testing` feature (not in the list above, not on
//! docs.rs); applications never need it.
//!
//! # Deployment caveats
//! * [`key::ClientIp`] trusts no forwarding header until you list your proxies;
//!   behind a load balancer without them, every client shares the balancer's
//!   bucket.
//! * The memory backend is per process: N app servers admit N × the quota.

#![deny(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    unsafe_code
)]
// docs.rs builds with `--cfg docsrs` (Cargo.toml): items behind a feature
// show a badge naming it.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub mod admin;
pub mod algorithm;
pub mod backend;
#[cfg(feature = "descriptor")]
#[cfg_attr(docsrs, doc(cfg(feature = "descriptor")))]
pub mod descriptor;
mod engine;
mod error;
pub mod handle;
mod http;
pub mod key;
pub mod observe;
pub mod offline;
pub mod policy;
mod quota;
pub mod response;
pub mod rollout;
mod util;

#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub use http::grpc;
pub use http::priced;

pub use algorithm::kind::{Algorithm, AlgorithmNameError, LeakyBucket};
pub use algorithm::penalty::Penalty;
pub use engine::token_lease;
pub use engine::{CircuitBreaker, EngineBuilder, FailurePolicy, MAX_TIERS};
pub use error::{BackendError, ConfigError, PingError};
pub use handle::RateLimitHandle;
pub use http::body::{BodyHold, ResponseBody};
pub use http::future::ResponseFuture;
pub use http::layer::{RateLimitLayer, RateLimitLayerBuilder};
pub use http::service::RateLimitService;
pub use http::tier::Tier;
pub use quota::Quota;

/// The `deadpool-redis` crate whose pools [`RedisBackend::from_pool`] and
/// [`RedisBackend::from_cluster_pool`] take. It is a 0.x crate, so build the
/// pool with this re-export: its version is always the one this crate was
/// built with, and a new deadpool-redis release is not a breaking change of
/// this crate's API.
///
/// [`RedisBackend::from_pool`]: backend::RedisBackend::from_pool
/// [`RedisBackend::from_cluster_pool`]: backend::RedisBackend::from_cluster_pool
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use deadpool_redis;

/// The README's Rust code, compiled (and, unless `no_run`, run) by
/// `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
