//! The concurrency tier through real HTTP: requests in flight per key,
//! measured by the handler itself, on the memory backend, two app instances
//! sharing a real Redis, and two sharing a real Redis Cluster; the slot is
//! released when the response body is done or dropped (a cancelled client
//! included), and a crashed instance's slots come back after their TTL
//! (on the test clock the scripts accept, never a sleep).

use crate::support::cluster::{calls as node_calls, RedisCluster};
use crate::support::*;
use axum::{extract::State, routing::get, Router};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tiered_ratelimit::algorithm::{Concurrency, Limit, RETRY_ESTIMATE_US};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend, TierCheck};
use tiered_ratelimit::key::Global;
use tiered_ratelimit::response::HeaderStyle;
use tiered_ratelimit::{RateLimitHandle, RateLimitLayer, Tier};
use tokio::sync::watch;

/// What the handler sees: requests running now, the most at once, and the
/// gate they wait at.
#[derive(Clone)]
struct Probe {
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
}

impl Probe {
    fn new() -> (Self, watch::Sender<bool>) {
        let (open, gate) = watch::channel(false);
        let p = Probe {
            running: Arc::default(),
            most: Arc::default(),
            gate,
        };
        (p, open)
    }
}

/// Counts a handler out when it ends or is dropped.
struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn slow(State(p): State<Probe>) -> &'static str {
    let n = p.running.fetch_add(1, Ordering::SeqCst) + 1;
    let _running = Running(p.running.clone());
    p.most.fetch_max(n, Ordering::SeqCst);
    let mut gate = p.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    "done"
}

fn app(layer: RateLimitLayer, probe: Probe) -> Router {
    Router::new()
        .route("/slow", get(slow))
        .layer(layer)
        .with_state(probe)
}

fn layer(backend: impl Into<Backend>, limit: u64) -> RateLimitLayer {
    RateLimitLayer::builder()
        .backend(backend.into())
        .backend_timeout(Duration::from_secs(2))
        .tier(Tier::concurrency("inflight", Global, limit))
        .build()
        .unwrap()
}

/// Waits (10 s at most) until `cond` holds: for a state the test caused,
/// never for time to pass.
async fn until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..5000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Until a peek says the tier has `free` slots (releases land in a task).
async fn until_free(h: &RateLimitHandle, free: u64) {
    for _ in 0..5000 {
        let s = h.peek("inflight", "all").await.unwrap();
        if s.allowed && s.remaining + 1 == free {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the slots were not released");
}

/// 50 concurrent slow requests against a limit of 5 spread over the
/// instances: exactly 5 run at once (as the handler counts them), the 45
/// others are 429 with `Retry-After: 1`; once the 5 end, their slots are
/// free and the next 5 run.
async fn fifty_against_five(layers: Vec<RateLimitLayer>) {
    let (probe, open) = Probe::new();
    let handle = layers[0].handle();
    let mut addrs = Vec::new();
    for l in layers {
        addrs.push(serve(app(l, probe.clone())).await);
    }
    for round in 0..2 {
        let _ = open.send(false);
        let c = client();
        let mut tasks = Vec::new();
        for i in 0..50 {
            let url = format!("http://{}/slow", addrs[i % addrs.len()]);
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let res = c.get(url).send().await.unwrap();
                let l = limits(&res);
                let body = res.text().await.unwrap();
                (l, body)
            }));
        }
        // The 45 denials come back while the 5 admitted wait at the gate.
        let done =
            |t: &Vec<tokio::task::JoinHandle<_>>| t.iter().filter(|t| t.is_finished()).count();
        until("45 requests were answered", || done(&tasks) == 45).await;
        assert_eq!(probe.running.load(Ordering::SeqCst), 5, "round {round}");
        let _ = open.send(true);
        let mut remaining = Vec::new();
        let mut denials = 0;
        for t in tasks {
            let (l, body) = t.await.unwrap();
            if l.status == 200 {
                assert_eq!(body, "done");
                assert_eq!((l.limit, l.reset), (Some(5), Some(T0_S + 60)));
                remaining.push(l.remaining.unwrap());
            } else {
                assert_eq!(l, denied(5, 0, T0_S + 1, 1));
                denials += 1;
            }
        }
        remaining.sort_unstable();
        assert_eq!((remaining, denials), (vec![0, 1, 2, 3, 4], 45));
        assert_eq!(probe.most.load(Ordering::SeqCst), 5);
        // Every body has been sent: every slot comes back.
        until_free(&handle, 5).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_against_five_in_memory() {
    let clock = ManualClock::new(T0_US);
    fifty_against_five(vec![layer(MemoryBackend::with_manual_clock(clock), 5)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_against_five_on_two_instances_sharing_redis() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // Group commit off: every request its own call, so that the calls can
    // be counted exactly (with it, the next test).
    let backend = || {
        RedisBackend::from_url(&redis.url())
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_max_batch(1)
    };
    fifty_against_five(vec![layer(backend(), 5), layer(backend(), 5)]).await;
    // One script call per request (not counting the calls of the first
    // burst that met "Function not found" before the library was loaded),
    // and one ZREM per admitted request's release: nothing else per request.
    assert_eq!(redis.succeeded("fcall"), 100);
    assert_eq!(redis.calls("evalsha"), 0);
    assert_eq!(redis.calls("zrem"), 10);
    // No slot left behind; only the fleet-wide top-N's hourly set.
    let keys: Vec<String> = redis.cmd(&["KEYS", "*"]);
    assert_eq!(keys, vec![format!("rl:blocked:{}", T0_S / 3600)]);
}

/// The same with group commit (the default): concurrent requests share
/// script calls, never more than one a request, and the slots come out
/// the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_against_five_on_two_instances_sharing_redis_with_group_commit() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let backend = || {
        RedisBackend::from_url(&redis.url())
            .unwrap()
            .with_manual_clock(clock.clone())
    };
    fifty_against_five(vec![layer(backend(), 5), layer(backend(), 5)]).await;
    let calls = redis.succeeded("fcall");
    assert!((1..=100).contains(&calls), "{calls} calls for 100 requests");
    assert_eq!(redis.calls("evalsha"), 0);
    assert_eq!(redis.calls("zrem"), 10);
    let keys: Vec<String> = redis.cmd(&["KEYS", "*"]);
    assert_eq!(keys, vec![format!("rl:blocked:{}", T0_S / 3600)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_against_five_on_two_instances_sharing_a_cluster() {
    let cluster = RedisCluster::start(0);
    let clock = ManualClock::new(T0_US);
    let backend = || {
        RedisBackend::cluster(cluster.urls())
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
    };
    fifty_against_five(vec![layer(backend(), 5), layer(backend(), 5)]).await;
    let owner = cluster.primary_of("{rl:inflight:all}");
    assert_eq!(node_calls(owner, "zrem"), 10);
    assert!(cluster.keys().is_empty());
}

/// A client that gives up frees its slot at once: the test clock stands
/// still, so only the release can free it.
async fn cancelled_client_frees_the_slot(backend: Backend) {
    let (probe, open) = Probe::new();
    let l = layer(backend, 1);
    let h = l.handle();
    let addr = serve(app(l, probe.clone())).await;
    let url = format!("http://{addr}/slow");
    // A raw client: the request, then the socket closed under it.
    let mut first = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut first, b"GET /slow HTTP/1.1\r\nhost: test\r\n\r\n")
        .await
        .unwrap();
    until("the first request runs", || {
        probe.running.load(Ordering::SeqCst) == 1
    })
    .await;
    let res = client().get(&url).send().await.unwrap();
    assert_eq!(limits(&res), denied(1, 0, T0_S + 1, 1));
    drop(first);
    // The server sees the connection close and drops the request.
    until("the handler was dropped", || {
        probe.running.load(Ordering::SeqCst) == 0
    })
    .await;
    until_free(&h, 1).await;
    let _ = open.send(true);
    let res = client().get(&url).send().await.unwrap();
    assert_eq!(limits(&res), ok(1, 0, T0_S + 60));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_client_frees_the_slot_in_memory() {
    let clock = ManualClock::new(T0_US);
    cancelled_client_frees_the_slot(MemoryBackend::with_manual_clock(clock).into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_client_frees_the_slot_on_redis() {
    let redis = RedisServer::start();
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    cancelled_client_frees_the_slot(b.into()).await;
}

/// A crashed instance never releases: its slots count until their leases
/// expire (60 s on the test clock), then they are free.
async fn slots_of_a_crashed_instance_expire(backend: Backend, clock: &ManualClock) {
    let c = Concurrency {
        limit: 2,
        ttl_us: 60_000_000,
        slot: 0,
    };
    let check = |slot: u64| {
        vec![TierCheck {
            key: "crash:inflight:all".to_owned(),
            limit: Limit::Concurrency(c.with_slot(slot)),
            cost: 1,
            home: None,
        }]
    };
    // The crashed instance took two slots and will never give them back.
    for slot in [1, 2] {
        assert!(backend.check(check(slot)).await.unwrap().allowed());
    }
    clock.advance(Duration::from_micros(59_999_999));
    let v = backend.check(check(3)).await.unwrap();
    assert_eq!(
        (v.decisions[0].allowed, v.decisions[0].retry_after_us),
        (false, 1)
    );
    clock.advance(Duration::from_micros(1));
    let v = backend.check(check(3)).await.unwrap();
    assert_eq!(
        (v.decisions[0].allowed, v.decisions[0].remaining),
        (true, 1)
    );
    let v = backend.check(check(4)).await.unwrap();
    assert_eq!(
        (v.decisions[0].allowed, v.decisions[0].remaining),
        (true, 0)
    );
    let v = backend.check(check(5)).await.unwrap();
    assert_eq!(
        (v.decisions[0].allowed, v.decisions[0].retry_after_us),
        (false, RETRY_ESTIMATE_US)
    );
}

#[tokio::test]
async fn slots_of_a_crashed_instance_expire_in_memory() {
    let clock = ManualClock::new(T0_US);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    slots_of_a_crashed_instance_expire(b.into(), &clock).await;
}

#[tokio::test]
async fn slots_of_a_crashed_instance_expire_on_redis() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600));
    slots_of_a_crashed_instance_expire(b.into(), &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_of_a_crashed_instance_expire_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600));
    slots_of_a_crashed_instance_expire(b.into(), &clock).await;
}

/// The IETF fields name the draft's quota unit for requests in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ietf_headers_use_the_concurrent_requests_unit() {
    let (probe, open) = Probe::new();
    let l = RateLimitLayer::builder()
        .backend(MemoryBackend::with_manual_clock(ManualClock::new(T0_US)))
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::concurrency("inflight", Global, 1))
        .build()
        .unwrap();
    let addr = serve(app(l, probe.clone())).await;
    let url = format!("http://{addr}/slow");
    let first = tokio::spawn({
        let url = url.clone();
        async move { client().get(url).send().await.unwrap() }
    });
    until("the first request runs", || {
        probe.running.load(Ordering::SeqCst) == 1
    })
    .await;
    let res = client().get(&url).send().await.unwrap();
    assert_eq!(res.status(), 429);
    let h = |n: &str| res.headers().get(n).unwrap().to_str().unwrap().to_owned();
    assert_eq!(
        h("ratelimit-policy"),
        r#""inflight";q=1;qu="concurrent-requests""#
    );
    assert_eq!(h("ratelimit"), r#""inflight";r=0;t=1"#);
    assert_eq!(h("retry-after"), "1");
    let _ = open.send(true);
    let res = first.await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["ratelimit-policy"],
        r#""inflight";q=1;qu="concurrent-requests""#
    );
}

/// A request that runs longer than its slot's TTL keeps its slot: every half
/// TTL its slot is renewed to a whole TTL from the backend's clock.
/// The TTL is 200 ms (renewals every 100 ms of real time); the test clock
/// moves only when the test says, and the test waits for each renewal to
/// show in a peek.
async fn long_requests_renew_their_slot(backend: Backend, clock: ManualClock) {
    let (probe, open) = Probe::new();
    let l = RateLimitLayer::builder()
        .backend(backend)
        .tier(Tier::concurrency("inflight", Global, 1).algorithm(
            tiered_ratelimit::Algorithm::Concurrency {
                slot_ttl: Duration::from_millis(200),
            },
        ))
        .build()
        .unwrap();
    let h = l.handle();
    let addr = serve(app(l, probe.clone())).await;
    let url = format!("http://{addr}/slow");
    let first = tokio::spawn({
        let url = url.clone();
        async move { client().get(url).send().await.unwrap() }
    });
    until("the first request runs", || {
        probe.running.load(Ordering::SeqCst) == 1
    })
    .await;
    for _ in 0..3 {
        // 150 ms on: without a renewal the slot would end in 50 ms.
        clock.advance(Duration::from_millis(150));
        let mut renewed = false;
        for _ in 0..5000 {
            let s = h.peek("inflight", "all").await.unwrap();
            assert!(!s.allowed, "the running request lost its slot");
            if s.reset_after == Duration::from_millis(200) {
                renewed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(renewed, "the slot was not renewed");
    }
    // 450 ms after it started, the request still holds its slot.
    let res = client().get(&url).send().await.unwrap();
    assert_eq!(res.status(), 429);
    let _ = open.send(true);
    assert_eq!(first.await.unwrap().status(), 200);
    until_free(&h, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_requests_renew_their_slot_in_memory() {
    let clock = ManualClock::new(T0_US);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    long_requests_renew_their_slot(b.into(), clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_requests_renew_their_slot_on_redis() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600));
    long_requests_renew_their_slot(b.into(), clock).await;
}

/// On a cluster a request's tiers live in several slots: a slot taken on
/// the concurrency tier while a rate tier in another slot denies is given
/// back (the cross-slot refund releases the lease), so the denied request
/// holds no slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_slot_denial_gives_the_slot_back() {
    let cluster = RedisCluster::start(0);
    let clock = ManualClock::new(T0_US);
    let b: Backend = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    let (inflight, rate) = ("x:inflight:all", "x:rate:all");
    assert_ne!(
        cluster.keyslot(&format!("{{{inflight}}}")),
        cluster.keyslot(&format!("{{{rate}}}"))
    );
    let c = Concurrency {
        limit: 2,
        ttl_us: 60_000_000,
        slot: 0,
    };
    let checks = |slot: u64, with_rate: bool| {
        let mut v = vec![TierCheck {
            key: inflight.to_owned(),
            limit: Limit::Concurrency(c.with_slot(slot)),
            cost: 1,
            home: None,
        }];
        if with_rate {
            v.push(TierCheck {
                key: rate.to_owned(),
                limit: Limit::FixedWindow(tiered_ratelimit::algorithm::Window {
                    limit: 1,
                    window_us: 3_600_000_000,
                }),
                cost: 1,
                home: None,
            });
        }
        v
    };
    assert!(b.check(checks(1, true)).await.unwrap().allowed());
    // The rate tier denies: the concurrency slot taken meanwhile is refunded.
    let v = b.check(checks(2, true)).await.unwrap();
    assert_eq!(
        v.decisions.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, false]
    );
    let held: u64 = cluster.cmd_for_key(
        &format!("{{{inflight}}}"),
        &["ZCARD", &format!("{{{inflight}}}")],
    );
    assert_eq!(held, 1);
    let v = b.check(checks(3, false)).await.unwrap();
    assert_eq!(
        (v.decisions[0].allowed, v.decisions[0].remaining),
        (true, 0)
    );
}

/// A handler that panics drops its request: the slot is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_releases_its_slot() {
    let l = layer(MemoryBackend::with_manual_clock(ManualClock::new(T0_US)), 1);
    let h = l.handle();
    let app = Router::new()
        .route(
            "/panic",
            get(|| async {
                if true {
                    panic!("handler panic (expected by the test)");
                }
                "unreachable"
            }),
        )
        .layer(l);
    let addr = serve(app).await;
    // The connection dies with the handler: no response.
    assert!(client()
        .get(format!("http://{addr}/panic"))
        .send()
        .await
        .is_err());
    until_free(&h, 1).await;
}

/// An app instance killed mid-request (its runtime shut down: no release
/// ever runs, as after a crash) keeps its slots until their TTLs expire
/// on the test clock; the other instance then admits again.
#[test]
fn a_killed_instance_frees_its_slots_after_their_ttl() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let backend = || {
        RedisBackend::from_url(&redis.url())
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
    };
    let doomed = multi_thread_runtime();
    let (probe, _open) = Probe::new();
    let addr_b = doomed.block_on(serve(app(layer(backend(), 2), probe.clone())));
    let rt = multi_thread_runtime();
    rt.block_on(async {
        let a = layer(backend(), 2);
        let h = a.handle();
        let addr_a = serve(app(a, probe.clone())).await;
        // Two requests run on instance B and hold both slots.
        let mut held = Vec::new();
        for _ in 0..2 {
            let url = format!("http://{addr_b}/slow");
            held.push(tokio::spawn(async move { client().get(url).send().await }));
        }
        until("both requests run on B", || {
            probe.running.load(Ordering::SeqCst) == 2
        })
        .await;
        let url_a = format!("http://{addr_a}/slow?a");
        assert_eq!(
            limits(&client().get(&url_a).send().await.unwrap()),
            denied(2, 0, T0_S + 1, 1)
        );
        // Kill B: its tasks are dropped and no release can run.
        doomed.shutdown_background();
        for t in held {
            assert!(t.await.unwrap().is_err(), "B answered after it was killed");
        }
        let s = h.peek("inflight", "all").await.unwrap();
        assert!(!s.allowed, "B's slots came back without a release");
        // One microsecond before the slots expire: still held.
        clock.advance(Duration::from_micros(59_999_999));
        assert!(!h.peek("inflight", "all").await.unwrap().allowed);
        clock.advance(Duration::from_micros(1));
        let s = h.peek("inflight", "all").await.unwrap();
        assert_eq!((s.allowed, s.remaining), (true, 1));
    });
}
