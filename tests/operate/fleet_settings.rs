//! Fleet-wide settings (`src/engine/settings.rs`): three app instances on
//! one real Redis, over HTTP. A quota, a plan quota or a list changed
//! through one instance (the admin API or the handle) is answered by the
//! others within one control-key poll (1 s here) plus 0.2 s; a change
//! `build()` would refuse is refused with the field named and nothing
//! written; a restarted instance reads the settings before it serves; a
//! hand-written malformed value is ignored everywhere; two writers at once
//! lose nothing. Redis time is the test's `ManualClock`; the only waits are
//! poll intervals, the bound under test.

use crate::support::*;
use http::StatusCode;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::algorithm::Calendar;
use tiered_ratelimit::backend::{ManualClock, RedisBackend};
use tiered_ratelimit::handle::ControlKey;
use tiered_ratelimit::key::{ApiKey, ClientIp};
use tiered_ratelimit::rollout::AccessList;
use tiered_ratelimit::{
    admin, Algorithm, ConfigError, Quota, RateLimitHandle, RateLimitLayer, Tier,
};

/// The control key's poll interval in these tests.
const POLL: Duration = Duration::from_secs(1);
/// The bound past the poll interval: the poll's round trip on loopback.
const LAG: Duration = Duration::from_millis(200);
const BASE: &str = "/admin/ratelimit";
const TOKEN: &str = "settings-test-token";

/// The tiers every instance is built with: `ip`, a fixed window of 5 a
/// minute with plans `free` (3) and `pro` (50) read from `x-plan`, and
/// `monthly`, a calendar quota of 1000 per API key.
fn tiers() -> Vec<Tier> {
    vec![
        Tier::new("ip", ClientIp::default(), Quota::per_minute(5))
            .algorithm(Algorithm::FixedWindow)
            .plans([
                ("free", Quota::per_minute(3)),
                ("pro", Quota::per_minute(50)),
            ])
            .plan_fn(|p| {
                p.headers
                    .get("x-plan")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            }),
        Tier::new(
            "monthly",
            ApiKey::header("x-api-key"),
            Quota::per_hour(1000),
        )
        .calendar(Calendar::month()),
    ]
}

struct Node {
    addr: SocketAddr,
    handle: RateLimitHandle,
}

fn layer(redis: &RedisServer, clock: &ManualClock) -> RateLimitLayer {
    RateLimitLayer::builder()
        .backend(
            RedisBackend::from_url(&redis.url())
                .unwrap()
                .with_manual_clock(clock.clone()),
        )
        .backend_timeout(Duration::from_secs(2))
        .control_key(ControlKey::new("rl:control").poll_interval(POLL))
        .allowlist(AccessList::new().user("configured-bot"))
        .tiers_from(tiers())
        .build()
        .unwrap()
}

/// An instance with the admin router at [`BASE`], ready (its first read
/// of the control hash done).
async fn node(redis: &RedisServer, clock: &ManualClock) -> Node {
    let layer = layer(redis, clock);
    let handle = layer.handle();
    let router = admin::router(handle.clone(), TOKEN);
    let addr = serve(app(layer).nest(BASE, router)).await;
    handle.ready().await;
    Node { addr, handle }
}

trait TiersFrom {
    fn tiers_from(self, tiers: Vec<Tier>) -> Self;
}

impl TiersFrom for tiered_ratelimit::RateLimitLayerBuilder {
    fn tiers_from(self, tiers: Vec<Tier>) -> Self {
        tiers.into_iter().fold(self, |b, t| b.tier(t))
    }
}

async fn get(addr: SocketAddr, plan: Option<&str>) -> Limits {
    let mut req = client().get(format!("http://{addr}/"));
    if let Some(p) = plan {
        req = req.header("x-plan", p);
    }
    limits(&req.send().await.unwrap())
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (StatusCode, Value) {
    let res = client()
        .post(format!("http://{addr}{BASE}{path}"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = res.status();
    (status, res.json().await.unwrap())
}

async fn api_get(addr: SocketAddr, path: &str) -> Value {
    let res = client()
        .get(format!("http://{addr}{BASE}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.json().await.unwrap()
}

/// One poll interval and its round trip: the bound the docs promise.
async fn one_poll() {
    tokio::time::sleep(POLL + LAG).await;
}

fn versions(nodes: &[&Node]) -> Vec<u64> {
    nodes.iter().map(|n| n.handle.settings_version()).collect()
}

/// A quota changed through A's admin API is answered by A at once and by
/// B and C within one poll plus 0.2 s; the fixed window keeps its count;
/// every instance reports the same version; a plan's quota likewise; a
/// reset gives the configured quota back everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_changed_through_one_instance_is_answered_by_all_within_a_poll() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b, c) = (
        node(&redis, &clock).await,
        node(&redis, &clock).await,
        node(&redis, &clock).await,
    );
    let reset = T0_S - T0_S % 60 + 60;
    assert_eq!(get(a.addr, None).await, ok(5, 4, reset));
    assert_eq!(get(b.addr, None).await, ok(5, 3, reset));
    assert_eq!(get(c.addr, None).await, ok(5, 2, reset));
    assert_eq!(versions(&[&a, &b, &c]), [0, 0, 0]);

    let (status, body) = post(
        a.addr,
        "/api/quota",
        json!({"tier": "ip", "limit": 10, "period": "1m"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["settings_version"], 1);
    assert_eq!(body["tiers"][0]["quota"]["limit"], 10);
    assert_eq!(
        redis
            .cmd::<Option<String>>(&["HGET", "rl:control", "settings_version"])
            .as_deref(),
        Some("1")
    );
    // A applies its own write at once.
    assert_eq!(get(a.addr, None).await, ok(10, 6, reset));
    one_poll().await;
    assert_eq!(get(b.addr, None).await, ok(10, 5, reset));
    assert_eq!(get(c.addr, None).await, ok(10, 4, reset));
    assert_eq!(versions(&[&a, &b, &c]), [1, 1, 1]);
    assert_eq!(api_get(c.addr, "/api/status").await["settings_version"], 1);

    // A plan's quota, through the handle of B.
    assert_eq!(
        b.handle
            .set_fleet_quota("ip", Some("free"), Quota::per_minute(7), "test")
            .await
            .unwrap(),
        2
    );
    one_poll().await;
    // The plan's own window (its key is the tier's: the count carries).
    assert_eq!(get(a.addr, Some("free")).await, ok(7, 0, reset));
    let status = api_get(a.addr, "/api/status").await;
    assert_eq!(status["tiers"][0]["plans"][0]["plan"], "free");
    assert_eq!(status["tiers"][0]["plans"][0]["quota"]["limit"], 7);
    assert_eq!(status["tiers"][0]["quota"]["limit"], 10);
    assert_eq!(versions(&[&a, &b, &c]), [2, 2, 2]);

    // Back to the configured quota, through C.
    let (status, body) = post(c.addr, "/api/quota/reset", json!({"tier": "ip"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["settings_version"], 3);
    assert_eq!(body["tiers"][0]["quota"]["limit"], 5);
    one_poll().await;
    assert_eq!(get(a.addr, None).await, denied(5, 0, reset, reset - T0_S));
    assert_eq!(versions(&[&a, &b, &c]), [3, 3, 3]);
    // The plan keeps its change until it is reset too.
    let doc: Value =
        serde_json::from_str(&redis.cmd::<String>(&["HGET", "rl:control", "settings"])).unwrap();
    assert_eq!(
        doc,
        json!({"tiers": {"ip": {"plans": {"free": {"limit": 7, "period": "1m"}}}}, "by": "admin"})
    );
}

/// What `build()` refuses is refused by every door with the field named,
/// and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_change_is_refused_with_its_field_and_nothing_is_written() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let a = node(&redis, &clock).await;
    for (body, field) in [
        (json!({"tier": "ip", "limit": 0, "period": "1m"}), "limit"),
        (json!({"tier": "nope", "limit": 5, "period": "1m"}), "tier"),
        (
            json!({"tier": "ip", "limit": 5, "period": "month"}),
            "period",
        ),
        (
            json!({"tier": "ip", "limit": 5, "period": "soon"}),
            "period",
        ),
        (
            json!({"tier": "ip", "limit": 5, "period": "1m", "burst": 9}),
            "burst",
        ),
        (
            json!({"tier": "ip", "limit": 5, "period": "1m", "plan": "gold"}),
            "plan",
        ),
        (
            json!({"tier": "monthly", "limit": 5, "period": "30d"}),
            "period",
        ),
    ] {
        let (status, res) = post(a.addr, "/api/quota", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {res}");
        assert_eq!(res["error"], "invalid_quota", "{body}");
        assert_eq!(res["field"], field, "{body}: {res}");
    }
    let (status, res) = post(
        a.addr,
        "/api/lists",
        json!({"list": "deny", "add": [{"ip": "10.0.0.0/33"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{res}");
    assert_eq!(res["field"], "add.ips[0]");
    let (status, res) = post(a.addr, "/api/lists", json!({"list": "grey"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{res}");
    assert_eq!(res["field"], "list");
    // The handle's per-process setters name the fleet-wide ones.
    assert!(matches!(
        a.handle.set_tier_quota("ip", Quota::per_minute(9)),
        Err(ConfigError::FleetWide {
            instead: "set_fleet_quota",
            ..
        })
    ));
    assert!(matches!(
        a.handle.set_denylist(AccessList::new()),
        Err(ConfigError::FleetWide {
            instead: "set_fleet_denylist",
            ..
        })
    ));
    let fields: Vec<String> = redis.cmd(&["HKEYS", "rl:control"]);
    assert!(fields.is_empty(), "written: {fields:?}");
    assert_eq!(a.handle.settings_version(), 0);
    // A calendar tier takes its own period, and counts over its month.
    let (status, res) = post(
        a.addr,
        "/api/quota",
        json!({"tier": "monthly", "limit": 2000, "period": "month"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{res}");
    assert_eq!(res["tiers"][1]["quota"]["limit"], 2000);
}

/// A restarted instance reads the settings before it serves; deleting
/// them by hand gives every instance the configured settings back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_serves_the_stored_settings() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let a = node(&redis, &clock).await;
    assert_eq!(
        a.handle
            .set_fleet_quota("ip", None, Quota::per_minute(20), "test")
            .await
            .unwrap(),
        1
    );
    drop(a);
    let d = node(&redis, &clock).await;
    assert_eq!(d.handle.settings_version(), 1);
    let reset = T0_S - T0_S % 60 + 60;
    assert_eq!(get(d.addr, None).await, ok(20, 19, reset));
    redis.cmd::<i64>(&["HDEL", "rl:control", "settings", "settings_version"]);
    one_poll().await;
    assert_eq!(d.handle.settings_version(), 0);
    assert_eq!(get(d.addr, None).await, ok(5, 3, reset));
}

/// A starting instance's first request waits for its first read of the
/// settings (at most the backend timeout) instead of answering with the
/// configured quota: here the layer is built outside a Tokio runtime, so
/// its watcher starts with that very request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_instance_answers_its_first_request_under_the_stored_settings() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let a = node(&redis, &clock).await;
    a.handle
        .set_fleet_quota("ip", None, Quota::per_minute(20), "test")
        .await
        .unwrap();
    let built = std::thread::scope(|s| s.spawn(|| layer(&redis, &clock)).join().unwrap());
    let h = built.handle();
    assert_eq!(h.settings_version(), 0, "nothing read before serving");
    let addr = serve(app(built)).await;
    let reset = T0_S - T0_S % 60 + 60;
    assert_eq!(get(addr, None).await, ok(20, 19, reset));
    assert_eq!(h.settings_version(), 1);
}

/// A malformed value written by hand is ignored by every instance (the
/// last good settings stay), and no change is written over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_stored_value_is_ignored_everywhere() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b) = (node(&redis, &clock).await, node(&redis, &clock).await);
    a.handle
        .set_fleet_quota("ip", None, Quota::per_minute(10), "test")
        .await
        .unwrap();
    one_poll().await;
    assert_eq!(versions(&[&a, &b]), [1, 1]);
    let reset = T0_S - T0_S % 60 + 60;
    for (doc, version) in [
        ("{not json", "2"),
        (
            r#"{"tiers":{"ip":{"quota":{"limit":0,"period":"1m"}}}}"#,
            "3",
        ),
        (
            r#"{"tiers":{"gone":{"quota":{"limit":9,"period":"1m"}}}}"#,
            "4",
        ),
        (r#"{"tiers":{}}"#, "five"),
    ] {
        redis.cmd::<i64>(&[
            "HSET",
            "rl:control",
            "settings",
            doc,
            "settings_version",
            version,
        ]);
        one_poll().await;
        assert_eq!(versions(&[&a, &b]), [1, 1], "{doc}");
        assert_eq!(get(b.addr, None).await.limit, Some(10), "{doc}");
    }
    let (status, res) = post(
        a.addr,
        "/api/quota",
        json!({"tier": "ip", "limit": 30, "period": "1m"}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{res}");
    assert_eq!(res["error"], "settings_conflict");
    assert_eq!(get(a.addr, None).await.limit, Some(10));
    let _ = reset;
}

/// Lists changed through A apply on B within a poll; `GET /api/lists`
/// answers the entries in force; removing gives the request back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_changed_through_one_instance_apply_on_the_others() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b) = (node(&redis, &clock).await, node(&redis, &clock).await);
    assert_eq!(get(b.addr, None).await.status, 200);
    let (status, res) = post(
        a.addr,
        "/api/lists",
        json!({"list": "deny", "add": [{"ip": "127.0.0.1"}, {"user": "mallory"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{res}");
    assert_eq!(
        res["deny"],
        json!({"ips": ["127.0.0.1/32"], "users": ["mallory"]})
    );
    assert_eq!(res["allow"], json!({"users": ["configured-bot"]}));
    assert_eq!(res["settings_version"], 1);
    one_poll().await;
    assert_eq!(get(b.addr, None).await.status, 403);
    assert_eq!(
        api_get(b.addr, "/api/lists").await["deny"]["ips"],
        json!(["127.0.0.1/32"])
    );
    let (status, _) = post(
        a.addr,
        "/api/lists",
        json!({"list": "deny", "remove": [{"ip": "127.0.0.1/32"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    one_poll().await;
    assert_eq!(get(b.addr, None).await.status, 200);
    assert_eq!(versions(&[&a, &b]), [2, 2]);
}

/// Two instances writing at once lose nothing: every write gets its own
/// version, and the document holds the last of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_at_once_lose_nothing() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b) = (node(&redis, &clock).await, node(&redis, &clock).await);
    let quotas = async {
        let mut v = Vec::new();
        for i in 1..=10 {
            v.push(
                a.handle
                    .set_fleet_quota("ip", None, Quota::per_minute(100 + i), "a")
                    .await
                    .unwrap(),
            );
        }
        v
    };
    let lists = async {
        let mut v = Vec::new();
        for i in 1..=10 {
            v.push(
                b.handle
                    .set_fleet_allowlist(AccessList::new().user(format!("bot-{i}")), "b")
                    .await
                    .unwrap(),
            );
        }
        v
    };
    let (qv, lv) = tokio::join!(quotas, lists);
    let mut all: Vec<u64> = qv.iter().chain(&lv).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (1..=20).collect::<Vec<u64>>());
    one_poll().await;
    assert_eq!(versions(&[&a, &b]), [20, 20]);
    for n in [&a, &b] {
        assert_eq!(n.handle.tiers()[0].quota, Quota::per_minute(110));
        assert_eq!(n.handle.allowlist_entries().users, ["bot-10"]);
    }
}

/// The page's forms: a quota set and a denylist entry added through the
/// page reach the other instance, and the page shows the version and the
/// entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_changes_quotas_and_lists_for_the_fleet() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b) = (node(&redis, &clock).await, node(&redis, &clock).await);
    let raw = client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let form = |pairs: &'static [(&'static str, &'static str)]| {
        raw.post(format!("http://{}{BASE}/settings", a.addr))
            .bearer_auth(TOKEN)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(
                pairs
                    .iter()
                    .map(|(k, v)| format!("{k}={}", v.replace('/', "%2F")))
                    .collect::<Vec<_>>()
                    .join("&"),
            )
            .send()
    };
    let res = form(&[
        ("action", "quota"),
        ("tier", "ip"),
        ("plan", ""),
        ("limit", "12"),
        ("period", "1m"),
        ("burst", ""),
        ("op", "set"),
    ])
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    let res = form(&[
        ("action", "list"),
        ("list", "deny"),
        ("kind", "user"),
        ("value", "mallory"),
        ("op", "add"),
    ])
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    let res = form(&[
        ("action", "quota"),
        ("tier", "ip"),
        ("limit", "0"),
        ("period", "1m"),
        ("op", "set"),
    ])
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(res.json::<Value>().await.unwrap()["field"], "limit");
    one_poll().await;
    assert_eq!(versions(&[&a, &b]), [2, 2]);
    assert_eq!(get(b.addr, None).await.limit, Some(12));
    let page = client()
        .get(format!("http://{}{BASE}", b.addr))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(r#"<p class="muted" id="settings-version">settings version 2</p>"#),
        "{page}"
    );
    assert!(
        page.contains("<p><strong>denylist</strong>: user mallory</p>"),
        "{page}"
    );
    assert!(page.contains("all instances (control key <code>rl:control</code>)"));
}

/// The gauge `tiered_ratelimit_settings_version` carries the version the
/// instance applies, with its HELP text.
#[test]
fn the_settings_version_gauge_follows_the_applied_version() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        current_thread_runtime().block_on(async {
            let layer = layer(&redis, &clock);
            let h = layer.handle();
            assert_eq!(h.ready().await, 0);
            for (limit, version) in [(10, 1), (20, 2)] {
                let v = h
                    .set_fleet_quota("ip", None, Quota::per_minute(limit), "test")
                    .await
                    .unwrap();
                assert_eq!(v, version);
            }
        });
    });
    let snap = snapshotter.snapshot().into_vec();
    let gauge = snap
        .iter()
        .find(|(k, ..)| k.key().name() == "tiered_ratelimit_settings_version")
        .map(|(_, _, desc, v)| (desc.clone(), v));
    let Some((desc, DebugValue::Gauge(v))) = gauge else {
        panic!("no settings version gauge in {snap:?}");
    };
    assert_eq!(v.into_inner(), 2.0);
    assert!(desc.is_some_and(|d| d.to_string().contains("settings version")));
}

/// Without a control key the same API changes this process only, through
/// the handle's update: the quota and the list apply to the next request,
/// and version 0 says nothing is fleet-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_control_key_the_api_changes_this_process() {
    let layer = RateLimitLayer::builder()
        .backend(tiered_ratelimit::backend::MemoryBackend::with_manual_clock(
            ManualClock::new(T0_US),
        ))
        .tiers_from(tiers())
        .build()
        .unwrap();
    let h = layer.handle();
    let addr = serve(app(layer).nest(BASE, admin::router(h.clone(), TOKEN))).await;
    let reset = T0_S - T0_S % 60 + 60;
    assert_eq!(get(addr, None).await, ok(5, 4, reset));
    let (status, res) = post(
        addr,
        "/api/quota",
        json!({"tier": "ip", "limit": 8, "period": "1m"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{res}");
    assert_eq!(res["settings_version"], 0);
    assert_eq!(get(addr, None).await, ok(8, 6, reset));
    let (status, res) = post(
        addr,
        "/api/quota",
        json!({"tier": "ip", "limit": 0, "period": "1m"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{res}");
    assert_eq!(res["field"], "limit");
    let (status, res) = post(
        addr,
        "/api/lists",
        json!({"list": "deny", "add": [{"ip": "127.0.0.1"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{res}");
    assert!(res["changes_apply_to"]
        .as_str()
        .unwrap()
        .starts_with("this instance"));
    assert_eq!(get(addr, None).await.status, 403);
    let (status, _) = post(addr, "/api/quota/reset", json!({"tier": "ip"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h.tiers()[0].quota, Quota::per_minute(5));
}

/// One algorithm's pair of instances for the carry-over test: a single
/// tier `t` of 100 a minute (a calendar tier: 100 a month) on its own
/// prefix and control key.
async fn carry_pair(
    redis: &RedisServer,
    clock: &ManualClock,
    name: &str,
    algorithm: Option<Algorithm>,
) -> (Node, Node) {
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let tier = match algorithm {
            Some(a) => Tier::new("t", ClientIp::default(), Quota::per_minute(100)).algorithm(a),
            None => Tier::new("t", ClientIp::default(), Quota::per_hour(100))
                .calendar(Calendar::month()),
        };
        let layer = RateLimitLayer::builder()
            .backend(
                RedisBackend::from_url(&redis.url())
                    .unwrap()
                    .with_manual_clock(clock.clone()),
            )
            .backend_timeout(Duration::from_secs(2))
            .key_prefix(name)
            .control_key(ControlKey::new(format!("{name}:control")).poll_interval(POLL))
            .tier(tier)
            .build()
            .unwrap();
        let handle = layer.handle();
        let router = admin::router(handle.clone(), TOKEN);
        let addr = serve(app(layer).nest(BASE, router)).await;
        handle.ready().await;
        nodes.push(Node { addr, handle });
    }
    let b = nodes.pop().unwrap();
    (nodes.pop().unwrap(), b)
}

/// A quota changed fleet-wide carries each key's used capacity over, on
/// every algorithm (docs/rollout.md, "A quota change: nothing free"): 80
/// of 100 used through A; raised to 200 through A's admin API, B answers
/// 119 left after its request; lowered to 50 through B, A denies, with the
/// exact wait: 32 tokens at 50 a minute for the next (38.4 s, 39 in
/// whole seconds) for the buckets, the window's end for the windows, the entries' age for the
/// log. Two instances per algorithm on one Redis, over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_quota_change_carries_used_capacity_over_on_every_algorithm() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let minute_end = T0_S - T0_S % 60 + 60;
    // (name, algorithm, period in the API, Retry-After and reset once
    // lowered to 50 with 81 used).
    let cases = [
        ("tb", Some(Algorithm::TokenBucket), "1m", 39, T0_S + 39),
        (
            "lb",
            Some(Algorithm::LeakyBucket(
                tiered_ratelimit::LeakyBucket::Police,
            )),
            "1m",
            39,
            T0_S + 39,
        ),
        (
            "fw",
            Some(Algorithm::FixedWindow),
            "1m",
            minute_end - T0_S,
            minute_end,
        ),
        (
            "log",
            Some(Algorithm::SlidingWindowLog),
            "1m",
            60,
            T0_S + 60,
        ),
        ("swc", Some(Algorithm::SlidingWindowCounter), "1m", 0, 0),
        ("cal", None, "month", 0, 0),
    ];
    let mut pairs = Vec::new();
    for (name, algorithm, ..) in &cases {
        pairs.push(carry_pair(&redis, &clock, name, *algorithm).await);
    }
    for (a, _) in &pairs {
        for _ in 0..80 {
            assert_eq!(get(a.addr, None).await.status, 200);
        }
    }
    for ((name, _, period, ..), (a, _)) in cases.iter().zip(&pairs) {
        let (status, body) = post(
            a.addr,
            "/api/quota",
            json!({"tier": "t", "limit": 200, "period": period}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
    }
    one_poll().await;
    for ((name, ..), (_, b)) in cases.iter().zip(&pairs) {
        let l = get(b.addr, None).await;
        assert_eq!(
            (l.status, l.limit, l.remaining),
            (200, Some(200), Some(119)),
            "{name}"
        );
    }
    for ((name, _, period, ..), (_, b)) in cases.iter().zip(&pairs) {
        let (status, body) = post(
            b.addr,
            "/api/quota",
            json!({"tier": "t", "limit": 50, "period": period}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
    }
    one_poll().await;
    for ((name, _, _, retry, reset), (a, _)) in cases.iter().zip(&pairs) {
        let l = get(a.addr, None).await;
        assert_eq!(
            (l.status, l.limit, l.remaining),
            (429, Some(50), Some(0)),
            "{name}"
        );
        if *retry > 0 {
            assert_eq!(
                (l.retry_after, l.reset),
                (Some(*retry), Some(*reset)),
                "{name}"
            );
        }
    }
}
