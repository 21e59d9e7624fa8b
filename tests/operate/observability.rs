//! What an operator watches: metric names and bounded labels, top-N blocked
//! keys, the per-minute history, and the 429-rate anomaly alert, through
//! real HTTP with a manual clock.

use crate::support::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::time::Duration;
use tiered_ratelimit::{
    key::{ClientIp, Endpoint, User},
    observe::AnomalyConfig,
    Quota, Tier,
};

both_backends!(top_blocked_and_history, anomaly_alert_on_a_step);

async fn top_blocked_and_history(env: Env) {
    let layer = env
        .builder()
        .tier(Tier::new("user", User, Quota::per_minute(2)))
        .build()
        .unwrap();
    let h = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let send = |u: &'static str| {
        c.get(format!("http://{addr}/users/7"))
            .header("authorization", format!("Bearer {u}"))
            .send()
    };
    // mallory: 2 allowed then 10 blocked; eve: 2 allowed, 3 blocked; bob: 1.
    for _ in 0..12 {
        send("mallory").await.unwrap();
    }
    for _ in 0..5 {
        send("eve").await.unwrap();
    }
    send("bob").await.unwrap();
    let top = h
        .top_blocked("user", 10, Duration::from_secs(3600))
        .unwrap();
    let got: Vec<(&str, u64)> = top.iter().map(|b| (b.key.as_str(), b.count)).collect();
    assert_eq!(got, [("mallory", 10), ("eve", 3)]);
    assert!(top.iter().all(|b| b.error == 0));
    // Near the limit: every second request left 0 of 2 (< 20 %).
    let near = h
        .top_near_limit("user", 10, Duration::from_secs(3600))
        .unwrap();
    assert_eq!(
        near.iter().map(|b| b.key.as_str()).collect::<Vec<_>>(),
        ["eve", "mallory"]
    );
    assert!(h.top_blocked("nope", 1, Duration::from_secs(60)).is_none());

    // The minute closes when a request arrives in the next one.
    env.clock.advance(Duration::from_secs(60));
    send("bob").await.unwrap();
    let hist = h.history("user").unwrap();
    assert_eq!(hist.len(), 1);
    assert_eq!(
        (hist[0].requests, hist[0].limited, hist[0].shadow_limited),
        (18, 13, 0)
    );
    assert_eq!(hist[0].start, T0_S - T0_S % 60);
}

async fn anomaly_alert_on_a_step(env: Env) {
    let layer = env
        .builder()
        .anomaly(AnomalyConfig {
            bucket_secs: 10,
            warmup: 5,
            confirm: 2,
            min_requests: 10,
            ..AnomalyConfig::default()
        })
        .tier(Tier::new(
            "ip",
            ClientIp::default(),
            Quota::per_second(1000),
        ))
        .tier(Tier::new("user", User, Quota::per_minute(600).burst(5)))
        .build()
        .unwrap();
    let h = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    // Normal: 20 requests per 10 s bucket from 20 users, none limited.
    let mut bucket = 0u64;
    let mut run_bucket = |abusive: bool| {
        bucket += 1;
        let c = c.clone();
        let clock = env.clock.clone();
        async move {
            for i in 0..20 {
                let user = if abusive {
                    "mallory".to_owned()
                } else {
                    format!("u{bucket}-{i}")
                };
                c.get(format!("http://{addr}/"))
                    .header("authorization", format!("Bearer {user}"))
                    .send()
                    .await
                    .unwrap();
            }
            clock.advance(Duration::from_secs(10));
        }
    };
    for _ in 0..8 {
        run_bucket(false).await;
    }
    assert!(h.anomalies().iter().all(|a| !a.alerting));
    // One user floods: 15 of 20 requests limited in each bucket.
    run_bucket(true).await;
    run_bucket(true).await;
    // The second anomalous bucket closes with the next request.
    run_bucket(false).await;
    let alerts: Vec<_> = h.anomalies().into_iter().filter(|a| a.alerting).collect();
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(
        (alerts[0].tier.as_str(), alerts[0].endpoint.as_str()),
        ("user", "GET /")
    );
    assert!((alerts[0].rate - 0.75).abs() < 1e-9, "{alerts:?}");
    // Back to normal: the alert clears at the next closed bucket.
    run_bucket(false).await;
    assert!(h.anomalies().iter().all(|a| !a.alerting));
}

/// The metrics facade sees every request, with bounded labels only.
#[test]
fn metric_names_and_bounded_labels() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            use tower::ServiceExt;
            let layer = tiered_ratelimit::RateLimitLayer::builder()
                .tier(
                    Tier::new("user", User, Quota::per_minute(5))
                        .plans([("pro", Quota::per_minute(1))]),
                )
                .build()
                .unwrap();
            let app = app(layer);
            for _ in 0..3 {
                let req = http::Request::get("/users/1")
                    .header("authorization", "Bearer secret-user-id")
                    .header("x-test-plan", "pro")
                    .body(axum::body::Body::empty())
                    .unwrap();
                app.clone().oneshot(req).await.unwrap();
            }
        });
    });
    let snap = snapshotter.snapshot().into_vec();
    let mut seen = Vec::new();
    for (key, _unit, _desc, value) in &snap {
        let name = key.key().name().to_owned();
        let labels = metric_labels(key.key());
        for l in &labels {
            assert!(!l.contains("secret-user-id"), "{name}: unbounded label {l}");
        }
        let v = match value {
            DebugValue::Counter(c) => *c as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(h) => h.len() as f64,
        };
        seen.push((name, labels.join(","), v));
    }
    seen.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let has = |name: &str, labels: &str, v: f64| {
        assert!(
            seen.iter()
                .any(|(n, l, x)| n == name && l == labels && *x == v),
            "missing {name}{{{labels}}} = {v} in {seen:#?}"
        )
    };
    has("tiered_ratelimit_requests_total", "decision=allowed", 1.0);
    has("tiered_ratelimit_requests_total", "decision=limited", 2.0);
    has(
        "tiered_ratelimit_tier_decisions_total",
        "decision=limited,tier=user,plan=pro,endpoint=GET /users/{id}",
        2.0,
    );
    has(
        "tiered_ratelimit_tier_decisions_total",
        "decision=near_limit,tier=user,plan=pro,endpoint=GET /users/{id}",
        1.0,
    );
    has(
        "tiered_ratelimit_check_duration_seconds",
        "backend=memory,part=total",
        3.0,
    );
    has("tiered_ratelimit_mode", "tier=user", 3.0);
}

/// Every tier's decision on every request is counted once, per (tier,
/// plan, endpoint, decision): `limited` on the binding tier only,
/// `limited_not_binding` on the other enforced tiers that denied, one
/// endpoint value for unmatched routes, and `<other>` past the endpoint cap.
/// Summed over `decision`, a (tier, endpoint) gives the requests that tier
/// checked there: the denominator of its 429 rate.
#[test]
fn tier_decisions_per_endpoint_count_every_decision() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let statuses = metrics::with_local_recorder(&recorder, || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            use tower::ServiceExt;
            let layer = tiered_ratelimit::RateLimitLayer::builder()
                .max_endpoints(3)
                .tier(
                    Tier::new("user", User, Quota::per_minute(2))
                        .plans([("pro", Quota::per_minute(1))]),
                )
                .tier(Tier::new("hourly", User, Quota::per_hour(2)))
                .tier(
                    Tier::new("endpoint", Endpoint, Quota::per_minute(1))
                        .mode(tiered_ratelimit::rollout::Mode::Shadow),
                )
                .build()
                .unwrap();
            let app = app(layer);
            let mut statuses = Vec::new();
            for (method, path, user, plan) in [
                ("GET", "/users/1", "alice", None),
                ("GET", "/users/1", "alice", None),
                ("GET", "/users/1", "alice", None),
                ("GET", "/users/1", "alice", None),
                ("GET", "/", "bob", Some("pro")),
                ("GET", "/nope", "carol", None),
                ("GET", "/zzz/1", "erin", None),
                ("POST", "/login", "dave", None),
            ] {
                let mut req = http::Request::builder()
                    .method(method)
                    .uri(path)
                    .header("authorization", format!("Bearer {user}"));
                if let Some(p) = plan {
                    req = req.header("x-test-plan", p);
                }
                let res = app
                    .clone()
                    .oneshot(req.body(axum::body::Body::empty()).unwrap())
                    .await
                    .unwrap();
                let retry = res
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                statuses.push((res.status().as_u16(), retry));
            }
            statuses
        })
    });
    // alice's 3rd and 4th: both enforced tiers deny; `hourly` waits longer.
    let r1800 = || (429, Some("1800".to_owned()));
    assert_eq!(
        statuses,
        [
            (200, None),
            (200, None),
            r1800(),
            r1800(),
            (200, None),
            (404, None),
            (404, None),
            (200, None),
        ]
    );
    let mut got: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "tiered_ratelimit_tier_decisions_total")
        .map(|(k, _, _, v)| {
            let labels: Vec<String> = k.key().labels().map(|l| l.value().to_owned()).collect();
            let DebugValue::Counter(c) = v else {
                panic!("a counter")
            };
            (labels.join(" | "), c)
        })
        .collect();
    got.sort();
    let mut want: Vec<(String, u64)> = [
        // alice ×4 on GET /users/{id}
        ("allowed | user | default | GET /users/{id}", 1),
        ("near_limit | user | default | GET /users/{id}", 1),
        ("limited_not_binding | user | default | GET /users/{id}", 2),
        ("allowed | hourly | default | GET /users/{id}", 1),
        ("near_limit | hourly | default | GET /users/{id}", 1),
        ("limited | hourly | default | GET /users/{id}", 2),
        ("near_limit | endpoint | default | GET /users/{id}", 1),
        ("shadow_limited | endpoint | default | GET /users/{id}", 3),
        // bob, plan pro, on GET /
        ("near_limit | user | pro | GET /", 1),
        ("allowed | hourly | default | GET /", 1),
        ("near_limit | endpoint | default | GET /", 1),
        // carol and erin: two unmatched paths, one endpoint value
        ("allowed | user | default | GET <unmatched>", 2),
        ("allowed | hourly | default | GET <unmatched>", 2),
        ("near_limit | endpoint | default | GET <unmatched>", 1),
        ("shadow_limited | endpoint | default | GET <unmatched>", 1),
        // dave: a 4th endpoint past the cap of 3
        ("allowed | user | default | <other>", 1),
        ("allowed | hourly | default | <other>", 1),
        ("near_limit | endpoint | default | <other>", 1),
    ]
    .into_iter()
    .map(|(l, c)| (l.to_owned(), c))
    .collect();
    want.sort();
    assert_eq!(got, want);
}

/// A 429 answered by the deny cache (Redis, no backend call) counts
/// `limited` for its tier and endpoint like the backend's own. A key's
/// first 429 is `limited` in `requests_total` too, so an operator sees
/// users refused: the first answered from an entry an admission primed (the
/// backend denied nothing), or the backend's own denial (which writes the
/// entry); only the later ones are `cache_blocked`.
#[test]
fn deny_cache_429s_count_as_limited_per_endpoint() {
    use tiered_ratelimit::{backend::ManualClock, backend::RedisBackend, RateLimitLayer};
    let redis = RedisServer::start();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let clock = ManualClock::new(T0_US);
    let (a, b) = metrics::with_local_recorder(&recorder, || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            use tower::ServiceExt;
            let layer = || {
                RateLimitLayer::builder()
                    .backend(
                        RedisBackend::from_url(&redis.url())
                            .unwrap()
                            .with_manual_clock(clock.clone()),
                    )
                    .tier(Tier::new("user", User, Quota::per_minute(1)))
                    // Never reached on a loaded host: a fail-open answer
                    // would count as allowed (100 ms by default).
                    .backend_timeout(std::time::Duration::from_secs(10))
                    .build()
                    .unwrap()
            };
            let send = |app: axum::Router| async move {
                let req = http::Request::get("/users/1")
                    .header("authorization", "Bearer alice")
                    .body(axum::body::Body::empty())
                    .unwrap();
                app.oneshot(req).await.unwrap().status().as_u16()
            };
            // A: the admission that empties the bucket primes the cache;
            // both 429s come from the cache.
            let a = layer();
            let app_a = app(a.clone());
            let mut statuses = Vec::new();
            for _ in 0..3 {
                statuses.push(send(app_a.clone()).await);
            }
            assert_eq!(statuses, [200, 429, 429]);
            // B, another instance: its first 429 is the backend's denial.
            let b = layer();
            let app_b = app(b.clone());
            assert_eq!([send(app_b.clone()).await, send(app_b).await], [429, 429]);
            (a.handle().counts(), b.handle().counts())
        })
    });
    assert_eq!(
        (a.allowed, a.limited, a.cache_blocked),
        (1, 1, 1),
        "instance A: {a:?}"
    );
    assert_eq!(
        (b.allowed, b.limited, b.cache_blocked),
        (0, 1, 1),
        "instance B: {b:?}"
    );
    let mut got: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(k, _, _, v)| {
            let name = k.key().name();
            if !name.starts_with("tiered_ratelimit_") || !name.ends_with("_total") {
                return None;
            }
            let labels: Vec<String> = k.key().labels().map(|l| l.value().to_owned()).collect();
            match v {
                DebugValue::Counter(c) if c > 0 => {
                    Some((format!("{name} {}", labels.join(" | ")), c))
                }
                _ => None,
            }
        })
        .collect();
    got.sort();
    let want: Vec<(String, u64)> = [
        ("tiered_ratelimit_requests_total allowed", 1),
        ("tiered_ratelimit_requests_total cache_blocked", 2),
        ("tiered_ratelimit_requests_total limited", 2),
        (
            "tiered_ratelimit_tier_decisions_total limited | user | default | GET /users/{id}",
            4,
        ),
        (
            "tiered_ratelimit_tier_decisions_total near_limit | user | default | GET /users/{id}",
            1,
        ),
    ]
    .into_iter()
    .map(|(l, c)| (l.to_owned(), c))
    .collect();
    assert_eq!(got, want);
}

/// Blocked keys counted fleet-wide in Redis by the decision's own script call:
/// two app servers, one merged answer, one EVALSHA per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_wide_top_blocked_in_the_same_call() {
    use tiered_ratelimit::{backend::ManualClock, backend::RedisBackend, RateLimitLayer};
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let mk = || {
        RateLimitLayer::builder()
            .backend(
                RedisBackend::from_url(&redis.url())
                    .unwrap()
                    .with_manual_clock(clock.clone()),
            )
            .deny_cache(0)
            .tier(Tier::new("user", User, Quota::per_minute(1)))
            .build()
            .unwrap()
    };
    let (la, lb) = (mk(), mk());
    let h = la.handle();
    let (a, b) = (serve(app(la)).await, serve(app(lb)).await);
    let c = client();
    // Load the script, then count calls.
    c.get(format!("http://{a}/"))
        .header("authorization", "Bearer warm")
        .send()
        .await
        .unwrap();
    redis.cmd::<()>(&["CONFIG", "RESETSTAT"]);
    let mut requests = 0u64;
    for (addr, user, n) in [
        (a, "mallory", 6),
        (b, "mallory", 5),
        (b, "eve", 3),
        (a, "bob", 1),
    ] {
        for _ in 0..n {
            c.get(format!("http://{addr}/"))
                .header("authorization", format!("Bearer {user}"))
                .send()
                .await
                .unwrap();
            requests += 1;
        }
    }
    let calls = redis.script_calls();
    assert_eq!(
        calls, requests,
        "one script call per request, top-N included"
    );
    let top = h
        .top_blocked_fleet("user", 10, Duration::from_secs(3600))
        .await
        .unwrap();
    let got: Vec<(&str, u64)> = top.iter().map(|b| (b.key.as_str(), b.count)).collect();
    assert_eq!(got, [("mallory", 10), ("eve", 2)]);
    let set = format!("rl:blocked:{}", T0_S / 3600);
    let ttl: i64 = redis.cmd(&["TTL", &set]);
    assert!(ttl > 89_990 && ttl <= 90_000, "ttl {ttl}");
}

/// Every `tiered_ratelimit_*` series in a Prometheus scrape has its `# HELP`
/// line (`metrics::describe_*`), on a setup like the quickstart's (Redis,
/// the quickstart's tiers, a control key, a leased tier, requests allowed,
/// refused by Redis and by the deny cache, a key error).
#[test]
fn every_series_in_a_scrape_has_help() {
    use metrics_exporter_prometheus::PrometheusBuilder;
    use tiered_ratelimit::{backend::RedisBackend, policy::Policy, RateLimitLayer};
    let redis = RedisServer::start();
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let policy = Policy::from_toml_str(
        r#"
key_prefix = "help"
failure_policy = "open"
[control]
redis_key = "help:control"
poll_interval = "1s"
[[tier]]
name = "global"
key = "global"
limit = 1000
period = "1s"
sync = "lease"
[[tier]]
name = "ip"
key = "ip"
limit = 60
period = "1m"
[[tier]]
name = "api_key"
key = { header = "x-api-key" }
limit = 10000
period = "1h"
[[tier]]
name = "user"
key = "user"
limit = 100
period = "1m"
[[tier]]
name = "endpoint"
key = "endpoint"
limit = 3
period = "10s"
"#,
    )
    .unwrap();
    metrics::with_local_recorder(&recorder, || {
        current_thread_runtime().block_on(async {
            let layer =
                RateLimitLayer::from_policy(&policy, RedisBackend::from_url(&redis.url()).unwrap())
                    .unwrap();
            let addr = serve(app(layer.clone())).await;
            let c = client();
            for i in 0..6 {
                c.get(format!("http://{addr}/users/{i}"))
                    .header("authorization", "Bearer alice")
                    .header("x-api-key", "k1")
                    .send()
                    .await
                    .unwrap();
            }
            // No connect info: the ip tier's key error.
            let addr = serve_without_connect_info(app(layer)).await;
            c.get(format!("http://{addr}/")).send().await.unwrap();
        });
    });
    let scrape = handle.render();
    let mut series: Vec<&str> = scrape
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with("tiered_ratelimit_"))
        .map(|l| {
            let name = l.split(['{', ' ']).next().unwrap();
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|base| {
                    scrape.contains(&format!("# TYPE {base} histogram"))
                        || scrape.contains(&format!("# TYPE {base} summary"))
                })
                .unwrap_or(name)
        })
        .collect();
    series.sort_unstable();
    series.dedup();
    for s in [
        "tiered_ratelimit_requests_total",
        "tiered_ratelimit_tier_decisions_total",
        "tiered_ratelimit_check_duration_seconds",
        "tiered_ratelimit_mode",
        "tiered_ratelimit_enforced_percent",
        "tiered_ratelimit_key_errors_total",
        "tiered_ratelimit_lease_tokens_total",
    ] {
        assert!(series.contains(&s), "{s} not in the scrape:\n{scrape}");
    }
    for s in &series {
        let help = scrape
            .lines()
            .find(|l| l.starts_with(&format!("# HELP {s} ")));
        assert!(
            help.is_some_and(|h| h.len() > format!("# HELP {s} ").len() + 20),
            "no HELP for {s}:\n{scrape}"
        );
    }
}
