//! Refunds by response status (`skip_failed_requests`,
//! `skip_successful_requests`) through real HTTP on both backends, and the
//! Rust refund twins (`Limit::refund`, used by the memory backend) against
//! `lua/refund.lua` on Redis for random sequences.

use crate::support::algorithms::{algorithm_limits_without, clock_step};
use crate::support::*;
use axum::{http::HeaderMap, http::StatusCode, routing::post, Router};
use proptest::prelude::*;
use std::time::{Duration, Instant};
use tiered_ratelimit::algorithm::Limit;
use tiered_ratelimit::backend::{Backend, ManualClock, TierCheck, TierRefund};
use tiered_ratelimit::{
    key::{ClientIp, Global},
    Quota, RateLimitLayer, Tier,
};

both_backends!(
    successful_logins_never_consume,
    failed_requests_never_consume,
    a_failure_is_refunded_between_successes,
    only_the_tier_with_the_option_is_refunded,
    a_failure_under_an_override_is_refunded_on_its_quota,
);

/// A login endpoint: 401 with `x-fail: 1`, 200 otherwise.
fn login_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/login",
            post(|h: HeaderMap| async move {
                if h.get("x-fail").is_some_and(|v| v == "1") {
                    (StatusCode::UNAUTHORIZED, "no")
                } else {
                    (StatusCode::OK, "welcome")
                }
            }),
        )
        .layer(layer)
}

/// `POST /login` on `addr`, a failed login (401) when `fail`.
async fn login(c: &reqwest::Client, addr: std::net::SocketAddr, fail: bool) -> reqwest::Response {
    let r = c.post(format!("http://{addr}/login"));
    let r = if fail { r.header("x-fail", "1") } else { r };
    r.send().await.expect("the login request")
}

/// The stored keys: Redis keys and values, or the memory store's size.
fn stored(env: &Env) -> Vec<(String, Option<String>)> {
    match (&env.redis, &env.backend) {
        (Some(r), _) => r
            .keys()
            .into_iter()
            .map(|k| {
                let v = r.get(&k);
                (k, v)
            })
            .collect(),
        (None, Backend::Memory(m)) => vec![(format!("memory keys: {}", m.len()), None)],
        _ => unreachable!(),
    }
}

/// Waits (at most 2 s) until the store is `want`: a refund on Redis runs in
/// a task of its own after the response.
async fn settle(env: &Env, want: &[(String, Option<String>)]) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let got = stored(env);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "store never became {want:?}; is {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn empty(env: &Env) -> Vec<(String, Option<String>)> {
    match env.redis {
        Some(_) => Vec::new(),
        None => vec![("memory keys: 0".to_owned(), None)],
    }
}

fn with_status(status: u16, l: Limits) -> Limits {
    Limits { status, ..l }
}

async fn successful_logins_never_consume(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("login", Global, Quota::per_minute(3)).skip_successful_requests(true))
        .build()
        .unwrap();
    let addr = serve(login_app(layer)).await;
    let c = client();
    for _ in 0..10 {
        // The headers describe the state before the refund.
        assert_eq!(limits(&login(&c, addr, false).await), ok(3, 2, T0_S + 20));
        // Refunded: a full bucket is no key.
        settle(&env, &empty(&env)).await;
    }
    assert_eq!(
        limits(&login(&c, addr, true).await),
        with_status(401, ok(3, 2, T0_S + 20))
    );
    assert_eq!(
        limits(&login(&c, addr, true).await),
        with_status(401, ok(3, 1, T0_S + 40))
    );
    assert_eq!(
        limits(&login(&c, addr, true).await),
        with_status(401, ok(3, 0, T0_S + 60))
    );
    assert_eq!(
        limits(&login(&c, addr, false).await),
        denied(3, 0, T0_S + 20, 20)
    );
    assert_eq!(
        limits(&login(&c, addr, true).await),
        denied(3, 0, T0_S + 20, 20)
    );
}

async fn failed_requests_never_consume(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("login", Global, Quota::per_minute(3)).skip_failed_requests(true))
        .build()
        .unwrap();
    let addr = serve(login_app(layer)).await;
    let c = client();
    for _ in 0..10 {
        assert_eq!(
            limits(&login(&c, addr, true).await),
            with_status(401, ok(3, 2, T0_S + 20))
        );
        settle(&env, &empty(&env)).await;
    }
    assert_eq!(limits(&login(&c, addr, false).await), ok(3, 2, T0_S + 20));
    assert_eq!(limits(&login(&c, addr, false).await), ok(3, 1, T0_S + 40));
    assert_eq!(limits(&login(&c, addr, false).await), ok(3, 0, T0_S + 60));
    assert_eq!(
        limits(&login(&c, addr, true).await),
        denied(3, 0, T0_S + 20, 20)
    );
}

async fn a_failure_is_refunded_between_successes(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("login", Global, Quota::per_minute(3)).skip_failed_requests(true))
        .build()
        .unwrap();
    let addr = serve(login_app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/login");
    assert_eq!(
        limits(&c.post(&url).send().await.unwrap()),
        ok(3, 2, T0_S + 20)
    );
    assert_eq!(
        limits(&c.post(&url).send().await.unwrap()),
        ok(3, 1, T0_S + 40)
    );
    let before = stored(&env);
    // Charged (the headers show it), then given back whole.
    assert_eq!(
        limits(&c.post(&url).header("x-fail", "1").send().await.unwrap()),
        with_status(401, ok(3, 0, T0_S + 60))
    );
    settle(&env, &before).await;
    // The last token is still there for a success.
    assert_eq!(
        limits(&c.post(&url).send().await.unwrap()),
        ok(3, 0, T0_S + 60)
    );
    assert_eq!(
        limits(&c.post(&url).send().await.unwrap()),
        denied(3, 0, T0_S + 20, 20)
    );
}

async fn only_the_tier_with_the_option_is_refunded(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("login", Global, Quota::per_minute(3)).skip_failed_requests(true))
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(5)))
        .build()
        .unwrap();
    let addr = serve(login_app(layer)).await;
    let c = client();
    let fail = || {
        c.post(format!("http://{addr}/login"))
            .header("x-fail", "1")
            .send()
    };
    for i in 0..5u64 {
        let l = limits(&fail().await.unwrap());
        assert_eq!(l.status, 401);
        assert_eq!(l.remaining, Some(2.min(4 - i)), "request {i}");
        // The login tier is back to no key; the ip tier keeps its charge.
        let want = match &env.redis {
            Some(_) => vec![("rl:ip:127.0.0.1".to_owned(), None)],
            None => vec![("memory keys: 1".to_owned(), None)],
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let got: Vec<_> = stored(&env)
                .into_iter()
                .map(|(k, v)| (k, if env.redis.is_some() { None } else { v }))
                .collect();
            if got == want {
                break;
            }
            assert!(Instant::now() < deadline, "{got:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // The ip tier (never refunded) denies the 6th.
    assert_eq!(fail().await.unwrap().status(), 429);
}

// ---------------------------------------------------------------------------
// The Rust refund twins against lua/refund.lua.

/// The shared algorithm table without `fixed_odd`: six limits.
fn twin_limits() -> Vec<Limit> {
    algorithm_limits_without("fixed_odd")
        .into_iter()
        .map(|(_, limit)| limit)
        .collect()
}

/// One op: advance the clock, check `cost` on a key, and maybe refund an
/// earlier charge (by index among the charges so far, modulo their count).
type Op = (u64, u8, u64, Option<usize>);

fn twin_ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        (
            clock_step(),
            0u8..2,
            prop_oneof![6 => Just(1u64), 3 => 1u64..=3],
            prop::option::weighted(0.5, 0usize..1000),
        ),
        1..50,
    )
}

/// Candidates the Redis scripts pack: a token bucket and a policing leaky
/// bucket of rate 1, a fixed window, a sliding window counter.
fn candidate_limits() -> [Limit; 4] {
    use tiered_ratelimit::algorithm::{Gcra, TokenBucket, Window};
    let s = 1_000_000;
    [
        Limit::TokenBucket(TokenBucket::new(2, s, 3).unwrap()),
        Limit::LeakyBucket(Gcra {
            bucket: TokenBucket::new(4, 2 * s, 4).unwrap(),
            max_delay_us: None,
        }),
        Limit::FixedWindow(Window {
            limit: 3,
            window_us: 2 * s,
        }),
        Limit::SlidingWindowCounter(Window {
            limit: 4,
            window_us: 3 * s,
        }),
    ]
}

/// Refunds on Redis and in memory leave the same state, with and without
/// candidate quotas beside the refunded tier.
#[test]
fn rust_refunds_equal_lua_refunds() {
    let server = RedisServer::start();
    let rt = current_thread_runtime();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let cases = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(
            &(0usize..6, twin_ops(), any::<bool>()),
            |(which, ops, cands)| {
                let case = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let limit = twin_limits()[which];
                let clock = ManualClock::new(T0_US + 123_457);
                let (redis, memory) = server.redis_and_memory(&clock);
                let mut charged: Vec<(TierRefund, TierRefund)> = Vec::new();
                for (i, &(step, key, cost, refund)) in ops.iter().enumerate() {
                    clock.advance(Duration::from_micros(step));
                    let check = TierCheck {
                        key: format!("t{case}:k{key}"),
                        limit,
                        cost,
                        home: None,
                    };
                    // With four candidates (packed in the tier key's value on
                    // Redis), which a refund of the live charge must leave as
                    // they are: every later decision of theirs is compared.
                    let (checks, live_of) = if cands {
                        let mut checks = vec![check.clone()];
                        for (j, l) in candidate_limits().into_iter().enumerate() {
                            checks.push(TierCheck {
                                key: format!("t{case}:k{key}{{c:{j}}}"),
                                limit: l,
                                cost,
                                home: None,
                            });
                        }
                        (checks, vec![0u8; 4])
                    } else {
                        (vec![check.clone()], Vec::new())
                    };
                    let m = rt
                        .block_on(memory.check_candidates(checks.clone(), 0, &live_of))
                        .unwrap();
                    let r = rt
                        .block_on(redis.check_candidates(checks, 0, &live_of))
                        .unwrap();
                    prop_assert_eq!(&m.decisions, &r.decisions, "check diverged at op {}", i);
                    if m.decisions[0].allowed {
                        let charge = |v: &tiered_ratelimit::backend::Verdict| TierRefund {
                            check: check.clone(),
                            charge: v.charges[0].expect("a charge"),
                            debt: false,
                        };
                        charged.push((charge(&m), charge(&r)));
                    }
                    if let (Some(k), false) = (refund, charged.is_empty()) {
                        // Each charge is refunded at most once, as the layer does.
                        let (rm, rr) = charged.remove(k % charged.len());
                        rt.block_on(memory.refund(vec![rm])).unwrap();
                        rt.block_on(redis.refund(vec![rr])).unwrap();
                        // The state after the refund, read on both without
                        // charging: a cost above the capacity is always denied
                        // and its decision shows remaining and reset.
                        for key in 0..2u8 {
                            let probe = vec![TierCheck {
                                key: format!("t{case}:k{key}"),
                                limit,
                                cost: limit.capacity() + 1,
                                home: None,
                            }];
                            let m = rt.block_on(memory.check(probe.clone())).unwrap();
                            let r = rt.block_on(redis.check(probe)).unwrap();
                            prop_assert_eq!(
                                &m.decisions,
                                &r.decisions,
                                "state after refund diverged at op {}",
                                i
                            );
                        }
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

/// A per-key override of 6 a minute on a 3-a-minute tier: a failed request
/// is refunded on the override's quota, as it was charged, on both backends.
async fn a_failure_under_an_override_is_refunded_on_its_quota(env: Env) {
    let layer = env
        .builder()
        .tier(
            Tier::new("login", Global, Quota::per_minute(3))
                .skip_failed_requests(true)
                .overrides(true),
        )
        .build()
        .unwrap();
    let h = layer.handle();
    let six = tiered_ratelimit::handle::Override::Quota(Quota::per_minute(6));
    h.set_override("login", "all", six, None, "test")
        .await
        .unwrap();
    let addr = serve(login_app(layer)).await;
    let c = client();
    // One token every 10 s.
    assert_eq!(limits(&login(&c, addr, false).await), ok(6, 5, T0_S + 10));
    assert_eq!(
        limits(&login(&c, addr, true).await),
        with_status(401, ok(6, 4, T0_S + 20))
    );
    // The refund (on Redis, in a task after the response) gives the token
    // back: the bucket's TAT (µs) one token (10 s) past the start, as after
    // the one success, tagged with the override's quota (rate 1, 10^7
    // units a token: not the tier's configured one).
    if let Some(redis) = &env.redis {
        let want = format!("{}:0:1:10000000", (T0_S + 10) * 1_000_000);
        let deadline = Instant::now() + Duration::from_secs(2);
        while redis.get("rl:login:all").as_deref() != Some(want.as_str()) {
            assert!(
                Instant::now() < deadline,
                "never refunded: {:?}",
                redis.get("rl:login:all")
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert_eq!(limits(&login(&c, addr, false).await), ok(6, 4, T0_S + 20));
}
