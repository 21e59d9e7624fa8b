//! The penalty box through real HTTP, on the memory backend, a real Redis
//! and a real Redis Cluster: the login brute-force recipe (failed logins
//! only, through skip_successful_requests), exact headers while blocked,
//! the backoff of a repeat offence, peek, lift and reset; on the test clock.

use crate::support::cluster::RedisCluster;
use crate::support::*;
use axum::http::{HeaderMap, StatusCode};
use axum::{routing::post, Router};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::key::ClientIp;
use tiered_ratelimit::{Penalty, Quota, RateLimitLayer, Tier};

async fn login(headers: HeaderMap) -> StatusCode {
    match headers.get("x-password").and_then(|v| v.to_str().ok()) {
        Some("right") => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

async fn attempt(addr: SocketAddr, password: &str) -> Limits {
    limits(
        &client()
            .post(format!("http://{addr}/login"))
            .header("x-password", password)
            .send()
            .await
            .unwrap(),
    )
}

fn failed(limit: u64, remaining: u64, reset: u64) -> Limits {
    Limits {
        status: 401,
        ..ok(limit, remaining, reset)
    }
}

/// The recipe: 3 failed logins a minute per IP (a token bucket, one back
/// every 20 s; successful logins refunded), and a penalty box: 2 more 429s
/// within 10 minutes block the IP for 15 minutes, a repeat offence within a
/// day for 30.
async fn login_brute_force(backend: Backend, clock: ManualClock) {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(2))
        .tier(
            Tier::new("login_ip", ClientIp::default(), Quota::per_minute(3))
                .skip_successful_requests(true)
                .penalty(
                    Penalty::new(2, Duration::from_secs(600), Duration::from_secs(900))
                        .backoff(2)
                        .max_block(Duration::from_secs(3600)),
                ),
        )
        .build()
        .unwrap();
    let h = layer.handle();
    let addr = serve(Router::new().route("/login", post(login)).layer(layer)).await;

    assert_eq!(attempt(addr, "a").await, failed(3, 2, T0_S + 20));
    assert_eq!(attempt(addr, "b").await, failed(3, 1, T0_S + 40));
    assert_eq!(attempt(addr, "c").await, failed(3, 0, T0_S + 60));
    // A 429: the first strike.
    assert_eq!(attempt(addr, "d").await, denied(3, 0, T0_S + 20, 20));
    // The second: blocked 15 minutes; the headers show the block's end.
    assert_eq!(attempt(addr, "e").await, denied(3, 0, T0_S + 900, 900));
    // While blocked every request is denied, the right password too.
    assert_eq!(attempt(addr, "right").await, denied(3, 0, T0_S + 900, 900));
    let s = h.peek("login_ip", "127.0.0.1").await.unwrap();
    assert_eq!(
        (s.allowed, s.blocked_for),
        (false, Some(Duration::from_secs(900)))
    );
    clock.advance(Duration::from_secs(899));
    assert_eq!(attempt(addr, "right").await, denied(3, 0, T0_S + 900, 1));
    clock.advance(Duration::from_secs(1));
    // Over: the block did not touch the bucket, which is full again.
    assert_eq!(attempt(addr, "right").await, ok(3, 2, T0_S + 920));
    // The successful login is refunded (on Redis in a task of its own).
    for _ in 0..5000 {
        let s = h.peek("login_ip", "127.0.0.1").await.unwrap();
        assert_eq!(s.blocked_for, None);
        if s.remaining == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // A repeat offence within the day: twice as long.
    let now = T0_S + 900;
    assert_eq!(attempt(addr, "a").await, failed(3, 2, now + 20));
    assert_eq!(attempt(addr, "b").await, failed(3, 1, now + 40));
    assert_eq!(attempt(addr, "c").await, failed(3, 0, now + 60));
    assert_eq!(attempt(addr, "d").await, denied(3, 0, now + 20, 20));
    assert_eq!(attempt(addr, "e").await, denied(3, 0, now + 1800, 1800));
    // Lifted (the operator): the bucket is still empty, so a 429 of the
    // bucket, and a first strike again.
    assert!(h.lift("login_ip", "127.0.0.1").await.unwrap());
    assert_eq!(attempt(addr, "f").await, denied(3, 0, now + 20, 20));
    // Reset: everything starts fresh.
    assert!(h.reset("login_ip", "127.0.0.1").await.unwrap());
    assert_eq!(attempt(addr, "g").await, failed(3, 2, now + 20));
    assert!(!h.lift("login_ip", "127.0.0.1").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_brute_force_in_memory() {
    let clock = ManualClock::new(T0_US);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    login_brute_force(b.into(), clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_brute_force_on_redis() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200));
    login_brute_force(b.into(), clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_brute_force_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200));
    login_brute_force(b.into(), clock).await;
}

/// `memory` counts from the END of the previous block: with a block as
/// long as `memory` (10 minutes), an offence one second after the block
/// ends is a repeat, blocked twice as long. (Counted from the block's
/// start, as before, such a block never escalated.)
async fn memory_counts_from_the_block_end(backend: Backend, clock: ManualClock) {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(2))
        .tier(
            Tier::new("login_ip", ClientIp::default(), Quota::per_minute(1)).penalty(
                Penalty::new(1, Duration::from_secs(60), Duration::from_secs(600))
                    .memory(Duration::from_secs(600))
                    .max_block(Duration::from_secs(3600)),
            ),
        )
        .build()
        .unwrap();
    let addr = serve(Router::new().route("/login", post(login)).layer(layer)).await;
    assert_eq!(attempt(addr, "a").await, failed(1, 0, T0_S + 60));
    // The first offence: 10 minutes.
    assert_eq!(attempt(addr, "b").await, denied(1, 0, T0_S + 600, 600));
    // One second after the block's end (601 s after its start).
    clock.advance(Duration::from_secs(601));
    let now = T0_S + 601;
    assert_eq!(attempt(addr, "c").await, failed(1, 0, now + 60));
    // A repeat offence: 20 minutes.
    assert_eq!(attempt(addr, "d").await, denied(1, 0, now + 1200, 1200));
    // `memory` after that block's end: forgotten, 10 minutes again.
    clock.advance(Duration::from_secs(1200 + 600));
    let now = now + 1800;
    assert_eq!(attempt(addr, "e").await, failed(1, 0, now + 60));
    assert_eq!(attempt(addr, "f").await, denied(1, 0, now + 600, 600));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_counts_from_the_block_end_in_memory() {
    let clock = ManualClock::new(T0_US);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    memory_counts_from_the_block_end(b.into(), clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_counts_from_the_block_end_on_redis() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200));
    memory_counts_from_the_block_end(b.into(), clock).await;
}

/// One response, whole: status, headers (but `date`) sorted, body.
async fn answer(addr: SocketAddr, password: &str) -> (u16, Vec<(String, String)>, String) {
    let res = client()
        .post(format!("http://{addr}/login"))
        .header("x-password", password)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let mut headers: Vec<(String, String)> = res
        .headers()
        .iter()
        .filter(|(n, _)| *n != "date")
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
        .collect();
    headers.sort();
    (status, headers, res.text().await.unwrap())
}

/// A block answered by Redis and the same block answered a moment later
/// (at the same instant) by the deny cache are one answer, byte for byte:
/// `X-RateLimit-Limit` is the tier's (3), not the box's `violations` (2),
/// and the problem body lists the tier once. Both header families, so
/// every field is compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_from_the_deny_cache_is_the_backends_answer() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200));
    let layer =
        RateLimitLayer::builder()
            .backend(b)
            .backend_timeout(Duration::from_secs(2))
            .headers(tiered_ratelimit::response::HeaderStyle::Both)
            .on_rejection(tiered_ratelimit::response::ProblemRejection)
            .tier(
                Tier::new("login_ip", ClientIp::default(), Quota::per_minute(3)).penalty(
                    Penalty::new(2, Duration::from_secs(600), Duration::from_secs(900)),
                ),
            )
            .build()
            .unwrap();
    let h = layer.handle();
    let addr = serve(Router::new().route("/login", post(login)).layer(layer)).await;
    for _ in 0..3 {
        assert_eq!(answer(addr, "a").await.0, 401);
    }
    // The first strike, then the second: the block, both from Redis. A
    // strike is the tier's 429 (`quota-exceeded`); the block is the box's
    // (`abnormal-usage-detected`, draft-11 §5.3).
    let (status, _, body) = answer(addr, "b").await;
    assert_eq!(status, 429);
    assert_eq!(
        body,
        r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"Retry in 20 seconds.","violated-policies":["login_ip"],"retry_after":20}"#
    );
    let calls = redis.script_calls();
    let from_redis = answer(addr, "c").await;
    assert_eq!(redis.script_calls(), calls + 1);
    assert_eq!(h.counts().cache_blocked, 0);
    // The same instant, from the deny cache: no script call.
    let from_cache = answer(addr, "right").await;
    assert_eq!(redis.script_calls(), calls + 1);
    assert_eq!(h.counts().cache_blocked, 1);
    assert_eq!(from_cache, from_redis);
    let (status, headers, body) = from_cache;
    assert_eq!(status, 429);
    assert_eq!(
        body,
        r#"{"type":"https://iana.org/assignments/http-problem-types#abnormal-usage-detected","title":"Request not satisfied due to detection of abnormal request pattern","status":429,"detail":"Blocked after repeated rate-limited requests. Retry in 900 seconds.","violated-policies":["login_ip"],"retry_after":900}"#
    );
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(header("x-ratelimit-limit"), Some("3"));
    assert_eq!(header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        header("x-ratelimit-reset"),
        Some(&*(T0_S + 900).to_string())
    );
    assert_eq!(header("retry-after"), Some("900"));
    assert_eq!(header("ratelimit"), Some(r#""login_ip";r=0;t=900"#));
}
