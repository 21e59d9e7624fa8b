//! The layer on gRPC servers (feature `grpc`): the same
//! [`RateLimitLayer`](crate::RateLimitLayer), answering denied calls the
//! gRPC way.
//!
//! tonic 0.14 serves gRPC as tower services over HTTP/2, so the layer goes on
//! a tonic server like any tower layer (`Server::builder().layer(..)`), or
//! around one service (the wrapped service keeps its
//! [`NamedService`](tonic::server::NamedService) name, so
//! `add_service(layer.layer(svc))` works). The engine, the tiers and the
//! budgets are the HTTP layer's: one layer (or clones of it) on an axum app
//! and on a tonic server charges an API key's HTTP and gRPC calls to the
//! same buckets. Only the answer to a blocked call differs, chosen per
//! request by [`Protocol`] (by default from the request's `content-type`):
//!
//! | engine decision | HTTP answer | gRPC answer (HTTP 200, trailers-only) |
//! |---|---|---|
//! | an enforced tier denies | 429 + JSON | `grpc-status: 8` `RESOURCE_EXHAUSTED`, a message, and in `grpc-status-details-bin` a `google.rpc.Status` with a `google.rpc.RetryInfo` (`retry_delay` = `Retry-After` seconds), a `google.rpc.QuotaFailure` (one violation per denying tier) and, with a docs URL, a `google.rpc.Help` link |
//! | backend failure under [`FailurePolicy::Closed`](crate::FailurePolicy::Closed) | 503 | `grpc-status: 14` `UNAVAILABLE` |
//! | denylisted, [`DenyStatus::Forbidden`] | 403 | `grpc-status: 7` `PERMISSION_DENIED` |
//! | denylisted, [`DenyStatus::TooManyRequests`] | 429, `Retry-After: 3600` | `RESOURCE_EXHAUSTED`, `RetryInfo` 3600 s |
//!
//! The rate-limit numbers travel as response metadata (HTTP/2 headers): the
//! [`HeaderStyle`](crate::response::HeaderStyle)'s fields (`x-ratelimit-*`,
//! or the IETF `ratelimit` / `ratelimit-policy`) on every call that went
//! through a tier, and `retry-after` on a denied one. On an allowed call they
//! are the initial metadata of the service's response.
//!
//! # Keys
//! * **API key**: gRPC metadata are HTTP/2 headers, so
//!   [`ApiKey::header("x-api-key")`](crate::key::ApiKey) reads the
//!   `x-api-key` metadata entry (ASCII; a `-bin` entry is read as its base64
//!   text).
//! * **User**: [`User`](crate::key::User) reads the
//!   [`UserId`](crate::key::UserId) extension, which your authentication
//!   inserts *before* the limiter: a tower layer added to the
//!   `Server::builder()` ahead of the rate-limit layer (tonic interceptors run
//!   inside the service, after it). `examples/grpc.rs` has one.
//! * **Peer address**: [`ClientIp`](crate::key::ClientIp) reads tonic's
//!   `TcpConnectInfo` (the `remote_addr` of the connection).
//! * **Endpoint**: [`Endpoint`](crate::key::Endpoint) keys a gRPC request by
//!   its method path, `POST /package.Service/Method`, when the path has that
//!   shape (service and method names of `[A-Za-z0-9_.]`, at most
//!   256 bytes); any other path is `<unmatched>`.
//!
//! # Streaming calls
//! A call counts once, when it starts: a streaming call (client, server or
//! bidirectional) is one request to the layer, whatever the number of
//! messages it carries, and a denied one is refused before its first
//! message.
//!
//! # Deployment caveats
//! * A client can name methods that do not exist; tonic answers them
//!   `UNIMPLEMENTED`, after the layer charged them. Each distinct well-formed
//!   path is its own `endpoint` key (bounded in size; the memory backend is
//!   bounded and Redis keys expire) and, up to
//!   [`max_endpoints`](crate::RateLimitLayerBuilder::max_endpoints), its own
//!   metric label. Wrap each service instead of the whole server
//!   (`add_service(layer.layer(svc))`) to keep unknown services out.
//! * Refunds by result ([`Tier::skip_failed_requests`](crate::Tier::skip_failed_requests)):
//!   a gRPC call counts as failed when its HTTP status is ≥ 400 or its
//!   response *headers* carry a non-zero `grpc-status` (a trailers-only
//!   error, what tonic sends when a unary handler returns `Err(Status)` at
//!   once). A status sent in the trailers after a response body is not seen:
//!   such a call counts as succeeded.
//! * An [`OnRejection`](crate::response::OnRejection) shapes the HTTP 429
//!   only; the gRPC answer is this module's.
//!
//! ```no_run
//! use tiered_ratelimit::{key::{ApiKey, ClientIp, Endpoint}, Quota, RateLimitLayer, Tier};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder()
//!     .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(600)))
//!     .tier(Tier::new("api_key", ApiKey::header("x-api-key"), Quota::per_minute(100)))
//!     .tier(Tier::new("method", Endpoint, Quota::per_second(50)))
//!     .build()?;
//! let (_, health) = tonic_health::server::health_reporter();
//! tonic::transport::Server::builder()
//!     .layer(layer)
//!     .add_service(health)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # Ok(())
//! # }
//! ```

use crate::engine::Block;
use crate::response::Rejection;
use crate::rollout::DenyStatus;
use bytes::Bytes;
use http::request::Parts;
use http::Response;
use std::time::Duration;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// Which protocol the layer answers a blocked request in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// gRPC for requests whose `content-type` is `application/grpc` (or
    /// `application/grpc+proto`, `application/grpc-web`, …), HTTP for the
    /// others (the default).
    #[default]
    Auto,
    /// Always HTTP (429, 403, 503).
    Http,
    /// Always gRPC (a server that speaks nothing else).
    Grpc,
}

impl Protocol {
    /// Whether the request with head `parts` is answered the gRPC way.
    pub(crate) fn grpc(self, parts: &Parts) -> bool {
        match self {
            Protocol::Auto => is_grpc(parts),
            Protocol::Http => false,
            Protocol::Grpc => true,
        }
    }
}

pub(crate) use crate::key::is_grpc;

/// The gRPC answer to a blocked request (see the module docs): a
/// trailers-only response, its status in the headers, the rate-limit
/// numbers beside it.
pub(crate) fn respond(block: Block) -> Response<Bytes> {
    match block {
        Block::Limited(d) => {
            let status = exhausted(&d.rejection);
            let mut res = status.into_http::<Bytes>();
            d.headers.write(res.headers_mut());
            res.extensions_mut().insert(d.rejection);
            res
        }
        Block::Denylisted(DenyStatus::Forbidden) => {
            Status::new(Code::PermissionDenied, "forbidden").into_http()
        }
        Block::Denylisted(DenyStatus::TooManyRequests) => {
            let status = Status::with_error_details(
                Code::ResourceExhausted,
                "rate limit exceeded",
                ErrorDetails::with_retry_info(Some(Duration::from_secs(DENYLIST_RETRY_S))),
            );
            let mut res = status.into_http::<Bytes>();
            res.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from(DENYLIST_RETRY_S),
            );
            res
        }
        Block::Unavailable => {
            Status::new(Code::Unavailable, "rate limiter unavailable").into_http()
        }
    }
}

/// The `Retry-After` of a denylisted request answered 429 (and of its gRPC
/// form), seconds.
const DENYLIST_RETRY_S: u64 = 3600;

/// `RESOURCE_EXHAUSTED` for a denial: the message, `RetryInfo` with the
/// `Retry-After` seconds, one `QuotaFailure` violation per denying tier, and
/// the docs URL as a `Help` link. A request whose cost exceeds the tier's
/// capacity ([`RejectionReason::CostExceedsCapacity`](crate::response::RejectionReason))
/// gets no `RetryInfo` (no wait lets it pass), and its message and
/// violation say so.
fn exhausted(r: &Rejection) -> Status {
    if r.reason == crate::response::RejectionReason::CostExceedsCapacity {
        let mut details = ErrorDetails::new();
        details.add_quota_failure_violation(
            &*r.tier,
            format!(
                "cost_exceeds_capacity: the request costs more than the capacity of {} of tier \"{}\"",
                r.limit, r.tier
            ),
        );
        if let Some(url) = &r.docs_url {
            details.add_help_link("rate limits", &**url);
        }
        return Status::with_error_details(
            Code::ResourceExhausted,
            format!(
                "request cost exceeds the capacity of {} of tier \"{}\": it can never pass",
                r.limit, r.tier
            ),
            details,
        );
    }
    let mut details = ErrorDetails::with_retry_info(Some(Duration::from_secs(r.retry_after)));
    let violated = if r.violated_policies.is_empty() {
        std::slice::from_ref(&r.tier)
    } else {
        &r.violated_policies[..]
    };
    for tier in violated {
        details.add_quota_failure_violation(
            &**tier,
            format!("rate limit of tier \"{tier}\" exceeded"),
        );
    }
    if let Some(url) = &r.docs_url {
        details.add_help_link("rate limits", &**url);
    }
    Status::with_error_details(
        Code::ResourceExhausted,
        format!(
            "rate limit exceeded on tier \"{}\": retry in {} s",
            r.tier, r.retry_after
        ),
        details,
    )
}

/// Whether an allowed call failed, for refunds by result: an HTTP status
/// ≥ 400, or a non-zero `grpc-status` in the response headers.
pub(crate) fn failed(status: http::StatusCode, headers: &http::HeaderMap) -> bool {
    status.as_u16() >= 400
        || headers
            .get(Status::GRPC_STATUS)
            .is_some_and(|s| s.as_bytes() != b"0")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::method_path;

    fn parts(method: &str, path: &str, ct: Option<&str>) -> Parts {
        let mut b = http::Request::builder().method(method).uri(path);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn header<'r>(res: &'r Response<Bytes>, name: &str) -> Option<&'r str> {
        res.headers().get(name).map(|v| v.to_str().unwrap())
    }

    /// The blocks without a denial: HTTP 200, their gRPC status in the
    /// headers, no body.
    #[test]
    fn blocks_map_to_their_grpc_statuses() {
        let res = respond(Block::Unavailable);
        assert_eq!(res.status(), 200);
        assert_eq!(header(&res, "grpc-status"), Some("14"));
        assert_eq!(
            header(&res, "grpc-message"),
            Some("rate%20limiter%20unavailable")
        );
        assert!(res.body().is_empty());
        let res = respond(Block::Denylisted(DenyStatus::Forbidden));
        assert_eq!(header(&res, "grpc-status"), Some("7"));
        assert_eq!(header(&res, "retry-after"), None);
        let res = respond(Block::Denylisted(DenyStatus::TooManyRequests));
        assert_eq!(header(&res, "grpc-status"), Some("8"));
        assert_eq!(header(&res, "retry-after"), Some("3600"));
        assert_eq!(header(&res, "content-type"), Some("application/grpc"));
    }

    #[test]
    fn a_grpc_error_in_the_headers_is_a_failed_call() {
        let mut h = http::HeaderMap::new();
        assert!(!failed(http::StatusCode::OK, &h));
        assert!(failed(http::StatusCode::INTERNAL_SERVER_ERROR, &h));
        h.insert("grpc-status", http::HeaderValue::from_static("0"));
        assert!(!failed(http::StatusCode::OK, &h));
        h.insert("grpc-status", http::HeaderValue::from_static("5"));
        assert!(failed(http::StatusCode::OK, &h));
    }

    #[test]
    fn grpc_requests_are_told_by_their_content_type() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc-web",
            "Application/GRPC",
        ] {
            assert!(is_grpc(&parts("POST", "/a.B/C", Some(ct))), "{ct}");
        }
        for ct in ["application/json", "application/grpcx", "text/plain"] {
            assert!(!is_grpc(&parts("POST", "/a.B/C", Some(ct))), "{ct}");
        }
        assert!(!is_grpc(&parts("POST", "/a.B/C", None)));
    }

    #[test]
    fn method_paths_are_endpoints_only_when_well_formed() {
        let g = |path: &str| {
            method_path(&parts("POST", path, Some("application/grpc"))).map(str::to_owned)
        };
        assert_eq!(
            g("/grpc.health.v1.Health/Check").as_deref(),
            Some("/grpc.health.v1.Health/Check")
        );
        assert_eq!(g("/a/b/c"), None);
        assert_eq!(g("/a/"), None);
        assert_eq!(g("//b"), None);
        assert_eq!(g("/a%20b/c"), None);
        assert_eq!(g(&format!("/{}/m", "s".repeat(256))), None);
        // Not gRPC: no method path.
        assert_eq!(method_path(&parts("POST", "/a.B/C", None)), None);
        assert_eq!(
            method_path(&parts("GET", "/a.B/C", Some("application/grpc"))),
            None
        );
    }
}
