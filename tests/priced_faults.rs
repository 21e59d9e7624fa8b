//! Requests priced by their response when the Redis behind them is killed
//! while their settles are pending (issue 29), through real HTTP and a real
//! `redis-server` (killed with SIGKILL; it keeps nothing on disk), on a
//! manual clock. What docs/http.md ("Priced requests") says:
//!
//! * a settle Redis refused is retried in the background (3 times, over
//!   about 2 s): when Redis is back in time it lands, on whatever Redis then
//!   holds. A Redis restarted empty lost the reservations with the rest of
//!   its data: a debt is charged in full (a refund gives back at most what
//!   the key then misses).
//! * one still refused after its retries is dropped and counted in
//!   `tiered_ratelimit_settle_failures_total{kind}` (once per request),
//!   never retried later and never applied twice.

mod support;

use bytes::Bytes;
use http_body::Frame;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use support::priced::*;
use support::*;
use tiered_ratelimit::RateLimitLayer;
use tokio::sync::mpsc;

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

/// `tiered_ratelimit_settle_failures_total` so far, all kinds (a snapshot
/// hands out what was counted since the last one: summed here).
fn settle_failures() -> u64 {
    static SEEN: Mutex<u64> = Mutex::new(0);
    let mut seen = SEEN.lock().unwrap();
    for (k, _, _, v) in snapshotter().snapshot().into_vec() {
        if k.key().name() == "tiered_ratelimit_settle_failures_total" {
            let DebugValue::Counter(n) = v else {
                panic!("not a counter: {v:?}");
            };
            *seen += n;
        }
    }
    *seen
}

/// Waits (at most `within`) until `f` holds.
async fn until<T: PartialEq + std::fmt::Debug, F: std::future::Future<Output = T>>(
    within: Duration,
    want: T,
    mut f: impl FnMut() -> F,
) {
    let deadline = Instant::now() + within;
    loop {
        let got = f().await;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "never {want:?}; got {got:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn left(layer: &RateLimitLayer) -> (bool, u64) {
    let s = layer.handle().peek("tokens", "all").await.unwrap();
    (s.allowed, s.remaining + u64::from(s.allowed))
}

/// Two streams reserving 300 and 200 (heads 700 and 500 left); returns
/// them open.
async fn two_streams(base: &str, streams: &mut mpsc::UnboundedReceiver<Stream>) -> Vec<Stream> {
    let mut open = Vec::new();
    for (estimate, shown) in [(300, 700), (200, 500)] {
        let req = tokio::spawn(get_with(format!("{base}/stream"), Some(estimate)));
        let s = streams.recv().await.unwrap();
        s.frames.send(Frame::data(Bytes::from("a"))).unwrap();
        let r = req.await.unwrap();
        assert_eq!(limits(&r).remaining, Some(shown));
        tokio::spawn(async move { r.bytes().await });
        open.push(s);
    }
    open
}

/// Ends `s` with its actual in a trailer.
fn end(s: Stream, actual: u64) {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-usage-tokens", actual.into());
    s.frames.send(Frame::trailers(trailers)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_during_settles() {
    let _ = snapshotter();
    let mut env = Env::redis();
    // Redis expires keys in real time while the manual clock stands still.
    env.backend =
        tiered_ratelimit::backend::RedisBackend::from_url(&env.redis.as_ref().unwrap().url())
            .unwrap()
            .with_manual_clock(env.clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
            .into();
    let layer = env.builder().tier(tokens()).build().unwrap();
    let (tx, mut streams) = mpsc::unbounded_channel();
    let base = format!("http://{}", serve(llm_app(layer.clone(), tx)).await);
    let failures = settle_failures();

    // 1. Killed with two settles pending, back at once: both land on the
    //    empty Redis, the reservations (500) gone with its data, the debts
    //    (300 reserved, 450 used; 200 reserved, 450 used) charged in full,
    //    in whichever order: 1000 − 150 − 250.
    let mut open = two_streams(&base, &mut streams).await;
    let redis = env.redis.as_mut().unwrap();
    redis.stop();
    end(open.remove(0), 450);
    end(open.remove(0), 450);
    redis.restart();
    until(Duration::from_secs(5), (true, 600), || left(&layer)).await;
    assert_eq!(settle_failures(), failures);

    // 2. Killed for longer than the retries (about 2 s): each request's
    //    settle is counted once as failed and dropped. Nothing of it lands
    //    once Redis is back.
    redis.cmd::<()>(&["FLUSHALL"]);
    let mut open = two_streams(&base, &mut streams).await;
    redis.stop();
    end(open.remove(0), 100);
    end(open.remove(0), 450);
    until(Duration::from_secs(10), failures + 2, || async {
        settle_failures()
    })
    .await;
    redis.restart();
    assert_eq!(left(&layer).await, (true, 1000));
    let r = get_with(&format!("{base}/llm?tokens=10"), Some(10)).await;
    assert_eq!(limits(&r).remaining, Some(990));
    assert_eq!(settle_failures(), failures + 2);
}
