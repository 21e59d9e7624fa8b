//! What a user gets by default (issue 25, point 1): a layer built the
//! ordinary way, with the builder or from a policy file and no other call,
//! stores each token bucket as ONE integer (Redis `OBJECT ENCODING` `int`),
//! for a quota whose period is a multiple of its limit (100/hour: the TAT in
//! µs) and for one that is not (7/minute: the TAT in µs and its remainder
//! in ticks of 1/7 µs, coded in three more digits); docs/redis.md, "Stored
//! values". Driven over HTTP through a real server and a real Redis, on the
//! manual clock, so every value and TTL is exact.

use crate::support::*;
use tiered_ratelimit::{
    backend::{ManualClock, RedisBackend},
    key::ClientIp,
    policy::Policy,
    Quota, RateLimitLayer, Tier,
};

/// The keys of the two tiers for a client on 127.0.0.1.
const HOURLY: &str = "rl:ip:127.0.0.1";
const ODD: &str = "rl:ip7:127.0.0.1";

/// One request through `layer` at T0, then what Redis holds: per key its
/// value, encoding, `MEMORY USAGE … SAMPLES 0` and `PTTL`.
async fn one_request(
    layer: RateLimitLayer,
    redis: &RedisServer,
) -> Vec<(String, String, i64, i64)> {
    let addr = serve(app(layer)).await;
    let res = client()
        .get(format!("http://{addr}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    [HOURLY, ODD]
        .iter()
        .map(|key| {
            let value = redis.get(key).unwrap();
            let encoding: String = redis.cmd(&["OBJECT", "ENCODING", key]);
            let bytes: i64 = redis.cmd(&["MEMORY", "USAGE", key, "SAMPLES", "0"]);
            let pttl: i64 = redis.cmd(&["PTTL", key]);
            (value, encoding, bytes, pttl)
        })
        .collect()
}

/// 100/hour: a token every 36 s, so one request leaves the bucket full
/// again at T0 + 36 s: the value is that TAT in µs, PX 36 000 ms. 7/minute:
/// a token every 8 571 428 4/7 µs: TAT T0 + 8 571 428 µs and 4 ticks of
/// 1/7 µs, coded 024 (rate 7, remainder 4), PX 8 572 ms (rounded up).
fn assert_integers(keys: &[(String, String, i64, i64)]) {
    let (value, encoding, bytes, pttl) = &keys[0];
    assert_eq!(value, &(T0_US + 36_000_000).to_string());
    assert_eq!(encoding, "int");
    assert_eq!(*bytes, 72, "{HOURLY}");
    // Redis's own clock runs while the test does: PX was exactly 36 000.
    assert!((35_000..=36_000).contains(pttl), "PTTL {pttl}");
    let (value, encoding, bytes, pttl) = &keys[1];
    assert_eq!(value, &format!("{}024", T0_US + 8_571_428));
    assert_eq!(encoding, "int");
    assert_eq!(*bytes, 72, "{ODD}");
    assert!((7_572..=8_572).contains(pttl), "PTTL {pttl}");
}

#[tokio::test]
async fn the_builders_defaults_write_one_integer_per_bucket() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let layer = RateLimitLayer::builder()
        .backend(
            RedisBackend::from_url(&redis.url())
                .unwrap()
                .with_manual_clock(clock),
        )
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_hour(100)))
        .tier(Tier::new("ip7", ClientIp::default(), Quota::per_minute(7)))
        .build()
        .unwrap();
    assert_integers(&one_request(layer, &redis).await);
}

#[tokio::test]
async fn a_policy_files_layer_writes_one_integer_per_bucket() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let policy = Policy::from_toml_str(
        r#"
        [[tier]]
        name = "ip"
        key = "ip"
        limit = 100
        period = "1h"

        [[tier]]
        name = "ip7"
        key = "ip"
        limit = 7
        period = "1m"
        "#,
    )
    .unwrap();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock);
    let layer = RateLimitLayer::from_policy(&policy, backend).unwrap();
    assert_integers(&one_request(layer, &redis).await);
}
