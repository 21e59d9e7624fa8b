//! Safe rollout through real HTTP: shadow, canary, off and the kill switch,
//! runtime changes under load, allow and deny lists, plans, methods.

use crate::support::*;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tiered_ratelimit::{
    key::{ClientIp, Global, User},
    rollout::{AccessList, DenyStatus, Mode},
    Quota, RateLimitLayer, Tier,
};

both_backends!(
    shadow_counts_but_never_rejects,
    shadow_tier_does_not_weaken_enforced_tiers,
    shadow_numbers_equal_enforce_numbers,
    canary_enforces_a_stable_slice_of_keys,
    off_and_kill_switch_skip_the_backend,
    allowlist_skips_limiting,
    denylist_refuses_first,
    plans_pick_the_quota_and_change_at_run_time,
    options_is_not_counted_by_default,
);

async fn shadow_counts_but_never_rejects(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(2)).mode(Mode::Shadow))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    for _ in 0..5 {
        assert_eq!(
            limits(&c.get(format!("http://{addr}/")).send().await.unwrap()),
            NO_LIMITS
        );
    }
    let counts = handle.counts();
    assert_eq!(
        (counts.allowed, counts.shadow_limited, counts.limited),
        (2, 3, 0)
    );

    // With shadow headers on, clients see the numbers (but still no 429).
    let layer = env
        .builder()
        .key_prefix("rl2")
        .shadow_headers(true)
        .tier(Tier::new("global", Global, Quota::per_minute(2)).mode(Mode::Shadow))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let get = || c.get(format!("http://{addr}/")).send();
    assert_eq!(limits(&get().await.unwrap()), ok(2, 1, T0_S + 30));
    assert_eq!(limits(&get().await.unwrap()), ok(2, 0, T0_S + 60));
    // Would be denied: passes, and shows what is truly left.
    assert_eq!(limits(&get().await.unwrap()), ok(2, 0, T0_S + 60));
}

async fn shadow_tier_does_not_weaken_enforced_tiers(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(3)))
        .tier(Tier::new("user", User, Quota::per_minute(1)).mode(Mode::Shadow))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let alice = || {
        c.get(format!("http://{addr}/"))
            .header("authorization", "Bearer alice")
            .send()
    };
    // The user tier would deny from the 2nd request on; the IP tier still
    // counts every request, and rejects the 4th.
    assert_eq!(limits(&alice().await.unwrap()), ok(3, 2, T0_S + 20));
    assert_eq!(limits(&alice().await.unwrap()), ok(3, 1, T0_S + 40));
    assert_eq!(limits(&alice().await.unwrap()), ok(3, 0, T0_S + 60));
    assert_eq!(limits(&alice().await.unwrap()), denied(3, 0, T0_S + 20, 20));
    let counts = handle.counts();
    // On Redis the 3rd admission emptied the IP bucket and primed the deny
    // cache: the 4th is refused locally, and counted `limited` all the same
    // (the key's first 429).
    let refused = (1, 0);
    assert_eq!(
        (
            counts.allowed,
            counts.shadow_limited,
            (counts.limited, counts.cache_blocked)
        ),
        (1, 2, refused)
    );
    if let Some(r) = &env.redis {
        // The user bucket was charged once, as an enforced tier would be.
        assert_eq!(r.get("rl:user:alice").as_deref(), Some("1700000060000000"));
    }
}

async fn shadow_numbers_equal_enforce_numbers(env: Env) {
    let build = |prefix: &str, mode: Mode| {
        env.builder()
            .key_prefix(prefix)
            .tier(Tier::new("global", Global, Quota::per_second(20).burst(5)).mode(mode))
            .tier(Tier::new("user", User, Quota::per_second(2).burst(3)).mode(mode))
            .build()
            .unwrap()
    };
    let enforce = build("enf", Mode::Enforce);
    let shadow = build("sha", Mode::Shadow);
    let (he, hs) = (enforce.handle(), shadow.handle());
    let (ae, as_) = (serve(app(enforce)).await, serve(app(shadow)).await);
    let c = client();
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        env.clock.advance(Duration::from_micros(x % 150_000));
        let user = format!("Bearer u{}", x % 4);
        for addr in [ae, as_] {
            c.get(format!("http://{addr}/"))
                .header("authorization", &user)
                .send()
                .await
                .unwrap();
        }
    }
    let (e, s) = (he.counts(), hs.counts());
    // Enforced rejections are answered by the backend or, on Redis, by the
    // deny cache (shadow denials are never cached): together they are the
    // shadow's would-be rejections.
    let rejected = e.limited + e.cache_blocked;
    assert!(
        rejected > 30,
        "the traffic must be limited to prove anything: {e:?}"
    );
    assert_eq!(rejected, s.shadow_limited);
    assert_eq!(e.allowed, s.allowed);
    assert_eq!(s.limited, 0);
}

async fn canary_enforces_a_stable_slice_of_keys(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("user", User, Quota::per_minute(1)).mode(Mode::Canary { percent: 50 }))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let mut rejected = 0;
    let mut expected = 0;
    for u in 0..60 {
        let id = format!("u{u}");
        if (Mode::Canary { percent: 50 }).enforces("user", &id) {
            expected += 1;
        }
        for attempt in 0..2 {
            let res = c
                .get(format!("http://{addr}/"))
                .header("authorization", format!("Bearer {id}"))
                .send()
                .await
                .unwrap();
            if res.status() == 429 {
                assert_eq!(attempt, 1);
                rejected += 1;
            }
        }
    }
    assert_eq!(rejected, expected);
    assert!(
        expected > 15 && expected < 45,
        "{expected} of 60 enforced at 50 %"
    );
}

async fn off_and_kill_switch_skip_the_backend(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(1)))
        .tier(Tier::new("user", User, Quota::per_minute(1)).mode(Mode::Off))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let get = || {
        c.get(format!("http://{addr}/"))
            .header("authorization", "Bearer bob")
            .send()
    };
    assert_eq!(limits(&get().await.unwrap()), ok(1, 0, T0_S + 60));
    assert_eq!(limits(&get().await.unwrap()).status, 429);
    // The kill switch: the next request passes, untouched.
    handle.set_mode(Mode::Off);
    for _ in 0..3 {
        assert_eq!(limits(&get().await.unwrap()), NO_LIMITS);
    }
    handle.set_mode(Mode::Enforce);
    assert_eq!(limits(&get().await.unwrap()).status, 429);
    if let Some(r) = &env.redis {
        // The user tier is off: it never reached Redis.
        assert_eq!(r.keys(), vec!["rl:global:all".to_owned()]);
    }
    assert!(handle.set_tier_mode("nope", Mode::Off).is_err());
}

async fn allowlist_skips_limiting(env: Env) {
    // Over TCP the peer is 127.0.0.1; trusting it lets the test choose the
    // client address with X-Forwarded-For.
    let client_ip = ClientIp::default().trusted_proxies(["127.0.0.1/32".parse().unwrap()]);
    let layer = env
        .builder()
        .client_ip(client_ip.clone())
        .allowlist(
            AccessList::new()
                .ip("192.0.2.0/24".parse().unwrap())
                .ip("2001:db8::/32".parse().unwrap())
                .api_key("sk_partner")
                .user("ops-bot")
                .predicate(|p| p.uri.path() == "/users/health"),
        )
        .tier(Tier::new("ip", client_ip, Quota::per_minute(1)))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let from = |ip: &str| {
        c.get(format!("http://{addr}/"))
            .header("x-forwarded-for", ip)
    };
    for _ in 0..3 {
        for r in [
            from("192.0.2.77"),
            from("2001:db8:1::9"),
            from("203.0.113.1").header("x-api-key", "sk_partner"),
            from("203.0.113.1").header("authorization", "Bearer ops-bot"),
            c.get(format!("http://{addr}/users/health"))
                .header("x-forwarded-for", "203.0.113.1"),
        ] {
            assert_eq!(limits(&r.send().await.unwrap()), NO_LIMITS);
        }
    }
    assert_eq!(handle.counts().allowlisted, 15);
    // Not on the list: limited. A forged hop left of the real client does not help.
    assert_eq!(
        limits(&from("198.51.100.1").send().await.unwrap()).status,
        200
    );
    assert_eq!(
        limits(&from("192.0.2.77, 198.51.100.1").send().await.unwrap()).status,
        429
    );
    // Lists change at run time.
    handle.set_allowlist(AccessList::new()).unwrap();
    assert_eq!(
        limits(&from("192.0.2.77").send().await.unwrap()).status,
        200
    );
    assert_eq!(
        limits(&from("192.0.2.77").send().await.unwrap()).status,
        429
    );
    if let Some(r) = &env.redis {
        assert_eq!(
            r.keys(),
            vec![
                "rl:ip:192.0.2.77".to_owned(),
                "rl:ip:198.51.100.1".to_owned()
            ]
        );
    }
}

async fn denylist_refuses_first(env: Env) {
    for (status, code) in [
        (DenyStatus::Forbidden, 403),
        (DenyStatus::TooManyRequests, 429),
    ] {
        let layer = env
            .builder()
            .denylist(AccessList::new().user("mallory"), status)
            .allowlist(AccessList::new().user("mallory"))
            .tier(Tier::new("global", Global, Quota::per_minute(100)))
            .build()
            .unwrap();
        let addr = serve(app(layer)).await;
        let res = client()
            .get(format!("http://{addr}/"))
            .header("authorization", "Bearer mallory")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), code);
        let body = res.text().await.unwrap();
        assert!(
            body.contains(if code == 403 {
                "forbidden"
            } else {
                "rate_limit_exceeded"
            }),
            "{body}"
        );
    }
    // The kill switch stops the limiter, not the denylist.
    let layer = env
        .builder()
        .denylist(AccessList::new().user("mallory"), DenyStatus::Forbidden)
        .tier(Tier::new("global", Global, Quota::per_minute(1)))
        .mode(Mode::Off)
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let as_user = |user: &'static str| {
        client()
            .get(format!("http://{addr}/"))
            .header("authorization", format!("Bearer {user}"))
            .send()
    };
    for _ in 0..3 {
        assert_eq!(limits(&as_user("alice").await.unwrap()), NO_LIMITS);
        assert_eq!(as_user("mallory").await.unwrap().status(), 403);
    }
    assert_eq!(handle.counts().denylisted, 3);
    assert_eq!(handle.counts().skipped, 3);
}

async fn plans_pick_the_quota_and_change_at_run_time(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("user", User, Quota::per_minute(2)).plans([
            ("free", Quota::per_minute(1)),
            ("pro", Quota::per_minute(3)),
        ]))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let send = |user: &str, plan: Option<&str>| {
        let mut r = c
            .get(format!("http://{addr}/"))
            .header("authorization", format!("Bearer {user}"));
        if let Some(p) = plan {
            r = r.header("x-test-plan", p);
        }
        r.send()
    };
    assert_eq!(
        limits(&send("f", Some("free")).await.unwrap()),
        ok(1, 0, T0_S + 60)
    );
    assert_eq!(
        limits(&send("p", Some("pro")).await.unwrap()),
        ok(3, 2, T0_S + 20)
    );
    assert_eq!(limits(&send("d", None).await.unwrap()), ok(2, 1, T0_S + 30));
    assert_eq!(
        limits(&send("x", Some("gold")).await.unwrap()),
        ok(2, 1, T0_S + 30)
    );
    // A new quota for "free" applies to the next request of every free key.
    // Both backends keep the bucket's used capacity: 1 token of 1/min is 1
    // of 10/min, so 8 are left after this request (full 12 s later).
    handle
        .set_plan_quota("user", "free", Quota::per_minute(10))
        .unwrap();
    assert_eq!(
        limits(&send("f", Some("free")).await.unwrap()),
        ok(10, 8, T0_S + 12)
    );
    let status = handle.tiers();
    assert_eq!(
        status[0].plans[0],
        ("free".to_owned(), Quota::per_minute(10))
    );
}

async fn options_is_not_counted_by_default(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(1)))
        .tier(Tier::new("posts", Global, Quota::per_minute(1)).methods([http::Method::POST]))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    for _ in 0..3 {
        let res = c
            .request(reqwest::Method::OPTIONS, format!("http://{addr}/"))
            .send()
            .await
            .unwrap();
        assert_eq!(limits(&res).limit, None, "OPTIONS is not limited");
    }
    // GET counts on `global` only; POST on both.
    assert_eq!(
        limits(&c.get(format!("http://{addr}/")).send().await.unwrap()),
        ok(1, 0, T0_S + 60)
    );
    assert_eq!(
        limits(&c.post(format!("http://{addr}/login")).send().await.unwrap()).status,
        429
    );
}

/// Two tiers switched off and on together, under concurrent load: no request
/// may see one switched and not the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_changes_are_atomic_under_load() {
    let layer = RateLimitLayer::builder()
        .tier(Tier::new("a", Global, Quota::per_hour(1_000_000)))
        .tier(Tier::new("b", User, Quota::per_hour(2_000_000)))
        .build()
        .unwrap();
    let handle = layer.handle();
    let addr = serve(app(layer)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut on = false;
            while !stop.load(Ordering::Relaxed) {
                let mode = if on { Mode::Enforce } else { Mode::Off };
                handle
                    .update(|c| {
                        c.tier_mode("a", mode)?.tier_mode("b", mode)?;
                        Ok(())
                    })
                    .unwrap();
                on = !on;
                tokio::task::yield_now().await;
            }
        })
    };
    let c = client();
    let mut seen = HashSet::new();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut limits_seen = Vec::new();
            for _ in 0..100 {
                let res = c
                    .get(format!("http://{addr}/"))
                    .header("authorization", format!("Bearer w{w}"))
                    .send()
                    .await
                    .unwrap();
                limits_seen.push(limits(&res).limit);
            }
            limits_seen
        }));
    }
    for t in tasks {
        seen.extend(t.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    flipper.await.unwrap();
    // Both on: tier a (fewer remaining) is shown. Both off: nothing. Half
    // (only b on) would show b's limit, 2 000 000.
    assert!(
        !seen.contains(&Some(2_000_000)),
        "a half-applied change was seen: {seen:?}"
    );
    assert!(
        seen.contains(&Some(1_000_000)) && seen.contains(&None),
        "{seen:?}"
    );
}

/// Canary over 10 000 keys: the enforced fraction is within ±1 point of the
/// percent, and raising the percent only adds keys.
#[test]
fn canary_fraction_and_monotonicity() {
    let keys: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();
    let mut previous: HashSet<&str> = HashSet::new();
    for percent in [0u8, 1, 5, 10, 25, 50, 90, 100] {
        let mode = Mode::Canary { percent };
        let enforced: HashSet<&str> = keys
            .iter()
            .filter(|k| mode.enforces("user", k))
            .map(String::as_str)
            .collect();
        let fraction = enforced.len() as f64 / keys.len() as f64 * 100.0;
        assert!(
            (fraction - f64::from(percent)).abs() <= 1.0,
            "{percent} %: {fraction:.2} % enforced"
        );
        assert!(
            previous.is_subset(&enforced),
            "raising to {percent} % dropped keys"
        );
        previous = enforced;
    }
    // Stable: the same answer every time, and per tier.
    assert_eq!(
        Mode::Canary { percent: 10 }.enforces("user", "user-1"),
        Mode::Canary { percent: 10 }.enforces("user", "user-1")
    );
}

/// IP allowlist edge cases: /0, /32, /128, IPv4-mapped IPv6.
#[test]
fn access_list_cidr_edges() {
    let peer = |ip: &str| {
        let (mut p, _) = http::Request::new(()).into_parts();
        let addr: std::net::IpAddr = ip.parse().unwrap();
        p.extensions.insert(std::net::SocketAddr::new(addr, 1));
        p
    };
    let ip = ClientIp::default();
    let list = |net: &str| AccessList::new().ip(net.parse().unwrap());
    assert!(list("0.0.0.0/0").matches(&peer("203.0.113.9"), &ip));
    assert!(!list("0.0.0.0/0").matches(&peer("2001:db8::1"), &ip));
    assert!(list("::/0").matches(&peer("2001:db8::1"), &ip));
    assert!(list("192.0.2.1/32").matches(&peer("192.0.2.1"), &ip));
    assert!(!list("192.0.2.1/32").matches(&peer("192.0.2.2"), &ip));
    assert!(list("2001:db8::1/128").matches(&peer("2001:db8::1"), &ip));
    assert!(!list("2001:db8::1/128").matches(&peer("2001:db8::2"), &ip));
    // A v4 client reached over a dual-stack socket matches v4 entries...
    assert!(list("192.0.2.0/24").matches(&peer("::ffff:192.0.2.7"), &ip));
    // ...and v4-mapped entries match v4 clients.
    assert!(list("::ffff:192.0.2.0/120").matches(&peer("192.0.2.7"), &ip));
    assert!(!list("::ffff:192.0.2.0/120").matches(&peer("192.0.3.7"), &ip));
    // No peer address: IP entries cannot match.
    let (p, _) = http::Request::new(()).into_parts();
    assert!(!list("0.0.0.0/0").matches(&p, &ip));
}

/// The same layer on one nested router only (`route_layer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_route_limits_with_route_layer() {
    use axum::{routing::get, Router};
    let layer = RateLimitLayer::builder()
        .tier(Tier::new("api", Global, Quota::per_minute(1)))
        .build()
        .unwrap();
    let app = Router::new()
        .nest(
            "/api",
            Router::new()
                .route("/x", get(|| async { "x" }))
                .route_layer(layer),
        )
        .route("/free", get(|| async { "free" }));
    let addr = serve(app).await;
    let c = client();
    assert_eq!(
        c.get(format!("http://{addr}/api/x"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(format!("http://{addr}/api/x"))
            .send()
            .await
            .unwrap()
            .status(),
        429
    );
    for _ in 0..3 {
        assert_eq!(
            c.get(format!("http://{addr}/free"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    }
}

/// One `HSET` on the control hash switches two app instances sharing Redis,
/// within the poll interval; a malformed value is ignored; `HDEL` restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_wide_control_key() {
    use tiered_ratelimit::{backend::RedisBackend, handle::ControlKey};
    let redis = RedisServer::start();
    let poll = Duration::from_millis(100);
    let mk = || {
        RateLimitLayer::builder()
            .backend(RedisBackend::from_url(&redis.url()).unwrap())
            .control_key(ControlKey::new("rl:control").poll_interval(poll))
            .tier(Tier::new("global", Global, Quota::per_hour(1)))
            .build()
            .unwrap()
    };
    let (la, lb) = (mk(), mk());
    let (ha, hb) = (la.handle(), lb.handle());
    let a = serve(app(la)).await;
    let b = serve(app(lb)).await;
    let c = client();
    let status = |addr| {
        let c = c.clone();
        async move { limits(&c.get(format!("http://{addr}/")).send().await.unwrap()) }
    };
    assert_eq!(status(a).await.status, 200);
    assert_eq!(status(b).await.status, 429);
    assert_eq!(status(a).await.status, 429);

    // Wait until both watchers have polled at least once, then switch.
    redis.cmd::<()>(&["HSET", "rl:control", "mode", "off"]);
    let switched = |h: &tiered_ratelimit::RateLimitHandle, m: Mode| h.effective_mode() == m;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !(switched(&ha, Mode::Off) && switched(&hb, Mode::Off)) {
        assert!(
            std::time::Instant::now() < deadline,
            "the fleet did not switch"
        );
        tokio::time::sleep(poll / 4).await;
    }
    assert_eq!(status(a).await, NO_LIMITS);
    assert_eq!(status(b).await, NO_LIMITS);

    // A typo is ignored: the last good value stays.
    redis.cmd::<()>(&["HSET", "rl:control", "mode", "offf"]);
    tokio::time::sleep(poll * 3).await;
    assert_eq!(ha.effective_mode(), Mode::Off);

    // A tier override, then everything back to the configuration.
    redis.cmd::<()>(&[
        "HSET",
        "rl:control",
        "mode",
        "enforce",
        "tier:global",
        "shadow",
    ]);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ha.tiers()[0].effective_mode != Mode::Shadow
        || hb.tiers()[0].effective_mode != Mode::Shadow
    {
        assert!(
            std::time::Instant::now() < deadline,
            "tier override not applied"
        );
        tokio::time::sleep(poll / 4).await;
    }
    assert_eq!(status(a).await, NO_LIMITS, "shadow: passes without headers");
    redis.cmd::<()>(&["DEL", "rl:control"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ha.tiers()[0].effective_mode != Mode::Enforce
        || hb.tiers()[0].effective_mode != Mode::Enforce
    {
        assert!(std::time::Instant::now() < deadline, "not restored");
        tokio::time::sleep(poll / 4).await;
    }
    assert_eq!(status(a).await.status, 429);
}

/// The `tiered_ratelimit_mode` gauge follows the fleet control key
/// (docs/observability.md): `HSET rl:control mode off` sets it to 0, and a
/// tier override to shadow sets that tier's gauge to 1. The control poll
/// runs on this current-thread runtime, so the thread-local recorder sees it.
#[test]
fn mode_gauge_follows_the_control_key() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tiered_ratelimit::{backend::RedisBackend, handle::ControlKey};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let redis = RedisServer::start();
    let gauge = || {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find_map(|(key, _, _, value)| {
                let k = key.key();
                let tier = k.labels().find(|l| l.key() == "tier")?.value().to_owned();
                match (k.name(), value) {
                    ("tiered_ratelimit_mode", DebugValue::Gauge(v)) if tier == "gauge_tier" => {
                        Some(v.into_inner())
                    }
                    _ => None,
                }
            })
    };
    metrics::with_local_recorder(&recorder, || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            let poll = Duration::from_millis(50);
            let layer = RateLimitLayer::builder()
                .backend(RedisBackend::from_url(&redis.url()).unwrap())
                .key_prefix("gauge")
                .control_key(ControlKey::new("gauge:control").poll_interval(poll))
                .tier(Tier::new("gauge_tier", Global, Quota::per_hour(1)))
                .build()
                .unwrap();
            let h = layer.handle();
            assert_eq!(gauge(), Some(3.0), "enforce when built");
            // The control watcher starts with the first request.
            let app = app(layer);
            let req = http::Request::get("/")
                .body(axum::body::Body::empty())
                .unwrap();
            let res = tower::ServiceExt::oneshot(app.clone(), req).await.unwrap();
            assert_eq!(res.status(), 200);
            redis.cmd::<()>(&["HSET", "gauge:control", "mode", "off"]);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while h.effective_mode() != Mode::Off {
                assert!(std::time::Instant::now() < deadline, "not switched");
                tokio::time::sleep(poll / 2).await;
            }
            assert_eq!(gauge(), Some(0.0), "the kill switch shows as 0");
            redis.cmd::<()>(&[
                "HSET",
                "gauge:control",
                "mode",
                "enforce",
                "tier:gauge_tier",
                "shadow",
            ]);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while h.tiers()[0].effective_mode != Mode::Shadow {
                assert!(std::time::Instant::now() < deadline, "no override");
                tokio::time::sleep(poll / 2).await;
            }
            assert_eq!(gauge(), Some(1.0), "a tier override to shadow");
            drop(app);
        });
    });
}

/// The control key's log line says what an operator wrote (`mode=off`,
/// not Rust's `Some(Off)`) and names the tiers whose mode changed, with
/// their new mode (`none`: no longer set by the key).
#[test]
fn control_key_log_names_the_mode_and_the_changed_tiers() {
    use tiered_ratelimit::{backend::RedisBackend, handle::ControlKey};
    let redis = RedisServer::start();
    let buf = LogBuf::default();
    tracing::subscriber::with_default(buf.subscriber(tracing::Level::WARN), || {
        current_thread_runtime().block_on(async {
            let poll = Duration::from_millis(50);
            let layer = RateLimitLayer::builder()
                .backend(RedisBackend::from_url(&redis.url()).unwrap())
                .key_prefix("logs")
                .control_key(ControlKey::new("logs:control").poll_interval(poll))
                .tier(Tier::new("global", Global, Quota::per_hour(100)))
                .tier(Tier::new("login", Global, Quota::per_hour(100)))
                .tier(Tier::new("search", Global, Quota::per_hour(100)))
                .build()
                .unwrap();
            let h = layer.handle();
            // The control watcher starts with the first request.
            let app = app(layer);
            let req = http::Request::get("/")
                .body(axum::body::Body::empty())
                .unwrap();
            let res = tower::ServiceExt::oneshot(app.clone(), req).await.unwrap();
            assert_eq!(res.status(), 200);
            redis.cmd::<()>(&[
                "HSET",
                "logs:control",
                "mode",
                "off",
                "tier:login",
                "shadow",
                "tier:search",
                "canary:10",
            ]);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while h.effective_mode() != Mode::Off {
                assert!(std::time::Instant::now() < deadline, "not switched");
                tokio::time::sleep(poll / 2).await;
            }
            redis.cmd::<()>(&["HDEL", "logs:control", "tier:login"]);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while buf.text().matches("control key changed").count() < 2 {
                assert!(std::time::Instant::now() < deadline, "no second line");
                tokio::time::sleep(poll / 2).await;
            }
            drop(app);
        });
    });
    let text = buf.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("control key changed"))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].ends_with(
            "control key changed the rate limiter's modes key=\"logs:control\" \
             mode=off tiers=login=shadow,search=canary:10"
        ),
        "{text}"
    );
    assert!(
        lines[1].ends_with(
            "control key changed the rate limiter's modes key=\"logs:control\" \
             mode=off tiers=login=none"
        ),
        "{text}"
    );
    assert!(!text.contains("Some("), "{text}");
}
