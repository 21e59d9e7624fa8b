//! The reference service's stat names as Prometheus series beside ours:
//! after a known sequence of gRPC calls over TCP, `GET /metrics` holds
//! exactly these `ratelimit_service_rate_limit_*` series (a plain node, a
//! nested one with `value_to_metric`, a shadowed wildcard, a node with
//! `detailed_metric`). One test per binary: it installs the recorder.

mod support;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::path::Path;
use support::{d, T0_US};
use tiered_ratelimit::backend::{ManualClock, MemoryBackend};
use tiered_ratelimit::descriptor::{FailureStatus, ReferenceConfig};
use tiered_ratelimit::response::HeaderStyle;
use tiered_ratelimit::EngineBuilder;
use tiered_ratelimit_rls::{serve, Rls};

/// A descriptor's entries.
type Entries = &'static [(&'static str, &'static str)];

const EDGE: &str = "
domain: edge
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: route
    value: api
    descriptors:
      - key: user
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /files/*
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: client
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
";

/// Under the global `SHADOW_MODE`: 2 per minute on one key.
const SHADOWED: &str = "
domain: sh
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 2}
";

fn req(entries: &[(&str, &str)], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![d(entries)],
        hits_addend: hits,
    }
}

#[tokio::test]
async fn the_reference_stat_names_count_a_known_sequence() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("recorder");
    let backend: tiered_ratelimit::backend::Backend =
        MemoryBackend::with_manual_clock(ManualClock::new(T0_US)).into();
    let rls = |name: &str, yaml: &str, shadow: bool| {
        let mut config = ReferenceConfig::default();
        config.add(Path::new(name), yaml).expect("valid YAML");
        let limiters = config
            .limiters(&backend, "rls-stats", shadow, || {
                EngineBuilder::default()
                    .headers(HeaderStyle::None)
                    .backend_timeout(std::time::Duration::from_secs(10))
            })
            .expect("limiters");
        Rls::domains(limiters, FailureStatus::OverLimit)
    };
    // The global shadow mode: a request with a descriptor over its limit
    // is OK and charged its other descriptors (counted as charged).
    let shadowed = rls("sh.yaml", SHADOWED, true);
    let sh = |values: &[&str]| RateLimitRequest {
        domain: "sh".into(),
        descriptors: values.iter().map(|v| d(&[("k", v)])).collect(),
        hits_addend: 0,
    };
    let mut sh_codes = Vec::new();
    for r in [sh(&["a"]), sh(&["a"]), sh(&["a", "b"])] {
        let a = shadowed.decide(&r).await.unwrap();
        let codes: Vec<i32> = a.statuses.iter().map(|s| s.code).collect();
        sh_codes.push((a.overall_code, codes));
    }
    assert_eq!(sh_codes, [(1, vec![1]), (1, vec![1]), (1, vec![2, 1])]);
    let rls = rls("edge.yaml", EDGE, false);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (grpc_addr, metrics_addr) = (grpc.local_addr().unwrap(), metrics.local_addr().unwrap());
    tokio::spawn(serve(
        rls,
        grpc,
        Some((metrics, handle)),
        std::future::pending(),
    ));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = RateLimitServiceClient::new(channel);
    let mut codes = Vec::new();
    let calls: [(Entries, u32, usize); 4] = [
        // 5 per minute, near from the 5th (floor(5 × 0.8) = 4): 5 pass, 1 over.
        (&[("tenant", "a")], 0, 6),
        // 2 per minute, near from the 2nd: 2 pass, 1 over; the user's value
        // in the key (value_to_metric).
        (&[("route", "api"), ("user", "bob")], 0, 3),
        // 1 per minute in shadow: 1 passes, 1 over (answered OK); the
        // wildcard's pattern in the key.
        (&[("path", "/files/x")], 0, 2),
        // detailed_metric: the request's value; 3 hits in one call.
        (&[("client", "c1")], 3, 1),
    ];
    for (entries, hits, times) in calls {
        for _ in 0..times {
            let r = c.should_rate_limit(req(entries, hits)).await.unwrap();
            codes.push(r.into_inner().overall_code);
        }
    }
    assert_eq!(codes, [1, 1, 1, 1, 1, 2, 1, 1, 2, 1, 1, 1]);
    let body = reqwest::get(format!("http://{metrics_addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut series: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("ratelimit_service_rate_limit_"))
        .collect();
    series.sort_unstable();
    assert_eq!(
        series,
        [
            r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="path_/files/*"} 1"#,
            r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="route_api",key2="user_bob"} 1"#,
            r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="tenant"} 1"#,
            r#"ratelimit_service_rate_limit_near_limit{domain="sh",key1="k"} 1"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="path_/files/*"} 1"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="route_api",key2="user_bob"} 1"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="tenant"} 1"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="sh",key1="k"} 1"#,
            r#"ratelimit_service_rate_limit_shadow_mode{domain="edge",key1="path_/files/*"} 1"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="client_c1"} 3"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="path_/files/*"} 2"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="route_api",key2="user_bob"} 3"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="tenant"} 6"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="sh",key1="k"} 4"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="client_c1"} 3"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="path_/files/*"} 1"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="route_api",key2="user_bob"} 2"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="tenant"} 5"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="sh",key1="k"} 3"#,
        ]
    );
}
