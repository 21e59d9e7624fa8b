//! Redis-only behaviour: agreement with the memory backend, exact admission
//! across app servers, faults, script reloads and deadpool pools.

use crate::support::rng::Rng;
use crate::support::*;
use std::time::{Duration, Instant};
use tiered_ratelimit::{
    backend::{Backend, ManualClock, MemoryBackend, RedisBackend},
    key::{ClientIp, Global, User},
    rollout::Mode,
    FailurePolicy, Quota, RateLimitLayer, Tier,
};

fn tiers(b: tiered_ratelimit::RateLimitLayerBuilder) -> tiered_ratelimit::RateLimitLayerBuilder {
    b.tier(Tier::new("global", Global, Quota::per_second(10).burst(20)))
        .tier(Tier::new(
            "ip",
            ClientIp::default(),
            Quota::per_minute(67).burst(9),
        ))
        .tier(Tier::new("user", User, Quota::new(3, Duration::from_secs(10))).cost(1))
        .tier(
            Tier::new(
                "heavy",
                User,
                Quota::new(9, Duration::from_secs(13)).burst(4),
            )
            .cost(2),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_decide_identically() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let mem: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
    let red: Backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .into();
    // The deny cache is on (the Redis side's default; the memory backend
    // has none): it may spare Redis calls, never change an answer (see
    // src/deny_cache/rule.rs).
    let build = |b: Backend| {
        tiers(
            RateLimitLayer::builder()
                .backend(b)
                .backend_timeout(Duration::from_secs(2)),
        )
        .build()
        .unwrap()
    };
    let mem_addr = serve(app(build(mem))).await;
    let red_addr = serve(app(build(red))).await;
    let c = client();
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    let mut denied_count = 0;
    for i in 0..400 {
        // Steps from 0 to ~1.5 s in odd microseconds, bursts of same-instant requests.
        let step = match rng.next() % 4 {
            0 => 0,
            1 => rng.next() % 200_000,
            _ => rng.next() % 1_500_000,
        };
        clock.advance(Duration::from_micros(step));
        let user = ["alice", "bob", "carol", ""][(rng.next() % 4) as usize];
        let path = ["/", "/users/1", "/users/2"][(rng.next() % 3) as usize];
        let send = |addr| {
            let mut r = c.get(format!("http://{addr}{path}"));
            if !user.is_empty() {
                r = r.header("authorization", format!("Bearer {user}"));
            }
            r.send()
        };
        let m = send(mem_addr).await.unwrap();
        let r = send(red_addr).await.unwrap();
        let (lm, lr) = (limits(&m), limits(&r));
        assert_eq!(lm, lr, "request {i} ({user} {path}) diverged");
        if lm.status == 429 {
            denied_count += 1;
        }
        assert_eq!(m.text().await.unwrap(), r.text().await.unwrap());
    }
    // The sequence must exercise both outcomes to prove anything.
    assert!(
        denied_count > 50 && denied_count < 350,
        "denied {denied_count}"
    );
    eprintln!("{denied_count} of 400 denied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_app_servers_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let mk = || {
        RateLimitLayer::builder()
            .backend(RedisBackend::from_url(&redis.url()).unwrap())
            .tier(Tier::new("global", Global, Quota::per_hour(30)))
            .backend_timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let c = client();
    for round in 0..20 {
        // Fresh app servers (and so fresh deny caches) on an emptied Redis.
        redis.cmd::<()>(&["FLUSHALL"]);
        let a = serve(app(mk())).await;
        let b = serve(app(mk())).await;
        let mut handles = Vec::new();
        // 2 app servers × 200 concurrent requests on one key.
        for i in 0..400 {
            let url = format!("http://{}/", if i % 2 == 0 { a } else { b });
            let c = c.clone();
            handles.push(tokio::spawn(async move {
                c.get(url).send().await.unwrap().status().as_u16()
            }));
        }
        let mut ok = 0;
        let mut limited = 0;
        for h in handles {
            match h.await.unwrap() {
                200 => ok += 1,
                429 => limited += 1,
                s => panic!("unexpected status {s}"),
            }
        }
        assert_eq!((ok, limited), (30, 370), "round {round}");
    }
}

/// Shadow mode never blocks: with every tier in shadow mode, a Redis outage
/// under `FailurePolicy::Closed` passes requests (counted as failed open),
/// while a layer with one enforced tier answers 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_passes_when_redis_is_down_even_when_closed() {
    let mut redis = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let mk = |shadow_user: bool, shadow_global: bool| {
        let mode = |shadow| if shadow { Mode::Shadow } else { Mode::Enforce };
        RateLimitLayer::builder()
            .backend(RedisBackend::from_url(&redis.url()).unwrap())
            .tier(Tier::new("global", Global, Quota::per_hour(1000)).mode(mode(shadow_global)))
            .tier(Tier::new("user", User, Quota::per_hour(10)).mode(mode(shadow_user)))
            .failure_policy(FailurePolicy::Closed)
            .backend_timeout(timeout)
            .build()
            .unwrap()
    };
    let all_shadow = mk(true, true);
    let h = all_shadow.handle();
    let all_shadow = serve(app(all_shadow)).await;
    let one_enforced = serve(app(mk(true, false))).await;
    let c = client();
    let hit = |addr| c.get(format!("http://{addr}/")).send();
    assert_eq!(hit(all_shadow).await.unwrap().status(), 200);
    redis.stop();
    for _ in 0..3 {
        let res = hit(all_shadow).await.unwrap();
        assert_eq!(limits(&res), NO_LIMITS, "passes without headers");
        assert_eq!(hit(one_enforced).await.unwrap().status(), 503);
    }
    assert_eq!(h.counts().fail_open, 3);
    assert_eq!(h.counts().fail_closed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_follows_failure_policy_and_recovers() {
    let mut redis = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let mk = |policy| {
        RateLimitLayer::builder()
            .backend(RedisBackend::from_url(&redis.url()).unwrap())
            .tier(Tier::new("global", Global, Quota::per_hour(1000)))
            .failure_policy(policy)
            .backend_timeout(timeout)
            .build()
            .unwrap()
    };
    let open = serve(app(mk(FailurePolicy::Open))).await;
    let closed = serve(app(mk(FailurePolicy::Closed))).await;
    let c = client();
    let hit = |addr| c.get(format!("http://{addr}/")).send();

    assert_eq!(limits(&hit(open).await.unwrap()).remaining, Some(999));
    assert_eq!(limits(&hit(closed).await.unwrap()).remaining, Some(998));

    redis.stop();
    for _ in 0..5 {
        let started = Instant::now();
        let res = hit(open).await.unwrap();
        assert_eq!(limits(&res), NO_LIMITS, "fail-open passes without headers");
        assert!(
            started.elapsed() < timeout * 4,
            "took {:?}",
            started.elapsed()
        );
        let started = Instant::now();
        let res = hit(closed).await.unwrap();
        assert_eq!(res.status(), 503);
        assert_eq!(
            res.text().await.unwrap(),
            r#"{"error":"rate_limiter_unavailable"}"#
        );
        assert!(
            started.elapsed() < timeout * 4,
            "took {:?}",
            started.elapsed()
        );
    }

    // Redis comes back empty (no persistence); the connection manager
    // reconnects and the script is reloaded without an app restart.
    redis.restart();
    let back = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let l = limits(&hit(open).await.unwrap());
        if l.remaining.is_some() {
            assert_eq!(l.remaining, Some(999));
            // Circuit breaker probe (500 ms) plus the reconnect.
            assert!(
                back.elapsed() < Duration::from_secs(1),
                "resumed after {:?}",
                back.elapsed()
            );
            break;
        }
        assert!(Instant::now() < deadline, "limiting did not resume");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_costs_at_most_the_timeout() {
    let redis = RedisServer::start();
    let timeout = Duration::from_millis(250);
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&redis.url()).unwrap())
        .tier(Tier::new("global", Global, Quota::per_hour(1000)))
        .backend_timeout(timeout)
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()).remaining,
        Some(999)
    );

    redis.pause();
    for _ in 0..3 {
        let started = Instant::now();
        let res = c.get(&url).send().await.unwrap();
        let took = started.elapsed();
        assert_eq!(limits(&res), NO_LIMITS);
        assert!(
            took >= timeout,
            "answered in {took:?}: the timeout path was not taken"
        );
        assert!(took < timeout * 8, "took {took:?}");
    }
    // The last check's deadline is its send time plus the timeout in Redis's
    // clock as calibrated by an earlier reply, so it may lie a reply's
    // latency past the moment its timeout fired here (a few ms, more on a
    // loaded machine). Resuming one more timeout later puts every deadline
    // behind Redis's clock whatever that latency was.
    tokio::time::sleep(timeout).await;
    redis.resume();
    // The three checks that timed out reach Redis now, past their deadline:
    // they write nothing, so there is no pile-up of late charges. The next
    // request is the second one ever charged.
    let l = limits(&c.get(&url).send().await.unwrap());
    assert_eq!(l.remaining, Some(998));
    let stored: String = redis.get("rl:global:all").unwrap();
    // The TAT in µs: two tokens (3.6 s each) short of full at the second
    // charge, less the refill since the first, which is under a token.
    let tat: u64 = stored.parse().unwrap();
    let time: Vec<String> = redis.cmd(&["TIME"]);
    let now = time[0].parse::<u64>().unwrap() * 1_000_000 + time[1].parse::<u64>().unwrap();
    assert!(
        (3_600_000..=7_200_000).contains(&(tat - now)),
        "{stored} at {now}"
    );
}

/// A layer with one `global` tier of 100 an hour on `backend`, under
/// `FailurePolicy::Closed`, served: its client and URL, after a first
/// request that left 99.
async fn serve_global_100_per_hour(backend: RedisBackend) -> (reqwest::Client, String) {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .tier(Tier::new("global", Global, Quota::per_hour(100)))
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()).remaining,
        Some(99)
    );
    (c, url)
}

/// The next two requests pass with 98 and 97 left (`why`: the assertion's
/// message).
async fn next_two_pass(c: &reqwest::Client, url: &str, why: &str) {
    for want in [98, 97] {
        let res = c.get(url).send().await.unwrap();
        assert_eq!(limits(&res).status, 200, "{why}");
        assert_eq!(limits(&res).remaining, Some(want));
    }
}

/// The check runs as a Redis Function (`FCALL`); a Redis that lost it
/// (`FUNCTION FLUSH`, a restart without persistence) gets the library again
/// on the next check, which still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_flush_is_reloaded_transparently() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url()).unwrap();
    let function = backend.function_name().to_owned();
    assert!(function.starts_with("trl_check_"), "{function}");
    let (c, url) = serve_global_100_per_hour(backend).await;
    let library = format!("tiered_ratelimit_{}", &function["trl_check_".len()..]);
    let listed: redis::Value = redis.cmd(&["FUNCTION", "LIST", "LIBRARYNAME", &library]);
    assert!(format!("{listed:?}").contains(&function), "{listed:?}");
    redis.cmd::<()>(&["FUNCTION", "FLUSH"]);
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    next_two_pass(&c, &url, "no 503 for a missing function").await;
    // One failed FCALL, one FUNCTION LOAD, two that ran; no EVALSHA.
    assert_eq!(redis.calls("fcall"), 3);
    assert_eq!(redis.calls("function|load"), 1);
    assert_eq!(redis.calls("evalsha") + redis.calls("eval"), 0);
}

/// A Redis that refuses `FUNCTION LOAD` (here an ACL user without the
/// `@scripting` `FUNCTION` command, as some managed services have; Redis 6
/// has no Functions at all) gets `EVALSHA` of the same code, with its own
/// `NOSCRIPT` reload after `SCRIPT FLUSH`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_functions_checks_use_evalsha() {
    let redis = RedisServer::start();
    redis.cmd::<()>(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">pw",
        "~*",
        "+@all",
        "-function",
    ]);
    let url = format!("redis://app:pw@127.0.0.1:{}/", redis.port());
    let backend = RedisBackend::from_url(&url).unwrap();
    let sha = backend.script_sha().to_owned();
    let (c, url) = serve_global_100_per_hour(backend).await;
    let exists: Vec<i64> = redis.cmd(&["SCRIPT", "EXISTS", &sha]);
    assert_eq!(exists, vec![1]);
    redis.cmd::<()>(&["SCRIPT", "FLUSH"]);
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    next_two_pass(&c, &url, "no 503 for NOSCRIPT").await;
    // Switched for good: no FCALL after the first refusal.
    assert_eq!(redis.calls("fcall"), 0);
    assert_eq!(redis.calls("evalsha"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadpool_pool_backend() {
    let redis = RedisServer::start();
    let pool = deadpool_redis::Config::from_url(redis.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let clock = ManualClock::new(T0_US);
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_pool(pool).with_manual_clock(clock))
        .tier(Tier::new("global", Global, Quota::per_minute(2)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        ok(2, 1, T0_S + 30)
    );
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        ok(2, 0, T0_S + 60)
    );
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()),
        denied(2, 0, T0_S + 30, 30)
    );
    // One connection taken from the pool and shared, not one per request.
    let clients: String = redis.cmd(&["CLIENT", "LIST"]);
    assert_eq!(clients.lines().count(), 2, "{clients}"); // ours + this CLIENT LIST
}

/// Changing a tier's algorithm (or two layers sharing a prefix) leaves keys
/// of another Redis type behind: they read as no state, never as a script
/// error that would fail open. (A string of another algorithm is read by
/// this one's rules, docs/redis.md: the sliding counter reads the fixed
/// window's integer, start + 1 in the same window, as its own one request.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_another_algorithm_is_replaced_not_an_error() {
    use tiered_ratelimit::Algorithm;
    let redis = RedisServer::start();
    let mk = |algorithm| {
        RateLimitLayer::builder()
            .backend(RedisBackend::from_url(&redis.url()).unwrap())
            .failure_policy(FailurePolicy::Closed)
            .deny_cache(0)
            .tier(Tier::new("global", Global, Quota::per_hour(100)).algorithm(algorithm))
            .build()
            .unwrap()
    };
    let c = client();
    let mut expected_type = "";
    for (algorithm, redis_type) in [
        (Algorithm::SlidingWindowLog, "zset"),
        (Algorithm::TokenBucket, "string"),
        (Algorithm::SlidingWindowLog, "zset"),
        (Algorithm::FixedWindow, "string"),
        (Algorithm::SlidingWindowCounter, "string"),
    ] {
        let addr = serve(app(mk(algorithm))).await;
        let res = c.get(format!("http://{addr}/")).send().await.unwrap();
        // Closed policy: a script error would be a 503.
        assert_eq!(
            limits(&res).status,
            200,
            "{algorithm:?} after a {expected_type} key"
        );
        let want = if algorithm == Algorithm::SlidingWindowCounter {
            98
        } else {
            99
        };
        assert_eq!(
            limits(&res).remaining,
            Some(want),
            "{algorithm:?} after a {expected_type} key"
        );
        let t: String = redis.cmd(&["TYPE", "rl:global:all"]);
        assert_eq!(t, redis_type);
        expected_type = redis_type;
    }
}

/// A service may be called on a thread without a runtime and its future
/// awaited on one: the check's timer is made on the first poll.
#[test]
fn a_check_built_outside_a_runtime_runs_inside_one() {
    use tower::{Layer, Service};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layer = RateLimitLayer::builder()
        // Nothing listens there: the check fails and the (open) failure
        // policy passes the request.
        .backend(RedisBackend::from_url("redis://127.0.0.1:1/").unwrap())
        .tier(Tier::new("g", Global, Quota::per_second(10)))
        .backend_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let handle = layer.handle();
    let mut svc = layer.layer(tower::service_fn(|_r: http::Request<String>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    }));
    rt.block_on(std::future::poll_fn(|cx| svc.poll_ready(cx)))
        .unwrap();
    let fut = svc.call(http::Request::new(String::new()));
    let res = rt.block_on(fut).unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(handle.counts().fail_open, 1);
}

/// The deadline the layer sends with every production check (the clock
/// argument `"-<deadline µs>"`, Redis's clock): a script that starts after
/// it writes nothing and answers `{ now }` alone ("late"); one that starts
/// before it checks and writes as with `""`. Driven through the library's
/// own Function, as the backend calls it.
#[test]
fn a_check_that_starts_after_its_deadline_writes_nothing() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url()).unwrap();
    let library = backend.function_library().to_owned();
    let function = backend.function_name().to_owned();
    redis.cmd::<()>(&["FUNCTION", "LOAD", &library]);
    // A token bucket of 10^12 units, 1 unit/µs, 10^9 units a token (1 000
    // s of refill: the charged key outlives the test, where a token of
    // 1 000 units gave it 1 ms and a loaded machine saw it expire before
    // the EXISTS below), cost 1, short reply (flag 8).
    let spec = "4 1000000000000 1 1000000000 0 1 8";
    let key = "rl:ip:203.0.113.7";
    let late: Vec<i64> = redis.cmd(&["FCALL", &function, "1", key, "-1", spec]);
    assert_eq!(late.len(), 1, "{late:?}");
    assert!(late[0] > 1_700_000_000_000_000, "now in µs: {late:?}");
    assert_eq!(redis.cmd::<i64>(&["EXISTS", key]), 0);
    let far = format!("-{}", i64::MAX);
    let checked: Vec<i64> = redis.cmd(&["FCALL", &function, "1", key, &far, spec]);
    assert_eq!(checked.len(), 2, "{checked:?}");
    assert_eq!(redis.cmd::<i64>(&["EXISTS", key]), 1);
    // The same answer shape as without a deadline.
    let plain: Vec<i64> = redis.cmd(&["FCALL", &function, "1", key, "", spec]);
    assert_eq!(plain.len(), 2, "{plain:?}");
}
