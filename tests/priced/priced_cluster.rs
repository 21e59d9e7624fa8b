//! Requests priced by their response on a real Redis Cluster (three
//! primaries; issue 29): 300 concurrent streamed requests on one key, their
//! settles batched by the instance and sent as one call per hash slot, so
//! a hot key's settles cost a few calls whatever their number; after every
//! settle the tier holds exactly quota − Σ actual (a manual clock that
//! stands still).

use crate::support::cluster::{calls, failed_calls, RedisCluster};
use crate::support::priced::*;
use crate::support::rng::Rng;
use crate::support::*;
use bytes::Bytes;
use http_body::Frame;
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::{ManualClock, RedisBackend};
use tiered_ratelimit::priced::{Actual, Estimate};
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::sync::mpsc;

const N: u64 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_of_a_hot_key_are_batched_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let backend = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US))
        .with_test_ttl_slack(Duration::from_secs(600));
    // 30 000 tokens a minute; each request reserves 100 and uses 0..=100:
    // all 300 fit.
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(10))
        .tier(
            Tier::new("tokens", Global, Quota::per_minute(30_000)).priced(
                Estimate::header("x-max-tokens", 1, 1_000_000),
                Actual::header("x-usage-tokens"),
            ),
        )
        .build()
        .unwrap();
    let (tx, mut streams) = mpsc::unbounded_channel();
    let base = format!("http://{}/stream", serve(llm_app(layer.clone(), tx)).await);
    let scripts = || -> u64 {
        cluster
            .primaries()
            .into_iter()
            // Answered calls: the first calls of a fresh cluster may meet
            // NOSCRIPT and be sent again as EVAL.
            .map(|p| {
                ["evalsha", "eval"]
                    .map(|c| calls(p, c) - failed_calls(p, c))
                    .iter()
                    .sum::<u64>()
            })
            .sum()
    };
    let before = scripts();
    let heads: Vec<_> = (0..N)
        .map(|_| tokio::spawn(get_with(base.clone(), Some(100))))
        .collect();
    let mut open = Vec::new();
    for h in heads {
        let r = h.await.unwrap();
        assert_eq!(limits(&r).limit, Some(30_000), "admitted with a decision");
        open.push(r);
    }
    let checks = scripts() - before;
    let mut rng = Rng::new(0xC1A5);
    let mut sum_actual = 0;
    for _ in 0..N {
        let s = streams.recv().await.unwrap();
        let actual = rng.below(101);
        sum_actual += actual;
        s.frames.send(Frame::data(Bytes::from("x"))).unwrap();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-usage-tokens", actual.into());
        s.frames.send(Frame::trailers(trailers)).unwrap();
    }
    for r in open {
        assert_eq!(r.bytes().await.unwrap(), "x");
    }
    let want = 30_000 - sum_actual;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut peeks = 0;
    loop {
        let s = layer.handle().peek("tokens", "all").await.unwrap();
        peeks += 1;
        if s.remaining + 1 == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "tier never held {want}; holds {}",
            s.remaining + 1
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The peeks above are one script call each.
    let settles = scripts() - before - checks - peeks;
    eprintln!(
        "cluster: {N} requests, {checks} check calls, {settles} settle calls, \
         Σ actual {sum_actual}, {:.3} calls per request",
        (checks + settles) as f64 / N as f64
    );
    assert_eq!(checks, N);
    // One call per batch (at most one per 10 ms), not one per settle.
    assert!(settles <= 40, "{settles} settle calls for {N} settles");
    assert!((checks + settles) as f64 / N as f64 <= 1.2);
}
