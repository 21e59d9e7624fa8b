//! The rate-limit layer on a tonic gRPC server (feature `grpc`).
//!
//! ```sh
//! cargo run --example grpc --features grpc                 # in memory
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example grpc --features grpc
//! ```
//!
//! Serves `grpc.health.v1.Health` (tonic-health's service, so no protoc is
//! needed) on `LISTEN_ADDR` (default `127.0.0.1:50051`) behind four tiers —
//! peer address, user (from `authorization: Bearer <id>` metadata, through a
//! tower layer that runs before the limiter), API key (`x-api-key` metadata)
//! and method path — then calls it with a tonic client until the API key's
//! quota runs out, printing each answer: the rate-limit metadata of allowed
//! calls, then `RESOURCE_EXHAUSTED` with its `RetryInfo`. The server keeps
//! running afterwards; try it with
//! `grpcurl -plaintext -H 'x-api-key: demo' 127.0.0.1:50051 grpc.health.v1.Health/Check`
//! (grpcurl needs the server's reflection, which this example does not
//! serve: pass `-import-path`/`-proto` with health.proto).

use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::RedisBackend;
use tiered_ratelimit::key::{ApiKey, ClientIp, Endpoint, User, UserId};
use tiered_ratelimit::{Quota, RateLimitLayer, Tier};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;

/// Demo authentication: the bearer token *is* the user id (verify a real
/// token before trusting it). A tower layer, so it runs before the limiter;
/// tonic interceptors run inside the service, after it.
fn auth(mut req: http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body> {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|id| UserId(id.to_owned()));
    if let Some(user) = user {
        req.extensions_mut().insert(user);
    }
    req
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let addr: SocketAddr = std::env::var("LISTEN_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:50051".to_owned())
        .parse()?;
    let mut builder = RateLimitLayer::builder()
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(600)))
        .tier(Tier::new("user", User, Quota::per_minute(100)))
        .tier(Tier::new(
            "api_key",
            ApiKey::header("x-api-key"),
            Quota::per_minute(5),
        ))
        .tier(Tier::new("method", Endpoint, Quota::per_second(100)))
        .backend_timeout(Duration::from_millis(50))
        .docs_url("https://example.com/docs/rate-limits");
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            println!("backend: Redis at {url}");
            builder = builder
                .backend(RedisBackend::from_url(&url)?)
                .key_prefix("grpc-example");
        }
        Err(_) => println!("backend: in memory (set REDIS_URL for Redis)"),
    }
    // build() + one PING: an unreachable Redis is logged now (a WARN: the
    // default failure policy lets calls through until it answers).
    let layer = builder.build_checked().await?;

    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("serving grpc.health.v1.Health on {addr}");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(tower::util::MapRequestLayer::new(auth))
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);
    for i in 1..=6 {
        let mut req = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
        req.metadata_mut().insert("x-api-key", "demo".parse()?);
        req.metadata_mut()
            .insert("authorization", "Bearer alice".parse()?);
        match client.check(req).await {
            Ok(res) => {
                let md = res.metadata();
                let get = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).unwrap_or("-");
                println!(
                    "call {i}: OK, x-ratelimit-limit {} remaining {} reset {}",
                    get("x-ratelimit-limit"),
                    get("x-ratelimit-remaining"),
                    get("x-ratelimit-reset"),
                );
            }
            Err(status) => {
                let delay = status
                    .get_details_retry_info()
                    .and_then(|r| r.retry_delay)
                    .map_or(0, |d| d.as_secs());
                println!(
                    "call {i}: {:?} \"{}\", RetryInfo {delay} s",
                    status.code(),
                    status.message()
                );
            }
        }
    }
    server.await??;
    Ok(())
}
