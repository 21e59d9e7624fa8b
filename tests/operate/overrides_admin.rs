//! Per-key overrides through the admin API and page (memory backend, test
//! clock). A test binary of its own: it asserts log lines, and a `tracing`
//! subscriber set for one test misses events while other tests of the same
//! process run on other threads.

use crate::support::*;
use axum::{routing::get, Router};
use std::net::SocketAddr;
use tiered_ratelimit::backend::{ManualClock, MemoryBackend};
use tiered_ratelimit::key::ClientIp;
use tiered_ratelimit::{Quota, RateLimitLayer, Tier};

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
        page.contains(r#"<tr><td><code>ip</code></td><td><code class="key" title="10.0.0.9">10.0.0.9</code></td><td>500/3600000ms burst 500</td><td>2023-11-15T00:13:20Z</td><td><form method="post" action="/key"><input type="hidden" name="action" value="remove_override"><input type="hidden" name="tier" value="ip"><input type="hidden" name="key" value="10.0.0.9"><button>remove</button></form></td></tr>"#)
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
            serde_json::json!({"tier": "ip", "key": "", "rule": "blocked"}),
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
