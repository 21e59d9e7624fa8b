//! Outages and abuse against a real redis-server: the circuit breaker, the
//! local fallback, and the deny cache.

use crate::support::*;
use std::time::{Duration, Instant};
use tiered_ratelimit::{
    backend::{ManualClock, RedisBackend},
    key::Global,
    CircuitBreaker, FailurePolicy, Quota, RateLimitLayer, Tier,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_spares_redis_under_a_single_key_flood() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = redis_layer(&redis, &clock)
        .tier(Tier::new("global", Global, Quota::per_minute(10)))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    // Load the script first (its first EVALSHA answers NOSCRIPT), through
    // another layer with its own keys.
    let warm = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&redis.url()).unwrap())
        .key_prefix("warm")
        .tier(Tier::new("global", Global, Quota::per_minute(10)))
        .build()
        .unwrap();
    let warm = serve(app(warm)).await;
    c.get(format!("http://{warm}/")).send().await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let mut statuses = Vec::new();
    for _ in 0..100 {
        statuses.push(limits(&c.get(&url).send().await.unwrap()));
    }
    // 10 admitted by Redis; the 10th emptied the bucket and Redis said when
    // the next token comes, so all 90 others are denied locally, with the
    // same headers Redis would give.
    assert_eq!(statuses.iter().filter(|l| l.status == 200).count(), 10);
    assert_eq!(redis.script_calls(), 10);
    // The key's first 429 counts `limited` (the backend denied nothing),
    // the 89 after it `cache_blocked`.
    assert_eq!(handle.counts().cache_blocked, 89);
    assert_eq!(handle.counts().limited, 1);
    assert!(
        statuses[10..]
            .iter()
            .all(|l| *l == denied(10, 0, T0_S + 6, 6)),
        "{:?}",
        &statuses[10..12]
    );
    // One microsecond before the token: still cached.
    clock.advance(Duration::from_micros(5_999_999));
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        denied(10, 0, T0_S + 6, 1)
    );
    assert_eq!(redis.script_calls(), 10);
    // At the exact retry time the cache lets the request through to Redis.
    clock.advance(Duration::from_micros(1));
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        ok(10, 0, T0_S + 6 + 60)
    );
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        denied(10, 0, T0_S + 12, 6)
    );
    assert_eq!(redis.script_calls(), 11);
    // Redis calls per denied request over the flood: none of 92 (the first
    // 429 after each of the two primings counted `limited`).
    let n = handle.counts();
    assert_eq!((n.cache_blocked, n.limited), (90, 2));
    // A runtime change drops cached denials: the next request is Redis's
    // to answer, under the new quota. The bucket's used capacity carries
    // over (docs/rollout.md, "A quota change"): 10 tokens of 1000/min
    // used, 989 left after this one, full in 11 × 60 ms (Reset rounds up
    // to whole seconds).
    handle
        .set_tier_quota("global", Quota::per_minute(1000))
        .unwrap();
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        ok(1000, 989, T0_S + 7)
    );
    assert_eq!(redis.script_calls(), 12);
}

/// An admission that leaves less than another request of its cost primes
/// the deny cache (fixed window, leaky bucket; the token bucket above), but
/// not on a shadow tier, nor on one that refunds by status (a refund could
/// make room before the cached instant): those keep asking Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_is_primed_by_the_admission_that_empties_a_tier() {
    use tiered_ratelimit::{rollout::Mode, Algorithm, LeakyBucket};
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let c = client();
    // Load the script once, so every count below is of real checks.
    let mut prefix = 0;
    let mut run = |tier: Tier| {
        prefix += 1;
        let layer = redis_layer(&redis, &clock)
            .key_prefix(format!("p{prefix}"))
            .tier(tier)
            .build()
            .unwrap();
        let handle = layer.handle();
        let redis = &redis;
        let c = &c;
        async move {
            let addr = serve(app(layer)).await;
            c.get(format!("http://{addr}/")).send().await.unwrap();
            redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
            let mut ok = 0;
            for _ in 0..9 {
                if c.get(format!("http://{addr}/"))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    == 200
                {
                    ok += 1;
                }
            }
            let n = handle.counts();
            (ok, redis.script_calls(), n.cache_blocked, n.limited)
        }
    };
    let quota = || Quota::per_hour(4);
    // 1 + 3 admitted; the 3rd (of 9) empties the tier: 6 answered locally,
    // the first of them counted `limited` (the key's first 429).
    let fixed = Tier::new("t", Global, quota()).algorithm(Algorithm::FixedWindow);
    assert_eq!(run(fixed).await, (3, 3, 5, 1));
    let leaky =
        Tier::new("t", Global, quota()).algorithm(Algorithm::LeakyBucket(LeakyBucket::Police));
    assert_eq!(run(leaky).await, (3, 3, 5, 1));
    // Every request reaches Redis.
    let refunding = Tier::new("t", Global, quota()).skip_failed_requests(true);
    assert_eq!(run(refunding).await, (3, 9, 0, 6));
    let shadow = Tier::new("t", Global, quota()).mode(Mode::Shadow);
    assert_eq!(run(shadow).await, (9, 9, 0, 0));
}

/// An entry applies only under the limit it was decided with: a key
/// drained under the `free` plan is refused locally for `free` requests, but
/// a `pro` request on the same key (which Redis admits) goes to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_answers_only_under_the_limit_it_saw() {
    use tiered_ratelimit::Algorithm;
    let redis = RedisServer::start();
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&redis.url()).unwrap())
        .backend_timeout(Duration::from_secs(2))
        .tier(
            Tier::new("g", Global, Quota::per_hour(1))
                .algorithm(Algorithm::FixedWindow)
                .plans([("free", Quota::per_hour(1)), ("pro", Quota::per_hour(100))]),
        )
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let get = |plan: &'static str| {
        c.get(format!("http://{addr}/"))
            .header("x-test-plan", plan)
            .send()
    };
    assert_eq!(get("free").await.unwrap().status(), 200);
    // The admission emptied the free window: the next free request is
    // refused locally...
    assert_eq!(get("free").await.unwrap().status(), 429);
    let n = handle.counts();
    assert_eq!((n.cache_blocked, n.limited), (0, 1), "the key's first 429");
    // ...a pro request is Redis's to decide, and Redis admits it.
    assert_eq!(get("pro").await.unwrap().status(), 200);
    let n = handle.counts();
    assert_eq!((n.cache_blocked, n.limited), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_answers_only_the_cost_it_saw() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = redis_layer(&redis, &clock)
        .tier(
            Tier::new("global", Global, Quota::new(5, Duration::from_secs(5)))
                .cost_fn(cost_from_header("x-cost")),
        )
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let send = |cost: u64| {
        c.get(format!("http://{addr}/"))
            .header("x-cost", cost.to_string())
            .send()
    };
    assert_eq!(limits(&send(3).await.unwrap()).status, 200);
    // Cost 3 with 2 left: denied (and cached for cost 3)...
    assert_eq!(limits(&send(3).await.unwrap()), denied(5, 2, T0_S + 1, 1));
    // ...a larger cost gets its own, longer wait from Redis...
    assert_eq!(limits(&send(4).await.unwrap()), denied(5, 2, T0_S + 2, 2));
    // ...but cost 2 still fits and must reach Redis.
    assert_eq!(limits(&send(2).await.unwrap()), ok(5, 0, T0_S + 5));
}

/// With two enforced tiers denying, a 429 from the cache describes the one
/// with the longest wait, as Redis's does — not the first cached one: a
/// client that waits the `Retry-After` it was given is not denied again by
/// the other. A tier without an entry does not stop the cache when it could
/// not bind (a token bucket of one a minute cannot make anyone wait longer
/// than a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_answers_with_the_longest_wait() {
    use tiered_ratelimit::Algorithm;
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = redis_layer(&redis, &clock)
        .tier(Tier::new("minute", Global, Quota::per_minute(1)))
        .tier(Tier::new("hour", Global, Quota::per_hour(1)).algorithm(Algorithm::FixedWindow))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    // T0 is 800 s into its hour: the hour's window ends 2 800 s later.
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        ok(1, 0, T0_S + 2800)
    );
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    // The admission emptied both tiers and primed both entries: the
    // minute's (60 s) and the hour's (2 800 s). The hour binds.
    let res = c.get(&url).send().await.unwrap();
    assert_eq!(limits(&res), denied(1, 0, T0_S + 2800, 2800));
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"error":"rate_limit_exceeded","retry_after":2800}"#
    );
    // A minute on, the minute's entry has lapsed (a token is back), the
    // hour's has not: still the hour's 429, still without Redis.
    clock.advance(Duration::from_secs(60));
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        denied(1, 0, T0_S + 2800, 2740)
    );
    assert_eq!(redis.script_calls(), 0);
    // Both from the cache: the key's first 429 `limited`, then one
    // `cache_blocked`.
    let n = handle.counts();
    assert_eq!((n.cache_blocked, n.limited), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_breaker_stops_paying_the_timeout() {
    let redis = RedisServer::start();
    // A long timeout, so "waited for Redis" and "did not" are far apart
    // whatever the machine's load.
    let timeout = Duration::from_millis(1500);
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&redis.url()).unwrap())
        .tier(Tier::new("global", Global, Quota::per_hour(1000)))
        .backend_timeout(timeout)
        .circuit_breaker(CircuitBreaker {
            failures: 3,
            probe_interval: Duration::from_millis(1500),
        })
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()).remaining,
        Some(999)
    );
    redis.pause();
    // Three requests pay the timeout, then the circuit opens.
    for _ in 0..3 {
        let t = Instant::now();
        assert_eq!(limits(&c.get(&url).send().await.unwrap()), NO_LIMITS);
        assert!(t.elapsed() >= timeout, "took {:?}", t.elapsed());
    }
    assert_eq!(handle.circuit_state(), "open");
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(limits(&c.get(&url).send().await.unwrap()), NO_LIMITS);
        assert!(
            t.elapsed() < timeout / 2,
            "an open circuit still waited {:?}",
            t.elapsed()
        );
    }
    assert_eq!(handle.counts().fail_open, 23);
    // Redis returns; after the probe interval one request probes and closes it.
    redis.resume();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    // (probe_interval is 1.5 s: the circuit is half-open now)
    assert_eq!(handle.circuit_state(), "half_open");
    let l = limits(&c.get(&url).send().await.unwrap());
    assert!(l.remaining.is_some(), "the probe reached Redis: {l:?}");
    assert_eq!(handle.circuit_state(), "closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_limits_locally_with_the_divided_quota() {
    let mut redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // The first check (a connect and the script's load) must be Redis's
    // answer, not the fallback's, on a loaded host too; once Redis is
    // stopped its refused connects fail at once, whatever the timeout.
    let layer = redis_layer(&redis, &clock)
        .backend_timeout(PATIENT)
        .tier(Tier::new("global", Global, Quota::per_minute(10)))
        .failure_policy(FailurePolicy::Fallback)
        .fallback_instances(2)
        .circuit_breaker(CircuitBreaker {
            failures: 0,
            probe_interval: Duration::from_secs(1),
        })
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        ok(10, 9, T0_S + 6)
    );
    redis.stop();
    // Local buckets of 10 / 2 = 5 per minute, on the same clock.
    for want in [4, 3, 2, 1, 0] {
        assert_eq!(
            limits(&c.get(&url).send().await.unwrap()),
            ok(5, want, T0_S + (5 - want) * 12)
        );
    }
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        denied(5, 0, T0_S + 12, 12)
    );
    assert_eq!(handle.counts().fallback, 6);
    // Redis is back (empty): decisions come from it again.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let l = limits(&c.get(&url).send().await.unwrap());
        if l.limit == Some(10) {
            assert_eq!(l, ok(10, 9, T0_S + 6));
            break;
        }
        assert!(Instant::now() < deadline, "did not switch back: {l:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issues `n` requests to `svc` before awaiting any (so all of them are
/// planned, and find the deny cache, before the first answer comes back),
/// then awaits them in order: their statuses and `Retry-After`s.
async fn burst<S>(svc: &mut S, n: usize) -> Vec<(u16, Option<String>)>
where
    S: tower::Service<
        http::Request<axum::body::Body>,
        Response = http::Response<tiered_ratelimit::ResponseBody<axum::body::Body>>,
    >,
    S::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let mut futures = Vec::new();
    for _ in 0..n {
        let req = http::Request::builder()
            .uri("/")
            .body(axum::body::Body::empty())
            .unwrap();
        futures.push(svc.ready().await.unwrap().call(req));
    }
    let mut out = Vec::new();
    for f in futures {
        let res = f.await.unwrap();
        let retry = res
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        out.push((res.status().as_u16(), retry));
    }
    out
}

/// One global tier of `quota` on `redis`, on `clock`, with `timeout` as
/// the backend timeout. (Keys outlive their TTL by a minute in real time: a
/// bucket a thousandth drained has a 1 ms TTL, which a loaded machine can
/// outlast between two requests of one burst.)
fn single_flight_layer(
    redis: &RedisServer,
    clock: &ManualClock,
    quota: Quota,
    timeout: Duration,
) -> RateLimitLayer {
    RateLimitLayer::builder()
        .backend(
            redis
                .backend_on(clock)
                .with_test_ttl_slack(Duration::from_secs(60)),
        )
        .tier(Tier::new("global", Global, quota))
        .backend_timeout(timeout)
        .build()
        .unwrap()
}

/// A backend timeout no check reaches, even on a loaded host: the tests
/// that count calls and admissions must not see a slow check answered by
/// the failure policy (the default 100 ms was exceeded at a load average of
/// 20 on two cores: 1 001 admitted of 1 000). Waiters wait for a probe at
/// most this long, so a longer timeout only makes the single flight surer.
const PATIENT: Duration = Duration::from_secs(30);

fn ok_service() -> impl tower::Service<
    http::Request<axum::body::Body>,
    Response = http::Response<axum::body::Body>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    tower::service_fn(|_| async { Ok(http::Response::new(axum::body::Body::empty())) })
}

/// Single flight: when a cached denial lapses, the first request goes to
/// Redis and those that arrive during its round trip wait for its answer
/// instead of asking too. Its admission takes the one token that came back
/// and empties the bucket again, so they are answered 429 from the cache,
/// with no Redis call of their own.
#[tokio::test(flavor = "current_thread")]
async fn deny_cache_lets_one_request_ask_for_a_lapsed_key() {
    use tower::Layer;
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = single_flight_layer(&redis, &clock, Quota::per_minute(10), PATIENT);
    let handle = layer.handle();
    let mut svc = layer.layer(ok_service());
    // All eleven are issued before the first answer: none finds the cache
    // primed yet, and Redis denies the eleventh.
    let first = burst(&mut svc, 11).await;
    assert!(first[..10].iter().all(|(s, _)| *s == 200), "{first:?}");
    assert_eq!(first[10], (429, Some("6".into())));
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let before = handle.counts();
    // The next token comes at +6 s; the entry lapses then.
    clock.advance(Duration::from_secs(6));
    let statuses = burst(&mut svc, 21).await;
    assert_eq!(statuses[0], (200, None));
    assert!(
        statuses[1..].iter().all(|s| *s == (429, Some("6".into()))),
        "{statuses:?}"
    );
    assert_eq!(redis.script_calls(), 1);
    let after = handle.counts();
    // 20 answered by the cache: the first after the probe's admission
    // primed it is the key's first 429 (`limited`), 19 `cache_blocked`.
    assert_eq!(after.cache_blocked, before.cache_blocked + 19);
    assert_eq!(after.limited, before.limited + 1);
}

/// The waiters never get a 429 Redis would not give: when the probe's
/// admission leaves room, nothing is cached and they all ask Redis, which
/// admits them.
#[tokio::test(flavor = "current_thread")]
async fn requests_that_waited_for_a_probe_with_room_left_ask_redis() {
    use tower::Layer;
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // 1000 per second, burst 1000: empty after 1000, a token per ms.
    let layer = single_flight_layer(&redis, &clock, Quota::per_second(1000), PATIENT);
    let handle = layer.handle();
    let mut svc = layer.layer(ok_service());
    let first = burst(&mut svc, 1001).await;
    assert_eq!(first.iter().filter(|(s, _)| *s == 200).count(), 1000);
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    // Half a second later, 500 tokens are back; the entry (until +1 ms) has
    // lapsed a moment ago.
    clock.advance(Duration::from_millis(500));
    let statuses = burst(&mut svc, 21).await;
    assert!(statuses.iter().all(|(s, _)| *s == 200), "{statuses:?}");
    // The probe, then each waiter on its own.
    assert_eq!(redis.script_calls(), 21);
    assert_eq!(handle.counts().allowed, 1000 + 21);
}

/// A request that waited for a probe gets only what is left of
/// `backend_timeout` for its own check: the layer adds at most that much
/// to a request, wait included (with Redis frozen: the probe fails open at
/// the timeout, the request that waited for it about then too, not one
/// timeout later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_probe_counts_against_the_backend_timeout() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // Long enough that one timeout plus a loaded host's HTTP round trips
    // (half a timeout) stays well apart from two timeouts.
    let timeout = Duration::from_secs(3);
    let layer = single_flight_layer(&redis, &clock, Quota::per_minute(10), timeout);
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    for _ in 0..11 {
        c.get(&url).send().await.unwrap();
    }
    clock.advance(Duration::from_secs(6));
    redis.pause();
    let started = Instant::now();
    let probe = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { c.get(&url).send().await.map(|r| limits(&r)) }
    });
    // Let the probe reach the layer first (if it has not, the request below
    // probes itself and the bound holds all the more).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let res = c.get(&url).send().await.unwrap();
    let took = started.elapsed();
    assert_eq!(limits(&res), NO_LIMITS, "fail-open at the timeout");
    assert_eq!(probe.await.unwrap().unwrap(), NO_LIMITS);
    // One timeout from the probe's start (+ slack), not two.
    assert!(took < timeout * 3 / 2, "took {took:?}");
    redis.resume();
}

/// After a probe's answer left room, the lapsed entry is forgotten: the
/// next requests on the key go to Redis side by side, none waiting for
/// another (here: the second of two is awaited first and must not wait for
/// the first, which is never polled before it).
#[tokio::test(flavor = "current_thread")]
async fn an_answer_with_room_left_ends_the_single_flight() {
    use tower::{Layer, Service, ServiceExt};
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = single_flight_layer(
        &redis,
        &clock,
        Quota::per_second(1000),
        Duration::from_secs(30),
    );
    let mut svc = layer.layer(ok_service());
    let first = burst(&mut svc, 1001).await;
    assert_eq!(first.iter().filter(|(s, _)| *s == 200).count(), 1000);
    clock.advance(Duration::from_millis(500));
    // The probe finds room (500 tokens back): nothing is cached.
    assert_eq!(burst(&mut svc, 1).await, [(200, None)]);
    let req = || {
        http::Request::builder()
            .uri("/")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let a = svc.ready().await.unwrap().call(req());
    let b = svc.ready().await.unwrap().call(req());
    // A hang detector, not a measurement: b would wait the 30 s timeout for
    // a, which is not polled, had the lapsed entry stayed.
    let b = tokio::time::timeout(Duration::from_secs(10), b)
        .await
        .expect("the second request waited for the first")
        .unwrap();
    assert_eq!(b.status(), 200);
    assert_eq!(a.await.unwrap().status(), 200);
}

/// The paced flood of `perf/load.sh` (issue 16): one key floods a tier of
/// 100 a second (a token every 10 ms) at 20 requests per token, next to
/// three tiers that never run short (1 000 a second, a burst of 10^9). Each
/// token is taken by the one request that finds the entry lapsed (the
/// probe); its answer primes the entry again and says the other tiers have
/// room, so every other request — including those in the last millisecond
/// before the token, when an empty 1 000/s tier could have bound with a
/// 1 ms wait — is answered 429 from the cache: one Redis call per token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_answers_a_paced_flood_with_one_call_per_token() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let never = || Quota::per_second(1000).burst(1_000_000_000);
    // Counts exact admissions and calls: a timeout no loaded host reaches,
    // and keys that outlive their TTL in real time (the clock stands still
    // while Redis expires keys: `ip`'s second of TTL ran out before the
    // 101st request on a loaded host, which then found a full bucket).
    let layer = RateLimitLayer::builder()
        .backend(
            redis
                .backend_on(&clock)
                .with_test_ttl_slack(Duration::from_secs(600)),
        )
        .backend_timeout(PATIENT)
        .tier(Tier::new("global", Global, never()))
        .tier(Tier::new("ip", Global, Quota::per_second(100)))
        .tier(Tier::new("user", Global, never()))
        .tier(Tier::new("endpoint", Global, never()))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    // Load the script first, through another layer with its own keys.
    let warm = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&redis.url()).unwrap())
        .key_prefix("warm")
        .backend_timeout(PATIENT)
        .tier(Tier::new("global", Global, never()))
        .build()
        .unwrap();
    let warm = serve(app(warm)).await;
    c.get(format!("http://{warm}/")).send().await.unwrap();
    // The burst: 100 admitted, the 100th empties `ip` (the next token at
    // +10 ms), the 101st is denied.
    for k in 0..101 {
        let status = c.get(&url).send().await.unwrap().status();
        assert_eq!(status, if k < 100 { 200 } else { 429 }, "request {k}");
    }
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let before = handle.counts();
    // 10 tokens' worth of flood, a request every 0.5 ms.
    let mut statuses = Vec::new();
    for _ in 0..200 {
        clock.advance(Duration::from_micros(500));
        statuses.push(limits(&c.get(&url).send().await.unwrap()));
    }
    // The request on each token (every 20th) is admitted; all the others
    // are denied for the rest of the token's 10 ms (a 1 s Retry-After).
    for (k, l) in statuses.iter().enumerate() {
        let want = if k % 20 == 19 { 200 } else { 429 };
        assert_eq!(l.status, want, "request {k}: {l:?}");
        if want == 429 {
            assert_eq!(
                (l.limit, l.remaining, l.retry_after),
                (Some(100), Some(0), Some(1))
            );
        }
    }
    assert_eq!(redis.script_calls(), 10);
    let after = handle.counts();
    // 190 answered by the cache: the first after each priming admission
    // `limited`, the others `cache_blocked`.
    assert_eq!(
        (
            after.cache_blocked - before.cache_blocked,
            after.limited - before.limited
        ),
        (181, 9)
    );
}
