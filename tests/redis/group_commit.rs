//! Group commit on a real redis-server (src/backend/redis/batch.rs,
//! lua/batch.lua): the checks of requests that arrive while a call is in
//! flight go together in the next call; each is still decided alone, in
//! arrival order, all or nothing on its own keys, with its own deadline.

use crate::support::algorithms::S;
use crate::support::rng::Rng;
use crate::support::*;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;
use tiered_ratelimit::algorithm::{Gcra, Limit, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, RedisBackend, TierCheck, Verdict};
use tiered_ratelimit::{key::Global, BackendError, Quota, RateLimitLayer, Tier};

type CheckFut = Pin<Box<dyn Future<Output = Result<Verdict, BackendError>> + Send>>;

/// Polls every future in list order until all are done: the checks reach
/// the backend (their first poll) in this order, so the first is sent alone
/// and the others queue behind it, in order.
async fn join_in_order(mut futs: Vec<CheckFut>) -> Vec<Result<Verdict, BackendError>> {
    let mut out: Vec<Option<Result<Verdict, BackendError>>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                if let Poll::Ready(r) = f.as_mut().poll(cx) {
                    *o = Some(r);
                }
            }
        }
        if out.iter().all(Option::is_some) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

fn checks_of(b: &Backend, requests: &[Vec<TierCheck>]) -> Vec<CheckFut> {
    requests
        .iter()
        .map(|r| {
            let b = b.clone();
            let r = r.clone();
            Box::pin(async move { b.check(r).await }) as CheckFut
        })
        .collect()
}

/// A Redis backend on `redis` and a memory backend, both on `clock` (the
/// Redis keys' TTLs with 10 minutes' slack, so that the manual clock can
/// run ahead of Redis's), to decide the same requests side by side.
fn fixed(limit: u64) -> Limit {
    Limit::FixedWindow(Window {
        limit,
        window_us: 60 * S,
    })
}

fn tier(key: &str, limit: Limit) -> TierCheck {
    TierCheck {
        key: key.to_owned(),
        limit,
        cost: 1,
        home: None,
    }
}

/// 64 requests at once on one key of limit 10: exactly 10 pass, in far
/// fewer script calls than requests (with Redis `TIME`, no test clock). On
/// one thread, so that the first call cannot be answered before the others
/// are queued (on a loaded machine a worker thread can read its reply
/// while this one is descheduled, and the next request then finds nothing
/// in flight: correct, but not a count to assert).
#[tokio::test(flavor = "current_thread")]
async fn concurrent_requests_share_calls_and_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let b: Backend = RedisBackend::from_url(&redis.url()).unwrap().into();
    // A day's window: the run cannot straddle two.
    let day = Limit::FixedWindow(Window {
        limit: 10,
        window_us: 86_400 * S,
    });
    // Load the function first, so that the count below is of checks only.
    b.check(vec![tier("warm", day)]).await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let requests: Vec<Vec<TierCheck>> = (0..64).map(|_| vec![tier("k", day)]).collect();
    let verdicts = join_in_order(checks_of(&b, &requests)).await;
    let allowed = verdicts
        .iter()
        .filter(|v| v.as_ref().unwrap().allowed())
        .count();
    assert_eq!(allowed, 10);
    // The first alone, the 63 others in two calls (32 + 31).
    assert_eq!(redis.calls("fcall"), 3);
    // The first ten in arrival order passed, with exact remainings.
    for (i, v) in verdicts.iter().enumerate() {
        let d = &v.as_ref().unwrap().decisions[0];
        assert_eq!(d.allowed, i < 10, "request {i}");
        assert_eq!(d.remaining, 9u64.saturating_sub(i as u64), "request {i}");
    }
}

/// Requests spawned from many tasks on several threads: still exactly the
/// limit, in fewer calls than requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_from_many_threads_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let b: Backend = RedisBackend::from_url(&redis.url()).unwrap().into();
    let day = Limit::FixedWindow(Window {
        limit: 10,
        window_us: 86_400 * S,
    });
    b.check(vec![tier("warm", day)]).await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let b = b.clone();
        tasks.push(tokio::spawn(async move {
            b.check(vec![tier("spawned", day)]).await.unwrap().allowed()
        }));
    }
    let mut n = 0;
    for t in tasks {
        n += usize::from(t.await.unwrap());
    }
    assert_eq!(n, 10);
    let calls = redis.calls("fcall");
    assert!((1..64).contains(&calls), "{calls} calls");
}

/// Sequential requests are each sent alone, as ever: one call a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_requests_are_one_call_each() {
    let redis = RedisServer::start();
    let b: Backend = RedisBackend::from_url(&redis.url()).unwrap().into();
    b.check(vec![tier("warm", fixed(100))]).await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    for i in 0..20u64 {
        let v = b.check(vec![tier("k", fixed(100))]).await.unwrap();
        assert_eq!(v.decisions[0].remaining, 99 - i);
    }
    assert_eq!(redis.calls("fcall"), 20);
}

/// In one call, a request denied by one of its keys leaves its other keys
/// untouched, and the requests after it see exactly that.
#[tokio::test(flavor = "current_thread")]
async fn a_denied_request_in_a_batch_charges_none_of_its_keys() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b: Backend = redis.backend_on(&clock).into();
    b.check(vec![tier("warm", fixed(1))]).await.unwrap();
    let requests = vec![
        vec![tier("a", fixed(1))],
        // Queued behind the first: "a" is full by then, so "b" stays at 0.
        vec![tier("b", fixed(2)), tier("a", fixed(1))],
        vec![tier("b", fixed(2))],
        vec![tier("b", fixed(2))],
        vec![tier("b", fixed(2))],
    ];
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let v: Vec<bool> = join_in_order(checks_of(&b, &requests))
        .await
        .into_iter()
        .map(|v| v.unwrap().allowed())
        .collect();
    assert_eq!(v, [true, false, true, true, false]);
    assert_eq!(redis.calls("fcall"), 2);
}

/// Requests of every algorithm, several tiers and shared keys, sent at once
/// (one alone, the rest in one call) decide exactly as the memory backend
/// decides them one after the other in the same order.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_decides_as_the_memory_backend_in_arrival_order() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (red, mem) = redis.redis_and_memory(&clock);
    let bucket = TokenBucket::new(5, 60 * S, 5).unwrap();
    let limits = [
        fixed(4),
        Limit::SlidingWindowCounter(Window {
            limit: 5,
            window_us: 60 * S,
        }),
        Limit::SlidingWindowLog(Window {
            limit: 3,
            window_us: 60 * S,
        }),
        Limit::TokenBucket(bucket),
        Limit::LeakyBucket(Gcra {
            bucket,
            max_delay_us: None,
        }),
    ];
    let mut rng = Rng::new(43);
    red.check(vec![tier("warm", fixed(1))]).await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    for round in 0..12 {
        let requests = random_requests(&mut rng, &limits, 25, "", 2);
        let got = join_in_order(checks_of(&red, &requests)).await;
        for (i, (r, g)) in requests.iter().zip(got).enumerate() {
            let want = mem.check(r.clone()).await.unwrap();
            let g = g.unwrap();
            assert_eq!(g.decisions, want.decisions, "round {round} request {i}");
            assert_eq!(g.now_us, want.now_us);
        }
        clock.advance(Duration::from_micros(rng.next() % (20 * S)));
    }
    // One alone and one batch a round.
    assert_eq!(redis.calls("fcall"), 24);
}

/// A request queued behind a call that does not come back in time gets its
/// failure policy when its deadline passes (fail open here), like the
/// request in flight; neither is charged when Redis comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_past_its_deadline_follows_the_failure_policy() {
    let redis = RedisServer::start();
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&redis.url()).unwrap())
        .tier(Tier::new("global", Global, Quota::per_hour(100)))
        .backend_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let url = format!("http://{addr}/");
    // Calibrates Redis's clock: the later checks carry their deadline.
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()).remaining,
        Some(99)
    );
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    redis.pause();
    // Four: the default circuit breaker opens at the fifth failure.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            limits(&c.get(&url).send().await.unwrap())
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), NO_LIMITS);
    }
    assert_eq!(handle.counts().fail_open, 4);
    // A deadline may lie a reply's latency past the moment its timeout
    // fired here (redis_backend.rs, the same wait): one more timeout puts
    // them all behind Redis's clock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    // Whatever reached Redis after its deadline wrote nothing (the queued
    // requests were given up before their call, or reached Redis late): the
    // next request is the second charged.
    assert_eq!(
        limits(&c.get(&url).send().await.unwrap()).remaining,
        Some(98)
    );
    // The first alone, the others in one call at most, the last alone.
    assert!(redis.calls("fcall") <= 3, "{}", redis.calls("fcall"));
}

/// Where Redis refuses Functions, a batch runs as an `EVALSHA` script of
/// the same code (reloaded after `SCRIPT FLUSH`).
#[tokio::test(flavor = "current_thread")]
async fn without_functions_a_batch_runs_as_a_script() {
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
    let clock = ManualClock::new(T0_US);
    let b: Backend = RedisBackend::from_url(&url)
        .unwrap()
        .with_manual_clock(clock)
        .into();
    b.check(vec![tier("warm", fixed(1))]).await.unwrap();
    redis.cmd::<()>(&["SCRIPT", "FLUSH"]);
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let requests: Vec<Vec<TierCheck>> = (0..16).map(|_| vec![tier("k", fixed(10))]).collect();
    let verdicts = join_in_order(checks_of(&b, &requests)).await;
    let allowed: Vec<bool> = verdicts
        .iter()
        .map(|v| v.as_ref().unwrap().allowed())
        .collect();
    assert_eq!(allowed, (0..16).map(|i| i < 10).collect::<Vec<_>>());
    // Each call once refused (NOSCRIPT), its script loaded, sent again.
    assert_eq!(redis.calls("evalsha"), 4);
    assert_eq!(redis.calls("script|load"), 2);
    assert_eq!(redis.calls("fcall"), 0);
}

/// Group commit off (`with_max_batch(1)`): every request is its own call.
#[tokio::test(flavor = "current_thread")]
async fn max_batch_one_sends_every_request_alone() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b: Backend = redis.backend_on(&clock).with_max_batch(1).into();
    b.check(vec![tier("warm", fixed(100))]).await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let requests: Vec<Vec<TierCheck>> = (0..16).map(|_| vec![tier("k", fixed(10))]).collect();
    let verdicts = join_in_order(checks_of(&b, &requests)).await;
    let allowed = verdicts
        .iter()
        .filter(|v| v.as_ref().unwrap().allowed())
        .count();
    assert_eq!(allowed, 10);
    assert_eq!(redis.calls("fcall"), 16);
}

/// Requests whose tiers are all fixed windows take the batch's
/// increment-first path (`check_incr`, lua/dispatch.lua): over window
/// turns, shared keys, costs up to above the limit and both stored forms
/// (limit < window: an integer; limit ≥ window: "start:count", which goes
/// the ordinary way), they decide exactly as the memory backend does.
#[tokio::test(flavor = "current_thread")]
async fn fixed_windows_increment_first_decide_as_the_memory_backend() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (red, mem) = redis.redis_and_memory(&clock);
    let limits = [
        fixed(3),
        Limit::FixedWindow(Window {
            limit: 5,
            window_us: 2 * S,
        }),
        // limit ≥ window: the "start:count" form.
        Limit::FixedWindow(Window {
            limit: 10,
            window_us: 8,
        }),
    ];
    let mut rng = Rng::new(7);
    for round in 0..30 {
        let requests = random_requests(&mut rng, &limits, 20, "fw", 4);
        let got = join_in_order(checks_of(&red, &requests)).await;
        for (i, (r, g)) in requests.iter().zip(got).enumerate() {
            let want = mem.check(r.clone()).await.unwrap();
            assert_eq!(
                g.unwrap().decisions,
                want.decisions,
                "round {round} request {i}"
            );
        }
        clock.advance(Duration::from_micros(rng.next() % (3 * S / 2)));
    }
    // The integer form went the increment-first way; the other did not.
    assert!(redis.calls("incrby") > 0);
}

/// A denied request on the increment-first path leaves its keys exactly as
/// it found them: an existing key's value and expiry, and no key it
/// created.
#[tokio::test(flavor = "current_thread")]
async fn an_increment_first_denial_leaves_its_keys_as_found() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b: Backend = redis.backend_on(&clock).into();
    b.check(vec![tier("a", fixed(5))]).await.unwrap();
    let a_before: String = redis.get("a").unwrap();
    let expiry: i64 = redis.cmd(&["PEXPIRETIME", "a"]);
    let requests = vec![
        vec![tier("warm", fixed(5))],
        // "a" passes, "full" denies (cost 2 above its limit 1): neither is
        // charged, and "full", which did not exist, still does not.
        vec![
            tier("a", fixed(5)),
            TierCheck {
                key: "full".to_owned(),
                limit: fixed(1),
                cost: 2,
                home: None,
            },
        ],
        vec![tier("a", fixed(5))],
    ];
    let v: Vec<Verdict> = join_in_order(checks_of(&b, &requests))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        v.iter().map(Verdict::allowed).collect::<Vec<_>>(),
        [true, false, true]
    );
    // The third request saw the count the first left: 1, so 3 remain.
    assert_eq!(v[2].decisions[0].remaining, 3);
    assert_eq!(redis.get("full"), None);
    let a_after: u64 = redis.get("a").unwrap().parse().unwrap();
    assert_eq!(a_after, a_before.parse::<u64>().unwrap() + 1);
    // Its expiry as the first request set it: nothing SET it since.
    let expiry_after: i64 = redis.cmd(&["PEXPIRETIME", "a"]);
    assert_eq!(expiry_after, expiry);
}

/// A request of fixed windows sent alone (not in a group commit) is decided
/// increment-first too (`check_incr`, lua/check.lua): one INCRBY per key,
/// no read; denied, it leaves its keys exactly as it found them (an
/// existing key's value and expiry, and no key it created), and the next
/// request sees the count the allowed ones left.
#[tokio::test(flavor = "current_thread")]
async fn a_lone_increment_first_denial_leaves_its_keys_as_found() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b: Backend = redis.backend_on(&clock).into();
    let v = b.check(vec![tier("a", fixed(5))]).await.unwrap();
    assert_eq!(v.decisions[0].remaining, 4);
    let a_before: String = redis.get("a").unwrap();
    let expiry: i64 = redis.cmd(&["PEXPIRETIME", "a"]);
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    // "a" passes, "full" denies (cost 2 above its limit 1): neither is
    // charged, and "full", which did not exist, still does not.
    let v = b
        .check(vec![
            tier("a", fixed(5)),
            TierCheck {
                key: "full".to_owned(),
                limit: fixed(1),
                cost: 2,
                home: None,
            },
        ])
        .await
        .unwrap();
    assert!(!v.allowed());
    // (What "a" would have left: its tier allowed.)
    assert_eq!(v.decisions[0].remaining, 3);
    assert!(!v.decisions[1].allowed);
    assert_eq!(redis.get("full"), None);
    assert_eq!(redis.get("a").unwrap(), a_before);
    let expiry_after: i64 = redis.cmd(&["PEXPIRETIME", "a"]);
    assert_eq!(expiry_after, expiry);
    let v = b.check(vec![tier("a", fixed(5))]).await.unwrap();
    assert_eq!(v.decisions[0].remaining, 3);
    // Each went alone, with no read: INCRBY per key (two, one, one).
    assert_eq!(redis.calls("fcall"), 2);
    assert_eq!(redis.calls("incrby"), 3);
    assert_eq!(redis.calls("mget"), 0);
}

/// `n` random requests of 1 to 3 tiers, each tier one of `limits` on a key
/// `<prefix><limit's index>:k<0..3>:<tier>` (keys shared across requests,
/// one algorithm each), of cost 1 to `max_cost`.
fn random_requests(
    rng: &mut Rng,
    limits: &[Limit],
    n: usize,
    prefix: &str,
    max_cost: u64,
) -> Vec<Vec<TierCheck>> {
    (0..n)
        .map(|_| {
            let tiers = 1 + rng.next() % 3;
            (0..tiers)
                .map(|t| {
                    let a = (rng.next() % limits.len() as u64) as usize;
                    TierCheck {
                        key: format!("{prefix}{a}:k{}:{t}", rng.next() % 3),
                        limit: limits[a],
                        cost: 1 + rng.next() % max_cost,
                        home: None,
                    }
                })
                .collect()
        })
        .collect()
}

/// Requests with candidate quotas in batches (lua/batch.lua runs each
/// through check_request): every decision, the candidates' included, is
/// the memory backend's in arrival order.
#[tokio::test(flavor = "current_thread")]
async fn candidates_in_a_batch_decide_as_the_memory_backend() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (red, mem) = redis.redis_and_memory(&clock);
    let bucket = TokenBucket::new(5, 60 * S, 5).unwrap();
    let limits = [
        fixed(4),
        Limit::SlidingWindowLog(Window {
            limit: 3,
            window_us: 60 * S,
        }),
        Limit::TokenBucket(bucket),
    ];
    let mut rng = Rng::new(47);
    red.check(vec![tier("warm", fixed(1))]).await.unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let (mut denied, mut allowed) = (0, 0);
    for round in 0..12 {
        let requests: Vec<(Vec<TierCheck>, Vec<u8>)> =
            random_requests(&mut rng, &limits, 25, "", 2)
                .into_iter()
                .map(|mut r| {
                    let live = r.len();
                    let mut live_of = Vec::new();
                    for l in 0..live {
                        let c = &r[l];
                        // Each key keeps one limit: the next one's after its
                        // live key's.
                        let a = limits.iter().position(|x| *x == c.limit).unwrap_or(0);
                        let limit = limits[(a + 1) % limits.len()];
                        let cost = c.cost.min(limit.capacity() + 1);
                        let key = format!("{}{{c:{l}}}", c.key);
                        r.push(TierCheck {
                            key,
                            limit,
                            cost,
                            home: None,
                        });
                        live_of.push(l as u8);
                    }
                    (r, live_of)
                })
                .collect();
        let futs: Vec<CheckFut> = requests
            .iter()
            .map(|(r, live_of)| {
                let (b, r, live_of) = (red.clone(), r.clone(), live_of.clone());
                Box::pin(async move { b.check_candidates(r, 0, &live_of).await }) as CheckFut
            })
            .collect();
        let got = join_in_order(futs).await;
        for (i, ((r, live_of), g)) in requests.iter().zip(got).enumerate() {
            let want = mem.check_candidates(r.clone(), 0, live_of).await.unwrap();
            let g = g.unwrap();
            assert_eq!(g.decisions, want.decisions, "round {round} request {i}");
            for d in &want.decisions[r.len() - live_of.len()..] {
                if d.allowed {
                    allowed += 1;
                } else {
                    denied += 1;
                }
            }
        }
        clock.advance(Duration::from_micros(rng.next() % (20 * S)));
    }
    assert!(
        denied > 20 && allowed > 20,
        "{denied} denied, {allowed} allowed"
    );
    // One alone and one batch a round.
    assert_eq!(redis.calls("fcall"), 24);
}

/// Fixed windows only, live and candidate: a batch of such requests is
/// decided increment-first (check_incr), which must leave candidates to
/// check_request: a candidate's denial never rejects its request. Live
/// windows of 6 with candidates of 2, so candidates deny while the live
/// tiers allow; every decision is the memory backend's.
#[tokio::test(flavor = "current_thread")]
async fn fixed_window_candidates_in_a_batch_never_reject_a_request() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (red, mem) = redis.redis_and_memory(&clock);
    let mut rng = Rng::new(53);
    red.check(vec![tier("warm", fixed(1))]).await.unwrap();
    let (mut live_allowed, mut candidate_denied) = (0, 0);
    for round in 0..8 {
        let requests: Vec<(Vec<TierCheck>, Vec<u8>)> =
            random_requests(&mut rng, &[fixed(6)], 25, "", 1)
                .into_iter()
                .map(|mut r| {
                    let live = r.len();
                    let mut live_of = Vec::new();
                    for l in 0..live {
                        let key = format!("{}{{c:2/1m}}", r[l].key);
                        r.push(TierCheck {
                            key,
                            limit: fixed(2),
                            cost: 1,
                            home: None,
                        });
                        live_of.push(l as u8);
                    }
                    (r, live_of)
                })
                .collect();
        let futs: Vec<CheckFut> = requests
            .iter()
            .map(|(r, live_of)| {
                let (b, r, live_of) = (red.clone(), r.clone(), live_of.clone());
                Box::pin(async move { b.check_candidates(r, 0, &live_of).await }) as CheckFut
            })
            .collect();
        let got = join_in_order(futs).await;
        for (i, ((r, live_of), g)) in requests.iter().zip(got).enumerate() {
            let want = mem.check_candidates(r.clone(), 0, live_of).await.unwrap();
            assert_eq!(
                g.unwrap().decisions,
                want.decisions,
                "round {round} request {i}"
            );
            let n = r.len() - live_of.len();
            if want.decisions[..n].iter().all(|d| d.allowed) {
                live_allowed += 1;
                candidate_denied += usize::from(want.decisions[n..].iter().any(|d| !d.allowed));
            }
        }
        clock.advance(Duration::from_micros(rng.next() % (40 * S)));
    }
    assert!(
        candidate_denied > 10 && live_allowed > candidate_denied,
        "{live_allowed} allowed, {candidate_denied} of them with a candidate denying"
    );
}
