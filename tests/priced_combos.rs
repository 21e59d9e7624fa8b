//! A priced tier beside the engine's other features (issue 29), through
//! real HTTP on both backends, on a manual clock: a concurrency tier and
//! shadow mode; lease mode and per-key overrides, refused at build.

mod support;

use bytes::Bytes;
use http_body::Frame;
use std::time::{Duration, Instant};
use support::priced::*;
use support::*;
use tiered_ratelimit::rollout::Mode;
use tiered_ratelimit::{key::Global, RateLimitLayer, Tier};
use tokio::sync::mpsc;

both_backends!(with_a_concurrency_tier, in_shadow_mode,);

async fn start(
    env: &Env,
    tiers: Vec<Tier>,
) -> (String, RateLimitLayer, mpsc::UnboundedReceiver<Stream>) {
    let mut b = env.builder();
    for t in tiers {
        b = b.tier(t);
    }
    let layer = b.build().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let addr = serve(llm_app(layer.clone(), tx)).await;
    (format!("http://{addr}"), layer, rx)
}

async fn left(layer: &RateLimitLayer) -> (bool, u64) {
    let s = layer.handle().peek("tokens", "all").await.unwrap();
    (s.allowed, s.remaining + u64::from(s.allowed))
}

/// Waits (at most 2 s) for a settle sent in a task of its own.
async fn until_left(layer: &RateLimitLayer, want: (bool, u64)) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let got = left(layer).await;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "never {want:?}; got {got:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A stream reserving `estimate`, its head back (status 200).
async fn open(
    base: &str,
    estimate: u64,
    streams: &mut mpsc::UnboundedReceiver<Stream>,
) -> (Stream, reqwest::Response) {
    let req = tokio::spawn(get_with(format!("{base}/stream"), Some(estimate)));
    let s = streams.recv().await.unwrap();
    s.frames.send(Frame::data(Bytes::from("a"))).unwrap();
    let r = req.await.unwrap();
    assert_eq!(r.status(), 200);
    (s, r)
}

/// Ends a stream with its actual in a trailer, and reads it to its end.
async fn end(s: Stream, r: reqwest::Response, actual: u64) {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-usage-tokens", actual.into());
    s.frames.send(Frame::trailers(trailers)).unwrap();
    drop(s.frames);
    assert_eq!(r.bytes().await.unwrap(), "a");
}

async fn with_a_concurrency_tier(env: Env) {
    let inflight = Tier::concurrency("inflight", Global, 2);
    let (base, layer, mut streams) = start(&env, vec![inflight, tokens()]).await;
    let (a, ra) = open(&base, 300, &mut streams).await;
    let (b, rb) = open(&base, 200, &mut streams).await;
    assert_eq!(left(&layer).await, (true, 500));
    // Two in flight: the third is denied by the concurrency tier and
    // reserves nothing on `tokens`.
    let r = get_with(format!("{base}/llm?tokens=1"), Some(100)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(left(&layer).await, (true, 500));
    // A's end settles (300 reserved, 100 used) and frees its slot.
    end(a, ra, 100).await;
    until_left(&layer, (true, 700)).await;
    let r = get_with(format!("{base}/llm?tokens=50"), Some(100)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(left(&layer).await, (true, 650));
    end(b, rb, 200).await;
    assert_eq!(left(&layer).await, (true, 650));
}

async fn in_shadow_mode(env: Env) {
    let (base, layer, _streams) = start(&env, vec![tokens().mode(Mode::Shadow)]).await;
    // Reserved 500 (the cap), used 700: 200 of debt settled.
    let r = get_with(format!("{base}/llm?tokens=700"), Some(500)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(left(&layer).await, (true, 300));
    // 400 would be denied: passes, charged nothing, settles nothing.
    let r = get_with(format!("{base}/llm?tokens=50"), Some(400)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(left(&layer).await, (true, 300));
    // 200 fits: reserved, used 100.
    let r = get_with(format!("{base}/llm?tokens=100"), Some(200)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(left(&layer).await, (true, 200));
}

#[test]
fn lease_mode_and_overrides_are_refused_naming_the_field() {
    let build = |t: Tier| {
        RateLimitLayer::builder()
            .tier(t)
            .build()
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        build(tokens().lease(tiered_ratelimit::token_lease::TokenLease::new())),
        "tier \"tokens\": sync: a priced tier cannot run in lease mode"
    );
    assert_eq!(
        build(tokens().overrides(true)),
        "tier \"tokens\": overrides: a priced tier takes no per-key overrides \
         (its settle would use the tier's own quota)"
    );
}
