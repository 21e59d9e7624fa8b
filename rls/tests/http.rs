//! The reference service's HTTP endpoints over TCP with a real HTTP client
//! (reqwest): `POST /json` (a `ShouldRateLimit` in protobuf's JSON mapping,
//! the reference's status codes) on memory and a real Redis, exact bodies;
//! `GET /healthcheck` (200 `OK` while serving, 500 empty after); and the
//! binary serving them on the reference's `HOST`/`PORT`.

mod support;

use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use support::{free_port, rls_command, Killed, RedisServer, T0_US};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::descriptor::{FailureStatus, ReferenceConfig};
use tiered_ratelimit::response::HeaderStyle;
use tiered_ratelimit::EngineBuilder;
use tiered_ratelimit_rls::{serve_http, Rls};

const EDGE: &str = "
domain: edge
descriptors:
  - key: tenant
    rate_limit:
      unit: minute
      requests_per_unit: 2
  - key: path
    value: /free
  - key: plan
    rate_limit:
      name: plan_hourly
      unit: hour
      requests_per_unit: 10
";

fn rls(backend: impl Into<Backend>) -> Rls {
    let mut config = ReferenceConfig::default();
    config
        .add(Path::new("edge.yaml"), EDGE)
        .expect("valid YAML");
    let limiters = config
        .limiters(&backend.into(), "rls-http", false, || {
            EngineBuilder::default()
                .headers(HeaderStyle::None)
                .backend_timeout(std::time::Duration::from_secs(10))
        })
        .expect("limiters");
    Rls::domains(limiters, FailureStatus::OverLimit).engine_headers(false)
}

/// gRPC and HTTP on free loopback ports; the HTTP address.
async fn start(rls: Rls) -> SocketAddr {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap();
    tokio::spawn(serve_http(
        rls,
        grpc,
        Some(http),
        None,
        std::future::pending(),
    ));
    addr
}

/// POSTs `body` to `/json`: the status, the content type and the body.
async fn post(addr: SocketAddr, body: &str) -> (u16, String, String) {
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/json"))
        .body(body.to_owned())
        .send()
        .await
        .expect("answered");
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, ct, r.text().await.unwrap())
}

fn tenant(value: &str) -> String {
    json!({"domain": "edge", "descriptors": [{"entries": [{"key": "tenant", "value": value}]}]})
        .to_string()
}

async fn json_endpoint(addr: SocketAddr) {
    let ok = |remaining: Value| {
        let mut s = json!({"code": "OK",
            "currentLimit": {"requestsPerUnit": 2, "unit": "MINUTE"},
            "durationUntilReset": "40s"});
        if !remaining.is_null() {
            s["limitRemaining"] = remaining;
        }
        s
    };
    // Two within the limit, then over it: 200, 200, 429; a remaining of 0
    // is left out, as protobuf's JSON mapping leaves out default values.
    let (status, ct, body) = post(addr, &tenant("a")).await;
    assert_eq!((status, ct.as_str()), (200, "application/json"));
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body,
        json!({"overallCode": "OK", "statuses": [ok(json!(1))]})
    );
    let (status, _, body) = post(addr, &tenant("a")).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"overallCode": "OK", "statuses": [ok(Value::Null)]})
    );
    let (status, ct, body) = post(addr, &tenant("a")).await;
    assert_eq!((status, ct.as_str()), (429, "application/json"));
    assert_eq!(
        body,
        r#"{"overallCode":"OVER_LIMIT","statuses":[{"code":"OVER_LIMIT","currentLimit":{"requestsPerUnit":2,"unit":"MINUTE"},"durationUntilReset":"40s"}]}"#
    );
    // Proto field names are read too; a per-descriptor hitsAddend as a
    // string (uint64's JSON form); a named limit; a key=value without a
    // limit (no currentLimit, no reset); an unknown domain: OK, no limit.
    let (status, _, body) = post(
        addr,
        r#"{"domain":"edge","hits_addend":1,"descriptors":[
            {"entries":[{"key":"plan","value":"pro"}],"hitsAddend":"4"},
            {"entries":[{"key":"path","value":"/free"}]},
            {"entries":[{"key":"tenant","value":"a"}]}]}"#,
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"overallCode": "OVER_LIMIT", "statuses": [
            {"code": "OK", "currentLimit": {"name": "plan_hourly", "requestsPerUnit": 10, "unit": "HOUR"},
             "limitRemaining": 10, "durationUntilReset": "2800s"},
            {"code": "OK"},
            {"code": "OVER_LIMIT", "currentLimit": {"requestsPerUnit": 2, "unit": "MINUTE"},
             "durationUntilReset": "40s"},
        ]})
    );
    let (status, _, body) = post(
        addr,
        r#"{"domain":"nowhere","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#,
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"overallCode":"OK","statuses":[{"code":"OK"}]}"#)
    );
    // Not a request, an unknown field, a negative count, a request refused
    // (no descriptors): 400, the reference's text and what is wrong.
    for (bad, why) in [
        (
            "not json",
            "not a RateLimitRequest in JSON: expected ident at line 1 column 2",
        ),
        (
            r#"{"domain":"edge","descriptors":[],"extra":1}"#,
            "not a RateLimitRequest in JSON: unknown field `extra`, expected one of \
             `domain`, `descriptors`, `hitsAddend`, `hits_addend` at line 1 column 41",
        ),
        (
            r#"{"domain":"edge","descriptors":[]}"#,
            "descriptors: the list must not be empty",
        ),
        (
            r#"{"domain":"edge","hitsAddend":-1,"descriptors":[{"entries":[{"key":"tenant","value":"c"}]}]}"#,
            "not a RateLimitRequest in JSON: -1: a count is never negative at line 1 column 32",
        ),
        (
            r#"{"domain":"edge","descriptors":[{"entries":[{"key":"tenant","value":"c"}],"hitsAddend":"lots"}]}"#,
            "not a RateLimitRequest in JSON: \"lots\": a count is a non-negative integer \
             at line 1 column 93",
        ),
    ] {
        let (status, _, body) = post(addr, bad).await;
        assert_eq!(
            (status, body.as_str()),
            (400, format!("Bad Request: {why}\n").as_str()),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn json_endpoint_in_memory() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    json_endpoint(start(rls(backend)).await).await;
}

#[tokio::test]
async fn json_endpoint_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    json_endpoint(start(rls(backend)).await).await;
}

#[tokio::test]
async fn healthcheck_answers_ok_while_serving_and_500_after() {
    let serving = Arc::new(AtomicBool::new(true));
    let app = tiered_ratelimit_rls::endpoints::router(rls(MemoryBackend::new()), serving.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let get = || async move {
        let r = reqwest::get(format!("http://{addr}/healthcheck"))
            .await
            .expect("answered");
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_eq!(get().await, (200, "OK".to_owned()));
    serving.store(false, Ordering::Release);
    assert_eq!(get().await, (500, String::new()));
}

/// The binary on the reference's environment: `HOST`/`PORT` serve
/// `/healthcheck` and `/json` beside gRPC.
#[tokio::test]
async fn the_binary_serves_them_on_host_and_port() {
    let dir = std::env::temp_dir().join(format!("rls-http-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("edge.yaml"), EDGE).unwrap();
    let (grpc, http) = (free_port(), free_port());
    let child = rls_command()
        .env_clear()
        .arg("--config")
        .arg(&dir)
        .arg("--metrics")
        .arg("none")
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        .env("HOST", "127.0.0.1")
        .env("PORT", http.to_string())
        .env("LOG_LEVEL", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let _child = Killed(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let health = loop {
        if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{http}/healthcheck")).await {
            break (r.status().as_u16(), r.text().await.unwrap());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never listened on PORT {http}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(health, (200, "OK".to_owned()));
    let addr: SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
    let (status, _, body) = post(addr, &tenant("z")).await;
    assert_eq!(status, 200);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["statuses"][0]["limitRemaining"], json!(1));
    assert_eq!(body["statuses"][0]["currentLimit"]["unit"], json!("MINUTE"));
    std::fs::remove_dir_all(&dir).unwrap();
}
