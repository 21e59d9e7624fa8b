//! Lease mode's metrics (`tiered_ratelimit_lease_calls_total`,
//! `tiered_ratelimit_lease_tokens_total{op}`), under a global debugging
//! recorder: their own test binary, so that no other test's leases count.

mod support;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::collections::HashMap;
use std::time::Duration;
use support::*;
use tiered_ratelimit::backend::ManualClock;
use tiered_ratelimit::key::Global;
use tiered_ratelimit::token_lease::TokenLease;
use tiered_ratelimit::{Quota, Tier};

#[tokio::test]
async fn lease_calls_tokens_taken_and_returned_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = redis_layer(&redis, &clock)
        .backend_timeout(Duration::from_secs(5))
        .key_prefix("metrics")
        .tier(
            Tier::new("global", Global, Quota::per_hour(100))
                .lease(TokenLease::new().min(20).max(20)),
        )
        .build()
        .unwrap();
    let handle = layer.handle();
    // Every series exists from the build on, at 0.
    let at_build: Vec<String> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(_, _, _, v)| matches!(v, DebugValue::Counter(0)))
        .map(|(k, _, _, _)| {
            let labels: Vec<String> = k.key().labels().map(|l| l.value().to_owned()).collect();
            format!("{}{:?}", k.key().name(), labels)
        })
        .filter(|n| n.starts_with("tiered_ratelimit_lease"))
        .collect();
    for series in [
        "tiered_ratelimit_lease_calls_total[]",
        "tiered_ratelimit_lease_tokens_total[\"taken\"]",
        "tiered_ratelimit_lease_tokens_total[\"returned\"]",
    ] {
        assert!(
            at_build.iter().any(|s| s == series),
            "{series} in {at_build:?}"
        );
    }
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    // Five checked per request; the fifth asks for a lease of 20.
    for _ in 0..5 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    for _ in 0..10_000 {
        if !handle.leases().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(handle.leases()[0].tokens, 20);
    for _ in 0..3 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(handle.return_leases().await, 17);
    let mut counters = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let DebugValue::Counter(v) = value {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            counters.insert(format!("{}{{{}}}", key.key().name(), labels.join(",")), v);
        }
    }
    assert_eq!(counters["tiered_ratelimit_lease_calls_total{}"], 1);
    assert_eq!(
        counters["tiered_ratelimit_lease_tokens_total{op=taken}"],
        20
    );
    assert_eq!(
        counters["tiered_ratelimit_lease_tokens_total{op=returned}"],
        17
    );
}
