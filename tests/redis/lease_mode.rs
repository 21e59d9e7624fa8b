//! Lease mode (`sync = "lease"`, issue 19) against real Redis: app instances
//! (separate layers and backends in one process, each its own HTTP server)
//! share one `redis-server`; the test clock is frozen (a ManualClock the
//! scripts accept), so no bucket refills and no lease expires during a run,
//! and every count below is exact.
//!
//! Accounting used throughout: every token the shared bucket let out was
//! either admitted by a request or is still held in some instance's lease
//! (or lost with a "crashed" one). After the leases are returned, the
//! shared bucket holds exactly `quota - admitted - lost`; the false
//! denials of a run over the quota are the tokens that were held at its
//! end, bounded by `instances × max`.

use crate::support::cluster::RedisCluster;
use crate::support::*;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::key::{Global, User};
use tiered_ratelimit::policy::Policy;
use tiered_ratelimit::token_lease::TokenLease;
use tiered_ratelimit::{Algorithm, ConfigError, Quota, RateLimitHandle, RateLimitLayer, Tier};

const QUOTA: u64 = 100;
const MAX_LEASE: u64 = 5;
const INSTANCES: usize = 4;

fn leased_layer(backend: Backend, prefix: &str, tier: Tier) -> RateLimitLayer {
    RateLimitLayer::builder()
        .backend(backend)
        .key_prefix(prefix)
        // Generous: on a loaded machine a check past the default 100 ms
        // fails open and is not counted, and these tests count exactly.
        .backend_timeout(Duration::from_secs(5))
        .tier(tier)
        .build()
        .unwrap()
}

fn global(quota: Quota, lease: TokenLease) -> Tier {
    Tier::new("global", Global, quota).lease(lease)
}

/// Tokens the key's shared bucket holds now (peek answers what the next
/// request would leave).
async fn available(handle: &RateLimitHandle, tier: &str, key: &str) -> u64 {
    let s = handle.peek(tier, key).await.unwrap();
    if s.allowed {
        s.remaining + 1
    } else {
        s.remaining
    }
}

/// Sends `n` concurrent GETs to `addr`; answers how many got 200 (the
/// others must be 429).
async fn burst(client: &reqwest::Client, addrs: &[std::net::SocketAddr], per: usize) -> u64 {
    let mut all = Vec::new();
    for addr in addrs {
        for _ in 0..per {
            let c = client.clone();
            let url = format!("http://{addr}/");
            all.push(tokio::spawn(async move {
                c.get(url).send().await.unwrap().status().as_u16()
            }));
        }
    }
    let mut ok = 0;
    for h in all {
        match h.await.unwrap() {
            200 => ok += 1,
            429 => {}
            s => panic!("unexpected status {s}"),
        }
    }
    ok
}

/// Waits (10 s at most) until `cond` holds: for a state the test caused
/// (a background lease landing), never for time to pass.
async fn until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..10_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("timed out waiting for {what}");
}

struct Fleet {
    handles: Vec<RateLimitHandle>,
    addrs: Vec<std::net::SocketAddr>,
}

async fn fleet(backends: Vec<Backend>, prefix: &str, quota: Quota) -> Fleet {
    let mut handles = Vec::new();
    let mut addrs = Vec::new();
    for b in backends {
        let layer = leased_layer(b, prefix, global(quota, TokenLease::new().max(MAX_LEASE)));
        handles.push(layer.handle());
        addrs.push(serve(app(layer)).await);
    }
    Fleet { handles, addrs }
}

fn redis_backends(redis: &RedisServer, clock: &ManualClock) -> Vec<Backend> {
    (0..INSTANCES)
        .map(|_| redis.backend_on(clock).into())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_instances_never_admit_over_the_quota_in_20_runs() {
    let redis = RedisServer::start();
    let mut worst = 0;
    for run in 0..20 {
        // A client per run: its connections close with it (400 a run).
        let client = client();
        let clock = ManualClock::new(T0_US);
        let prefix = format!("lease{run}");
        let f = fleet(
            redis_backends(&redis, &clock),
            &prefix,
            Quota::per_hour(QUOTA),
        )
        .await;
        // 400 concurrent requests, 100 per instance, against a quota of 100.
        let admitted = burst(&client, &f.addrs, 100).await;
        assert!(admitted <= QUOTA, "run {run}: {admitted} admitted");
        let mut held = 0;
        for h in &f.handles {
            held += h.return_leases().await;
        }
        // Every token that left the shared bucket was admitted or held.
        let left = available(&f.handles[0], "global", "all").await;
        assert_eq!(left, QUOTA - admitted, "run {run}");
        assert_eq!(held, QUOTA - admitted, "run {run}");
        // The false denials (a request denied while a lease held a token)
        // are within the documented bound.
        assert!(held <= INSTANCES as u64 * MAX_LEASE, "run {run}: {held}");
        worst = worst.max(held);
        let counts: u64 = f.handles.iter().map(|h| h.lease_counts().local).sum();
        let taken: u64 = f.handles.iter().map(|h| h.lease_counts().taken).sum();
        assert_eq!(taken - held, counts, "run {run}: leased tokens spent");
    }
    eprintln!("worst false denials over 20 runs: {worst}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_instance_loses_its_lease_and_nothing_is_spent_twice() {
    let redis = RedisServer::start();
    for run in 0..20 {
        // A client per run: its connections close with it (400 a run).
        let client = client();
        let clock = ManualClock::new(T0_US);
        let prefix = format!("kill{run}");
        let f = fleet(
            redis_backends(&redis, &clock),
            &prefix,
            Quota::per_hour(QUOTA),
        )
        .await;
        let first = burst(&client, &f.addrs, 25).await;
        // Instance 0 "crashes": its tokens are never returned, and it gets
        // no more requests.
        let mut lost = f.handles[0].abandon_leases();
        let second = burst(&client, &f.addrs[1..], 100).await;
        // A lease that was in flight when it crashed is lost too.
        lost += f.handles[0].abandon_leases();
        let admitted = first + second;
        assert!(admitted <= QUOTA, "run {run}: {admitted}");
        assert!(lost <= MAX_LEASE, "run {run}: lost {lost}");
        let mut held = 0;
        for h in &f.handles[1..] {
            held += h.return_leases().await;
        }
        let left = available(&f.handles[1], "global", "all").await;
        assert_eq!(left + lost, QUOTA - admitted, "run {run}");
        assert_eq!(held, left, "run {run}");
    }
}

/// One instance, `global` leased (a lease of exactly 20 after five
/// anonymous requests), `user` checked per request.
async fn one_instance(
    redis: &RedisServer,
    clock: &ManualClock,
    prefix: &str,
) -> (RateLimitHandle, String) {
    let layer = redis_layer(redis, clock)
        .backend_timeout(Duration::from_secs(5))
        .key_prefix(prefix)
        // So that the denial below reaches Redis (and the local step).
        .deny_cache(0)
        .tier(global(
            Quota::per_hour(QUOTA),
            TokenLease::new().min(20).max(20),
        ))
        .tier(Tier::new("user", User, Quota::per_hour(2)))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    // Demand of 5 in no time = 20 per interval: the fifth request asks for
    // a lease of 20 (min 20, max 20), in the background.
    for _ in 0..5 {
        let r = c.get(format!("http://{addr}/")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    until("the lease", || !handle.leases().is_empty()).await;
    assert_eq!(handle.leases()[0].tokens, 20);
    assert_eq!(handle.leases()[0].key, format!("{prefix}:global:all"));
    assert_eq!(available(&handle, "global", "all").await, QUOTA - 5 - 20);
    (handle, format!("http://{addr}/"))
}

#[tokio::test]
async fn all_or_nothing_a_per_request_tier_that_denies_spends_no_leased_token() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (handle, url) = one_instance(&redis, &clock, "one1").await;
    let c = client();
    let calls = redis.script_calls();
    for remaining in ["1", "0"] {
        let r = c
            .get(&url)
            .header("authorization", "Bearer bob")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // The tier with least remaining: user.
        assert_eq!(r.headers()["x-ratelimit-remaining"], remaining);
    }
    assert_eq!(handle.leases()[0].tokens, 18);
    let r = c
        .get(&url)
        .header("authorization", "Bearer bob")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    // 2 per hour: the next token in 30 minutes.
    assert_eq!(r.headers()["retry-after"], "1800");
    // The user tier denied: the global token it took locally is back.
    assert_eq!(handle.leases()[0].tokens, 18);
    assert_eq!(available(&handle, "global", "all").await, QUOTA - 25);
    // One script call per request (the user tier), none for global.
    assert_eq!(redis.script_calls() - calls, 3);
    assert_eq!(handle.lease_counts().local, 2);
    assert_eq!(handle.lease_counts().calls, 1);
    assert_eq!(handle.lease_counts().taken, 20);
}

#[tokio::test]
async fn locally_decided_headers_show_the_shared_count_minus_local_spending() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (handle, url) = one_instance(&redis, &clock, "one2").await;
    let c = client();
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // 75 in the shared bucket at the lease, + 19 left of it.
    assert_eq!(r.headers()["x-ratelimit-remaining"], "94");
    assert_eq!(r.headers()["x-ratelimit-limit"], "100");
    // Full again after (100 - 94) tokens at 36 s each (legacy headers: an
    // epoch).
    assert_eq!(r.headers()["x-ratelimit-reset"], (T0_S + 216).to_string());
    assert_eq!(handle.leases()[0].tokens, 19);
}

#[tokio::test]
async fn graceful_return_puts_exactly_the_unspent_tokens_back() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (handle, url) = one_instance(&redis, &clock, "one3").await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(handle.return_leases().await, 17);
    assert!(handle.leases().is_empty());
    // 100 - 5 (per request) - 3 (from the lease) left, exactly.
    assert_eq!(available(&handle, "global", "all").await, QUOTA - 8);
    assert_eq!(handle.lease_counts().returned, 17);
}

#[tokio::test]
async fn retry_after_is_never_early_and_an_expired_lease_goes_back() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // 5 requests checked per request, then a lease of 20 (75 left shared).
    let (handle, url) = leased_algorithm(
        &redis,
        &clock,
        "retry",
        Algorithm::TokenBucket,
        Quota::per_hour(QUOTA),
    )
    .await;
    let c = client();
    // The 20 leased, then the 75 shared one request at a time: no further
    // lease (a quarter of the shared count at most, below min = 20).
    let mut admitted = 5;
    let retry = loop {
        let r = c.get(&url).send().await.unwrap();
        if r.status() == 429 {
            break r.headers()["retry-after"].to_str().unwrap().to_owned();
        }
        admitted += 1;
    };
    assert_eq!(admitted, QUOTA);
    assert_eq!(handle.lease_counts().calls, 1);
    assert_eq!(handle.lease_counts().local, 20);
    // One token back in the shared bucket: 36 s (100 per hour).
    assert_eq!(retry, "36");
    clock.advance(Duration::from_secs(36) - Duration::from_micros(1));
    assert_eq!(c.get(&url).send().await.unwrap().status(), 429);
    clock.advance(Duration::from_micros(1));
    assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn an_expired_lease_goes_back_to_the_shared_bucket() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (handle, url) = leased_algorithm(
        &redis,
        &clock,
        "expiry",
        Algorithm::TokenBucket,
        Quota::per_hour(QUOTA),
    )
    .await;
    let c = client();
    assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    assert_eq!(handle.leases()[0].tokens, 19);
    // The lease lives 2 × 100 ms; the next request finds it expired, hands
    // its 19 tokens back and is checked per request (its demand since the
    // lease, 2 in 200 ms, asks for no new lease).
    clock.advance(Duration::from_millis(200));
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(handle.leases().is_empty());
    assert_eq!(handle.return_leases().await, 0);
    assert_eq!(handle.lease_counts().returned, 19);
    // 100 - 5 - 1 (from the lease) - 1 (this one), refilled for 200 ms
    // (36 s a token: none yet).
    assert_eq!(available(&handle, "global", "all").await, 93);
}

#[tokio::test]
async fn lease_mode_is_a_no_op_on_the_memory_backend() {
    let layer = leased_layer(
        MemoryBackend::new().into(),
        "mem",
        global(Quota::per_hour(3), TokenLease::new()),
    );
    let handle = layer.handle();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    for expect in [200, 200, 200, 429] {
        assert_eq!(c.get(&url).send().await.unwrap().status(), expect);
    }
    assert!(handle.leases().is_empty());
    assert_eq!(handle.lease_counts(), Default::default());
}

#[tokio::test]
async fn build_refuses_lease_mode_where_it_cannot_run() {
    let e = RateLimitLayer::builder()
        .tier(
            Tier::new("w", Global, Quota::per_second(10))
                .algorithm(Algorithm::SlidingWindowLog)
                .lease(TokenLease::new()),
        )
        .build()
        .unwrap_err();
    assert!(matches!(e, ConfigError::LeaseUnsupported { ref tier, .. } if tier == "w"));
    assert_eq!(
        e.to_string(),
        "tier \"w\": sync: lease mode takes token_bucket, leaky_bucket (police) and fixed_window only"
    );
    let e = RateLimitLayer::builder()
        .tier(
            Tier::new("s", Global, Quota::per_second(10))
                .skip_failed_requests(true)
                .lease(TokenLease::new()),
        )
        .build()
        .unwrap_err();
    assert!(matches!(e, ConfigError::LeaseUnsupported { ref tier, .. } if tier == "s"));
}

#[test]
fn toml_sync_lease() {
    let policy = Policy::from_toml_str(
        r#"
        [[tier]]
        name = "global"
        key = "global"
        limit = 1000
        period = "1s"
        sync = "lease"
        sync_interval = "50ms"
        sync_max = 64
        "#,
    )
    .unwrap();
    assert!(RateLimitLayer::from_policy(&policy, MemoryBackend::new()).is_ok());
    let e = Policy::from_toml_str(
        r#"
        [[tier]]
        name = "global"
        key = "global"
        limit = 1000
        period = "1s"
        sync = "often"
        "#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("unknown variant `often`"), "{e}");
    let policy = Policy::from_toml_str(
        r#"
        [[tier]]
        name = "global"
        key = "global"
        limit = 1000
        period = "1s"
        sync_max = 64
        "#,
    )
    .unwrap();
    assert_eq!(
        RateLimitLayer::from_policy(&policy, MemoryBackend::new())
            .unwrap_err()
            .to_string(),
        "policy: tier \"global\": sync_max: only sync = \"lease\" uses it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_a_cluster_never_admit_over_the_quota() {
    let cluster = RedisCluster::start(0);
    for run in 0..3 {
        // A client per run: its connections close with it (400 a run).
        let client = client();
        let clock = ManualClock::new(T0_US);
        let backends = (0..2)
            .map(|_| {
                RedisBackend::cluster(cluster.urls())
                    .unwrap()
                    .with_manual_clock(clock.clone())
                    .into()
            })
            .collect();
        let f = fleet(backends, &format!("cl{run}"), Quota::per_hour(QUOTA)).await;
        let admitted = burst(&client, &f.addrs, 200).await;
        assert!(admitted <= QUOTA);
        let mut held = 0;
        for h in &f.handles {
            held += h.return_leases().await;
        }
        assert!(held <= 2 * MAX_LEASE);
        let left = available(&f.handles[0], "global", "all").await;
        assert_eq!(left, QUOTA - admitted, "run {run}");
        assert_eq!(held, left, "run {run}");
    }
}

/// One instance, `global` leased under `algorithm`: five requests checked
/// per request, then a lease of exactly 20 (min 20, max 20).
async fn leased_algorithm(
    redis: &RedisServer,
    clock: &ManualClock,
    prefix: &str,
    algorithm: Algorithm,
    quota: Quota,
) -> (RateLimitHandle, String) {
    let layer = redis_layer(redis, clock)
        .backend_timeout(Duration::from_secs(5))
        .key_prefix(prefix)
        .deny_cache(0)
        .tier(
            Tier::new("global", Global, quota)
                .algorithm(algorithm)
                .lease(TokenLease::new().min(20).max(20)),
        )
        .build()
        .unwrap();
    let handle = layer.handle();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    for _ in 0..5 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    until("the lease", || !handle.leases().is_empty()).await;
    assert_eq!(handle.leases()[0].tokens, 20);
    (handle, url)
}

#[tokio::test]
async fn a_fixed_window_lease_is_never_spent_in_the_next_window() {
    let redis = RedisServer::start();
    // T0 is 20 s into a minute: at T0 + 30 s the window ends in 10 s.
    let clock = ManualClock::new(T0_US + 30_000_000);
    let (handle, url) = leased_algorithm(
        &redis,
        &clock,
        "fw",
        Algorithm::FixedWindow,
        Quota::per_minute(100),
    )
    .await;
    let c = client();
    assert_eq!(available(&handle, "global", "all").await, 75);
    for _ in 0..3 {
        let r = c.get(&url).send().await.unwrap();
        assert_eq!(r.status(), 200);
        // A window's reset: its end, exact.
        assert_eq!(r.headers()["x-ratelimit-reset"], (T0_S + 40).to_string());
    }
    assert_eq!(handle.leases()[0].tokens, 17);
    // The lease lives 200 ms; move past it but stay in the window: the 17
    // go back to this window's count.
    clock.advance(Duration::from_millis(200));
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // (Its demand, 4 in 200 ms, is below the lease minimum: no new lease.)
    // The graceful return waits for the expiry's return in flight.
    assert_eq!(handle.return_leases().await, 0);
    assert_eq!(handle.lease_counts().returned, 17);
    // 5 + 3 + this one counted: 91 left in this window.
    assert_eq!(available(&handle, "global", "all").await, 91);
    // The next window: whatever a lease held of the last one is worthless;
    // the new window starts full.
    clock.set(T0_US + 40_000_000);
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ratelimit-remaining"], "99");
}

#[tokio::test]
async fn a_policing_leaky_bucket_leases_and_returns_exactly() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (handle, url) = leased_algorithm(
        &redis,
        &clock,
        "lb",
        Algorithm::LeakyBucket(tiered_ratelimit::LeakyBucket::Police),
        Quota::per_hour(100),
    )
    .await;
    let c = client();
    assert_eq!(available(&handle, "global", "all").await, 75);
    for _ in 0..4 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(handle.return_leases().await, 16);
    assert_eq!(available(&handle, "global", "all").await, 91);
}

#[tokio::test]
async fn shadow_checks_are_never_leased_and_the_kill_switch_passes_everything() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = redis_layer(&redis, &clock)
        .backend_timeout(Duration::from_secs(5))
        .key_prefix("shadow")
        .tier(
            Tier::new("global", Global, Quota::per_hour(3))
                .mode(tiered_ratelimit::rollout::Mode::Shadow)
                .lease(TokenLease::new().min(1)),
        )
        .build()
        .unwrap();
    let handle = layer.handle();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    // (The first call loads the Functions library.)
    assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    let calls = redis.script_calls();
    // Shadow: over the quota and still passing, every request checked per
    // request (the shadow denial is counted), nothing leased.
    for _ in 0..9 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(redis.script_calls() - calls, 9);
    assert_eq!(handle.lease_counts(), Default::default());
    // The kill switch: no check at all.
    handle.set_mode(tiered_ratelimit::rollout::Mode::Off);
    for _ in 0..5 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(redis.script_calls() - calls, 9);
    assert!(handle.leases().is_empty());
}

#[tokio::test]
async fn a_per_key_tier_leases_only_keys_busy_enough_to_pay_for_it() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = redis_layer(&redis, &clock)
        .backend_timeout(Duration::from_secs(5))
        .key_prefix("perkey")
        .deny_cache(0)
        .tier(Tier::new("user", User, Quota::per_hour(1_000)).lease(TokenLease::new()))
        .build()
        .unwrap();
    let handle = layer.handle();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    let get = |user: &'static str| {
        c.get(&url)
            .header("authorization", format!("Bearer {user}"))
            .send()
    };
    // A few requests a minute: below 2 per 100 ms interval, never leased;
    // one script call per request.
    for _ in 0..10 {
        assert_eq!(get("quiet").await.unwrap().status(), 200);
        clock.advance(Duration::from_secs(20));
    }
    assert_eq!(handle.lease_counts().calls, 0);
    // A busy key (its requests in no time on the test clock) is leased.
    for _ in 0..3 {
        assert_eq!(get("busy").await.unwrap().status(), 200);
    }
    until("the busy key's lease", || !handle.leases().is_empty()).await;
    let leases = handle.leases();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].key, "perkey:user:busy");
    assert_eq!(handle.lease_counts().calls, 1);
}
