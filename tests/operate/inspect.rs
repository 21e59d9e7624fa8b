//! Peek and reset ([`RateLimitHandle::peek`], [`RateLimitHandle::reset`],
//! the admin API's `/api/peek/{tier}` and `/api/reset`) on the memory
//! backend, a real Redis and a real Redis Cluster: exact numbers, nothing
//! charged by a peek (the next requests see the same state; Redis answers
//! `EVALSHA_RO` and gets no write), a reset key starts fresh.

use crate::support::cluster::{calls as node_calls, RedisCluster};
use crate::support::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::handle::{InspectError, KeyStatus};
use tiered_ratelimit::key::User;
use tiered_ratelimit::{admin, Quota, RateLimitHandle, RateLimitLayerBuilder, Tier};

const TOKEN: &str = "test-admin-token-0123456789";
const BASE: &str = "/admin/ratelimit";

both_backends!(peek_reads_without_charging_and_reset_starts_fresh);

async fn as_user(addr: SocketAddr, user: &str) -> Limits {
    limits(
        &client()
            .get(format!("http://{addr}/"))
            .header("authorization", format!("Bearer {user}"))
            .send()
            .await
            .unwrap(),
    )
}

fn status(
    allowed: bool,
    remaining: u64,
    reset_s: u64,
    retry_s: u64,
) -> (bool, u64, u64, Duration, Duration) {
    (
        allowed,
        3,
        remaining,
        Duration::from_secs(reset_s),
        Duration::from_secs(retry_s),
    )
}

fn numbers(s: &KeyStatus) -> (bool, u64, u64, Duration, Duration) {
    (
        s.allowed,
        s.limit,
        s.remaining,
        s.reset_after,
        s.retry_after,
    )
}

/// The scenario every backend runs: `user`, a token bucket of 3 a minute
/// (one token back every 20 s), keys by user id.
async fn scenario(builder: RateLimitLayerBuilder) -> (RateLimitHandle, SocketAddr) {
    let layer = builder
        .tier(Tier::new("user", User, Quota::per_minute(3)))
        .build()
        .unwrap();
    let h = layer.handle();
    let addr = serve(app(layer).nest(BASE, admin::router(h.clone(), TOKEN))).await;

    // A key never seen: the next request would leave 2 (a peek answers
    // with the numbers the next request would get), and it writes nothing.
    let s = h.peek("user", "alice").await.unwrap();
    assert_eq!(numbers(&s), status(true, 2, 20, 0));
    assert_eq!(s.now_us, T0_US);

    assert_eq!(as_user(addr, "alice").await, ok(3, 2, T0_S + 20));
    assert_eq!(as_user(addr, "alice").await, ok(3, 1, T0_S + 40));
    // Peeked twice: the same numbers, nothing consumed.
    for _ in 0..2 {
        let s = h.peek("user", "alice").await.unwrap();
        assert_eq!(numbers(&s), status(true, 0, 60, 0));
    }
    assert_eq!(as_user(addr, "alice").await, ok(3, 0, T0_S + 60));
    let s = h.peek("user", "alice").await.unwrap();
    assert_eq!(numbers(&s), status(false, 0, 60, 20));
    assert_eq!(as_user(addr, "alice").await, denied(3, 0, T0_S + 20, 20));

    // Reset: fresh for the whole backend; a second reset finds nothing.
    assert!(h.reset("user", "alice").await.unwrap());
    let s = h.peek("user", "alice").await.unwrap();
    assert_eq!(numbers(&s), status(true, 2, 20, 0));
    assert_eq!(as_user(addr, "alice").await, ok(3, 2, T0_S + 20));
    assert!(h.reset("user", "alice").await.unwrap());
    assert!(!h.reset("user", "alice").await.unwrap());

    // Errors name what is wrong; no backend call for them.
    assert!(matches!(
        h.peek("nope", "alice").await,
        Err(InspectError::UnknownTier(t)) if t == "nope"
    ));
    assert!(matches!(
        h.peek("user", "").await,
        Err(InspectError::InvalidKey)
    ));
    assert!(matches!(
        h.reset("user", "").await,
        Err(InspectError::InvalidKey)
    ));
    // Any other text is a key, as people read it or as stored: `a b` and
    // its stored form `a%20b` are one key.
    for (read, stored) in [
        ("a b", "a%20b"),
        ("{alice}", "%7Balice%7D"),
        ("é", "%C3%A9"),
    ] {
        let s = h.peek("user", read).await.unwrap();
        assert_eq!(numbers(&s), status(true, 2, 20, 0), "{read}");
        assert_eq!(h.peek("user", stored).await.unwrap(), s, "{stored}");
        assert!(!h.reset("user", read).await.unwrap(), "{read}");
    }
    (h, addr)
}

/// The admin API over the same layer: peek and reset by HTTP.
async fn admin_api(addr: SocketAddr) {
    assert_eq!(as_user(addr, "bob").await, ok(3, 2, T0_S + 20));
    let c = client();
    let peek = |key: &str| {
        c.get(format!("http://{addr}{BASE}/api/peek/user?key={key}"))
            .header("authorization", format!("Bearer {TOKEN}"))
            .send()
    };
    let res = peek("bob").await.unwrap();
    assert_eq!(res.status(), 200);
    let v: Value = res.json().await.unwrap();
    assert_eq!(
        v,
        json!({
            "tier": "user", "key": "bob", "allowed": true, "limit": 3, "remaining": 1,
            "reset_after_us": 40_000_000, "retry_after_us": 0, "now_us": T0_US,
            "blocked_for_us": null,
        })
    );
    // A key as read (`a b`, once percent-encoded in the query) or as
    // stored (`a%20b`, encoded again): one key, answered by its stored form.
    for typed in ["a%20b", "a%2520b"] {
        let res = peek(typed).await.unwrap();
        assert_eq!(res.status(), 200, "{typed}");
        let v: Value = res.json().await.unwrap();
        assert_eq!(v["key"], "a%20b", "{typed}");
    }
    let res = peek("").await.unwrap();
    assert_eq!(res.status(), 400);
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["error"], "invalid_key");
    let res = c
        .get(format!("http://{addr}{BASE}/api/peek/nope?key=bob"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
    // Without the token: 401, nothing read.
    let res = c
        .get(format!("http://{addr}{BASE}/api/peek/user?key=bob"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401);

    let reset = || {
        c.post(format!("http://{addr}{BASE}/api/reset"))
            .header("authorization", format!("Bearer {TOKEN}"))
            .json(&json!({ "tier": "user", "key": "bob" }))
            .send()
    };
    // The page: the key looked up, and its reset button.
    let page = c
        .get(format!("http://{addr}{BASE}?peek_tier=user&peek_key=bob"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(r#"<table id="lookup"><tr><th>next request</th><td>allowed</td></tr><tr><th>limit</th><td class="n">3</td></tr><tr><th>remaining after it</th><td class="n">1</td></tr><tr><th>full again in</th><td class="n">40 s</td></tr><tr><th>passes in</th><td class="n">0 s</td></tr><tr><th>penalty box</th><td>no</td></tr></table>"#),
        "{page}"
    );
    let res = client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("http://{addr}{BASE}/key"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("action=reset&tier=user&key=bob")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 303);
    assert_eq!(as_user(addr, "bob").await, ok(3, 2, T0_S + 20));
    let v: Value = reset().await.unwrap().json().await.unwrap();
    assert_eq!(v, json!({ "tier": "user", "key": "bob", "existed": true }));
    let v: Value = reset().await.unwrap().json().await.unwrap();
    assert_eq!(v["existed"], false);
    assert_eq!(as_user(addr, "bob").await, ok(3, 2, T0_S + 20));
}

async fn peek_reads_without_charging_and_reset_starts_fresh(env: Env) {
    let before = env
        .redis
        .as_ref()
        .map(|r| (r.succeeded("fcall"), r.calls("evalsha_ro")));
    let (_, addr) = scenario(env.builder()).await;
    if let (Some(r), Some((fcall, ro))) = (&env.redis, before) {
        // 5 requests: one FCALL each that ran (a first one may have met
        // "Function not found" before the library was loaded) but the 429,
        // which the deny cache answered (primed by the admission that
        // emptied the bucket); 5 peeks, all read-only, and 6 more of keys
        // typed as read and as stored; the key was written by the requests
        // only.
        assert_eq!(r.succeeded("fcall") - fcall, 4);
        // (+1: the first met NOSCRIPT, the script was loaded, and it ran again.)
        assert_eq!(r.calls("evalsha_ro") - ro, 6 + 6);
        // 3 resets of alice, 3 of keys typed as read (nothing stored).
        assert_eq!(r.calls("del"), 3 + 3);
        // The last reset left nothing behind.
        let keys: Vec<String> = r.cmd(&["KEYS", "*"]);
        assert!(keys.is_empty(), "{keys:?}");
    }
    admin_api(addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_and_reset_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let clock = tiered_ratelimit::backend::ManualClock::new(T0_US);
    let backend = tiered_ratelimit::backend::RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(clock)
        .with_test_ttl_slack(Duration::from_secs(600));
    let builder = tiered_ratelimit::RateLimitLayer::builder()
        .backend(backend)
        .docs_url("https://example.com/docs/rate-limits")
        .backend_timeout(Duration::from_secs(2));
    let (_, addr) = scenario(builder).await;
    let owner = cluster.primary_of("{rl:user:alice}");
    // 5 peeks; the first met NOSCRIPT and ran again as EVAL_RO (which
    // caches the script on that node).
    assert_eq!(node_calls(owner, "evalsha_ro"), 5);
    assert_eq!(node_calls(owner, "eval_ro"), 1);
    assert_eq!(node_calls(owner, "del"), 3);
    assert!(cluster.keys().is_empty());
    admin_api(addr).await;
}
