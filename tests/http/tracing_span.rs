//! What the layer logs, captured with a thread-local subscriber: the tracing
//! span per check, and the start-up warning about a shared Redis key prefix.
//! tracing caches callsite interest process-wide: the captures share the
//! `http` binary with tests that log without one because the test support
//! installs a global dispatcher interested in every callsite before the
//! first capture (`tests/support/mod.rs`, `ensure_global_dispatcher`).

use crate::support::*;
use tiered_ratelimit::{
    key::{ClientIp, User},
    Quota, Tier,
};

/// One span per check, with every tier's result as a field.
#[test]
fn one_span_per_check_with_tier_results() {
    use tower::ServiceExt;
    let buf = LogBuf::default();
    let subscriber = buf.subscriber_with_spans(tracing::Level::DEBUG);
    tracing::subscriber::with_default(subscriber, || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            let layer = tiered_ratelimit::RateLimitLayer::builder()
                .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(10)))
                .tier(Tier::new("user", User, Quota::per_minute(1)))
                .build()
                .unwrap();
            let app = app(layer);
            for _ in 0..2 {
                let mut req = http::Request::get("/")
                    .header("authorization", "Bearer u1")
                    .body(axum::body::Body::empty())
                    .unwrap();
                req.extensions_mut()
                    .insert(std::net::SocketAddr::from(([192, 0, 2, 1], 5000)));
                app.clone().oneshot(req).await.unwrap();
            }
        });
    });
    let out = buf.text();
    let spans: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("rate_limit_check") && l.contains(" close "))
        .collect();
    assert_eq!(spans.len(), 2, "{out}");
    assert!(
        spans[0].contains("tiers=\"ip=allowed/9,user=allowed/0\""),
        "{out}"
    );
    assert!(
        spans[1].contains("tiers=\"ip=allowed/8,user=limited/0\""),
        "{out}"
    );
    // The rejection's debug event is logged inside that span.
    assert!(out.contains("tiers=\"ip=allowed/8,user=limited/0\"}: tiered_ratelimit::service: request rate limited tier=\"user\""), "{out}");
}

/// Building a layer on Redis with the default `key_prefix` logs one `WARN`
/// line (two services on one Redis would share buckets), worded so that it
/// is also true of a policy that sets `key_prefix = "rl"`; another prefix,
/// or the memory backend, logs none.
#[test]
fn default_key_prefix_on_redis_warns_once_per_build() {
    use tiered_ratelimit::{backend::RedisBackend, key::Global, RateLimitLayer};
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let warnings = || {
        let out = buf.text();
        out.lines()
            .filter(|l| {
                l.contains(" WARN ")
                    && l.contains(
                        "Redis backend with key_prefix \"rl\", the one every service \
                         gets without a key_prefix of its own: services sharing this \
                         Redis with the same prefix share their buckets; give each \
                         service its own key_prefix",
                    )
            })
            .count()
    };
    let server = RedisServer::start();
    tracing::subscriber::with_default(subscriber, || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            let tier = || Tier::new("g", Global, Quota::per_second(1));
            let redis = || RedisBackend::from_url(&server.url()).unwrap();
            let _a = RateLimitLayer::builder()
                .backend(redis())
                .tier(tier())
                .build()
                .unwrap();
            assert_eq!(warnings(), 1);
            let _b = RateLimitLayer::builder()
                .backend(redis())
                .key_prefix("svc-b")
                .tier(tier())
                .build()
                .unwrap();
            let _c = RateLimitLayer::builder().tier(tier()).build().unwrap();
            assert_eq!(warnings(), 1);
        });
    });
    let out = buf.text();
    assert!(
        out.contains("key_prefix=\"rl\"") || out.contains("key_prefix=rl"),
        "{out}"
    );
}

/// The quickstart's built-in policy, built on Redis as the quickstart
/// builds it (`policy.builder(backend)?.build_checked().await`, with
/// `REDIS_URL` set), logs no `WARN` at all: it names its own `key_prefix`,
/// as the key-prefix warning asks of every service sharing a Redis.
#[test]
fn the_quickstart_policy_builds_on_redis_without_a_warning() {
    use tiered_ratelimit::{backend::RedisBackend, policy::Policy};
    let source = include_str!("../../examples/quickstart/quickstart.rs");
    let start = source.find("const DEFAULT_POLICY: &str = r#\"").unwrap();
    let body = &source[start..];
    let policy = &body[body.find('"').unwrap() + 1..body.find("\"#;").unwrap()];
    let policy = Policy::from_toml_str(policy).unwrap();
    let server = RedisServer::start();
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    tracing::subscriber::with_default(subscriber, || {
        current_thread_runtime().block_on(async {
            let redis = RedisBackend::from_url(&server.url()).unwrap();
            let layer = policy
                .builder(redis)
                .unwrap()
                .build_checked()
                .await
                .unwrap();
            let names: Vec<&str> = layer.tier_names().collect();
            assert_eq!(names, ["global", "ip", "api_key", "user", "endpoint"]);
        });
    });
    assert_eq!(buf.text(), "", "no WARN line");
}

/// A control key on the memory backend cannot be watched: building such a
/// layer says so in one `WARN` line (the quickstart's policy has `[control]`
/// and runs in memory without `REDIS_URL`).
#[test]
fn control_key_on_the_memory_backend_warns() {
    use tiered_ratelimit::{handle::ControlKey, key::Global, RateLimitLayer};
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    tracing::subscriber::with_default(subscriber, || {
        let tier = || Tier::new("g", Global, Quota::per_second(1));
        let _with = RateLimitLayer::builder()
            .control_key(ControlKey::new("rl:control"))
            .tier(tier())
            .build()
            .unwrap();
        let _without = RateLimitLayer::builder().tier(tier()).build().unwrap();
    });
    let out = buf.text();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(
        lines[0].contains(
            "control key configured with the in-memory backend: it is not watched (it lives \
             in Redis); mode changes apply to this instance only"
        ),
        "{out}"
    );
}

/// The failure policy's log line names the policy as a policy file writes
/// it (`policy=open`), not in Rust's `Debug` (`Open`).
#[test]
fn failure_log_names_the_policy_as_written() {
    use tiered_ratelimit::{backend::RedisBackend, key::Global, FailurePolicy, RateLimitLayer};
    let buf = LogBuf::default();
    let dead = crate::support::redis_server::free_port();
    tracing::subscriber::with_default(buf.subscriber(tracing::Level::WARN), || {
        current_thread_runtime().block_on(async {
            let layer = RateLimitLayer::builder()
                .backend(RedisBackend::from_url(&format!("redis://127.0.0.1:{dead}/")).unwrap())
                .key_prefix("dead")
                .failure_policy(FailurePolicy::Open)
                .tier(Tier::new("g", Global, Quota::per_second(1)))
                .build()
                .unwrap();
            let req = http::Request::get("/")
                .body(axum::body::Body::empty())
                .unwrap();
            let res = tower::ServiceExt::oneshot(app(layer), req).await.unwrap();
            assert_eq!(res.status(), 200);
        });
    });
    let out = buf.text();
    let line = out
        .lines()
        .find(|l| l.contains("applying failure policy"))
        .unwrap_or_else(|| panic!("no failure line in {out}"));
    assert!(
        line.contains(" backend=\"redis\" policy=\"open\" "),
        "{line}"
    );
}

/// A span's `time.idle=…` as written by the fmt subscriber (`ns`, `µs`,
/// `ms` or `s`), in seconds.
fn idle_secs(line: &str) -> f64 {
    let value = line
        .split("time.idle=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("no time.idle in {line}"));
    let digits = value.trim_end_matches(|c: char| c.is_alphabetic() || c == 'µ');
    let unit = &value[digits.len()..];
    let n: f64 = digits.parse().unwrap_or_else(|_| panic!("{value}"));
    n * match unit {
        "ns" => 1e-9,
        "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        other => panic!("unit {other:?} in {line}"),
    }
}

/// The check's span lives from the moment its call is sent to the answer:
/// the wait for Redis is inside it (its idle time), not before it. Replies
/// are held 300 ms by a proxy in front of Redis.
#[tokio::test]
async fn the_redis_wait_is_inside_the_checks_span() {
    use std::time::Duration;
    use tiered_ratelimit::backend::RedisBackend;
    use tiered_ratelimit::key::Global;
    use tower::ServiceExt;
    let buf = LogBuf::default();
    let _log = tracing::subscriber::set_default(buf.subscriber_with_spans(tracing::Level::DEBUG));
    let redis = RedisServer::start();
    let fwd = crate::support::forward::Forwarder::start(redis.port()).await;
    let layer = tiered_ratelimit::RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&fwd.url()).unwrap())
        // About liveness: the held replies must not time out.
        .backend_timeout(Duration::from_secs(30))
        .tier(Tier::new("all", Global, Quota::per_minute(100)))
        .build()
        .unwrap();
    let app = app(layer);
    let get = || {
        http::Request::get("/")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    // Connected, and the script loaded, by one whole request.
    assert_eq!(app.clone().oneshot(get()).await.unwrap().status(), 200);
    fwd.hold_replies(true);
    let call = tokio::spawn(app.clone().oneshot(get()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    fwd.hold_replies(false);
    assert_eq!(call.await.unwrap().unwrap().status(), 200);
    let out = buf.text();
    let closes: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("rate_limit_check") && l.contains(" close "))
        .collect();
    assert_eq!(closes.len(), 2, "{out}");
    assert!(closes[1].contains("tiers=\"all=allowed/98\""), "{out}");
    let idle = idle_secs(closes[1]);
    assert!(
        idle >= 0.29,
        "the wait is not inside the span: idle {idle} s\n{out}"
    );
}
