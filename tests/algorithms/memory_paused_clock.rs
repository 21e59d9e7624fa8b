//! The memory backend on tokio's paused clock (its default, monotonic clock),
//! driven through the layer with `tower::ServiceExt::oneshot`.

use axum::{body::Body, routing::get, Router};
use http::Request;
use std::time::Duration;
use tiered_ratelimit::{backend::MemoryBackend, key::Global, Quota, RateLimitLayer, Tier};
use tower::ServiceExt;

fn header(res: &http::Response<Body>, name: &str) -> Option<u64> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

#[tokio::test(start_paused = true)]
async fn refills_exactly_on_the_paused_clock() {
    let store = MemoryBackend::new();
    let layer = RateLimitLayer::builder()
        .backend(store.clone())
        .tier(Tier::new(
            "global",
            Global,
            Quota::new(2, Duration::from_secs(10)),
        ))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let call = || {
        app.clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
    };
    let epoch_s = store.now_us() / 1_000_000;

    let r = call().await.unwrap();
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-ratelimit-remaining")),
        (200, Some(1))
    );
    let r = call().await.unwrap();
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-ratelimit-remaining")),
        (200, Some(0))
    );
    let r = call().await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(header(&r, "retry-after"), Some(5));

    tokio::time::advance(Duration::from_millis(4999)).await;
    let r = call().await.unwrap();
    assert_eq!(header(&r, "retry-after"), Some(1));
    tokio::time::advance(Duration::from_millis(1)).await;
    let r = call().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some(0));
    // The epoch anchor moves with the paused clock.
    assert_eq!(store.now_us() / 1_000_000, epoch_s + 5);
    assert_eq!(store.len(), 1);

    // Idle for a full period: the bucket's entry expires and is forgotten.
    tokio::time::advance(Duration::from_secs(10)).await;
    let r = call().await.unwrap();
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some(1));
}

#[tokio::test(start_paused = true)]
async fn concurrent_requests_admit_exactly_the_burst() {
    let layer = RateLimitLayer::builder()
        .tier(Tier::new("global", Global, Quota::per_hour(37)))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let mut handles = Vec::new();
    for _ in 0..200 {
        let app = app.clone();
        handles.push(tokio::spawn(async move {
            app.oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    let mut ok = 0;
    for h in handles {
        if h.await.unwrap() == 200 {
            ok += 1;
        }
    }
    assert_eq!(ok, 37);
}
