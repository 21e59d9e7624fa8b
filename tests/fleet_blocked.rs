//! The deny cache's 429s in the fleet-wide hourly blocked-keys sets: counted
//! exactly, without a script call per cached 429, flushed in one pipelined
//! call per interval; a Redis outage loses that interval only and never
//! holds up a request. Real redis-server, real HTTP.

mod support;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use support::*;
use tiered_ratelimit::backend::{ManualClock, RedisBackend};
use tiered_ratelimit::{key::User, Quota, RateLimitLayer, Tier};

/// Two per day: after the second admission the next token is 12 h away, so
/// that admission primes the deny cache and every later request of the key
/// is a cached 429 (no script call).
fn two_per_day() -> Quota {
    Quota::new(2, Duration::from_secs(86_400))
}

fn zrange(redis: &RedisServer, set: &str) -> Vec<(String, u64)> {
    redis.cmd(&["ZRANGE", set, "0", "-1", "WITHSCORES"])
}

/// Waits (polling, at most 10 s) until `set` holds exactly `want`.
async fn until_set(redis: &RedisServer, set: &str, want: &[(&str, u64)]) {
    let want: Vec<(String, u64)> = want.iter().map(|(k, c)| ((*k).to_owned(), *c)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = zrange(redis, set);
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "{set}: {got:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn send(c: &reqwest::Client, addr: std::net::SocketAddr, user: &str) -> (u16, Duration) {
    let t = Instant::now();
    let res = c
        .get(format!("http://{addr}/"))
        .header("authorization", format!("Bearer {user}"))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let has_headers = res.headers().contains_key("x-ratelimit-limit");
    (
        if status == 200 && !has_headers {
            0
        } else {
            status
        },
        t.elapsed(),
    )
}

/// Built outside any runtime (the flush task starts with the first cached
/// 429). Five keys with known counts, and a sixth hour boundary crossed in
/// the same flush interval: both hours' sets get their exact counts, with no
/// EVALSHA for any cached 429 and one ZINCRBY per key per set.
#[test]
fn cached_denials_reach_the_hourly_sets_exactly() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = RateLimitLayer::builder()
        .backend(
            RedisBackend::from_url(&redis.url())
                .unwrap()
                .with_manual_clock(clock.clone()),
        )
        .backend_timeout(Duration::from_secs(2))
        .tier(Tier::new("user", User, two_per_day()))
        .build()
        .unwrap();
    let h = layer.handle();
    let rt = multi_thread_runtime();
    rt.block_on(async move {
        let addr = serve(app(layer)).await;
        let c = client();
        // Load the script, then count calls.
        assert_eq!(send(&c, addr, "warm").await.0, 200);
        redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
        let counts = [("u1", 1), ("u2", 2), ("u3", 3), ("u4", 5), ("u5", 8)];
        let mut first_cached = None;
        for (user, n) in counts {
            for _ in 0..2 {
                assert_eq!(send(&c, addr, user).await.0, 200);
            }
            for _ in 0..n {
                first_cached.get_or_insert_with(Instant::now);
                assert_eq!(send(&c, addr, user).await.0, 429);
            }
        }
        // T0 is 22:13:20: 2800 s later the next hour's set takes the 429s.
        clock.advance(Duration::from_secs(2800));
        for user in ["u5", "u5", "u5", "u1"] {
            assert_eq!(send(&c, addr, user).await.0, 429);
        }
        let sending = first_cached.unwrap().elapsed();
        let hour = T0_S / 3600;
        let (this, next) = (
            format!("rl:blocked:{hour}"),
            format!("rl:blocked:{}", hour + 1),
        );
        until_set(
            &redis,
            &this,
            &[
                ("rl:user:u1", 1),
                ("rl:user:u2", 2),
                ("rl:user:u3", 3),
                ("rl:user:u4", 5),
                ("rl:user:u5", 8),
            ],
        )
        .await;
        until_set(&redis, &next, &[("rl:user:u1", 1), ("rl:user:u5", 3)]).await;
        // Two admissions per key reached Redis; none of the 23 cached 429s did.
        assert_eq!(redis.script_calls(), 10);
        // (Each key's first 429 counts `limited`, the 18 others
        // `cache_blocked`.)
        assert_eq!((h.counts().cache_blocked, h.counts().limited), (18, 5));
        // One flush (the first comes one interval, 1 s, after the first
        // cached 429; sending took less): one ZINCRBY per (hour, key).
        assert!(sending < Duration::from_secs(1), "sending took {sending:?}");
        assert_eq!(redis.calls("zincrby"), 7);
        assert_eq!(redis.calls("expire"), 2);
        for set in [&this, &next] {
            let ttl: i64 = redis.cmd(&["TTL", set]);
            assert!(ttl > 89_990 && ttl <= 90_000, "{set}: ttl {ttl}");
        }
        let top = h
            .top_blocked_fleet("user", 10, Duration::from_secs(7200))
            .await
            .unwrap();
        let got: Vec<(&str, u64)> = top.iter().map(|b| (b.key.as_str(), b.count)).collect();
        assert_eq!(
            got,
            [("u5", 11), ("u4", 5), ("u3", 3), ("u1", 2), ("u2", 2)]
        );
    });
}

static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
static TOTALS: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

/// A counter's total so far, under the global debugging recorder (only this
/// file's outage test reads it; snapshots drain the recorder).
fn counter(name: &str, labels: &str) -> u64 {
    let snap = SNAPSHOTTER
        .get_or_init(|| {
            let r = DebuggingRecorder::new();
            let s = r.snapshotter();
            r.install().expect("the only recorder of this test binary");
            s
        })
        .snapshot()
        .into_vec();
    let mut totals = TOTALS.lock().unwrap();
    let totals = totals.get_or_insert_with(HashMap::new);
    for (key, _, _, value) in snap {
        if let DebugValue::Counter(v) = value {
            let labels = metric_labels(key.key());
            *totals
                .entry(format!("{}{{{}}}", key.key().name(), labels.join(",")))
                .or_default() += v;
        }
    }
    totals
        .get(&format!("{name}{{{labels}}}"))
        .copied()
        .unwrap_or(0)
}

const DROPPED: &str = "tiered_ratelimit_fleet_blocked_dropped_total";

/// Waits (at most 10 s) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Redis killed during an interval: that interval's counts are dropped (and
/// counted as dropped), the cached 429s meanwhile are answered at once, and
/// after Redis returns the next interval's counts arrive exactly. Redis
/// frozen during a flush: requests are still answered within the backend
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_loses_only_its_interval() {
    counter(DROPPED, "reason=error");
    let mut redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let timeout = Duration::from_millis(500);
    let layer = RateLimitLayer::builder()
        .backend(
            RedisBackend::from_url(&redis.url())
                .unwrap()
                .with_manual_clock(clock.clone()),
        )
        .backend_timeout(timeout)
        .fleet_top_n_flush(Duration::from_millis(100), 1000)
        .tier(Tier::new("user", User, two_per_day()))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let set = format!("rl:blocked:{}", T0_S / 3600);
    let dropped = || counter(DROPPED, "reason=error") + counter(DROPPED, "reason=timeout");

    // Before: 3 cached 429s of `a` arrive.
    for status in [200, 200, 429, 429, 429] {
        assert_eq!(send(&c, addr, "a").await.0, status);
    }
    until_set(&redis, &set, &[("rl:user:a", 3)]).await;

    // Redis down: 4 cached 429s answered at once; their flush fails.
    redis.stop();
    for _ in 0..4 {
        let (status, took) = send(&c, addr, "a").await;
        assert_eq!(status, 429);
        assert!(took < timeout, "a cached 429 took {took:?}");
    }
    until("the failed flush", || dropped() >= 4).await;
    assert_eq!(dropped(), 4);

    // Redis back (empty): wait until the layer reaches it again.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while send(&c, addr, "probe").await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "the layer never reached Redis again"
        );
    }
    for status in [200, 200, 429] {
        assert_eq!(send(&c, addr, "b").await.0, status);
    }
    for _ in 0..2 {
        assert_eq!(send(&c, addr, "a").await.0, 429);
    }
    // Only the outage's interval is missing (the 3 before it went with the
    // killed server's memory, not with a flush).
    until_set(&redis, &set, &[("rl:user:b", 1), ("rl:user:a", 2)]).await;
    assert_eq!(dropped(), 4);

    // Redis frozen: a flush hangs until its timeout (1 s), and requests are
    // answered all the same: cached 429s at once, a check within the
    // backend timeout (fail open: no headers).
    let timeouts = counter(DROPPED, "reason=timeout");
    redis.pause();
    for _ in 0..3 {
        let (status, took) = send(&c, addr, "a").await;
        assert_eq!(status, 429);
        assert!(took < timeout, "a cached 429 took {took:?}");
    }
    until("the frozen flush to time out", || dropped() >= 7).await;
    let (status, took) = send(&c, addr, "c").await;
    assert_eq!(status, 0, "fail open");
    assert!(
        took < timeout + Duration::from_millis(250),
        "a check took {took:?}"
    );
    assert_eq!(counter(DROPPED, "reason=timeout"), timeouts + 3);
    redis.resume();
}
