//! A long request's concurrency slot is renewed every half TTL; a
//! renewal that fails (its connection dropped by `CLIENT KILL`) is tried
//! again until the slot would lapse, so the slot never lapses while the
//! request runs; and a slot that lapses all the same is counted in
//! `tiered_ratelimit_concurrency_lapses_total{tier}`. A global debugging
//! recorder: its own test binary, so that no other test's lapses count.

mod support;

use axum::{extract::State, routing::get, Router};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use support::*;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::key::Global;
use tiered_ratelimit::{Algorithm, RateLimitHandle, RateLimitLayer, Tier};
use tokio::sync::watch;

fn snapshotter() -> &'static Snapshotter {
    static S: OnceLock<Snapshotter> = OnceLock::new();
    S.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let s = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        s
    })
}

/// `tiered_ratelimit_concurrency_lapses_total{tier}` so far (a snapshot
/// hands out what was counted since the last one: summed here).
fn lapses(tier: &str) -> u64 {
    static SEEN: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap();
    for (k, _, _, v) in snapshotter().snapshot().into_vec() {
        if k.key().name() != "tiered_ratelimit_concurrency_lapses_total" {
            continue;
        }
        let DebugValue::Counter(n) = v else {
            panic!("not a counter: {v:?}");
        };
        for l in k.key().labels().filter(|l| l.key() == "tier") {
            match seen.iter_mut().find(|(t, _)| t == l.value()) {
                Some((_, total)) => *total += n,
                None => seen.push((l.value().to_owned(), n)),
            }
        }
    }
    seen.iter().find(|(t, _)| t == tier).map_or(0, |(_, n)| *n)
}

#[derive(Clone)]
struct Probe {
    running: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
}

async fn slow(State(p): State<Probe>) -> &'static str {
    p.running.fetch_add(1, Ordering::SeqCst);
    let mut gate = p.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    "done"
}

/// One request of a 1-slot tier `tier` (TTL `slot_ttl`) running, held at
/// its gate.
async fn one_running(
    backend: Backend,
    tier: &str,
    slot_ttl: Duration,
) -> (
    RateLimitHandle,
    watch::Sender<bool>,
    tokio::task::JoinHandle<u16>,
) {
    let (open, gate) = watch::channel(false);
    let probe = Probe {
        running: Arc::default(),
        gate,
    };
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(2))
        .tier(Tier::concurrency(tier, Global, 1).algorithm(Algorithm::Concurrency { slot_ttl }))
        .build()
        .unwrap();
    let handle = layer.handle();
    let app = Router::new()
        .route("/slow", get(slow))
        .layer(layer)
        .with_state(probe.clone());
    let addr = serve(app).await;
    let first = tokio::spawn(async move {
        client()
            .get(format!("http://{addr}/slow"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    for _ in 0..5000 {
        if probe.running.load(Ordering::SeqCst) == 1 {
            return (handle, open, first);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the first request did not run");
}

/// Redis's clock, in µs.
fn redis_now_us(redis: &RedisServer) -> u64 {
    let (s, us): (u64, u64) = redis.cmd(&["TIME"]);
    s * 1_000_000 + us
}

/// The slot's expiry (µs) in the tier's sorted set, if it is there.
fn slot_expiry_us(redis: &RedisServer, key: &str) -> Option<u64> {
    let v: Vec<(String, f64)> = redis.cmd(&["ZRANGE", key, "0", "-1", "WITHSCORES"]);
    assert!(v.len() <= 1, "{v:?}");
    v.first().map(|(_, s)| *s as u64)
}

/// Redis's own clock (no test clock), a 400 ms TTL renewed every 200 ms,
/// and for 1.2 s the layer's connections are killed every 20 ms
/// (`CLIENT KILL TYPE normal`): renewals fail and are tried again at once
/// on a fresh connection, so the slot never lapses — sampled against Redis
/// `TIME` all along — and no lapse is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_renewals_are_retried_until_the_slot_would_lapse() {
    let _ = snapshotter();
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url()).unwrap();
    let (_h, open, first) = one_running(backend.into(), "killed", Duration::from_millis(400)).await;
    let key = "rl:killed:all";
    let started = Instant::now();
    let mut kills = 0u64;
    let mut samples = 0u64;
    while started.elapsed() < Duration::from_millis(1200) {
        let killed: u64 = redis.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
        kills += killed;
        for _ in 0..2 {
            let now = redis_now_us(&redis);
            let until = slot_expiry_us(&redis, key).expect("the slot is held");
            assert!(
                until > now,
                "the running request's slot lapsed {} µs ago, {:?} in",
                now - until,
                started.elapsed()
            );
            samples += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // The layer reconnects when a renewal fails: each kill after the first
    // is of a connection a failed renewal made (about one per 200 ms tick).
    assert!(kills >= 4, "{kills} connections killed");
    assert!(samples >= 20, "{samples} samples");
    assert_eq!(lapses("killed"), 0);
    let _ = open.send(true);
    assert_eq!(first.await.unwrap(), 200);
}

/// A slot that lapses while its request runs (the test clock jumps past
/// it between two renewals) is counted once, on memory and on Redis.
async fn a_lapse_is_counted(backend: Backend, clock: ManualClock, tier: &str) {
    let (h, open, first) = one_running(backend, tier, Duration::from_millis(200)).await;
    assert_eq!(lapses(tier), 0);
    clock.advance(Duration::from_millis(250));
    for _ in 0..5000 {
        if lapses(tier) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(lapses(tier), 1);
    // The slot is free: the tier would admit another request.
    let s = h.peek(tier, "all").await.unwrap();
    assert!(s.allowed);
    // Counted once: no more renewals of that slot.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(lapses(tier), 1);
    let _ = open.send(true);
    assert_eq!(first.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapse_is_counted_in_memory() {
    let _ = snapshotter();
    let clock = ManualClock::new(T0_US);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    a_lapse_is_counted(b.into(), clock, "lapsing_memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapse_is_counted_on_redis() {
    let _ = snapshotter();
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let b = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600));
    a_lapse_is_counted(b.into(), clock, "lapsing_redis").await;
}
