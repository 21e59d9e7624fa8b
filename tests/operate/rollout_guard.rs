//! The automatic fall back to shadow (`[tier.guard]`,
//! `src/engine/rollout/guard.rs`): three instances on one real Redis, over
//! HTTP, with time compressed (1 s control-key poll, 2 s guard buckets, a
//! 5-bucket warmup) and real clocks (the guard's buckets are wall-clock
//! time). 40 users at 0.5 requests/s each, 20 checks/s fleet-wide, spread
//! over the three instances; each user uses 30 % of its quota.
//!
//! A steady run judges every bucket inside the band (`cause` null) and
//! falls back never; a quota made 10× too low at full enforcement falls
//! back to shadow on every instance within 30 s, logged once with the
//! evidence, while a denylisted client stays refused; five users at 50×
//! their rate are `abuse` and cause no fall back. On a Redis Cluster the
//! same fall back happens (the poll's one call, its keys in the control
//! key's slot).

use super::rollout_plan::{api_get, BASE, TOKEN};
use crate::support::*;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::RedisBackend;
use tiered_ratelimit::handle::ControlKey;
use tiered_ratelimit::observe::AnomalyConfig;
use tiered_ratelimit::rollout::{
    AccessList, DenyStatus, FallbackGuard, Mode, PlanAction, RolloutPlan, Stage,
};
use tiered_ratelimit::{admin, Quota, RateLimitHandle, Tier};

const POLL: Duration = Duration::from_secs(1);
const USERS: usize = 40;
/// Each user's pace: one request every 2 s.
const USER_EVERY: Duration = Duration::from_millis(2000);
/// The right quota: 5 per 3 s (1.67/s), 30 % of it used.
const RIGHT: Quota = Quota::new(5, Duration::from_secs(3));
/// 10× too low: 1 per 6 s (0.167/s), 3× over it.
const WRONG: Quota = Quota::new(1, Duration::from_secs(6));

struct Node {
    addr: SocketAddr,
    handle: RateLimitHandle,
}

fn tier(plan: Option<RolloutPlan>) -> Tier {
    let t = Tier::new(
        "user",
        |p: &http::request::Parts| {
            p.headers
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        },
        RIGHT,
    )
    .guard(
        FallbackGuard::shadow()
            .bucket(Duration::from_secs(2))
            .warmup(5),
    );
    match plan {
        Some(p) => t.rollout(p),
        None => t,
    }
}

async fn node(redis: &RedisServer, plan: Option<RolloutPlan>) -> Node {
    node_on(RedisBackend::from_url(&redis.url()).unwrap(), plan).await
}

async fn node_on(backend: RedisBackend, plan: Option<RolloutPlan>) -> Node {
    let layer = tiered_ratelimit::RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(2))
        .control_key(ControlKey::new("rl:control").poll_interval(POLL))
        .anomaly(AnomalyConfig {
            bucket_secs: 2,
            ..AnomalyConfig::default()
        })
        .denylist(
            AccessList::new().api_key("sk_banned"),
            DenyStatus::Forbidden,
        )
        .tier(tier(plan))
        .build()
        .unwrap();
    let handle = layer.handle();
    let router = app(layer).nest(BASE, admin::router(handle.clone(), TOKEN));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    handle.ready().await;
    Node { addr, handle }
}

/// Sends, until `stop`, one request of `users` in turn every `every`, to
/// the instances in turn.
fn traffic(
    addrs: Vec<SocketAddr>,
    users: Vec<String>,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let c = client();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let res = c
                .get(format!("http://{}/", addrs[n % addrs.len()]))
                .header("x-user", &users[n % users.len()])
                .send()
                .await
                .unwrap();
            assert!(
                res.status() == 200 || res.status() == 429,
                "{}",
                res.status()
            );
            n += 1;
        }
    })
}

fn users() -> Vec<String> {
    (0..USERS).map(|i| format!("user{i}")).collect()
}

/// The log's entries, oldest first.
fn log(redis: &RedisServer) -> Vec<Vec<(String, String)>> {
    let entries: Vec<(String, Vec<(String, String)>)> =
        redis.cmd(&["XRANGE", "{rl:control}:rollout", "-", "+"]);
    entries.into_iter().map(|(_, f)| f).collect()
}

fn field<'a>(entry: &'a [(String, String)], name: &str) -> &'a str {
    &entry.iter().find(|(k, _)| k == name).unwrap().1
}

async fn guard_of(addr: SocketAddr) -> Value {
    api_get(addr, "/api/anomalies").await["guards"][0].clone()
}

async fn modes(nodes: &[Node]) -> Vec<String> {
    let mut out = Vec::new();
    for n in nodes {
        let s = api_get(n.addr, "/api/status").await;
        out.push(s["tiers"][0]["effective_mode"].as_str().unwrap().to_owned());
    }
    out
}

/// Steady, then a quota 10× too low reaches the fleet: in shadow on every
/// instance within 30 s, once, with the evidence; the denylist still
/// refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_ten_times_too_low_falls_back_to_shadow_on_every_instance_within_30s() {
    let redis = RedisServer::start();
    let nodes = [
        node(&redis, None).await,
        node(&redis, None).await,
        node(&redis, None).await,
    ];
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let steady = traffic(
        addrs.clone(),
        users(),
        USER_EVERY / USERS as u32,
        stop.clone(),
    );
    // Warmup (5 buckets) and 6 buckets judged inside the band.
    tokio::time::sleep(Duration::from_secs(24)).await;
    for n in &nodes {
        let g = guard_of(n.addr).await;
        assert_eq!(g["judged"], true, "{g}");
        assert_eq!(g["cause"], Value::Null, "{g}");
        assert_eq!(g["streak"], 0, "{g}");
    }
    assert_eq!(modes(&nodes).await, ["enforce"; 3]);
    assert!(log(&redis).is_empty());
    let leaders: usize = {
        let mut l = 0;
        for n in &nodes {
            l += usize::from(guard_of(n.addr).await["leader"] == true);
        }
        l
    };
    assert_eq!(leaders, 1);

    // The wrong quota, fleet-wide.
    nodes[0]
        .handle
        .set_fleet_quota("user", None, WRONG, "test")
        .await
        .unwrap();
    let t0 = Instant::now();
    loop {
        if modes(&nodes).await == ["shadow"; 3] {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not in shadow everywhere within 30 s: {:?}, guard {}",
            modes(&nodes).await,
            guard_of(addrs[0]).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = t0.elapsed();
    eprintln!("fell back on every instance {took:?} after the wrong quota");
    for n in &nodes {
        let g = guard_of(n.addr).await;
        assert_eq!(g["cause"], "limiter", "{g}");
        let a = api_get(n.addr, "/api/anomalies").await;
        for s in a["anomalies"].as_array().unwrap() {
            assert_eq!(s["cause"], "limiter", "{s}");
        }
    }
    // The denylisted client stays refused.
    let res = client()
        .get(format!("http://{}/", addrs[1]))
        .header("x-user", "user0")
        .header("x-api-key", "sk_banned")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);
    // Logged once, by the guard, with the evidence; it stays so.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let entries = log(&redis);
    assert_eq!(entries.len(), 1, "{entries:?}");
    let e = &entries[0];
    assert_eq!(field(e, "event"), "fallback");
    assert_eq!(field(e, "tier"), "user");
    assert_eq!(field(e, "by"), "guard");
    assert!(field(e, "reason").starts_with("limiter: the 429 rate left its band"));
    assert!(
        field(e, "evidence").starts_with("cause=limiter "),
        "{}",
        field(e, "evidence")
    );
    assert_eq!(
        redis.cmd::<Option<String>>(&["HGET", "rl:control", "tier:user"]),
        Some("shadow".to_owned())
    );
    assert_eq!(modes(&nodes).await, ["shadow"; 3]);
    stop.store(true, Ordering::Relaxed);
    steady.await.unwrap();
}

/// Five users at 50× their rate: `abuse` on every instance, no fall back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_abusers_at_50x_are_abuse_and_no_fall_back() {
    let redis = RedisServer::start();
    let nodes = [
        node(&redis, None).await,
        node(&redis, None).await,
        node(&redis, None).await,
    ];
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = vec![traffic(
        addrs.clone(),
        users(),
        USER_EVERY / USERS as u32,
        stop.clone(),
    )];
    tokio::time::sleep(Duration::from_secs(16)).await;
    for a in 0..5 {
        tasks.push(traffic(
            addrs.clone(),
            vec![format!("user{a}")],
            USER_EVERY / 50,
            stop.clone(),
        ));
    }
    tokio::time::sleep(Duration::from_secs(16)).await;
    for n in &nodes {
        let g = guard_of(n.addr).await;
        assert_eq!(g["cause"], "abuse", "{g}");
        assert_eq!(g["streak"], 0, "{g}");
        let a = api_get(n.addr, "/api/anomalies").await;
        for s in a["anomalies"].as_array().unwrap() {
            assert_eq!(s["cause"], "abuse", "{s}");
        }
        // The abusers lead the top-N.
        let top = api_get(n.addr, "/api/top/user?n=5").await;
        let mut keys: Vec<String> = top["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["key"].as_str().unwrap().to_owned())
            .collect();
        keys.sort();
        assert_eq!(keys, ["user0", "user1", "user2", "user3", "user4"]);
    }
    assert_eq!(modes(&nodes).await, ["enforce"; 3]);
    assert!(log(&redis).is_empty());
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
}

/// Sets the quota 10× too low fleet-wide through `nodes[via]` and waits
/// until every node runs the tier in shadow, at most 30 s: how long it took.
async fn wrong_quota_falls_back_within_30s(nodes: &[Node], via: usize) -> Duration {
    nodes[via]
        .handle
        .set_fleet_quota("user", None, WRONG, "test")
        .await
        .unwrap();
    let t0 = Instant::now();
    while modes(nodes).await.iter().any(|m| m != "shadow") {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not in shadow everywhere within 30 s: {:?}, guard {}",
            modes(nodes).await,
            guard_of(nodes[0].addr).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    t0.elapsed()
}

/// A plan in canary:50 for an hour, then enforce.
fn canary_plan() -> Option<RolloutPlan> {
    Some(RolloutPlan::new([
        Stage::new(Mode::Canary { percent: 50 }).hold_for(Duration::from_secs(3600)),
        Stage::new(Mode::Enforce),
    ]))
}

/// Starts the plan through the first node and the steady traffic through
/// every one: the traffic's stop flag and its task.
async fn start_with_traffic(nodes: &[Node]) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    nodes[0]
        .handle
        .plan("user", PlanAction::Start, "test")
        .await
        .unwrap();
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let steady = traffic(
        addrs.clone(),
        users(),
        USER_EVERY / USERS as u32,
        stop.clone(),
    );
    (stop, steady)
}

/// A plan in its canary:50 stage: the wrong quota refuses both cohorts
/// alike (their rates match: the limiter is wrong for everyone); the
/// would-deny rate leaves its band, the tier goes to shadow everywhere and
/// the plan stops (`fellback`), once, and does not move again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_canary_stage_the_fall_back_stops_the_plan() {
    let redis = RedisServer::start();
    let nodes = [
        node(&redis, canary_plan()).await,
        node(&redis, canary_plan()).await,
        node(&redis, canary_plan()).await,
    ];
    let (stop, steady) = start_with_traffic(&nodes).await;
    tokio::time::sleep(Duration::from_secs(16)).await;
    assert_eq!(modes(&nodes).await, ["canary:50"; 3]);
    for n in &nodes {
        let g = guard_of(n.addr).await;
        assert_eq!(g["cause"], Value::Null, "{g}");
        // Both cohorts counted, both refused nothing.
        assert_eq!(
            (g["enforced_rate"].as_f64(), g["shadowed_rate"].as_f64()),
            (Some(0.0), Some(0.0)),
            "{g}"
        );
    }
    wrong_quota_falls_back_within_30s(&nodes, 2).await;
    tokio::time::sleep(POLL * 2).await;
    for n in &nodes {
        let p = api_get(n.addr, "/api/plan/user").await;
        assert_eq!(p["status"], "fellback", "{p}");
        assert_eq!(p["next_at_us"], Value::Null);
    }
    let entries = log(&redis);
    let events: Vec<(&str, &str)> = entries
        .iter()
        .map(|e| (field(e, "event"), field(e, "by")))
        .collect();
    assert_eq!(events, [("start", "test"), ("fallback", "guard")]);
    let evidence = field(&entries[1], "evidence");
    assert!(
        evidence.starts_with("cause=limiter ") && evidence.contains(" enforced_rate="),
        "{evidence}"
    );
    stop.store(true, Ordering::Relaxed);
    steady.await.unwrap();
}

/// On a Redis Cluster of three primaries: the control hash, the rollout
/// log, the stage's and the guard's keys share one slot, so each poll's
/// one call (the leader's step, the stage counts, the guard's part) runs
/// there; a plan in its canary:50 stage, a quota 10× too low: shadow on
/// both instances within 30 s, the plan `fellback`, logged once by the
/// guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_quota_ten_times_too_low_falls_back_to_shadow() {
    let cluster = cluster::RedisCluster::start(0);
    let slot = cluster.keyslot("rl:control");
    for key in [
        "{rl:control}:rollout",
        "{rl:control}:stage:user:1700000000000000",
        "{rl:control}:guard:user:lease",
        "{rl:control}:guard:user:850000000",
    ] {
        assert_eq!(cluster.keyslot(key), slot, "{key}");
    }
    let backend = || RedisBackend::cluster(cluster.urls()).unwrap();
    let nodes = [
        node_on(backend(), canary_plan()).await,
        node_on(backend(), canary_plan()).await,
    ];
    let (stop, steady) = start_with_traffic(&nodes).await;
    // Warmup (5 buckets) and a bucket or two judged inside the band.
    tokio::time::sleep(Duration::from_secs(14)).await;
    for n in &nodes {
        let g = guard_of(n.addr).await;
        assert_eq!(g["judged"], true, "{g}");
        assert_eq!(g["cause"], Value::Null, "{g}");
    }
    assert_eq!(modes(&nodes).await, ["canary:50"; 2]);
    // The stage's counts reached the cluster (each instance's part).
    let stage: Vec<String> = cluster.keys();
    assert!(
        stage
            .iter()
            .any(|k| k.starts_with("{rl:control}:stage:user:")),
        "{stage:?}"
    );

    let took = wrong_quota_falls_back_within_30s(&nodes, 1).await;
    eprintln!("on the cluster, fell back on every instance {took:?} after the wrong quota");
    tokio::time::sleep(POLL * 2).await;
    for n in &nodes {
        let p = api_get(n.addr, "/api/plan/user").await;
        assert_eq!(p["status"], "fellback", "{p}");
    }
    let entries: Vec<(String, Vec<(String, String)>)> = cluster.cmd_for_key(
        "{rl:control}:rollout",
        &["XRANGE", "{rl:control}:rollout", "-", "+"],
    );
    let events: Vec<(&str, &str)> = entries
        .iter()
        .map(|(_, e)| (field(e, "event"), field(e, "by")))
        .collect();
    assert_eq!(events, [("start", "test"), ("fallback", "guard")]);
    assert!(field(&entries[1].1, "reason").starts_with("limiter: the 429 rate left its band"));
    assert_eq!(
        cluster.cmd_for_key::<Option<String>>("rl:control", &["HGET", "rl:control", "tier:user"]),
        Some("shadow".to_owned())
    );
    stop.store(true, Ordering::Relaxed);
    steady.await.unwrap();
}
