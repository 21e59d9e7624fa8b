//! Per-key overrides through real HTTP, on the memory backend, a real Redis
//! and a real Redis Cluster, on the test clock: another quota shows its own
//! limit and remaining, unlimited passes without charging, blocked denies
//! with the time left as Retry-After, an expiry ends an override; on Redis
//! a second app instance applies an override set through the first one's
//! handle on its next request, with no extra Redis command per request.

use crate::support::cluster::RedisCluster;
use crate::support::*;
use axum::{routing::get, Router};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::handle::{Override, OverrideEntry};
use tiered_ratelimit::key::ClientIp;
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
    // for 5 minutes. The bucket's used capacity carries over (1 token of
    // 3, now 1 of 60), as after any quota change.
    let q = Override::Quota(Quota::per_minute(60));
    h.set_override("ip", IP, q, Some(Duration::from_secs(300)), "ops")
        .await
        .unwrap();
    assert_eq!(
        h.overrides("ip").await.unwrap(),
        vec![OverrideEntry::new(IP, q, Some(T0_US + 300_000_000))]
    );
    assert_eq!(hit(other).await, ok(60, 58, T0_S + 2));
    assert_eq!(hit(other).await, ok(60, 57, T0_S + 3));
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

/// Redis on the manual clock: what a quota change does there is what the
/// memory backend does (the time until full carries over, docs/redis.md).
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

/// Memory = Redis = a cluster: the same seeded sequence of override
/// changes (quotas of each algorithm's kind, unlimited, blocked, with and
/// without expiry, removals), requests and clock steps gets the same
/// answers, header for header, from the three backends (the Rust check
/// and the Lua twin of the override step).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_redis_and_a_cluster_agree_on_random_override_sequences() {
    use tiered_ratelimit::Algorithm;
    let redis = RedisServer::start();
    let cluster = RedisCluster::start(0);
    for (seed, algorithm) in [
        (1, Algorithm::TokenBucket),
        (2, Algorithm::FixedWindow),
        (3, Algorithm::SlidingWindowCounter),
        (4, Algorithm::SlidingWindowLog),
    ] {
        let clock = ManualClock::new(T0_US);
        let prefix = format!("p{seed}");
        let build = |b: Backend| {
            let layer = RateLimitLayer::builder()
                .backend(b)
                .key_prefix(prefix.clone())
                .backend_timeout(Duration::from_secs(2))
                .tier(
                    Tier::new("ip", ClientIp::default(), Quota::per_minute(4))
                        .algorithm(algorithm)
                        .overrides(true),
                )
                .build()
                .unwrap();
            let h = layer.handle();
            let app = Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(layer);
            (h, app)
        };
        let mut apps = Vec::new();
        for b in [
            MemoryBackend::with_manual_clock(clock.clone()).into(),
            redis_backend(&redis.url(), &clock),
            RedisBackend::cluster(cluster.urls())
                .unwrap()
                .with_manual_clock(clock.clone())
                .with_test_ttl_slack(Duration::from_secs(7200))
                .into(),
        ] {
            let (h, app) = build(b);
            apps.push((h, serve(app).await));
        }
        let mut rng = crate::support::rng::Rng::new(seed);
        for step in 0..120 {
            let op = rng.below(10);
            let ttl = [None, Some(Duration::from_secs(1 + rng.below(90)))][rng.index(2)];
            let rule = match rng.below(4) {
                0 => Override::Unlimited,
                1 => Override::Blocked,
                _ => Override::Quota(Quota::per_minute(1 + rng.below(8))),
            };
            let advance = Duration::from_millis(rng.below(20_000));
            let mut answers = Vec::new();
            for (h, addr) in &apps {
                let answer = match op {
                    0 => {
                        h.set_override("ip", IP, rule, ttl, "test").await.unwrap();
                        None
                    }
                    1 => Some(Limits {
                        status: u16::from(h.remove_override("ip", IP, "test").await.unwrap()),
                        ..NO_LIMITS
                    }),
                    _ => Some(hit(*addr).await),
                };
                answers.push(answer);
            }
            assert_eq!(
                answers[0], answers[1],
                "seed {seed} step {step}: memory vs Redis"
            );
            assert_eq!(
                answers[0], answers[2],
                "seed {seed} step {step}: memory vs cluster"
            );
            if op == 9 {
                clock.advance(advance);
            }
        }
    }
}

/// Removing an override, or its expiry, never hands the key a fresh
/// bucket: its used capacity carries over to the tier's quota, as any
/// quota change does (the one token of 1 an hour is one of 3 a minute);
/// and `peek` answers what the next request would see: under an override,
/// the override's numbers.
async fn removal_keeps_state_and_peek_shows_the_override(backend: Backend, clock: ManualClock) {
    let (h, addr) = app_on(backend).await;
    let hour = Override::Quota(Quota::per_hour(1));
    h.set_override("ip", IP, hour, None, "ops").await.unwrap();
    assert_eq!(hit(addr).await, ok(1, 0, T0_S + 3600));
    assert_eq!(hit(addr).await, denied(1, 0, T0_S + 3600, 3600));
    let s = h.peek("ip", IP).await.unwrap();
    assert_eq!(
        (s.allowed, s.limit, s.remaining, s.retry_after),
        (false, 1, 0, Duration::from_secs(3600))
    );
    // Removed: the tier's 3 a minute with that token used: 2 left, 1
    // after the next request (full 40 s later), not a fresh bucket.
    assert!(h.remove_override("ip", IP, "ops").await.unwrap());
    let s = h.peek("ip", IP).await.unwrap();
    assert_eq!(
        (s.allowed, s.limit, s.remaining, s.retry_after),
        (true, 3, 1, Duration::ZERO)
    );
    assert_eq!(hit(addr).await, ok(3, 1, T0_S + 40));
    // An override that expires: the same. Full again an hour later; then
    // 1 an hour for a minute, spent and denied.
    clock.advance(Duration::from_secs(3600));
    let now = T0_S + 3600;
    h.set_override("ip", IP, hour, Some(Duration::from_secs(60)), "ops")
        .await
        .unwrap();
    assert_eq!(hit(addr).await, ok(1, 0, now + 3600));
    assert_eq!(hit(addr).await, denied(1, 0, now + 3600, 3600));
    clock.advance(Duration::from_secs(60));
    let now = now + 60;
    // Expired with 59 of its 60 minutes to go: 59/60 of a token used,
    // ceil(3.54 × 10^9 × 2 × 10^7 / 3.6 × 10^9) = 19 666 667 units of the
    // tier's 2 × 10^7 a token: 1 left after the next request, full in
    // 39.67 s.
    let s = h.peek("ip", IP).await.unwrap();
    assert_eq!(
        (s.allowed, s.limit, s.remaining, s.retry_after),
        (true, 3, 1, Duration::ZERO)
    );
    assert_eq!(hit(addr).await, ok(3, 1, now + 40));
    // Blocked and unlimited, peeked: what the next request would get.
    h.set_override(
        "ip",
        IP,
        Override::Blocked,
        Some(Duration::from_secs(120)),
        "ops",
    )
    .await
    .unwrap();
    let s = h.peek("ip", IP).await.unwrap();
    assert_eq!(
        (s.allowed, s.limit, s.remaining, s.retry_after),
        (false, 3, 0, Duration::from_secs(120))
    );
    assert_eq!(hit(addr).await, denied(3, 0, now + 120, 120));
    h.set_override("ip", IP, Override::Unlimited, None, "ops")
        .await
        .unwrap();
    let s = h.peek("ip", IP).await.unwrap();
    assert_eq!((s.allowed, s.limit, s.remaining), (true, 3, 3));
    assert_eq!(hit(addr).await, ok(3, 3, now));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_keeps_state_in_memory() {
    let clock = ManualClock::new(T0_US);
    let b = MemoryBackend::with_manual_clock(clock.clone()).into();
    removal_keeps_state_and_peek_shows_the_override(b, clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_keeps_state_on_redis() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // The compact format, as the other Redis tests of this file (the
    // legacy strings start a bucket of another unit full: docs/redis.md).
    let b = redis_backend(&redis.url(), &clock);
    removal_keeps_state_and_peek_shows_the_override(b, clock).await;
}
