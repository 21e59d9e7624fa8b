//! What the service's test binaries share (each declares `mod support;`):
//! the root crate's starters of real redis-server processes (a standalone
//! server, a Cluster, Sentinels) and free ports, the service's binary
//! started and killed on drop, gRPC clients, `/metrics` read over TCP, and
//! Envoy's messages built from short forms.

// Each binary uses a part of it.
#![allow(dead_code, unused_imports)]

#[path = "../../../tests/support/cluster.rs"]
pub mod cluster;
#[path = "../../../tests/support/redis_server.rs"]
pub mod redis_server;
#[path = "../../../tests/support/sentinel.rs"]
pub mod sentinel;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub(crate) use redis_server::{free_port, RedisServer};

/// The manual clock's start: 1,700,000,000 s, 20 s into a minute, 800 s
/// into an hour, 80,000 s into a day.
pub const T0_US: u64 = 1_700_000_000 * 1_000_000;

/// A gRPC client of the service.
pub type Client = RateLimitServiceClient<Channel>;

/// The service's binary, `tiered-ratelimit-rls`, to be given its
/// arguments and environment.
pub fn rls_command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tiered-ratelimit-rls"))
}

/// A child process, killed (and waited for) on drop if still running.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Killed {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// A client of a server in this process (already listening at `addr`).
pub async fn connect(addr: SocketAddr) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    RateLimitServiceClient::new(channel)
}

/// A client of the binary's gRPC port, once it listens (10 s at most).
pub async fn connect_when_listening(grpc: u16) -> Client {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}")).unwrap();
        if let Ok(ch) = endpoint.connect().await {
            return RateLimitServiceClient::new(ch);
        }
        assert!(Instant::now() < deadline, "never listened on {grpc}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET /metrics` over plain HTTP/1.0 on `port`: the whole response.
pub async fn metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("metrics port");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// A descriptor of these `(key, value)` entries.
pub fn d(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request of `domain` with `descriptors`, `hits_addend` 0 (one hit).
pub fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

/// `ShouldRateLimit`, which must be answered.
pub async fn call(c: &mut Client, r: RateLimitRequest) -> RateLimitResponse {
    c.should_rate_limit(r).await.expect("answered").into_inner()
}

/// A status with a limit: code, name, per unit, unit, remaining, seconds
/// to reset.
pub fn limited_per(
    code: Code,
    name: &str,
    per_unit: u32,
    unit: Unit,
    remaining: u32,
    reset_s: i64,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code.into(),
        current_limit: Some(RateLimit {
            name: name.to_owned(),
            requests_per_unit: per_unit,
            unit: unit.into(),
        }),
        limit_remaining: remaining,
        duration_until_reset: Some(ProtoDuration {
            seconds: reset_s,
            nanos: 0,
        }),
        quota: None,
    }
}

/// An OK status without a limit.
pub fn no_limit(remaining: u32) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok.into(),
        limit_remaining: remaining,
        ..Default::default()
    }
}

/// A response header.
pub fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.to_owned(),
        value: v.to_owned(),
        ..Default::default()
    }
}
