//! The HTTP contract, through a real axum server over TCP, on both backends.
//! Each scenario runs twice: `memory_*` and `redis_*` (a redis-server of the
//! test's own). Time is a `ManualClock` shared by the backend and the test,
//! so every header value is exact.

use crate::support::*;
use std::time::Duration;
use tiered_ratelimit::{
    key::{ApiKey, ClientIp, Endpoint, Global, User},
    response::Rejection,
    FailurePolicy, Quota, Tier,
};

both_backends!(
    burst_then_deny_then_refill,
    all_or_nothing_and_binding_tier,
    endpoint_groups_by_route_template,
    anonymous_requests_skip_the_user_tier,
    weighted_cost_denied_consumes_nothing,
    api_keys_are_separate_and_never_stored_in_clear,
    custom_rejection_and_error_responses_keep_headers,
    missing_connect_info_follows_failure_policy,
    missing_connect_info_skips_only_the_ip_tier,
    rejection_names_every_violated_tier,
);

async fn get(c: &reqwest::Client, url: &str) -> reqwest::Response {
    c.get(url).send().await.expect("request")
}

async fn burst_then_deny_then_refill(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(3)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let url = format!("http://{addr}/");
    let c = client();

    // One token every 20 s; Reset = when the bucket is full again.
    assert_eq!(limits(&get(&c, &url).await), ok(3, 2, T0_S + 20));
    assert_eq!(limits(&get(&c, &url).await), ok(3, 1, T0_S + 40));
    assert_eq!(limits(&get(&c, &url).await), ok(3, 0, T0_S + 60));

    let res = get(&c, &url).await;
    assert_eq!(limits(&res), denied(3, 0, T0_S + 20, 20));
    assert_eq!(
        res.headers()["content-type"].to_str().unwrap(),
        "application/json"
    );
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"error":"rate_limit_exceeded","retry_after":20,"docs":"https://example.com/docs/rate-limits"}"#
    );

    // One microsecond before the token: still denied, Retry-After rounds up to 1.
    env.clock.advance(Duration::from_micros(19_999_999));
    assert_eq!(limits(&get(&c, &url).await), denied(3, 0, T0_S + 20, 1));
    env.clock.advance(Duration::from_micros(1));
    assert_eq!(limits(&get(&c, &url).await), ok(3, 0, T0_S + 80));

    // A full idle period refills the whole burst and no more.
    env.clock.advance(Duration::from_secs(3600));
    let now = T0_S + 20 + 3600;
    assert_eq!(limits(&get(&c, &url).await), ok(3, 2, now + 20));

    if let Some(r) = &env.redis {
        assert_eq!(r.keys(), vec!["rl:ip:127.0.0.1".to_owned()]);
    }
}

async fn all_or_nothing_and_binding_tier(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(100)))
        .tier(Tier::new("user", User, Quota::per_minute(2)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let url = format!("http://{addr}/");
    let c = client();
    let alice = || c.get(&url).header("authorization", "Bearer alice").send();

    // The user tier has the least remaining, so it is the one described.
    assert_eq!(limits(&alice().await.unwrap()), ok(2, 1, T0_S + 30));
    assert_eq!(limits(&alice().await.unwrap()), ok(2, 0, T0_S + 60));
    assert_eq!(limits(&alice().await.unwrap()), denied(2, 0, T0_S + 30, 30));
    assert_eq!(limits(&alice().await.unwrap()), denied(2, 0, T0_S + 30, 30));

    // The two denied requests took nothing from the global tier: 100 - 2.
    let started = std::time::Instant::now();
    // Anonymous: only the global tier applies. 3 tokens missing at 0.6 s each.
    assert_eq!(limits(&get(&c, &url).await), ok(100, 97, T0_S + 2));

    if let Some(r) = &env.redis {
        // 100 per 60 s: a token every 0.6 s, 3 missing; the value is the
        // bucket's TAT in µs, T0 + 1.8 s (one integer).
        assert_eq!(r.get("rl:global:all").as_deref(), Some("1700000001800000"));
        // TTL = time to full = 3 × 0.6 s, measured in Redis's real time.
        let pttl = r.pttl("rl:global:all");
        let elapsed = started.elapsed().as_millis() as i64;
        assert!(
            pttl <= 1800 && pttl >= 1800 - elapsed - 1,
            "pttl {pttl}, elapsed {elapsed} ms"
        );
        // user bucket: 0 tokens, 60 s to full.
        assert_eq!(r.get("rl:user:alice").as_deref(), Some("1700000060000000"));
        let pttl = r.pttl("rl:user:alice");
        assert!(pttl <= 60_000 && pttl > 55_000, "pttl {pttl}");
    }
}

async fn endpoint_groups_by_route_template(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("endpoint", Endpoint, Quota::per_minute(2)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let u = |p: &str| format!("http://{addr}{p}");

    assert_eq!(limits(&get(&c, &u("/users/1")).await).status, 200);
    assert_eq!(limits(&get(&c, &u("/users/2")).await).status, 200);
    assert_eq!(limits(&get(&c, &u("/users/3")).await).status, 429);
    // Other routes and methods have their own buckets.
    assert_eq!(limits(&get(&c, &u("/")).await), ok(2, 1, T0_S + 30));
    let post = c.post(u("/login")).send().await.unwrap();
    assert_eq!(limits(&post), ok(2, 1, T0_S + 30));

    if let Some(r) = &env.redis {
        assert_eq!(
            r.keys(),
            vec![
                "rl:endpoint:GET%20/".to_owned(),
                "rl:endpoint:GET%20/users/%7Bid%7D".to_owned(),
                "rl:endpoint:POST%20/login".to_owned(),
            ]
        );
    }
}

async fn anonymous_requests_skip_the_user_tier(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("user", User, Quota::per_minute(1)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let url = format!("http://{addr}/");
    let c = client();
    for _ in 0..5 {
        assert_eq!(limits(&get(&c, &url).await), NO_LIMITS);
    }
    let bob = || c.get(&url).header("authorization", "Bearer bob").send();
    assert_eq!(limits(&bob().await.unwrap()), ok(1, 0, T0_S + 60));
    assert_eq!(limits(&bob().await.unwrap()), denied(1, 0, T0_S + 60, 60));
    if let Some(r) = &env.redis {
        assert_eq!(r.keys(), vec!["rl:user:bob".to_owned()]);
    }
}

async fn weighted_cost_denied_consumes_nothing(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("global", Global, Quota::new(5, Duration::from_secs(5))).cost(3))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let url = format!("http://{addr}/");
    let c = client();
    // 1 token per second; 3 missing → full in 3 s.
    assert_eq!(limits(&get(&c, &url).await), ok(5, 2, T0_S + 3));
    // Cost 3 with 2 left: denied, shows the 2 that are truly left, waits 1 s.
    assert_eq!(limits(&get(&c, &url).await), denied(5, 2, T0_S + 1, 1));
    assert_eq!(limits(&get(&c, &url).await), denied(5, 2, T0_S + 1, 1));
    env.clock.advance(Duration::from_secs(1));
    assert_eq!(limits(&get(&c, &url).await), ok(5, 0, T0_S + 1 + 5));
}

async fn api_keys_are_separate_and_never_stored_in_clear(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new(
            "api_key",
            ApiKey::header("x-api-key"),
            Quota::per_hour(1),
        ))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let url = format!("http://{addr}/");
    let c = client();
    let with_key = |k: &'static str| c.get(&url).header("x-api-key", k).send();
    assert_eq!(limits(&with_key("sk_live_A").await.unwrap()).status, 200);
    assert_eq!(limits(&with_key("sk_live_A").await.unwrap()).status, 429);
    assert_eq!(limits(&with_key("sk_live_B").await.unwrap()).status, 200);
    // No key: the tier does not apply.
    assert_eq!(limits(&get(&c, &url).await), NO_LIMITS);
    if let Some(r) = &env.redis {
        let keys = r.keys();
        assert_eq!(keys.len(), 2);
        for k in keys {
            assert!(!k.contains("sk_live"), "secret in key {k}");
            let part = k.strip_prefix("rl:api_key:").expect("layout");
            assert_eq!(part.len(), 32);
            assert!(part.bytes().all(|b| b.is_ascii_hexdigit()));
        }
    }
}

async fn custom_rejection_and_error_responses_keep_headers(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(1)))
        .on_rejection(|r: &Rejection| {
            http::Response::builder()
                .status(429)
                .header("content-type", "text/plain")
                .header("x-ratelimit-remaining", "999") // overwritten by the layer
                .body(bytes::Bytes::from(format!("tier {} full", r.tier)))
                .unwrap()
        })
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let boom = get(&c, &format!("http://{addr}/boom")).await;
    assert_eq!(
        limits(&boom),
        Limits {
            status: 500,
            ..ok(1, 0, T0_S + 60)
        }
    );
    let res = get(&c, &format!("http://{addr}/")).await;
    assert_eq!(limits(&res), denied(1, 0, T0_S + 60, 60));
    assert_eq!(res.text().await.unwrap(), "tier global full");
}

async fn missing_connect_info_follows_failure_policy(env: Env) {
    let tier = || Tier::new("ip", ClientIp::default(), Quota::per_minute(1));
    let open = env.builder().tier(tier()).build().unwrap();
    let addr = serve_without_connect_info(app(open)).await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(
            limits(&get(&c, &format!("http://{addr}/")).await),
            NO_LIMITS
        );
    }
    let closed = env
        .builder()
        .tier(tier())
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap();
    let addr = serve_without_connect_info(app(closed)).await;
    let res = get(&c, &format!("http://{addr}/")).await;
    assert_eq!(res.status(), 503);
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"error":"rate_limiter_unavailable"}"#
    );
}

/// Served without connect info, the `ip` tier cannot be computed; under
/// fail-open (and fallback) it alone is skipped, and a user far over the
/// `user` tier's quota is still limited, with exact headers.
async fn missing_connect_info_skips_only_the_ip_tier(env: Env) {
    for policy in [FailurePolicy::Open, FailurePolicy::Fallback] {
        let layer = env
            .builder()
            .key_prefix(format!("rl{policy:?}"))
            .failure_policy(policy)
            .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(1)))
            .tier(Tier::new("user", User, Quota::per_minute(2)))
            .build()
            .unwrap();
        let addr = serve_without_connect_info(app(layer)).await;
        let url = format!("http://{addr}/");
        let c = client();
        let alice = || c.get(&url).header("authorization", "Bearer alice").send();
        assert_eq!(limits(&alice().await.unwrap()), ok(2, 1, T0_S + 30));
        assert_eq!(limits(&alice().await.unwrap()), ok(2, 0, T0_S + 60));
        for _ in 0..10 {
            assert_eq!(
                limits(&alice().await.unwrap()),
                denied(2, 0, T0_S + 30, 30),
                "{policy:?}"
            );
        }
        // Anonymous: no tier can be computed, so none applies.
        assert_eq!(limits(&get(&c, &url).await), NO_LIMITS);
        if let Some(r) = &env.redis {
            let prefix = format!("rl{policy:?}:");
            let mut keys: Vec<String> = r
                .keys()
                .into_iter()
                .filter(|k| k.starts_with(&prefix))
                .collect();
            keys.sort();
            assert_eq!(keys, vec![format!("{prefix}user:alice")]);
        }
    }
}

/// `Rejection::violated_policies`: every enforced tier that denied, in tier
/// order, for a custom body; the draft-11 fields describe the binding tier
/// (the longest wait) and `Retry-After` is its wait.
async fn rejection_names_every_violated_tier(env: Env) {
    let layer = env
        .builder()
        .headers(tiered_ratelimit::response::HeaderStyle::IetfDraft11)
        // A full decision from the backend, not the deny cache's shortcut.
        .deny_cache(0)
        .tier(Tier::new("global", Global, Quota::per_minute(1)))
        .tier(Tier::new("user", User, Quota::per_second(1)))
        .on_rejection(|r: &Rejection| {
            http::Response::builder()
                .status(429)
                .body(bytes::Bytes::from(format!(
                    "{} of {}",
                    r.tier,
                    r.violated_policies.join(",")
                )))
                .unwrap()
        })
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let alice = || {
        c.get(format!("http://{addr}/"))
            .header("authorization", "Bearer alice")
            .send()
    };
    assert_eq!(alice().await.unwrap().status(), 200);
    let res = alice().await.unwrap();
    assert_eq!(res.status(), 429);
    let h = |n: &str| res.headers()[n].to_str().unwrap().to_owned();
    assert_eq!(h("ratelimit"), r#""global";r=0;t=60"#);
    assert_eq!(h("retry-after"), "60");
    assert_eq!(res.text().await.unwrap(), "global of global,user");
}
