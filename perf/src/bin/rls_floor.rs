//! The floor of `perf/rls.sh`: Envoy's `RateLimitService` on tonic that
//! answers `OK` without looking at the request (no descriptor read, no
//! status written), served as `tiered-ratelimit-rls` serves its own — the
//! same generated server (envoy-types), `grpc.health.v1` beside it, tonic's
//! default server settings, Tokio's multi-threaded runtime. What a call
//! costs before any rate limiting: HTTP/2, gRPC framing, protobuf decoding
//! of the request and encoding of the answer.
//!
//! ```text
//! rls_floor <addr>        # e.g. 127.0.0.1:8081; runs until killed
//! ```

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

/// Answers `OK`, whatever was asked.
#[derive(Debug, Clone, Copy)]
struct Floor;

#[tonic::async_trait]
impl RateLimitService for Floor {
    async fn should_rate_limit(
        &self,
        _request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            ..Default::default()
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args().nth(1).ok_or("rls_floor <addr>")?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RateLimitServiceServer<Floor>>()
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(Floor))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await?;
    Ok(())
}
