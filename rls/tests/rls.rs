//! The Envoy rate limit service through a real tonic client over TCP
//! (Envoy's generated client from envoy-types), on memory, Redis and a
//! Redis Cluster: exact statuses, remaining and reset per descriptor; one
//! all-or-nothing decision per request under concurrency from two server
//! instances sharing Redis; the failure policy; hostile input.

mod support;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use std::net::SocketAddr;

use support::cluster::RedisCluster;
use support::{call, connect, d, header, no_limit, req, RedisServer, T0_US};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::descriptor::RulesPolicy;
use tiered_ratelimit_rls::{serve, Rls};

const RULES: &str = r#"
domain = "edge"
key_prefix = "rls-test"

[[rule]]
name = "per_ip"
match = [{ key = "remote_address" }]
limit = 2
period = "1m"

[[rule]]
name = "office"
match = [{ key = "remote_address", value = "10.0.0.1" }]
unlimited = true

[[rule]]
name = "per_user_path"
match = [{ key = "user" }, { key = "path" }]
limit = 3
period = "1m"

[[rule]]
name = "shadowed"
match = [{ key = "generic_key", value = "shadow" }]
limit = 1
period = "1m"
shadow_mode = true
"#;

/// Serves `rules` on `backend` on a free loopback port.
async fn start(rules: &str, backend: impl Into<Backend>) -> SocketAddr {
    let policy = RulesPolicy::from_toml_str(rules).expect("rules");
    let rls = Rls::new(
        policy.limiter(backend).expect("limiter"),
        policy.failure_status,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(rls, listener, None, std::future::pending()));
    addr
}

/// A status with a per-minute limit: code, rule, per unit, remaining,
/// seconds to reset.
fn limited(
    code: Code,
    name: &str,
    per_unit: u32,
    remaining: u32,
    reset_s: i64,
) -> DescriptorStatus {
    support::limited_per(code, name, per_unit, Unit::Minute, remaining, reset_s)
}

/// The scenario every backend must answer identically (time stands still
/// at T0 on the manual clock).
async fn exact_statuses(addr: SocketAddr) {
    let mut c = connect(addr).await;
    let ip = || d(&[("remote_address", "203.0.113.7")]);
    let alice = || d(&[("user", "alice"), ("path", "/a")]);
    // 1st: both allowed; binding (least remaining) per_ip.
    let r = call(&mut c, req("edge", vec![ip(), alice()])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(
        r.statuses,
        vec![
            limited(Code::Ok, "per_ip", 2, 1, 30),
            limited(Code::Ok, "per_user_path", 3, 2, 20),
        ]
    );
    // RateLimit-Policy: every rule the request is checked by; RateLimit:
    // the binding one.
    assert_eq!(
        r.response_headers_to_add,
        vec![
            header(
                "ratelimit-policy",
                r#""per_ip";q=2;w=60, "per_user_path";q=3;w=60"#
            ),
            header("ratelimit", r#""per_ip";r=1;t=30"#),
        ]
    );
    // 2nd: per_ip empty.
    let r = call(&mut c, req("edge", vec![ip(), alice()])).await;
    assert_eq!(
        r.statuses,
        vec![
            limited(Code::Ok, "per_ip", 2, 0, 60),
            limited(Code::Ok, "per_user_path", 3, 1, 40),
        ]
    );
    // 3rd: per_ip over the limit (30 s until it would pass); nothing is
    // charged, per_user_path included.
    let r = call(&mut c, req("edge", vec![ip(), alice()])).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0], limited(Code::OverLimit, "per_ip", 2, 0, 30));
    // per_user_path passed and was charged nothing: its uncharged count,
    // full again in 40 s (two requests of 20 s each).
    assert_eq!(r.statuses[1], limited(Code::Ok, "per_user_path", 3, 1, 40));
    assert_eq!(
        r.response_headers_to_add,
        vec![
            header(
                "ratelimit-policy",
                r#""per_ip";q=2;w=60, "per_user_path";q=3;w=60"#
            ),
            header("ratelimit", r#""per_ip";r=0;t=30"#),
            header("retry-after", "30"),
        ]
    );
    // The denied call charged nothing: alice still has 1 left.
    let r = call(&mut c, req("edge", vec![alice()])).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, "per_user_path", 3, 0, 60)]
    );
    // The specific unlimited rule replaces per_ip for the office; unknown
    // keys have no limit; neither calls the backend.
    for _ in 0..5 {
        let r = call(
            &mut c,
            req(
                "edge",
                vec![d(&[("remote_address", "10.0.0.1")]), d(&[("unknown", "x")])],
            ),
        )
        .await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses, vec![no_limit(u32::MAX), no_limit(0)]);
        assert!(r.response_headers_to_add.is_empty());
    }
    // A shadow rule decides and reports, never denies.
    let shadow = || d(&[("generic_key", "shadow")]);
    let r = call(&mut c, req("edge", vec![shadow()])).await;
    assert_eq!(r.statuses, vec![limited(Code::Ok, "shadowed", 1, 0, 60)]);
    let r = call(&mut c, req("edge", vec![shadow()])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses, vec![limited(Code::Ok, "shadowed", 1, 0, 60)]);
    // hits_addend is the cost: 2 on a fresh address empties per_ip at once.
    let mut r2 = req("edge", vec![d(&[("remote_address", "198.51.100.1")])]);
    r2.hits_addend = 2;
    let r = call(&mut c, r2.clone()).await;
    assert_eq!(r.statuses, vec![limited(Code::Ok, "per_ip", 2, 0, 60)]);
    let r = call(&mut c, r2).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, "per_ip", 2, 0, 60)]
    );
}

#[tokio::test]
async fn exact_statuses_in_memory() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    exact_statuses(start(RULES, backend).await).await;
}

#[tokio::test]
async fn exact_statuses_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    exact_statuses(start(RULES, backend).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_statuses_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let backend = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    exact_statuses(start(RULES, backend).await).await;
}

/// 200 concurrent calls, 100 to each of two server instances sharing one
/// Redis, each with two descriptors: `tenant` (100 an hour) and `plan` (60
/// an hour). Exactly 60 are allowed, and `tenant` was charged exactly 60
/// times (never for a call `plan` denied): a later call sees 39 left; in
/// fewer script calls than calls (group commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_are_all_or_nothing_under_concurrency_across_instances() {
    let rules = r#"
        domain = "edge"
        key_prefix = "rls-atomic"
        # No call times out (and fails open) on a loaded machine.
        backend_timeout_ms = 10000
        [[rule]]
        name = "tenant"
        match = [{ key = "tenant" }]
        limit = 100
        period = "1h"
        [[rule]]
        name = "plan"
        match = [{ key = "plan" }]
        limit = 60
        period = "1h"
    "#;
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let backend = || {
        RedisBackend::from_url(&redis.url())
            .unwrap()
            .with_manual_clock(clock.clone())
    };
    let a = connect(start(rules, backend()).await).await;
    let b = connect(start(rules, backend()).await).await;
    let both = || req("edge", vec![d(&[("tenant", "t1")]), d(&[("plan", "gold")])]);
    let mut calls = Vec::new();
    for i in 0..200 {
        let mut c = if i % 2 == 0 { a.clone() } else { b.clone() };
        let r = both();
        calls.push(tokio::spawn(async move { call(&mut c, r).await }));
    }
    let mut allowed = 0;
    for call in calls {
        let r = call.await.unwrap();
        if r.overall_code == Code::Ok as i32 {
            allowed += 1;
        } else {
            assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
        }
    }
    assert_eq!(allowed, 60);
    // Group commit (docs/redis.md): calls that arrived while one was in
    // flight went together, each still all or nothing.
    let scripts = redis.script_calls();
    assert!(scripts < 150, "{scripts} script calls for 200 requests");
    let r = call(&mut a.clone(), req("edge", vec![d(&[("tenant", "t1")])])).await;
    assert_eq!(r.statuses[0].limit_remaining, 39);
}

/// Redis down: `open` answers OK without limits; `closed` answers
/// OVER_LIMIT, or UNAVAILABLE with `failure_status = "unavailable"`; each
/// within the backend timeout.
#[tokio::test]
async fn backend_down_follows_the_failure_policy() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    redis.stop();
    let rules = |policy: &str, status: &str| {
        format!(
            "domain = \"edge\"\nfailure_policy = \"{policy}\"\nfailure_status = \"{status}\"\n\
             backend_timeout_ms = 50\n[[rule]]\nname = \"per_ip\"\n\
             match = [{{ key = \"remote_address\" }}]\nlimit = 2\nperiod = \"1m\"\n"
        )
    };
    let one = || req("edge", vec![d(&[("remote_address", "203.0.113.7")])]);
    let backend = || RedisBackend::from_url(&url).unwrap();
    let mut c = connect(start(&rules("open", "over_limit"), backend()).await).await;
    let r = call(&mut c, one()).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses, vec![no_limit(0)]);
    let mut c = connect(start(&rules("closed", "over_limit"), backend()).await).await;
    let r = call(&mut c, one()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    let mut c = connect(start(&rules("closed", "unavailable"), backend()).await).await;
    let s = c.should_rate_limit(one()).await.unwrap_err();
    assert_eq!(s.code(), tonic::Code::Unavailable);
    assert_eq!(s.message(), "rate limiter unavailable");
}

/// Hostile requests get a clear status, never a panic, never a key of
/// unbounded size.
#[tokio::test]
async fn hostile_input_gets_a_clear_status() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url()).unwrap();
    let mut c = connect(start(RULES, backend).await).await;
    let invalid = |s: tonic::Status, msg: &str| {
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert_eq!(s.message(), msg);
    };
    let ip = || d(&[("remote_address", "203.0.113.7")]);
    invalid(
        c.should_rate_limit(req("", vec![ip()])).await.unwrap_err(),
        "domain: empty",
    );
    // Another domain is answered OK without limits (as Envoy's reference
    // service: behind failure_mode_deny an error denies its traffic).
    let r = call(&mut c, req("other", vec![ip()])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses, vec![no_limit(0)]);
    invalid(
        c.should_rate_limit(req("edge", vec![])).await.unwrap_err(),
        "descriptors: the list must not be empty",
    );
    let many: Vec<_> = (0..10_000)
        .map(|i| d(&[("remote_address", &i.to_string())]))
        .collect();
    invalid(
        c.should_rate_limit(req("edge", many)).await.unwrap_err(),
        "descriptors: 10000, at most 64 are accepted",
    );
    invalid(
        c.should_rate_limit(req("edge", vec![ip(), d(&[])]))
            .await
            .unwrap_err(),
        "descriptors[1]: 0 entries, 1 to 16 are accepted",
    );
    // A 1 MiB value is a key like any other, stored hashed.
    let huge = "x".repeat(1 << 20);
    let r = call(&mut c, req("edge", vec![d(&[("remote_address", &huge)])])).await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let keys = redis.keys();
    assert!(
        keys.iter().all(|k| k.len() <= 64),
        "a key longer than 64 bytes: {keys:?}"
    );
    // Unknown keys: allowed without a limit.
    let r = call(
        &mut c,
        req("edge", vec![d(&[("nope", "1"), ("nope2", "2")])]),
    )
    .await;
    assert_eq!(r.statuses, vec![no_limit(0)]);
    // The server still answers.
    let r = call(&mut c, req("edge", vec![ip()])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
}

/// A rule in lease mode (`sync = "lease"`): two instances sharing Redis
/// answer a hot descriptor mostly from their token leases, never over the
/// quota; when they shut down gracefully their unspent tokens go back, so
/// a third instance finds exactly what the first two did not admit. (The
/// descriptor service keeps no deny cache, so once the quota is spent each
/// request is a call again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_rule_saves_calls_never_exceeds_its_quota_and_returns_its_tokens() {
    let leased = r#"
        domain = "edge"
        key_prefix = "rls-lease"
        backend_timeout_ms = 10000
        [[rule]]
        name = "tenant"
        match = [{ key = "tenant" }]
        limit = 100
        period = "1h"
        sync = "lease"
        sync_max = 10
    "#;
    let redis = RedisServer::start();
    // A frozen clock: no refill, so every token is accounted for.
    let clock = ManualClock::new(T0_US);
    let backend = || {
        RedisBackend::from_url(&redis.url())
            .unwrap()
            .with_manual_clock(clock.clone())
    };
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..2 {
        let policy = RulesPolicy::from_toml_str(leased).expect("rules");
        let rls = Rls::new(
            policy.limiter(backend()).expect("limiter"),
            policy.failure_status,
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(rls, listener, None, async move {
            let _ = stopped.await;
        }));
        servers.push((stop, server));
        clients.push(connect(addr).await);
    }
    let before = redis.script_calls();
    let hot = || req("edge", vec![d(&[("tenant", "t1")])]);
    let mut allowed = 0u64;
    // 150 waves of two concurrent calls, one to each instance.
    let mut first = (0, 0);
    for wave in 0..150 {
        if wave == 40 {
            first = (allowed, redis.script_calls() - before);
        }
        let mut waves = Vec::new();
        for c in &clients {
            let mut c = c.clone();
            let r = hot();
            waves.push(tokio::spawn(async move { call(&mut c, r).await }));
        }
        for w in waves {
            let r = w.await.unwrap();
            if r.overall_code == Code::Ok as i32 {
                allowed += 1;
            } else {
                assert_eq!(r.overall_code, Code::OverLimit as i32);
            }
        }
    }
    // The first 80 requests pass whatever the leases' timing (the two
    // instances hold at most 2 × 10 tokens, so the shared bucket still has
    // some for an instance that holds none), mostly from the leases (18
    // calls in the runs seen: a lease is one call for up to 10 requests).
    assert_eq!(first.0, 80);
    assert!(first.1 <= 40, "{} script calls for 80 requests", first.1);
    // Never over the quota; at most instances × sync_max (2 × 10) tokens
    // held unspent by the instances.
    assert!(allowed <= 100, "{allowed} admitted of a quota of 100");
    assert!(
        allowed >= 80,
        "{allowed} admitted: more than 2 × 10 false denials"
    );
    // Graceful shutdown returns the leases.
    for (stop, server) in servers {
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
    let plain = leased.replace("sync = \"lease\"\n        sync_max = 10\n", "");
    assert!(!plain.contains("sync"));
    let mut c = connect(start(&plain, backend()).await).await;
    let mut after = 0;
    for _ in 0..100 {
        if call(&mut c, hot()).await.overall_code == Code::Ok as i32 {
            after += 1;
        }
    }
    assert_eq!(allowed + after, 100, "{allowed} admitted, then {after}");
}

/// A descriptor whose cost (`hits_addend` 3) exceeds its rule's capacity
/// (2) can never pass: over the limit with no `duration_until_reset`, no
/// `retry-after` header, and a 429 body that says why; the rule's bucket
/// is untouched.
async fn cost_above_capacity_is_never_told_to_retry(addr: SocketAddr) {
    let mut c = connect(addr).await;
    let mut big = req("edge", vec![d(&[("remote_address", "192.0.2.9")])]);
    big.hits_addend = 3;
    for _ in 0..2 {
        let r = call(&mut c, big.clone()).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        // OVER_LIMIT reports 0 remaining (as the reference service); the
        // header shows the untouched bucket (r=2).
        assert_eq!(
            r.statuses,
            vec![DescriptorStatus {
                duration_until_reset: None,
                ..limited(Code::OverLimit, "per_ip", 2, 0, 0)
            }]
        );
        assert_eq!(
            r.response_headers_to_add,
            vec![
                header("ratelimit-policy", r#""per_ip";q=2;w=60"#),
                header("ratelimit", r#""per_ip";r=2;t=0"#),
                header("x-should-retry", "false"),
            ]
        );
        assert_eq!(
            String::from_utf8(r.raw_body).unwrap(),
            r#"{"error":"cost_exceeds_capacity","rule":"per_ip","limit":2}"#
        );
    }
    // Nothing was charged: a request of cost 1 sees the full bucket.
    let r = call(
        &mut c,
        req("edge", vec![d(&[("remote_address", "192.0.2.9")])]),
    )
    .await;
    assert_eq!(r.statuses, vec![limited(Code::Ok, "per_ip", 2, 1, 30)]);
    assert!(r.raw_body.is_empty());
}

#[tokio::test]
async fn cost_above_capacity_in_memory() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    cost_above_capacity_is_never_told_to_retry(start(RULES, backend).await).await;
}

#[tokio::test]
async fn cost_above_capacity_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    cost_above_capacity_is_never_told_to_retry(start(RULES, backend).await).await;
}

/// A calendar rule over gRPC (issue 28): a month anchored on the 31st in
/// Berlin. 1 µs before the boundary (Berlin's 29 February 2024, 00:00)
/// the old month has 1 µs left; at it the new month runs to Berlin's
/// 31 March (2 678 400 s), `current_limit` per MONTH.
#[tokio::test]
async fn a_calendar_month_rule_answers_the_time_to_its_boundary() {
    const FEB29_US: u64 = 1_709_161_200_000_000;
    let rules = "domain = 'edge'\n[[rule]]\nname = 'monthly'\n\
                 match = [{ key = 'api_key' }]\nlimit = 2\nperiod = 'month'\n\
                 anchor = 31\ntime_zone = 'Europe/Berlin'\n";
    let clock = ManualClock::new(FEB29_US - 1);
    let addr = start(rules, MemoryBackend::with_manual_clock(clock.clone())).await;
    let mut c = connect(addr).await;
    let status = |remaining: u32, seconds: i64, nanos: i32| DescriptorStatus {
        code: Code::Ok.into(),
        current_limit: Some(RateLimit {
            name: "monthly".to_owned(),
            requests_per_unit: 2,
            unit: Unit::Month.into(),
        }),
        limit_remaining: remaining,
        duration_until_reset: Some(ProtoDuration { seconds, nanos }),
        quota: None,
    };
    let r = || req("edge", vec![d(&[("api_key", "k1")])]);
    let got = call(&mut c, r()).await;
    assert_eq!(got.statuses, [status(1, 0, 1_000)]);
    clock.set(FEB29_US);
    let got = call(&mut c, r()).await;
    assert_eq!(got.statuses, [status(1, 2_678_400, 0)]);
}

/// `replaces` in the TOML rules file, as the reference's YAML has it: in
/// a request with a descriptor on `partner`, the descriptors on `per_ip`
/// have no limit (neither checked nor charged); alone, `per_ip` limits.
/// A `replaces` naming no rule of the file stops the start, naming it.
#[tokio::test]
async fn a_toml_rule_replaces_another_by_name() {
    let rules = |replaces: &str| {
        format!(
            "domain = \"edge\"\n\
             [[rule]]\nname = \"per_ip\"\nmatch = [{{ key = \"remote_address\" }}]\n\
             limit = 1\nperiod = \"1m\"\nalgorithm = \"fixed_window\"\n\
             [[rule]]\nname = \"partner\"\nmatch = [{{ key = \"partner\" }}]\n\
             limit = 5\nperiod = \"1m\"\nalgorithm = \"fixed_window\"\nreplaces = [\"{replaces}\"]\n"
        )
    };
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    let mut c = connect(start(&rules("per_ip"), backend).await).await;
    let ip = || d(&[("remote_address", "203.0.113.7")]);
    let partner = || d(&[("partner", "acme")]);
    // The first partner request, then two more: per_ip would allow one.
    for remaining in [4, 3, 2] {
        let r = call(&mut c, req("edge", vec![ip(), partner()])).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(
            r.statuses,
            vec![no_limit(0), limited(Code::Ok, "partner", 5, remaining, 40)]
        );
    }
    // per_ip was never charged: alone, its one request a minute passes.
    let r = call(&mut c, req("edge", vec![ip()])).await;
    assert_eq!(r.statuses, vec![limited(Code::Ok, "per_ip", 1, 0, 40)]);
    let r = call(&mut c, req("edge", vec![ip()])).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, "per_ip", 1, 0, 40)]
    );
    // A name that is no rule of the file, or the rule itself.
    let err = RulesPolicy::from_toml_str(&rules("per_host"))
        .unwrap()
        .limiter(MemoryBackend::new())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "policy: rule \"partner\": replaces: \"per_host\" is not a rule of this file"
    );
    let err = RulesPolicy::from_toml_str(&rules("partner"))
        .unwrap()
        .limiter(MemoryBackend::new())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "policy: rule \"partner\": replaces: a rule cannot replace itself"
    );
}
