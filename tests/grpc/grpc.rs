//! The layer on a tonic server (feature `grpc`), through a real tonic client
//! over TCP: the gRPC answers (RESOURCE_EXHAUSTED with RetryInfo, UNAVAILABLE),
//! the keys gRPC requests give (metadata, peer address, method path), one
//! budget for an API key's HTTP and gRPC calls, and the protocol choice.
//! The service is tonic-health's (pre-generated code: no protoc).

use crate::support::{client, limits, ok, RedisServer, T0_S, T0_US};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::{ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::grpc::Protocol;
use tiered_ratelimit::key::{ApiKey, ClientIp, Endpoint, User, UserId};
use tiered_ratelimit::{FailurePolicy, Quota, RateLimitLayer, RateLimitLayerBuilder, Tier};
use tonic::metadata::MetadataMap;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Status};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;

/// A builder on the memory backend with a manual clock at `T0`.
fn memory() -> RateLimitLayerBuilder {
    RateLimitLayer::builder().backend(MemoryBackend::with_manual_clock(ManualClock::new(T0_US)))
}

/// Demo auth as a tower layer outside the limiter: `authorization: Bearer
/// <id>` metadata becomes `UserId(<id>)`.
fn auth(mut req: http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body> {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|id| UserId(id.to_owned()));
    if let Some(u) = user {
        req.extensions_mut().insert(u);
    }
    req
}

/// Serves tonic-health's service (`""` serving) behind `layer` on a free
/// loopback port.
async fn serve_grpc(layer: RateLimitLayer) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        let _reporter = _reporter;
        tonic::transport::Server::builder()
            .layer(tower::util::MapRequestLayer::new(auth))
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .expect("serve");
    });
    addr
}

async fn connect(addr: SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    HealthClient::new(channel)
}

/// A `Check` request of service `service` with metadata `md`.
fn check(service: &str, md: &[(&'static str, &str)]) -> tonic::Request<HealthCheckRequest> {
    let mut req = tonic::Request::new(HealthCheckRequest {
        service: service.to_owned(),
    });
    for (k, v) in md {
        req.metadata_mut().insert(*k, v.parse().expect("ascii"));
    }
    req
}

/// The rate-limit numbers of a metadata map: limit, remaining, reset,
/// retry-after.
fn numbers(md: &MetadataMap) -> [Option<u64>; 4] {
    let n = |k: &str| md.get(k).map(|v| v.to_str().unwrap().parse().unwrap());
    [
        n("x-ratelimit-limit"),
        n("x-ratelimit-remaining"),
        n("x-ratelimit-reset"),
        n("retry-after"),
    ]
}

/// An allowed call: its numbers.
async fn allowed(
    c: &mut HealthClient<tonic::transport::Channel>,
    req: tonic::Request<HealthCheckRequest>,
) -> [Option<u64>; 4] {
    let res = c.check(req).await.expect("allowed");
    numbers(res.metadata())
}

/// A refused call: its status.
async fn refused(
    c: &mut HealthClient<tonic::transport::Channel>,
    req: tonic::Request<HealthCheckRequest>,
) -> Status {
    c.check(req).await.expect_err("refused")
}

/// The third call of an API key over its quota of 2 a minute:
/// RESOURCE_EXHAUSTED, the exact message, a RetryInfo whose delay is the
/// `retry-after` metadata, a QuotaFailure naming the tier, the docs URL as a
/// Help link, and the numbers as metadata.
#[tokio::test]
async fn denied_call_is_resource_exhausted_with_retry_info() {
    let layer = memory()
        .tier(Tier::new(
            "api_key",
            ApiKey::header("x-api-key"),
            Quota::per_minute(2),
        ))
        .docs_url("https://example.com/limits")
        .build()
        .unwrap();
    let mut c = connect(serve_grpc(layer).await).await;
    let key = [("x-api-key", "k1")];
    assert_eq!(
        allowed(&mut c, check("", &key)).await,
        [Some(2), Some(1), Some(T0_S + 30), None]
    );
    assert_eq!(
        allowed(&mut c, check("", &key)).await,
        [Some(2), Some(0), Some(T0_S + 60), None]
    );
    let s = refused(&mut c, check("", &key)).await;
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(
        s.message(),
        r#"rate limit exceeded on tier "api_key": retry in 30 s"#
    );
    assert_eq!(
        numbers(s.metadata()),
        [Some(2), Some(0), Some(T0_S + 30), Some(30)]
    );
    let details = s.get_error_details();
    let retry = details.retry_info().expect("RetryInfo");
    assert_eq!(retry.retry_delay, Some(Duration::from_secs(30)));
    let quota = details.quota_failure().expect("QuotaFailure");
    assert_eq!(quota.violations.len(), 1);
    assert_eq!(quota.violations[0].subject, "api_key");
    let help = details.help().expect("Help");
    assert_eq!(help.links[0].url, "https://example.com/limits");
    // Another key has its own budget.
    assert_eq!(
        allowed(&mut c, check("", &[("x-api-key", "k2")])).await,
        [Some(2), Some(1), Some(T0_S + 30), None]
    );
}

/// On the wire: a denied gRPC call is HTTP 200 with `content-type:
/// application/grpc` and `grpc-status: 8` in the headers of a trailers-only
/// response (no body); the message is percent-encoded.
#[tokio::test]
async fn denied_call_on_the_wire_is_http_200_trailers_only() {
    let layer = memory()
        .tier(Tier::new("method", Endpoint, Quota::per_minute(1)))
        .build()
        .unwrap();
    let addr = serve_grpc(layer).await;
    let mut c = connect(addr).await;
    assert_eq!(
        allowed(&mut c, check("", &[])).await,
        [Some(1), Some(0), Some(T0_S + 60), None]
    );
    let h2 = crate::support::client_builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let res = h2
        .post(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let h = |k: &str| res.headers().get(k).map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(h("content-type").as_deref(), Some("application/grpc"));
    assert_eq!(h("grpc-status").as_deref(), Some("8"));
    assert_eq!(
        h("grpc-message").as_deref(),
        Some("rate%20limit%20exceeded%20on%20tier%20%22method%22:%20retry%20in%2060%20s")
    );
    assert_eq!(h("retry-after").as_deref(), Some("60"));
    assert!(h("grpc-status-details-bin").is_some());
    assert_eq!(res.bytes().await.unwrap().len(), 0);
}

/// A backend that cannot answer under `FailurePolicy::Closed`: UNAVAILABLE,
/// within the backend timeout; under `Open` the call passes.
#[tokio::test]
async fn backend_failure_is_unavailable_when_closed() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    redis.stop();
    let layer = |policy| {
        RateLimitLayer::builder()
            .backend(RedisBackend::from_url(&url).unwrap())
            .key_prefix("grpc")
            .backend_timeout(Duration::from_millis(50))
            .failure_policy(policy)
            .tier(Tier::new(
                "api_key",
                ApiKey::header("x-api-key"),
                Quota::per_minute(2),
            ))
            .build()
            .unwrap()
    };
    let mut c = connect(serve_grpc(layer(FailurePolicy::Closed)).await).await;
    let s = refused(&mut c, check("", &[("x-api-key", "k1")])).await;
    assert_eq!(s.code(), Code::Unavailable);
    assert_eq!(s.message(), "rate limiter unavailable");
    let mut c = connect(serve_grpc(layer(FailurePolicy::Open)).await).await;
    assert_eq!(
        allowed(&mut c, check("", &[("x-api-key", "k1")])).await,
        [None; 4]
    );
}

/// One layer on an axum app and a tonic server: an API key's HTTP and gRPC
/// calls spend one budget, with exact numbers on both sides.
#[tokio::test]
async fn http_and_grpc_calls_of_one_api_key_share_one_budget() {
    let layer = memory()
        .tier(Tier::new(
            "api_key",
            ApiKey::header("x-api-key"),
            Quota::per_minute(4),
        ))
        .build()
        .unwrap();
    let http_addr = crate::support::serve(crate::support::app(layer.clone())).await;
    let mut g = connect(serve_grpc(layer).await).await;
    let h = client();
    let http_call = || {
        h.get(format!("http://{http_addr}/"))
            .header("x-api-key", "shared")
            .send()
    };
    let key = [("x-api-key", "shared")];
    // 4 a minute: one every 15 s; the reset is when the bucket is full.
    assert_eq!(limits(&http_call().await.unwrap()), ok(4, 3, T0_S + 15));
    assert_eq!(
        allowed(&mut g, check("", &key)).await,
        [Some(4), Some(2), Some(T0_S + 30), None]
    );
    assert_eq!(limits(&http_call().await.unwrap()), ok(4, 1, T0_S + 45));
    assert_eq!(
        allowed(&mut g, check("", &key)).await,
        [Some(4), Some(0), Some(T0_S + 60), None]
    );
    let res = http_call().await.unwrap();
    assert_eq!(limits(&res), crate::support::denied(4, 0, T0_S + 15, 15));
    let s = refused(&mut g, check("", &key)).await;
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(
        numbers(s.metadata()),
        [Some(4), Some(0), Some(T0_S + 15), Some(15)]
    );
    assert_eq!(
        s.get_details_retry_info().unwrap().retry_delay,
        Some(Duration::from_secs(15))
    );
}

/// The keys a gRPC call gives: the peer address (tonic's `TcpConnectInfo`:
/// under `Closed`, a missing one would answer UNAVAILABLE), the user from
/// metadata through an auth layer, and the method path as the endpoint
/// (`Check` and the streaming `Watch` have separate budgets; a stream counts
/// once).
#[tokio::test]
async fn peer_address_user_and_method_path_are_keys() {
    let layer = memory()
        .failure_policy(FailurePolicy::Closed)
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(100)))
        .tier(Tier::new("user", User, Quota::per_minute(1)))
        .tier(Tier::new("method", Endpoint, Quota::per_minute(3)))
        .build()
        .unwrap();
    let mut c = connect(serve_grpc(layer).await).await;
    let alice = [("authorization", "Bearer alice")];
    let bob = [("authorization", "Bearer bob")];
    // Binding tier: the least remaining (user: 0 of 1).
    assert_eq!(
        allowed(&mut c, check("", &alice)).await,
        [Some(1), Some(0), Some(T0_S + 60), None]
    );
    let s = refused(&mut c, check("", &alice)).await;
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(
        s.message(),
        r#"rate limit exceeded on tier "user": retry in 60 s"#
    );
    assert_eq!(
        allowed(&mut c, check("", &bob)).await,
        [Some(1), Some(0), Some(T0_S + 60), None]
    );
    // Anonymous: no user tier; `method` has 1 of 3 left after alice's and
    // bob's allowed calls (alice's refused one was not charged).
    assert_eq!(
        allowed(&mut c, check("", &[])).await,
        [Some(3), Some(0), Some(T0_S + 60), None]
    );
    let s = refused(&mut c, check("", &[])).await;
    assert_eq!(
        s.message(),
        r#"rate limit exceeded on tier "method": retry in 20 s"#
    );
    // `Watch` is another method: its own budget. A stream is one call.
    let mut stream = c
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("watch allowed")
        .into_inner();
    assert!(stream.message().await.unwrap().is_some());
    let md = numbers(
        c.watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("second watch allowed")
        .metadata(),
    );
    assert_eq!(md, [Some(3), Some(1), Some(T0_S + 40), None]);
}

/// The protocol is chosen by content type, or explicitly: `Http` answers a
/// gRPC request 429, `Grpc` answers a plain HTTP request `grpc-status: 8`.
#[tokio::test]
async fn protocol_is_chosen_by_content_type_or_explicitly() {
    let h2 = crate::support::client_builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for (protocol, content_type, want_status, want_grpc) in [
        (Protocol::Auto, "application/grpc", 200, Some("8")),
        (Protocol::Auto, "application/json", 429, None),
        (Protocol::Http, "application/grpc", 429, None),
        (Protocol::Grpc, "application/json", 200, Some("8")),
    ] {
        let layer = memory()
            .tier(Tier::new(
                "global",
                tiered_ratelimit::key::Global,
                Quota::per_minute(1),
            ))
            .protocol(protocol)
            .build()
            .unwrap();
        let addr = serve_grpc(layer).await;
        let send = || {
            h2.post(format!("http://{addr}/grpc.health.v1.Health/Check"))
                .header("content-type", content_type)
                .send()
        };
        send().await.unwrap();
        let res = send().await.unwrap();
        assert_eq!(res.status(), want_status, "{protocol:?} {content_type}");
        assert_eq!(
            res.headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap()),
            want_grpc,
            "{protocol:?} {content_type}"
        );
        assert_eq!(
            res.headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap()),
            Some("60")
        );
    }
}

/// `skip_failed_requests` on gRPC: a call answered with an error status in
/// its headers (tonic-health's NOT_FOUND for an unknown service) gets its
/// charge back.
#[tokio::test]
async fn calls_failing_with_a_grpc_status_are_refunded() {
    let layer = memory()
        .tier(
            Tier::new("api_key", ApiKey::header("x-api-key"), Quota::per_minute(1))
                .skip_failed_requests(true),
        )
        .build()
        .unwrap();
    let mut c = connect(serve_grpc(layer).await).await;
    let key = [("x-api-key", "k1")];
    for _ in 0..3 {
        let s = refused(&mut c, check("unknown", &key)).await;
        assert_eq!(s.code(), Code::NotFound);
    }
    assert_eq!(
        allowed(&mut c, check("", &key)).await,
        [Some(1), Some(0), Some(T0_S + 60), None]
    );
    let s = refused(&mut c, check("", &key)).await;
    assert_eq!(s.code(), Code::ResourceExhausted);
}

/// A concurrency tier holds a streaming call's slot until the stream ends:
/// with a limit of 1, a second `Watch` stream of the same API key is refused
/// while the first is open (RESOURCE_EXHAUSTED, `retry-after: 1`), and
/// admitted once the client has dropped the first.
#[tokio::test]
async fn a_stream_holds_its_concurrency_slot_until_it_ends() {
    let layer = memory()
        .tier(Tier::concurrency(
            "in_flight",
            ApiKey::header("x-api-key"),
            1,
        ))
        .build()
        .unwrap();
    let mut c = connect(serve_grpc(layer).await).await;
    let watch = || check("", &[("x-api-key", "k1")]);
    let mut first = c.watch(watch()).await.expect("admitted").into_inner();
    // The stream is open: its first message (SERVING) arrives.
    assert!(first.message().await.expect("a message").is_some());
    let s = c
        .watch(watch())
        .await
        .expect_err("refused while the first runs");
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(
        s.metadata().get("retry-after").map(|v| v.to_str().unwrap()),
        Some("1")
    );
    // Another key has its own slot.
    let other = check("", &[("x-api-key", "k2")]);
    let _second_key = c.watch(other).await.expect("another key's slot");
    // The client ends the first stream: the server drops its body and the
    // slot is free (released when the response body is dropped).
    drop(first);
    let mut freed = false;
    for _ in 0..100 {
        if c.watch(watch()).await.is_ok() {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(freed, "the slot comes back once the stream ends");
}

/// A call whose cost (here from `x-cost` metadata) exceeds the tier's
/// capacity can never pass: RESOURCE_EXHAUSTED without `RetryInfo` or
/// `retry-after`, a message and a `QuotaFailure` violation that say so;
/// nothing charged.
#[tokio::test]
async fn a_call_above_the_capacity_gets_no_retry_info() {
    let layer = memory()
        .tier(
            Tier::new("api_key", ApiKey::header("x-api-key"), Quota::per_minute(2)).cost_fn(
                |p: &http::request::Parts| {
                    p.headers
                        .get("x-cost")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                },
            ),
        )
        .docs_url("https://example.com/limits")
        .build()
        .unwrap();
    let mut c = connect(serve_grpc(layer).await).await;
    let s = refused(&mut c, check("", &[("x-api-key", "k1"), ("x-cost", "3")])).await;
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(
        s.message(),
        r#"request cost exceeds the capacity of 2 of tier "api_key": it can never pass"#
    );
    assert_eq!(numbers(s.metadata()), [Some(2), Some(2), Some(T0_S), None]);
    let details = s.get_error_details();
    assert!(details.retry_info().is_none());
    let quota = details.quota_failure().expect("QuotaFailure");
    assert_eq!(quota.violations.len(), 1);
    assert_eq!(quota.violations[0].subject, "api_key");
    assert_eq!(
        quota.violations[0].description,
        r#"cost_exceeds_capacity: the request costs more than the capacity of 2 of tier "api_key""#
    );
    assert_eq!(
        details.help().expect("Help").links[0].url,
        "https://example.com/limits"
    );
    // Nothing was charged.
    assert_eq!(
        allowed(&mut c, check("", &[("x-api-key", "k1")])).await,
        [Some(2), Some(1), Some(T0_S + 30), None]
    );
}
