//! Requests priced by their response (issue 29) through real HTTP on both
//! backends (a real `redis-server`), on a manual clock: the estimate
//! reserved at admission, the settle from a response header before the
//! head goes out, from a trailer or the `Usage` handle when a stream ends,
//! a disconnect mid-stream settling at the estimate, debt with an exact
//! Retry-After, and a request denied by another tier reserving nothing.

use crate::support::priced::*;
use crate::support::*;
use bytes::Bytes;
use http_body::Frame;
use std::time::Duration;
use tiered_ratelimit::priced::{Actual, Estimate};
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::sync::mpsc;

both_backends!(
    actual_in_a_header_settles_before_the_head,
    a_stream_settles_from_its_trailer_when_it_ends,
    a_disconnect_mid_stream_settles_at_the_estimate,
    a_request_denied_by_another_tier_reserves_nothing,
    the_handler_reports_through_the_usage_handle,
    a_policy_file_prices_a_tier,
);

async fn actual_in_a_header_settles_before_the_head(env: Env) {
    let (base, _layer, _streams) = start(&env, vec![tokens()]).await;
    // Reserve 200, use 50: the head shows the tier after the settle.
    let r = get_with(&format!("{base}/llm?tokens=50"), Some(200)).await;
    let l = limits(&r);
    assert_eq!(
        (l.status, l.limit, l.remaining),
        (200, Some(1000), Some(950))
    );
    // Reserve 200, use 400: 950 − 400.
    let r = get_with(&format!("{base}/llm?tokens=400"), Some(200)).await;
    assert_eq!(limits(&r).remaining, Some(550));
    // An estimate above the cap reserves the cap (500); use 600: 50 in
    // debt, shown as 0.
    let r = get_with(&format!("{base}/llm?tokens=600"), Some(9000)).await;
    let l = limits(&r);
    assert_eq!((l.status, l.remaining), (200, Some(0)));
    // In debt: denied; one token fits after 51 × 60 ms = 3.06 s.
    let r = get_with(&format!("{base}/llm?tokens=1"), Some(1)).await;
    let l = limits(&r);
    assert_eq!(
        (l.status, l.remaining, l.retry_after),
        (429, Some(0), Some(4))
    );
    env.clock.advance(Duration::from_micros(3_060_000 - 1));
    let r = get_with(&format!("{base}/llm?tokens=1"), Some(1)).await;
    assert_eq!(r.status(), 429);
    env.clock.advance(Duration::from_micros(1));
    let r = get_with(&format!("{base}/llm?tokens=1"), Some(1)).await;
    let l = limits(&r);
    assert_eq!((l.status, l.remaining), (200, Some(0)));
}

async fn a_stream_settles_from_its_trailer_when_it_ends(env: Env) {
    let (base, layer, mut streams) = start(&env, vec![tokens()]).await;
    let req = tokio::spawn(get_with(format!("{base}/stream"), Some(300)));
    let s = streams.recv().await.unwrap();
    s.frames.send(Frame::data(Bytes::from("a"))).unwrap();
    let r = req.await.unwrap();
    // A stream's head shows the reservation.
    assert_eq!(limits(&r).remaining, Some(700));
    assert_eq!(left(&layer).await, (true, 700));
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-usage-tokens", 120.into());
    s.frames.send(Frame::trailers(trailers)).unwrap();
    drop(s.frames);
    assert_eq!(r.bytes().await.unwrap(), "a");
    // Settled at 120: 180 given back.
    until_left(&layer, (true, 880)).await;
}

async fn a_disconnect_mid_stream_settles_at_the_estimate(env: Env) {
    let (base, layer, mut streams) = start(&env, vec![tokens()]).await;
    let req = tokio::spawn(get_with(format!("{base}/stream"), Some(300)));
    let s = streams.recv().await.unwrap();
    s.frames.send(Frame::data(Bytes::from("a"))).unwrap();
    let r = req.await.unwrap();
    assert_eq!(limits(&r).remaining, Some(700));
    // The handler had reported a usage; the client goes away mid-stream.
    s.usage.as_ref().unwrap().report(10);
    drop(r);
    // The server drops the body once it sees the connection closed.
    let _ = tokio::time::timeout(Duration::from_secs(5), s.dropped)
        .await
        .expect("the body was dropped");
    // Settled at the estimate: the 300 stay charged.
    assert_eq!(left(&layer).await, (true, 700));
    let r = get_with(&format!("{base}/llm?tokens=1"), Some(1)).await;
    assert_eq!(limits(&r).remaining, Some(699));
}

async fn a_request_denied_by_another_tier_reserves_nothing(env: Env) {
    let requests = Tier::new("requests", Global, Quota::per_minute(2));
    let (base, layer, _streams) = start(&env, vec![requests, tokens()]).await;
    for _ in 0..2 {
        let r = get_with(&format!("{base}/llm?tokens=50"), Some(400)).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(left(&layer).await, (true, 900));
    // Denied by `requests`: `tokens` (which would allow 400) is untouched.
    let r = get_with(&format!("{base}/llm?tokens=50"), Some(400)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(left(&layer).await, (true, 900));
}

async fn the_handler_reports_through_the_usage_handle(env: Env) {
    let tier = Tier::new("tokens", Global, Quota::per_minute(1000))
        .priced(Estimate::fixed(100), Actual::reported());
    let (base, layer, mut streams) = start(&env, vec![tier]).await;
    // Reported before the head: settled before it, shown in it.
    let r = get_with(&format!("{base}/report?tokens=30"), None).await;
    assert_eq!(limits(&r).remaining, Some(970));
    // A stream reporting while it runs: settled when it ends.
    let req = tokio::spawn(get_with(format!("{base}/stream"), None));
    let s = streams.recv().await.unwrap();
    s.frames.send(Frame::data(Bytes::from("a"))).unwrap();
    let r = req.await.unwrap();
    assert_eq!(limits(&r).remaining, Some(870));
    s.usage.as_ref().unwrap().report(250);
    drop(s.frames);
    assert_eq!(r.bytes().await.unwrap(), "a");
    until_left(&layer, (true, 720)).await;
}

async fn a_policy_file_prices_a_tier(env: Env) {
    let layer = policy_layer(TOKENS_POLICY, env.backend.clone());
    let (tx, _streams) = mpsc::unbounded_channel();
    let base = format!("http://{}", serve(llm_app(layer, tx)).await);
    // The default estimate (1000) fits the 1000; 40 used.
    let r = get_with(format!("{base}/llm?tokens=40"), None).await;
    assert_eq!(limits(&r).remaining, Some(960));
    // 961 reserved (more than left) is denied and reserves nothing.
    let r = get_with(format!("{base}/llm?tokens=1"), Some(961)).await;
    let l = limits(&r);
    assert_eq!((l.status, l.remaining), (429, Some(960)));
    let r = get_with(format!("{base}/llm?tokens=1"), Some(960)).await;
    assert_eq!(limits(&r).remaining, Some(959));
}

#[test]
fn priced_policies_fail_naming_the_field() {
    use tiered_ratelimit::policy::Policy;
    let build = |priced: &str| {
        let text = format!(
            "[[tier]]\nname = \"t\"\nkey = \"global\"\nlimit = 10\nperiod = \"1m\"\n[tier.priced]\n{priced}\n"
        );
        match Policy::from_toml_str(&text) {
            Err(e) => e.to_string(),
            Ok(p) => p
                .builder(tiered_ratelimit::backend::MemoryBackend::new())
                .and_then(|b| b.build())
                .unwrap_err()
                .to_string(),
        }
    };
    assert_eq!(
        build(r#"estimate = { header = "x-max-tokens", max = 5 }"#),
        "tier \"t\": priced.estimate.default: required with priced.estimate.header"
    );
    assert_eq!(
        build(r#"estimate = { header = "x-max-tokens", default = 1, max = 5, fixed = 2 }"#),
        "tier \"t\": priced.estimate: either header (with default and max) or fixed, not both"
    );
    assert_eq!(
        build(
            r#"estimate = { fixed = 2 }
actual = { header = "x usage" }"#
        ),
        "tier \"t\": priced.actual.header: \"x usage\" is not a valid header name"
    );
    assert!(build(r#"estimate = { fixed = 2, guess = 1 }"#).contains("unknown field `guess`"));
}

#[test]
fn misconfigured_priced_tiers_fail_at_build_naming_the_field() {
    let build = |t: Tier| {
        RateLimitLayer::builder()
            .tier(t)
            .build()
            .unwrap_err()
            .to_string()
    };
    let q = Quota::per_minute(1000);
    assert_eq!(
        build(
            Tier::new("t", Global, q)
                .algorithm(tiered_ratelimit::Algorithm::SlidingWindowLog)
                .priced(Estimate::fixed(1), Actual::reported())
        ),
        "tier \"t\": algorithm: a priced tier takes token_bucket or fixed_window only"
    );
    assert_eq!(
        build(
            Tier::new("t", Global, q).priced(Estimate::header("x max", 1, 2), Actual::reported())
        ),
        "tier \"t\": priced.estimate.header: \"x max\" is not a valid header name"
    );
    assert_eq!(
        build(
            Tier::new("t", Global, q)
                .priced(Estimate::header("x-max-tokens", 3, 2), Actual::reported())
        ),
        "tier \"t\": priced.estimate.default: default 3 must be at most max 2, and max above 0"
    );
    assert_eq!(
        build(Tier::new("t", Global, q).priced(Estimate::fixed(1), Actual::header("x usage"))),
        "tier \"t\": priced.actual.header: \"x usage\" is not a valid header name"
    );
    assert_eq!(
        build(
            Tier::new("t", Global, q)
                .skip_failed_requests(true)
                .priced(Estimate::fixed(1), Actual::reported())
        ),
        "tier \"t\": skip_failed_requests: a priced tier settles by its actual cost, not by status"
    );
}

/// The same scenarios on a Redis Cluster (three primaries): a settle is a
/// refund-mode call to the key's slot.
mod cluster {
    use crate::support::cluster::RedisCluster;
    use crate::support::Env;

    fn flush(cluster: &RedisCluster) {
        for p in cluster.primaries() {
            crate::support::cluster::node_cmd::<()>(p, &["FLUSHALL"]).unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reserve_settle_debt_and_streams() {
        let cluster = RedisCluster::start(0);
        super::actual_in_a_header_settles_before_the_head(Env::cluster(&cluster)).await;
        flush(&cluster);
        super::a_stream_settles_from_its_trailer_when_it_ends(Env::cluster(&cluster)).await;
        flush(&cluster);
        super::a_request_denied_by_another_tier_reserves_nothing(Env::cluster(&cluster)).await;
        flush(&cluster);
        super::a_disconnect_mid_stream_settles_at_the_estimate(Env::cluster(&cluster)).await;
    }
}
