//! Staged rollout plans (`src/engine/rollout/`): three app instances on one
//! real Redis, over HTTP. A plan started through one instance's admin API
//! walks its stages in order, each exactly once, advanced by one leader;
//! every instance applies a new stage's mode within one control-key poll
//! (1 s here) plus 0.2 s of the step; a stopped leader is replaced within
//! its lease plus a poll; a fleet restarted from nothing resumes the
//! stored stage. Redis time is the test's `ManualClock` (an hour-long stage
//! passes when the test moves it); the only waits are poll intervals and
//! leases, the bounds under test.

use crate::support::*;
use http::StatusCode;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::{ManualClock, RedisBackend};
use tiered_ratelimit::handle::ControlKey;
use tiered_ratelimit::key::ClientIp;
use tiered_ratelimit::rollout::{PlanAction, RolloutPlan};
use tiered_ratelimit::{admin, Quota, RateLimitHandle, RateLimitLayer, Tier};

pub(crate) const POLL: Duration = Duration::from_secs(1);
/// The bound past the poll interval: the poll's round trip on loopback.
pub(crate) const LAG: Duration = Duration::from_millis(200);
/// The leaders' lease in these tests.
pub(crate) const LEASE: Duration = Duration::from_secs(2);
pub(crate) const BASE: &str = "/admin/ratelimit";
pub(crate) const TOKEN: &str = "plan-test-token";
pub(crate) const HOUR_US: u64 = 3_600_000_000;

pub(crate) struct Node {
    pub(crate) addr: SocketAddr,
    pub(crate) handle: RateLimitHandle,
    server: tokio::task::JoinHandle<()>,
}

impl Node {
    /// Stops serving and drops the layer: its watcher (and its leadership)
    /// ends with it.
    pub(crate) async fn stop(self) {
        self.server.abort();
        let _ = self.server.await;
        drop(self.handle);
    }
}

/// The tier of these tests: `ip`, with the recipe's plan of hour-long stages.
fn tier() -> Tier {
    let plan = RolloutPlan::recipe(Duration::from_secs(3600)).lease(LEASE);
    Tier::new("ip", ClientIp::default(), Quota::per_minute(5)).rollout(plan)
}

pub(crate) fn layer(redis: &RedisServer, clock: &ManualClock, tier: Tier) -> RateLimitLayer {
    RateLimitLayer::builder()
        .backend(
            RedisBackend::from_url(&redis.url())
                .unwrap()
                .with_manual_clock(clock.clone()),
        )
        .backend_timeout(Duration::from_secs(2))
        .control_key(ControlKey::new("rl:control").poll_interval(POLL))
        .tier(tier)
        .build()
        .unwrap()
}

async fn node(redis: &RedisServer, clock: &ManualClock) -> Node {
    node_with(redis, clock, tier()).await
}

/// An instance with `tier` and the admin router at [`BASE`], ready.
pub(crate) async fn node_with(redis: &RedisServer, clock: &ManualClock, tier: Tier) -> Node {
    let layer = layer(redis, clock, tier);
    let handle = layer.handle();
    let router = app(layer).nest(BASE, admin::router(handle.clone(), TOKEN));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    handle.ready().await;
    Node {
        addr,
        handle,
        server,
    }
}

pub(crate) async fn post(addr: SocketAddr, path: &str, body: Value) -> (StatusCode, Value) {
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

pub(crate) async fn api_get(addr: SocketAddr, path: &str) -> Value {
    let res = client()
        .get(format!("http://{addr}{BASE}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.json().await.unwrap()
}

/// The plan's field as stored, split: version, stage, status, leader.
pub(crate) fn stored(redis: &RedisServer) -> Option<(u64, u64, String, String)> {
    let raw = redis.cmd::<Option<String>>(&["HGET", "rl:control", "plan:ip"])?;
    let p: Vec<&str> = raw.split(' ').collect();
    Some((
        p[0].parse().unwrap(),
        p[1].parse().unwrap(),
        p[2].to_owned(),
        p[6].to_owned(),
    ))
}

/// How often [`until`] looks.
pub(crate) const STEP: Duration = Duration::from_millis(20);

/// Waits ([`STEP`]s, at most `within`) until `done` holds of the stored
/// plan; answers how long it took.
pub(crate) async fn until(
    redis: &RedisServer,
    within: Duration,
    what: &str,
    done: impl Fn(&(u64, u64, String, String)) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if stored(redis).as_ref().is_some_and(&done) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{what}: not within {within:?}; stored {:?}",
            stored(redis)
        );
        tokio::time::sleep(STEP).await;
    }
}

/// Every node's `GET /api/plan/ip` and the tier's mode in force.
async fn views(nodes: &[&Node]) -> Vec<(u64, u64, String, String)> {
    let mut out = Vec::new();
    for n in nodes {
        let p = api_get(n.addr, "/api/plan/ip").await;
        let s = api_get(n.addr, "/api/status").await;
        out.push((
            p["version"].as_u64().unwrap(),
            p["stage"].as_u64().unwrap(),
            p["mode"].as_str().unwrap().to_owned(),
            s["tiers"][0]["effective_mode"].as_str().unwrap().to_owned(),
        ));
    }
    out
}

/// The log's events, oldest first, as `event:stage`.
pub(crate) fn log_events(redis: &RedisServer) -> Vec<String> {
    let entries: Vec<(String, Vec<(String, String)>)> =
        redis.cmd(&["XRANGE", "{rl:control}:rollout", "-", "+"]);
    entries
        .iter()
        .map(|(_, f)| {
            let get = |n: &str| f.iter().find(|(k, _)| k == n).unwrap().1.clone();
            format!("{}:{}", get("event"), get("stage"))
        })
        .collect()
}

/// Started through A's admin API, the plan walks shadow → canary:1 →
/// canary:10 → enforce as the hours pass, each step once (the log holds
/// each once, in order), and all three instances report the new stage and
/// run the tier in its mode within one poll plus 0.2 s of the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_advance_in_order_once_each_and_every_instance_follows_within_a_poll() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b, c) = (
        node(&redis, &clock).await,
        node(&redis, &clock).await,
        node(&redis, &clock).await,
    );
    let idle = api_get(b.addr, "/api/plan/ip").await;
    assert_eq!(idle["status"], "idle");
    assert_eq!(idle["version"], 0);
    assert_eq!(idle["holding"], Value::Null);

    let (status, body) = post(
        a.addr,
        "/api/plan",
        json!({"tier": "ip", "action": "start"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"tier": "ip", "stage": 0, "mode": "shadow", "status": "running",
               "since_us": T0_US, "next_at_us": T0_US + HOUR_US, "holding": null,
               "version": 1, "leader": body["leader"].clone()})
    );
    assert!(body["leader"].is_string());
    tokio::time::sleep(POLL + LAG).await;
    let shadow = (1, 0, "shadow".to_owned(), "shadow".to_owned());
    assert_eq!(views(&[&a, &b, &c]).await, vec![shadow.clone(); 3]);

    // The leader's work: one script call a poll (each renews the lease,
    // the beat), the others' none; measured over three beats.
    let beat = || {
        let raw = redis.cmd::<String>(&["HGET", "rl:control", "plan:ip"]);
        raw.split(' ').nth(7).unwrap().parse::<u64>().unwrap()
    };
    // A beat and the script calls read with no call between them (the
    // same beat before and after): a loaded host may see a fourth beat
    // before this test looks again, so beats and calls are compared.
    let snapshot = || loop {
        let b = beat();
        let calls = redis.script_calls();
        if beat() == b {
            return (b, calls);
        }
    };
    let (b1, c1) = snapshot();
    while beat() < b1 + 3 {
        tokio::time::sleep(STEP).await;
    }
    let (b2, c2) = snapshot();
    assert!(b2 >= b1 + 3);
    assert_eq!(
        c2 - c1,
        b2 - b1,
        "one script call a beat, the leader's alone"
    );

    for (stage, mode) in [(1, "canary:1"), (2, "canary:10"), (3, "enforce")] {
        clock.advance(Duration::from_secs(3600));
        // The leader steps at its next poll after the hour...
        until(&redis, POLL + LAG, "the step", |s| s.1 == stage).await;
        // ...and every instance follows within a poll and its round trip
        // of it (seen up to a STEP after it happened).
        tokio::time::sleep(POLL + LAG - STEP).await;
        let want = (1 + stage, stage, mode.to_owned(), mode.to_owned());
        assert_eq!(views(&[&a, &b, &c]).await, vec![want; 3], "stage {stage}");
    }
    assert_eq!(stored(&redis).unwrap().2, "done");
    let done = api_get(c.addr, "/api/plan/ip").await;
    assert_eq!(done["status"], "done");
    assert_eq!(done["next_at_us"], Value::Null);
    // More hours change nothing.
    clock.advance(Duration::from_secs(3600));
    tokio::time::sleep(POLL + LAG).await;
    assert_eq!(stored(&redis).unwrap().0, 4);
    assert_eq!(
        log_events(&redis),
        ["start:0", "advance:1", "advance:2", "advance:3", "done:3"]
    );
    // The API's log: newest first, who and which instance.
    let log = api_get(b.addr, "/api/rollout/log?count=2").await;
    let entries = log["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0]["event"], "done");
    assert_eq!(entries[1]["event"], "advance");
    assert_eq!(entries[1]["mode"], "enforce");
    assert_eq!(entries[1]["by"], "leader");
    assert_eq!(entries[1]["instance"], body["leader"]);
    assert_eq!(entries[1]["at_us"], T0_US + 3 * HOUR_US);
}

/// The leader stopped mid-stage: another instance takes the lease over
/// within the lease plus a poll (and its round trip), once, and advances
/// the plan when its hour has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_is_replaced_within_the_lease_and_a_poll() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b, c) = (
        node(&redis, &clock).await,
        node(&redis, &clock).await,
        node(&redis, &clock).await,
    );
    let first = a
        .handle
        .plan("ip", PlanAction::Start, "test")
        .await
        .unwrap()
        .leader
        .unwrap();
    // Stopped right after a renewal: replaced within the lease (from that
    // renewal, as the others see it at their next poll) plus a poll.
    let beat = || {
        let raw = redis.cmd::<String>(&["HGET", "rl:control", "plan:ip"]);
        raw.split(' ').nth(7).unwrap().parse::<u64>().unwrap()
    };
    let b0 = beat();
    while beat() == b0 {
        tokio::time::sleep(STEP).await;
    }
    a.stop().await;
    let took = until(&redis, LEASE + 2 * POLL + LAG, "the takeover", |s| {
        s.3 != first
    })
    .await;
    eprintln!("the takeover came {took:?} after the leader's last renewal (lease {LEASE:?}, poll {POLL:?})");
    assert!(took <= LEASE + POLL + LAG, "took {took:?}");
    let (version, stage, status, leader) = stored(&redis).unwrap();
    assert_eq!((version, stage, status.as_str()), (2, 0, "running"));
    assert!(
        [&b, &c].iter().any(|n| n.handle.plan_status("ip").unwrap().leader.as_deref() == Some(leader.as_str())),
        "the new leader is B or C"
    );
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the step", |s| s.1 == 1).await;
    tokio::time::sleep(POLL + LAG).await;
    assert_eq!(stored(&redis).unwrap().0, 3);
    assert_eq!(log_events(&redis), ["start:0", "takeover:0", "advance:1"]);
}

/// Every instance stopped, then three new ones: they run the stored stage's
/// mode from their first read, one takes the lease over, and the plan goes
/// on from where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_resumes_the_stored_stage() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let nodes = [
        node(&redis, &clock).await,
        node(&redis, &clock).await,
        node(&redis, &clock).await,
    ];
    nodes[1]
        .handle
        .plan("ip", PlanAction::Start, "test")
        .await
        .unwrap();
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the step", |s| s.1 == 1).await;
    for n in nodes {
        n.stop().await;
    }
    let (a, b, c) = (
        node(&redis, &clock).await,
        node(&redis, &clock).await,
        node(&redis, &clock).await,
    );
    let canary = (2, 1, "canary:1".to_owned(), "canary:1".to_owned());
    assert_eq!(views(&[&a, &b, &c]).await, vec![canary; 3]);
    until(&redis, LEASE + 2 * POLL + LAG, "the takeover", |s| s.0 == 3).await;
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the step", |s| s.1 == 2).await;
    tokio::time::sleep(POLL + LAG).await;
    let ten = (4, 2, "canary:10".to_owned(), "canary:10".to_owned());
    assert_eq!(views(&[&a, &b, &c]).await, vec![ten; 3]);
    assert_eq!(
        log_events(&redis),
        ["start:0", "advance:1", "takeover:1", "advance:2"]
    );
}

/// Pause stops the clock, resume restarts it where it stopped, abort puts
/// the first stage's mode back everywhere; an action that does not apply
/// is refused with its field, and a tier without a plan too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_abort_through_the_api() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b) = (node(&redis, &clock).await, node(&redis, &clock).await);
    let act =
        |action: &'static str| post(a.addr, "/api/plan", json!({"tier": "ip", "action": action}));
    let (status, res) = act("pause").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{res}");
    assert_eq!(res["field"], "action");
    assert_eq!(act("start").await.0, StatusCode::OK);
    let (status, res) = act("start").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{res}");
    clock.advance(Duration::from_secs(1800));
    let (_, paused) = act("pause").await;
    assert_eq!(paused["status"], "paused");
    clock.advance(Duration::from_secs(7200));
    tokio::time::sleep(POLL + LAG).await;
    assert_eq!(stored(&redis).unwrap().1, 0, "paused: no step");
    let (_, resumed) = act("resume").await;
    assert_eq!(resumed["status"], "running");
    // Half an hour of the stage is left.
    assert_eq!(
        resumed["next_at_us"],
        T0_US + 9000 * 1_000_000 + 1800 * 1_000_000
    );
    let (_, aborted) = act("abort").await;
    assert_eq!(aborted["status"], "aborted");
    assert_eq!(aborted["mode"], "shadow");
    tokio::time::sleep(POLL + LAG).await;
    let s = api_get(b.addr, "/api/status").await;
    assert_eq!(s["tiers"][0]["effective_mode"], "shadow");
    let (status, res) = post(
        a.addr,
        "/api/plan",
        json!({"tier": "nope", "action": "start"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{res}");
    let (status, res) = post(a.addr, "/api/plan", json!({"tier": "ip", "action": "go"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{res}");
    assert_eq!(res["field"], "action");
    assert_eq!(
        log_events(&redis),
        ["start:0", "pause:0", "resume:0", "abort:0"]
    );
    // The page: the plan's row with its actions, and the log's entries.
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
        page.contains(
            r#"<tr><td><code>ip</code></td><td class="n">0</td><td>shadow</td><td>aborted</td>"#
        ),
        "{page}"
    );
    assert!(page.contains(r#"<button name="action" value="start">start</button>"#));
    assert_eq!(
        page.matches("<td>admin</td>").count(),
        4,
        "the log's four entries"
    );
    // Its form starts the plan again (a redirect back to the page).
    let res = client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("http://{}{BASE}/plan", b.addr))
        .bearer_auth(TOKEN)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("tier=ip&action=start")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(stored(&redis).unwrap().2, "running");
    assert_eq!(log_events(&redis).last().unwrap(), "start:0");
}
