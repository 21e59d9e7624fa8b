//! A priced tier beside the engine's other features (issue 29), through
//! real HTTP on both backends, on a manual clock: a concurrency tier,
//! shadow mode and per-key overrides (the settle under the key's override,
//! as its admission); lease mode on Redis (the estimate spent from the
//! instance's lease, a refund back to it, a debt on the shared bucket).

use crate::support::priced::*;
use crate::support::*;
use bytes::Bytes;
use http_body::Frame;
use std::time::{Duration, Instant};
use tiered_ratelimit::handle::Override;
use tiered_ratelimit::priced::{Actual, Estimate};
use tiered_ratelimit::rollout::Mode;
use tiered_ratelimit::token_lease::TokenLease;
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::sync::mpsc;

both_backends!(
    with_a_concurrency_tier,
    in_shadow_mode,
    under_an_override,
    under_an_unlimited_override,
);

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

/// The priced tier of [`tokens`] (1 000 a minute, estimate at most 500),
/// keyed by the `x-user` header, taking per-key overrides.
fn tokens_per_user() -> Tier {
    let user = |p: &http::request::Parts| {
        p.headers
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Tier::new("tokens", user, Quota::per_minute(1000))
        .priced(
            Estimate::header("x-max-tokens", 100, 500),
            Actual::header("x-usage-tokens"),
        )
        .overrides(true)
}

/// `GET /llm?tokens=<actual>` as `user`, reserving `estimate`: its status
/// and `X-RateLimit-Limit`/`-Remaining` (after the settle: the actual is in
/// the response head).
async fn llm_as(base: &str, user: &str, actual: u64, estimate: u64) -> (u16, u64, u64) {
    let r = client()
        .get(format!("{base}/llm?tokens={actual}"))
        .header("x-user", user)
        .header("x-max-tokens", estimate)
        .send()
        .await
        .unwrap();
    let l = limits(&r);
    (l.status, l.limit.unwrap(), l.remaining.unwrap())
}

/// A 2 000 override of the 1 000 tier: the refund and the extra charge are
/// settled on the override's quota, as the admission was; another key of
/// the same tier keeps the tier's own.
async fn under_an_override(env: Env) {
    let (base, layer, _streams) = start(&env, vec![tokens_per_user()]).await;
    let q = Override::Quota(Quota::per_minute(2000));
    layer
        .handle()
        .set_override("tokens", "alice", q, None, "test")
        .await
        .unwrap();
    // Reserved 500, used 300: 200 back, 1 700 left.
    assert_eq!(llm_as(&base, "alice", 300, 500).await, (200, 2000, 1700));
    // Reserved 400 (1 300 left), used 700: 300 more, 1 000 left.
    assert_eq!(llm_as(&base, "alice", 700, 400).await, (200, 2000, 1000));
    // The next admission sees the settled 1 000: 100 reserved and used.
    assert_eq!(llm_as(&base, "alice", 100, 100).await, (200, 2000, 900));
    // Another key keeps the tier's 1 000: 500 reserved, 200 back.
    assert_eq!(llm_as(&base, "bob", 300, 500).await, (200, 1000, 700));
    assert_eq!(llm_as(&base, "bob", 700, 500).await, (200, 1000, 0));
    // bob: 0 left, denied.
    assert_eq!(llm_as(&base, "bob", 1, 1).await.0, 429);
    // alice: 900 left, 400 reserved, 1 400 used: 500 of debt.
    assert_eq!(llm_as(&base, "alice", 1400, 400).await, (200, 2000, 0));
    let r = client()
        .get(format!("{base}/llm?tokens=1"))
        .header("x-user", "alice")
        .header("x-max-tokens", 1)
        .send()
        .await
        .unwrap();
    // 500 of debt and a cost of 1 on 2 000 a minute (one every 30 ms):
    // 501 × 30 ms = 15.03 s, rounded up.
    assert_eq!(limits(&r), denied(2000, 0, T0_S + 16, 16));
}

/// An unlimited override charges nothing: nothing reserved, nothing
/// settled (not even an actual above the estimate); once it is removed the
/// key has the tier's whole quota.
async fn under_an_unlimited_override(env: Env) {
    let (base, layer, _streams) = start(&env, vec![tokens_per_user()]).await;
    let h = layer.handle();
    h.set_override("tokens", "alice", Override::Unlimited, None, "test")
        .await
        .unwrap();
    assert_eq!(llm_as(&base, "alice", 800, 500).await, (200, 1000, 1000));
    assert_eq!(llm_as(&base, "alice", 100, 500).await, (200, 1000, 1000));
    h.remove_override("tokens", "alice", "test").await.unwrap();
    assert_eq!(llm_as(&base, "alice", 100, 100).await, (200, 1000, 900));
}

/// The override scenarios on a Redis Cluster (three primaries): the
/// override's read and the settle go in one refund-mode call to the key's
/// slot.
mod cluster {
    use crate::support::cluster::RedisCluster;
    use crate::support::Env;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overrides() {
        let cluster = RedisCluster::start(0);
        super::under_an_override(Env::cluster(&cluster)).await;
        for p in cluster.primaries() {
            crate::support::cluster::node_cmd::<()>(p, &["FLUSHALL"]).unwrap();
        }
        super::under_an_unlimited_override(Env::cluster(&cluster)).await;
    }
}

/// A priced tier of 10 000 tokens a minute in lease mode (leases of 500)
/// on `env`'s Redis, once its first lease is held: two requests checked on
/// Redis (100 reserved, 100 used) make a demand of 200 in no time (800 per
/// 100 ms interval), so the second asks for a lease of 500 (the most),
/// taken in the background. The shared bucket then holds 9 300.
async fn leased(env: &Env) -> (String, RateLimitLayer, mpsc::UnboundedReceiver<Stream>) {
    let tier = Tier::new("tokens", Global, Quota::per_minute(10_000))
        .priced(
            Estimate::header("x-max-tokens", 100, 500),
            Actual::header("x-usage-tokens"),
        )
        .lease(TokenLease::new().min(500).max(500));
    let (base, layer, streams) = start(env, vec![tier]).await;
    for _ in 0..2 {
        let r = get_with(format!("{base}/llm?tokens=100"), Some(100)).await;
        assert_eq!(r.status(), 200);
    }
    let h = layer.handle();
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.leases().first().map(|l| l.tokens) != Some(500) {
        assert!(Instant::now() < deadline, "no lease: {:?}", h.leases());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(shared(&layer).await, 10_000 - 200 - 500);
    (base, layer, streams)
}

/// Tokens the shared bucket of `tokens` holds now.
async fn shared(layer: &RateLimitLayer) -> u64 {
    left(layer).await.1
}

/// Lease mode on a real Redis: 10 000 tokens a minute, leases of 500. A
/// reservation spent from the lease settles a refund into the lease (no
/// call) and a debt on the shared bucket; once the lease is returned the
/// shared bucket holds exactly 10 000 − Σ actual (a clock that stands
/// still). (The headers of a request decided from a lease are lease mode's
/// approximation: the shared count at the last answer, whichever of the
/// lease and a concurrent check landed last, plus the tokens held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_lease_mode() {
    let env = Env::redis();
    let (base, layer, _streams) = leased(&env).await;
    let h = layer.handle();
    let redis = env.redis.as_ref().unwrap();
    let shared = || shared(&layer);
    let calls = redis.script_calls();
    // Reserved 100 from the lease, used 40: 60 back to the lease, no call.
    let r = get_with(format!("{base}/llm?tokens=40"), Some(100)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(h.leases()[0].tokens, 460);
    assert_eq!(redis.script_calls(), calls);
    // Reserved 100 from the lease, used 250: 150 of debt on the shared
    // bucket (one settle call, before the head), the lease keeps 360.
    let r = get_with(format!("{base}/llm?tokens=250"), Some(100)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(h.leases()[0].tokens, 360);
    assert_eq!(shared().await, 9300 - 150);
    // The lease's 360 back: 10 000 − (2 × 100 + 40 + 250).
    assert_eq!(h.return_leases().await, 360);
    assert_eq!(shared().await, 10_000 - 490);
}

/// A refund that finds its lease expired is dropped (the shared bucket
/// under-admits it until refill, as a lost lease), never added to tokens
/// that went back already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_lease_mode_a_refund_after_the_lease_expired_is_dropped() {
    let env = Env::redis();
    let (base, layer, mut streams) = leased(&env).await;
    let h = layer.handle();
    let shared = || shared(&layer);
    // A stream reserves 100 from the lease (400 left).
    let (s, r) = open(&base, 100, &mut streams).await;
    assert_eq!(h.leases()[0].tokens, 400);
    // The lease lives 2 × 100 ms: it has expired when the stream ends
    // having used 40, so the 60 are dropped.
    env.clock.advance(Duration::from_millis(200));
    end(s, r, 40).await;
    h.return_leases().await;
    // 9 300 at the lease, + 33.3 refilled in 200 ms (one token per 6 ms),
    // + the lease's 400 returned; not the 60.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let got = shared().await;
        if got == 9300 + 33 + 400 {
            break;
        }
        assert!(Instant::now() < deadline, "shared bucket at {got}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(h.lease_counts().returned, 400);
}
