//! Per-key overrides through real HTTP, on the memory backend, a real Redis
//! and a real Redis Cluster, on the test clock: another quota shows its own
//! limit and remaining, unlimited passes without charging, blocked denies
//! with the time left as Retry-After, an expiry ends an override; on Redis
//! a second app instance applies an override set through the first one's
//! handle on its next request, with no extra Redis command per request.

mod support;

use axum::{routing::get, Router};
use std::net::SocketAddr;
use std::time::Duration;
use support::cluster::RedisCluster;
use support::LogBuf;
use support::*;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::key::ClientIp;
use tiered_ratelimit::overrides::{Override, OverrideEntry};
use tiered_ratelimit::{Quota, RateLimitHandle, RateLimitLayer, Tier};

const IP: &str = "127.0.0.1";

async fn hit(addr: SocketAddr) -> Limits {
    limits(
        &client()
            .get(format!("http://{addr}/"))
            .send()
            .await
            .unwrap(),
    )
}

/// An app limited to 3 requests a minute per IP (token bucket), taking
/// overrides; another tier (global) without them.
async fn app_on(backend: Backend) -> (RateLimitHandle, SocketAddr) {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(2))
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(3)).overrides(true))
        .build()
        .unwrap();
    let h = layer.handle();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    (h, serve(app).await)
}

/// The scenario; `other` is the app every request but the first goes to
/// (a second instance sharing the Redis, or the same app).
async fn overrides(h: RateLimitHandle, first: SocketAddr, other: SocketAddr, clock: ManualClock) {
    assert_eq!(hit(first).await, ok(3, 2, T0_S + 20));
    // Another quota: 60 a minute (a token bucket refilled one a second),
    // for 5 minutes.
    let q = Override::Quota(Quota::per_minute(60));
    h.set_override("ip", IP, q, Some(Duration::from_secs(300)), "ops")
        .await
        .unwrap();
    assert_eq!(
        h.overrides("ip").await.unwrap(),
        vec![OverrideEntry::new(IP, q, Some(T0_US + 300_000_000))]
    );
    assert_eq!(hit(other).await, ok(60, 59, T0_S + 1));
    assert_eq!(hit(other).await, ok(60, 58, T0_S + 2));
    // Unlimited: allowed, nothing charged, the tier shown full.
    h.set_override("ip", IP, Override::Unlimited, None, "ops")
        .await
        .unwrap();
    for _ in 0..10 {
        assert_eq!(hit(other).await, ok(3, 3, T0_S));
    }
    // Blocked for 2 minutes: denied, Retry-After the time left.
    h.set_override(
        "ip",
        IP,
        Override::Blocked,
        Some(Duration::from_secs(120)),
        "ops",
    )
    .await
    .unwrap();
    assert_eq!(hit(other).await, denied(3, 0, T0_S + 120, 120));
    clock.advance(Duration::from_secs(30));
    assert_eq!(hit(other).await, denied(3, 0, T0_S + 120, 90));
    // Expired: the tier's own quota on what was charged before the
    // overrides (the bucket refilled meanwhile: full).
    clock.advance(Duration::from_secs(90));
    assert_eq!(h.overrides("ip").await.unwrap(), vec![]);
    assert_eq!(hit(other).await, ok(3, 2, T0_S + 140));
    // Blocked for good: Retry-After 24 h; removed: back to the quota.
    h.set_override("ip", IP, Override::Blocked, None, "ops")
        .await
        .unwrap();
    assert_eq!(hit(other).await, denied(3, 0, T0_S + 120 + 86_400, 86_400));
    assert!(h.remove_override("ip", IP, "ops").await.unwrap());
    assert!(!h.remove_override("ip", IP, "ops").await.unwrap());
    assert_eq!(hit(other).await, ok(3, 1, T0_S + 160));
    // Another key is never touched.
    assert_eq!(h.overrides("ip").await.unwrap(), vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_in_memory() {
    let clock = ManualClock::new(T0_US);
    let (h, addr) = app_on(MemoryBackend::with_manual_clock(clock.clone()).into()).await;
    overrides(h, addr, addr, clock).await;
}

fn redis_backend(url: &str, clock: &ManualClock) -> Backend {
    RedisBackend::from_url(url)
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200))
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_on_redis_apply_to_a_second_instance_with_one_call_per_request() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (h, first) = app_on(redis_backend(&redis.url(), &clock)).await;
    let (_h2, second) = app_on(redis_backend(&redis.url(), &clock)).await;
    // Both instances have loaded the library.
    let (fcall, mget, get) = (
        redis.succeeded("fcall"),
        redis.calls("mget"),
        redis.calls("get"),
    );
    overrides(h, first, second, clock).await;
    // 18 requests, none answered by a deny cache (an overridden key's
    // answers are not cached), each one FCALL reading its keys (the
    // override's with the tier's) in one MGET; no GET.
    let requests = 18;
    assert_eq!(redis.succeeded("fcall") - fcall, requests);
    assert_eq!(redis.calls("mget") - mget, requests);
    assert_eq!(redis.calls("get") - get, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200));
    let (h, addr) = app_on(b.into()).await;
    overrides(h, addr, addr, clock).await;
}

/// The admin API: add (a quota, unlimited, blocked), list, remove; each
/// change logged naming the admin API, with its time; bad input answered
/// 400 naming the field; a tier taking no overrides 404.
#[tokio::test]
async fn the_admin_api_lists_adds_and_removes_overrides() {
    let buf = LogBuf::default();
    let _log = tracing::subscriber::set_default(buf.subscriber(tracing::Level::INFO));
    let clock = ManualClock::new(T0_US);
    let layer = RateLimitLayer::builder()
        .backend(MemoryBackend::with_manual_clock(clock.clone()))
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(3)).overrides(true))
        .tier(Tier::new(
            "plain",
            ClientIp::default(),
            Quota::per_minute(100),
        ))
        .build()
        .unwrap();
    let h = layer.handle();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let addr = serve(app).await;
    let admin = serve(tiered_ratelimit::admin::router(h.clone(), "t0ken")).await;
    let post = |path: &str, body: serde_json::Value| {
        client()
            .post(format!("http://{admin}{path}"))
            .bearer_auth("t0ken")
            .json(&body)
            .send()
    };
    let set = post(
        "/api/overrides",
        serde_json::json!({"tier": "ip", "key": IP, "rule": {"limit": 10, "period": "1m"}, "ttl": "1h"}),
    )
    .await
    .unwrap();
    assert_eq!(set.status(), 200);
    let listed = serde_json::json!({"tier": "ip", "overrides": [
        {"key": IP, "rule": {"limit": 10, "period_ms": 60_000, "burst": 10},
         "expires_at_us": T0_US + 3_600_000_000u64}]});
    assert_eq!(set.json::<serde_json::Value>().await.unwrap(), listed);
    let got = client()
        .get(format!("http://{admin}/api/overrides/ip"))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap();
    assert_eq!(got.json::<serde_json::Value>().await.unwrap(), listed);
    // Applied: the ip tier shows 10 (the plain tier has 99 left).
    assert_eq!(hit(addr).await, ok(10, 9, T0_S + 6));
    let blocked = post(
        "/api/overrides",
        serde_json::json!({"tier": "ip", "key": IP, "rule": "blocked"}),
    )
    .await
    .unwrap();
    assert_eq!(blocked.status(), 200);
    assert_eq!(hit(addr).await, denied(3, 0, T0_S + 86_400, 86_400));
    let removed = post(
        "/api/overrides/remove",
        serde_json::json!({"tier": "ip", "key": IP}),
    )
    .await
    .unwrap();
    assert_eq!(
        removed.json::<serde_json::Value>().await.unwrap(),
        serde_json::json!({"tier": "ip", "key": IP, "existed": true})
    );
    let log = buf.text();
    assert!(
        log.contains("rate limiter: override set")
            && log.contains("rule=10/60000ms burst 10")
            && log.contains("by=\"admin API\"")
            && log.contains(&format!("at_us={T0_US}")),
        "{log}"
    );
    assert!(log.contains("rate limiter: override removed"), "{log}");
    // The page: the list with a remove button, and the add form.
    let form = |body: &'static str| {
        client_builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap()
            .post(format!("http://{admin}/key"))
            .bearer_auth("t0ken")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
    };
    let res = form("action=override&tier=ip&key=10.0.0.9&rule=500%2F1h&ttl=2h")
        .await
        .unwrap();
    assert_eq!(res.status(), 303);
    let page = client()
        .get(format!("http://{admin}/"))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(r#"<tr><td><code>ip</code></td><td><code>10.0.0.9</code></td><td>500/3600000ms burst 500</td><td>2023-11-15T00:13:20Z</td><td><form method="post" action="/key"><input type="hidden" name="action" value="remove_override"><input type="hidden" name="tier" value="ip"><input type="hidden" name="key" value="10.0.0.9"><button>remove</button></form></td></tr>"#)
            && page.contains(r#"<select name="tier"><option>ip</option></select>"#),
        "{page}"
    );
    let res = form("action=remove_override&tier=ip&key=10.0.0.9")
        .await
        .unwrap();
    assert_eq!(res.status(), 303);
    assert_eq!(h.overrides("ip").await.unwrap(), vec![]);
    assert_eq!(
        form("action=override&tier=ip&key=k&rule=often")
            .await
            .unwrap()
            .status(),
        400
    );
    assert!(buf.text().contains("by=\"admin page\""));
    // Bad input.
    for (body, status, code) in [
        (
            serde_json::json!({"tier": "plain", "key": IP, "rule": "blocked"}),
            404,
            "unknown_tier",
        ),
        (
            serde_json::json!({"tier": "ip", "key": "a b", "rule": "blocked"}),
            400,
            "invalid_key",
        ),
        (
            serde_json::json!({"tier": "ip", "key": IP, "rule": "maybe"}),
            400,
            "invalid_body",
        ),
        (
            serde_json::json!({"tier": "ip", "key": IP, "rule": {"limit": 0, "period": "1m"}}),
            400,
            "invalid_quota",
        ),
        (
            serde_json::json!({"tier": "ip", "key": IP, "rule": "blocked", "ttl": "soon"}),
            400,
            "invalid_body",
        ),
    ] {
        let r = post("/api/overrides", body.clone()).await.unwrap();
        assert_eq!(r.status(), status, "{body}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"], code, "{body}: {v}");
    }
}

/// A policy file's `overrides = true`: the tier takes overrides, the
/// others do not.
#[tokio::test]
async fn a_policy_tier_takes_overrides_with_overrides_true() {
    let policy = tiered_ratelimit::policy::Policy::from_toml_str(
        "[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 3\nperiod = '1m'\noverrides = true\n\n\
         [[tier]]\nname = 'all'\nkey = 'global'\nlimit = 100\nperiod = '1s'\n",
    )
    .unwrap();
    let layer = policy
        .builder(MemoryBackend::with_manual_clock(ManualClock::new(T0_US)))
        .unwrap()
        .build()
        .unwrap();
    let h = layer.handle();
    h.set_override("ip", IP, Override::Unlimited, None, "test")
        .await
        .unwrap();
    let e = h
        .set_override("all", "all", Override::Unlimited, None, "test")
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "tier \"all\": no such tier taking overrides (Tier::overrides(true))"
    );
}
