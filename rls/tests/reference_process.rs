//! The binary started the way the reference service's container is: no
//! flags, its environment variables only (RUNTIME_ROOT and
//! RUNTIME_SUBDIRECTORY with a `config/` directory of YAML files, REDIS_URL
//! as `host:port` over tcp, GRPC_HOST/GRPC_PORT, USE_PROMETHEUS,
//! CACHE_KEY_PREFIX, LIMIT_RESPONSE_HEADERS_ENABLED with a renamed header);
//! and a variable it cannot honour refused at start by name.

#[allow(dead_code)]
#[path = "../../tests/support/redis_server.rs"]
mod redis_server;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use redis_server::{free_port, RedisServer};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.to_owned(),
        value: v.to_owned(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_environment_alone_starts_and_serves() {
    let redis = RedisServer::start();
    let root =
        std::env::temp_dir().join(format!("rls-env-{}-{}", std::process::id(), redis.port()));
    let config = root.join("ratelimit/config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: hour\n      requests_per_unit: 2\n",
    )
    .unwrap();
    std::fs::write(config.join(".edge.yaml.swp"), "\0 not yaml").unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_tiered-ratelimit-rls"))
        .env_clear()
        .env("RUNTIME_ROOT", &root)
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_IGNOREDOTFILES", "true")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port()))
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        // The HTTP endpoints' default is 8080: a free port instead.
        .env("HOST", "127.0.0.1")
        .env("PORT", free_port().to_string())
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", format!("127.0.0.1:{metrics}"))
        .env("CACHE_KEY_PREFIX", "ref")
        .env("LIMIT_RESPONSE_HEADERS_ENABLED", "true")
        .env("LIMIT_REMAINING_HEADER", "X-Left")
        .env("LOG_LEVEL", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn");
    let _child = Killed(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let channel = loop {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}")).unwrap();
        if let Ok(ch) = endpoint.connect().await {
            break ch;
        }
        assert!(
            Instant::now() < deadline,
            "never listened on GRPC_PORT {grpc}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut c = RateLimitServiceClient::new(channel);
    let r = || RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: "t1".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(
            c.should_rate_limit(r())
                .await
                .expect("answered")
                .into_inner(),
        );
    }
    let codes: Vec<i32> = answers.iter().map(|a| a.overall_code).collect();
    assert_eq!(
        codes,
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );
    let remaining: Vec<u32> = answers
        .iter()
        .map(|a| a.statuses[0].limit_remaining)
        .collect();
    assert_eq!(remaining, [1, 0, 0]);
    // The reference's headers only, one renamed; the reset is the hour's
    // end on Redis' clock in whole seconds, rounded up (the status has µs).
    let until = answers[2].statuses[0].duration_until_reset.unwrap();
    let reset = until.seconds + i64::from(until.nanos > 0);
    assert!((1..=3600).contains(&reset), "{reset}");
    assert_eq!(
        answers[2].response_headers_to_add,
        vec![
            header("ratelimit-limit", "2"),
            header("x-left", "0"),
            header("ratelimit-reset", &reset.to_string()),
        ]
    );
    // CACHE_KEY_PREFIX and the domain lead the keys in REDIS_URL's Redis.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(keys.iter().all(|k| k.starts_with("ref:edge:")), "{keys:?}");
    assert!(keys.iter().any(|k| k == "ref:edge:tenant:t1"), "{keys:?}");
    // PROMETHEUS_ADDR serves /metrics.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", metrics))
        .await
        .unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.0 200"), "{body}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_reference_variable_that_cannot_be_honoured_stops_the_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_tiered-ratelimit-rls"))
        .env_clear()
        .env("RUNTIME_ROOT", "/nonexistent")
        .env("USE_STATSD", "true")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "tiered-ratelimit-rls: USE_STATSD=true: statsd is not exported; metrics are Prometheus (USE_PROMETHEUS)\n"
    );
}

/// A descriptor on `tenant` with hits_addend 0: reads without charging.
fn peek_tenant() -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: "t1".into(),
            }],
            hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 }),
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}

/// Reload without a restart: a valid change is served by the next calls
/// (the counters kept), an invalid one is counted and the previous
/// configuration keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_config_is_swapped_in_and_a_broken_one_refused() {
    let root = std::env::temp_dir().join(format!("rls-reload-{}", std::process::id()));
    let config = root.join("config");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&config).unwrap();
    let yaml = |n: u32| {
        format!("domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: hour\n      requests_per_unit: {n}\n")
    };
    std::fs::write(config.join("edge.yaml"), yaml(2)).unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_tiered-ratelimit-rls"))
        .env_clear()
        .env("RUNTIME_ROOT", &root)
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        // The HTTP endpoints' default is 8080: a free port instead.
        .env("HOST", "127.0.0.1")
        .env("PORT", free_port().to_string())
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", format!("127.0.0.1:{metrics}"))
        .env("LOG_LEVEL", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let _child = Killed(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let channel = loop {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}")).unwrap();
        if let Ok(ch) = endpoint.connect().await {
            break ch;
        }
        assert!(Instant::now() < deadline, "never listened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut c = RateLimitServiceClient::new(channel);
    let mut charge = peek_tenant();
    charge.descriptors[0].hits_addend = None;
    let s = c
        .should_rate_limit(charge.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.statuses[0].limit_remaining, 1);
    // A valid change: 5 an hour, the one request already counted.
    std::fs::write(config.join("edge.yaml"), yaml(5)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = c
            .should_rate_limit(peek_tenant())
            .await
            .unwrap()
            .into_inner();
        let limit = s.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit;
        if limit == 5 {
            assert_eq!(s.statuses[0].limit_remaining, 4);
            break;
        }
        assert_eq!(limit, 2);
        assert!(Instant::now() < deadline, "the change was never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // An invalid change: refused, counted, the 5-an-hour config still serves.
    std::fs::write(
        config.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: fortnight\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !scrape(metrics)
        .await
        .contains("tiered_ratelimit_rls_config_loads_total{result=\"error\"} 1")
    {
        assert!(
            Instant::now() < deadline,
            "the broken change was never counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = c.should_rate_limit(charge).await.unwrap().into_inner();
    assert_eq!(s.overall_code, Code::Ok as i32);
    assert_eq!(
        s.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        5
    );
    assert_eq!(s.statuses[0].limit_remaining, 3);
    let body = scrape(metrics).await;
    assert!(
        body.contains("tiered_ratelimit_rls_config_loads_total{result=\"success\"} 1"),
        "{body}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
