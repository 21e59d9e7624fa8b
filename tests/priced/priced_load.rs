//! Requests priced by their response under load (issue 29): 1 000
//! concurrent streamed requests of random actual cost on one key, through
//! two app servers (two layers, two connection pools) sharing one real
//! Redis, on a manual clock that stands still, so no refill blurs the
//! ledger. Every request's head comes back while all streams are open (the
//! reservations are all in flight at once); then each stream reports its
//! actual in a trailer and ends.
//!
//! * Estimates that cover their actuals: the reserved cost never exceeds
//!   the quota, so neither does the admitted actual cost; after every
//!   settle the tier holds exactly quota − Σ actual.
//! * Under-estimates: the admitted actual cost exceeds the quota by at most
//!   Σ (actual − estimate) of the requests in flight (the bound), and after
//!   every settle the tier is exactly Σ actual − quota in debt: denied,
//!   `remaining` 0, the wait exact.
//!
//! It also reports the Redis script calls per priced request.

use crate::support::priced::*;
use crate::support::rng::Rng;
use crate::support::*;
use bytes::Bytes;
use http_body::Frame;
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::RedisBackend;
use tiered_ratelimit::priced::{Actual, Estimate};
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::sync::mpsc;

const N: usize = 1000;

struct Run {
    admitted: u64,
    sum_actual: u64,
    sum_over: u64,
    calls_per_request: f64,
    /// Script calls of the settles (every priced request whose actual
    /// differs from its estimate has one to send).
    settle_calls: u64,
}

/// 1 000 streamed requests reserving `estimate` each against a tier of
/// `quota` tokens per minute (burst = quota), actuals drawn from
/// `0..=max_actual`; returns what was admitted and what it cost.
async fn run(quota: u64, estimate: u64, max_actual: u64, seed: u64) -> (Run, RateLimitLayer, Env) {
    let env = Env::redis();
    let server = env.redis.as_ref().unwrap();
    let tier = || {
        Tier::new("tokens", Global, Quota::per_minute(quota)).priced(
            Estimate::header("x-max-tokens", 1, 1_000_000),
            Actual::header("x-usage-tokens"),
        )
    };
    let (tx, mut streams) = mpsc::unbounded_channel();
    let mut bases = Vec::new();
    let mut layers = Vec::new();
    for _ in 0..2 {
        // Each instance its own backend (its own connections), one Redis;
        // the clock stands still while Redis expires keys in real time.
        let backend: tiered_ratelimit::backend::Backend = RedisBackend::from_url(&server.url())
            .unwrap()
            .with_manual_clock(env.clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
            .into();
        let layer = RateLimitLayer::builder()
            .backend(backend)
            .backend_timeout(Duration::from_secs(10))
            .tier(tier())
            .build()
            .unwrap();
        let addr = serve(llm_app(layer.clone(), tx.clone())).await;
        bases.push(format!("http://{addr}/stream"));
        layers.push(layer);
    }
    let ok_calls =
        || server.succeeded("fcall") + server.succeeded("evalsha") + server.succeeded("eval");
    let calls_before = ok_calls();
    let heads: Vec<_> = (0..N)
        .map(|i| tokio::spawn(get_with(bases[i % 2].clone(), Some(estimate))))
        .collect();
    let mut open = Vec::new();
    for h in heads {
        let r = h.await.unwrap();
        match r.status().as_u16() {
            200 => {
                // Never admitted by the failure policy: every admission
                // carries the tier's numbers.
                assert_eq!(limits(&r).limit, Some(quota), "admitted without a decision");
                open.push(r)
            }
            429 => {}
            s => panic!("status {s}"),
        }
    }
    let admitted = open.len() as u64;
    let admission_calls = ok_calls() - calls_before;
    let settles_before = server.calls("evalsha");
    // Every admitted request's stream is open now: all reserved at once.
    assert!(
        admitted * estimate <= quota,
        "reserved more than the quota: {admitted} admitted"
    );
    let mut rng = Rng::new(seed);
    let (mut sum_actual, mut sum_over) = (0, 0);
    for _ in 0..admitted {
        let s = streams.recv().await.unwrap();
        let actual = rng.below(max_actual + 1);
        sum_actual += actual;
        sum_over += actual.saturating_sub(estimate);
        s.frames.send(Frame::data(Bytes::from("x"))).unwrap();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-usage-tokens", actual.into());
        s.frames.send(Frame::trailers(trailers)).unwrap();
    }
    for r in open {
        assert_eq!(r.bytes().await.unwrap(), "x");
    }
    let layer = layers.swap_remove(0);
    // Every settle sent (one per request whose actual differs), then landed.
    // One token per 60 000 000 / quota µs: in debt, one token fits once
    // the debt and the token have refilled.
    let want_left = quota.saturating_sub(sum_actual);
    let want_wait = (sum_actual + 1).saturating_sub(quota) * (60_000_000 / quota);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = layer.handle().peek("tokens", "all").await.unwrap();
        let got = (s.remaining + u64::from(s.allowed), s.retry_after);
        if got == (want_left, Duration::from_micros(want_wait)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "tier never held {want_left} tokens, {want_wait} µs wait; holds {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let calls = ok_calls() - calls_before;
    let settle_calls = server.calls("evalsha") - settles_before;
    let run = Run {
        admitted,
        sum_actual,
        sum_over,
        calls_per_request: calls as f64 / N as f64,
        settle_calls,
    };
    eprintln!(
        "estimate {estimate}, actual 0..={max_actual}, quota {quota}: {admitted} admitted, \
         Σ actual {sum_actual}, Σ over {sum_over}; script calls: {admission_calls} checks, \
         {settle_calls} settle calls, {calls} in all for {N} requests ({:.3} per request)",
        run.calls_per_request
    );
    (run, layer, env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn covering_estimates_never_exceed_the_quota() {
    let (r, layer, _env) = run(60_000, 100, 100, 0x5EED).await;
    // 600 reservations of 100 fill the 60 000; the other 400 are denied.
    assert_eq!(r.admitted, 600);
    assert_eq!(r.sum_over, 0);
    assert!(r.sum_actual <= 60_000);
    let s = layer.handle().peek("tokens", "all").await.unwrap();
    assert_eq!(s.remaining + 1, 60_000 - r.sum_actual);
    // Settles batched: a few calls for ~600 settles, ≤ 1.2 calls a request.
    assert!(r.settle_calls <= 30, "{} settle calls", r.settle_calls);
    assert!(r.calls_per_request <= 1.2, "{}", r.calls_per_request);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_estimates_overshoot_at_most_the_bound_and_owe_it() {
    // Reserve 50, use up to 150: 600 admitted fill the 30 000.
    let (r, layer, _env) = run(30_000, 50, 150, 0xD1CE).await;
    assert_eq!(r.admitted, 600);
    // The bound: what was admitted beyond the quota is at most the excess
    // of the requests in flight (all of them here).
    assert!(r.sum_actual <= 30_000 + r.sum_over);
    assert!(r.sum_actual > 30_000, "the seed makes the tier overshoot");
    // The excess is debt: denied, 0 left, and one token fits after
    // exactly (debt + 1) × 2 ms (30 000 per minute is one per 2 ms).
    let debt = r.sum_actual - 30_000;
    let s = layer.handle().peek("tokens", "all").await.unwrap();
    assert_eq!(
        (s.allowed, s.remaining, s.retry_after),
        (false, 0, Duration::from_micros((debt + 1) * 2_000))
    );
    assert!(r.settle_calls <= 30, "{} settle calls", r.settle_calls);
    assert!(r.calls_per_request <= 1.2, "{}", r.calls_per_request);
}
