//! Each algorithm through a real axum server over TCP with exact header
//! values — a burst, refill, the boundary case, weighted cost — on any
//! backend: tests/algorithms/algorithms_http.rs runs them on memory and Redis,
//! tests/redis/cluster.rs on a Redis Cluster. Time is a `ManualClock` at T0 (a
//! multiple of 10 s); the caller's builder brings the backend on that clock.

use super::{app, client, cost_from_header, denied, limits, ok, serve, Limits, NO_LIMITS, T0_S};
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::ManualClock;
use tiered_ratelimit::{key::Global, Algorithm, LeakyBucket, Quota, RateLimitLayerBuilder, Tier};

const W: Duration = Duration::from_secs(10);

/// Serves a layer with one Global tier `t` of `algorithm`, its cost from
/// `x-cost`; returns a request maker taking the cost.
async fn start(
    builder: RateLimitLayerBuilder,
    algorithm: Algorithm,
    quota: Quota,
) -> impl Fn(u64) -> reqwest::RequestBuilder {
    assert_eq!(T0_S % 10, 0);
    let layer = builder
        .tier(
            Tier::new("t", Global, quota)
                .algorithm(algorithm)
                .cost_fn(cost_from_header("x-cost")),
        )
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    move |cost: u64| {
        c.get(format!("http://{addr}/"))
            .header("x-cost", cost.to_string())
    }
}

async fn send(r: reqwest::RequestBuilder) -> Limits {
    limits(&r.send().await.unwrap())
}

pub async fn fixed_window(builder: RateLimitLayerBuilder, clock: &ManualClock) {
    let req = start(builder, Algorithm::FixedWindow, Quota::new(3, W)).await;
    // A burst of the limit, all resetting at the window's end.
    assert_eq!(send(req(1)).await, ok(3, 2, T0_S + 10));
    assert_eq!(send(req(1)).await, ok(3, 1, T0_S + 10));
    assert_eq!(send(req(1)).await, ok(3, 0, T0_S + 10));
    assert_eq!(send(req(1)).await, denied(3, 0, T0_S + 10, 10));
    clock.advance(Duration::from_micros(9_999_999));
    assert_eq!(send(req(1)).await, denied(3, 0, T0_S + 10, 1));
    // Boundary: the next window starts empty, one microsecond later.
    clock.advance(Duration::from_micros(1));
    for want in [2, 1, 0] {
        assert_eq!(send(req(1)).await, ok(3, want, T0_S + 20));
    }
    assert_eq!(send(req(1)).await.status, 429);
}

pub async fn sliding_window_log(builder: RateLimitLayerBuilder, clock: &ManualClock) {
    let req = start(builder, Algorithm::SlidingWindowLog, Quota::new(3, W)).await;
    for want in [2, 1, 0] {
        assert_eq!(send(req(1)).await, ok(3, want, T0_S + 10));
    }
    clock.advance(Duration::from_secs(4));
    // The oldest entry leaves the window at T0 + 10: 6 s from now.
    assert_eq!(send(req(1)).await, denied(3, 0, T0_S + 10, 6));
    // No boundary burst: crossing a window edge frees nothing early.
    clock.advance(Duration::from_micros(5_999_999));
    assert_eq!(send(req(1)).await, denied(3, 0, T0_S + 10, 1));
    clock.advance(Duration::from_micros(1));
    assert_eq!(send(req(1)).await, ok(3, 2, T0_S + 20));
    // Weighted: cost 2 fills the log; cost 1 must wait a whole window.
    assert_eq!(send(req(2)).await, ok(3, 0, T0_S + 20));
    assert_eq!(send(req(1)).await, denied(3, 0, T0_S + 20, 10));
}

pub async fn sliding_window_counter(builder: RateLimitLayerBuilder, clock: &ManualClock) {
    let req = start(builder, Algorithm::SlidingWindowCounter, Quota::new(4, W)).await;
    // Counters are zero two windows after the last admission.
    for want in [3, 2, 1, 0] {
        assert_eq!(send(req(1)).await, ok(4, want, T0_S + 20));
    }
    // Next window, once 4 × (10 − e)/10 ≤ 3: e = 2.5 s → 12.5 s from now.
    assert_eq!(send(req(1)).await, denied(4, 0, T0_S + 13, 13));
    clock.advance(Duration::from_micros(12_499_999));
    assert_eq!(send(req(1)).await, denied(4, 0, T0_S + 13, 1));
    clock.advance(Duration::from_micros(1));
    assert_eq!(send(req(1)).await, ok(4, 0, T0_S + 30));
}

pub async fn leaky_bucket_police(builder: RateLimitLayerBuilder, clock: &ManualClock) {
    let algorithm = Algorithm::LeakyBucket(LeakyBucket::Police);
    let req = start(builder, algorithm, Quota::new(2, W)).await;
    assert_eq!(send(req(1)).await, ok(2, 1, T0_S + 5));
    assert_eq!(send(req(1)).await, ok(2, 0, T0_S + 10));
    assert_eq!(send(req(1)).await, denied(2, 0, T0_S + 5, 5));
    clock.advance(Duration::from_secs(5));
    assert_eq!(send(req(1)).await, ok(2, 0, T0_S + 15));
}

/// Shaping delays in real time (the manual clock stands still meanwhile).
pub async fn leaky_bucket_shape_delays_then_rejects(builder: RateLimitLayerBuilder) {
    let algorithm = Algorithm::LeakyBucket(LeakyBucket::Shape {
        max_delay: Duration::from_millis(1500),
    });
    // 2 per second (a slot every 500 ms), no burst beyond one request.
    let req = start(builder, algorithm, Quota::per_second(2).burst(1)).await;
    assert_eq!(send(req(1)).await, ok(1, 0, T0_S + 1));
    // Three more at the same instant are queued 0.5, 1.0 and 1.5 s.
    let started = Instant::now();
    let queued: Vec<_> = (0..3)
        .map(|_| {
            let r = req(1);
            tokio::spawn(async move {
                let l = send(r).await;
                (l, started.elapsed())
            })
        })
        .collect();
    let mut results = Vec::new();
    for q in queued {
        results.push(q.await.unwrap());
    }
    results.sort_by_key(|(_, t)| *t);
    for ((l, took), delay_ms) in results.iter().zip([500u64, 1000, 1500]) {
        assert_eq!(l.status, 200);
        assert_eq!(l.remaining, Some(0));
        assert!(
            *took >= Duration::from_millis(delay_ms),
            "passed after {took:?}, its slot was {delay_ms} ms away"
        );
    }
    // The fifth would wait 2 s > max_delay: rejected at once, 0.5 s until it
    // fits. (That a rejection carries no delay is exact on the model:
    // `delay_us == 0` for every denial, checked in tests/algorithms/algorithms.rs.)
    assert_eq!(send(req(1)).await, denied(1, 0, T0_S + 1, 1));
}

pub async fn weighted_and_oversized_costs(builder: RateLimitLayerBuilder) {
    let req = start(builder, Algorithm::TokenBucket, Quota::new(5, W)).await;
    // One token every 2 s.
    assert_eq!(send(req(3)).await, ok(5, 2, T0_S + 6));
    // Cost 3 with 2 left: denied, shows the 2 left, waits for one token.
    assert_eq!(send(req(3)).await, denied(5, 2, T0_S + 2, 2));
    // A cost above the capacity never passes: 429 at once, no Retry-After
    // (no wait lets it pass); the reset is when the bucket is full.
    assert_eq!(
        send(req(6)).await,
        Limits {
            retry_after: None,
            ..denied(5, 2, T0_S + 6, 6)
        }
    );
    // Cost 0 from the cost function: the tier does not apply.
    assert_eq!(send(req(0)).await, NO_LIMITS);
    assert_eq!(send(req(2)).await, ok(5, 0, T0_S + 10));
}

/// 2024-03-11T00:00 in New York (04:00Z): the end of a 23-hour day.
pub const NY_MIDNIGHT_S: u64 = 1_710_129_600;

/// A calendar day in America/New_York (limit 2) across the midnight that
/// ends the 23-hour 10 March 2024: 1 µs before it counts in the old day, at
/// it in the new one; Reset, Retry-After and the IETF `w` exact. Sets the
/// caller's clock (the backend's and the app's) itself.
pub async fn calendar_day(builder: RateLimitLayerBuilder, clock: &ManualClock) {
    use tiered_ratelimit::{algorithm::Calendar, response::HeaderStyle};
    let b = NY_MIDNIGHT_S * 1_000_000;
    clock.set(b - 2_000_000);
    let day = Calendar::day().time_zone("America/New_York").unwrap();
    let layer = builder
        .headers(HeaderStyle::Both)
        .tier(Tier::new("t", Global, Quota::per_hour(2)).calendar(day))
        .build()
        .unwrap();
    let addr = serve(super::app(layer)).await;
    let c = client();
    let send = || async {
        let res = c.get(format!("http://{addr}/")).send().await.unwrap();
        let policy = res
            .headers()
            .get("ratelimit-policy")
            .map(|v| v.to_str().unwrap().to_owned());
        (limits(&res), policy)
    };
    let day23 = Some("\"t\";q=2;w=82800".to_owned());
    let day24 = Some("\"t\";q=2;w=86400".to_owned());
    assert_eq!(send().await, (ok(2, 1, NY_MIDNIGHT_S), day23.clone()));
    clock.set(b - 1);
    assert_eq!(send().await, (ok(2, 0, NY_MIDNIGHT_S), day23.clone()));
    assert_eq!(send().await, (denied(2, 0, NY_MIDNIGHT_S, 1), day23));
    clock.set(b);
    let next = NY_MIDNIGHT_S + 86_400;
    assert_eq!(send().await, (ok(2, 1, next), day24.clone()));
    assert_eq!(send().await, (ok(2, 0, next), day24.clone()));
    assert_eq!(send().await, (denied(2, 0, next, 86_400), day24));
}
