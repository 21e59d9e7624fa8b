//! A rollout plan's gates (`src/engine/rollout/gates.rs`), three instances
//! on one real Redis over HTTP: a stage whose time has passed holds while
//! the fleet has seen too few checks or keys, says so in `holding` on
//! every instance, and advances once it has (the keys that complete the
//! floor reach the leader through the other instances); a heavy key in the 1 %
//! canary cohort holds the plan with its reason; the application guard
//! holds, or steps the tier back to shadow and stops the plan.

use super::rollout_plan::*;
use crate::support::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::ManualClock;
use tiered_ratelimit::rollout::{GuardVerdict, Mode, PlanAction, RolloutPlan};
use tiered_ratelimit::{Quota, Tier};

/// `ip`, keyed by the `x-user` header, 1000 a minute, the recipe's plan of
/// hour-long stages with a floor of 20 checks and 5 keys.
pub(crate) fn tier(plan: RolloutPlan) -> Tier {
    Tier::new(
        "ip",
        |p: &http::request::Parts| {
            p.headers
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        },
        Quota::per_minute(1000),
    )
    .rollout(plan.lease(LEASE))
}

fn floor() -> RolloutPlan {
    RolloutPlan::recipe(Duration::from_secs(3600))
        .min_requests(20)
        .min_keys(5)
}

/// The stored plan's `holding` (empty: none).
fn holding(redis: &RedisServer) -> String {
    let raw = redis
        .cmd::<Option<String>>(&["HGET", "rl:control", "plan:ip"])
        .unwrap_or_default();
    raw.splitn(9, ' ').nth(8).unwrap_or("").to_owned()
}

async fn send(addr: SocketAddr, user: &str, n: usize) {
    for _ in 0..n {
        let res = client()
            .get(format!("http://{addr}/"))
            .header("x-user", user)
            .send()
            .await
            .unwrap();
        assert!(res.status().is_success() || res.status() == 429);
    }
}

/// A user in the 1 % canary cohort of tier `ip`.
fn enforced_at_one_percent() -> String {
    (0..)
        .map(|n| format!("u{n}"))
        .find(|k| Mode::Canary { percent: 1 }.enforces("ip", k))
        .unwrap()
}

/// Too few checks, then too few keys, hold the shadow stage past its hour
/// (every instance says why); the floor met, it advances at the leader's
/// next poll. In canary:1 a heavy key of the enforced cohort holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_floor_and_a_heavy_canary_key_hold_the_plan_with_their_reason() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let (a, b, c) = (
        node_with(&redis, &clock, tier(floor())).await,
        node_with(&redis, &clock, tier(floor())).await,
        node_with(&redis, &clock, tier(floor())).await,
    );
    let (status, body) = post(
        a.addr,
        "/api/plan",
        json!({"tier": "ip", "action": "start"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // Keys that are not in the 1 % cohort, to the leader.
    let plain: Vec<String> = (0..)
        .map(|n| format!("p{n}"))
        .filter(|k| !Mode::Canary { percent: 10 }.enforces("ip", k))
        .take(10)
        .collect();
    tokio::time::sleep(POLL + LAG).await;
    send(a.addr, &plain[0], 25).await;
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the hold", |s| s.0 == 2).await;
    assert_eq!(holding(&redis), "min_keys: fewer than 5 keys in the stage");
    tokio::time::sleep(POLL + LAG).await;
    for n in [&a, &b, &c] {
        let p = api_get(n.addr, "/api/plan/ip").await;
        assert_eq!(p["stage"], 0);
        assert_eq!(p["holding"], "min_keys: fewer than 5 keys in the stage");
    }
    // The other keys through the other instances: the gates count the
    // fleet's stage (each instance adds its counts at its poll, the leader
    // reads the sum at its own), so they reach the leader within a poll
    // of theirs.
    for (n, k) in plain[1..5].iter().enumerate() {
        send([&b, &c][n % 2].addr, k, 1).await;
    }
    until(&redis, 2 * POLL + LAG, "the step", |s| s.1 == 1).await;
    assert_eq!(holding(&redis), "");

    // canary:1: one heavy key of the enforced cohort, a few others.
    let heavy = enforced_at_one_percent();
    tokio::time::sleep(POLL + LAG).await;
    send(a.addr, &heavy, 30).await;
    for k in &plain[..5] {
        send(a.addr, k, 1).await;
    }
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the hold", |s| s.0 == 4).await;
    assert_eq!(
        holding(&redis),
        "enforced_share: over 2 % of the checks are in the enforced cohort (2 × canary:1): a few heavy keys are in it"
    );
    let log = api_get(b.addr, "/api/rollout/log?count=1").await;
    let hold = &log["entries"][0];
    assert_eq!(hold["event"], "hold");
    assert_eq!(hold["stage"], 1);
    assert_eq!(hold["by"], "leader");
    let evidence = hold["evidence"].as_str().unwrap();
    assert!(
        evidence.starts_with("requests=35 keys=6 enforced=30 "),
        "{evidence}"
    );
    // Held: more hours change nothing, and nothing is logged again.
    clock.advance(Duration::from_secs(3600));
    tokio::time::sleep(2 * POLL).await;
    assert_eq!(stored(&redis).unwrap().0, 4);
    assert_eq!(
        log_events(&redis),
        ["start:0", "hold:0", "advance:1", "hold:1"]
    );
}

/// The guard answers hold (the plan holds with its words), then fall back:
/// the tier goes to shadow on every instance and the plan stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_holds_then_falls_back_to_shadow() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let verdict = std::sync::Arc::new(std::sync::Mutex::new(GuardVerdict::Healthy));
    let plan = || {
        let v = verdict.clone();
        RolloutPlan::recipe(Duration::from_secs(3600)).guard(move |_tier| {
            let v = v.lock().unwrap().clone();
            async move { v }
        })
    };
    let (a, b) = (
        node_with(&redis, &clock, tier(plan())).await,
        node_with(&redis, &clock, tier(plan())).await,
    );
    a.handle
        .plan("ip", PlanAction::Start, "test")
        .await
        .unwrap();
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the step", |s| s.1 == 1).await;
    *verdict.lock().unwrap() = GuardVerdict::Hold("checkout errors at 2.1 %".into());
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the hold", |s| s.0 == 3).await;
    assert_eq!(holding(&redis), "guard: checkout errors at 2.1 %");
    *verdict.lock().unwrap() = GuardVerdict::FallBack("checkout errors at 9 %".into());
    until(&redis, POLL + LAG, "the fall back", |s| s.2 == "fellback").await;
    tokio::time::sleep(POLL + LAG).await;
    for n in [&a, &b] {
        let s = api_get(n.addr, "/api/status").await;
        assert_eq!(s["tiers"][0]["effective_mode"], "shadow");
        let p = api_get(n.addr, "/api/plan/ip").await;
        assert_eq!(p["status"], "fellback");
        assert_eq!(p["next_at_us"], Value::Null);
    }
    let log = api_get(b.addr, "/api/rollout/log?count=1").await;
    assert_eq!(log["entries"][0]["event"], "fallback");
    assert_eq!(log["entries"][0]["by"], "guard");
    assert_eq!(log["entries"][0]["reason"], "guard: checkout errors at 9 %");
    // Nothing re-advances by itself.
    clock.advance(Duration::from_secs(3600));
    tokio::time::sleep(2 * POLL).await;
    assert_eq!(
        log_events(&redis),
        ["start:0", "advance:1", "hold:1", "fallback:1"]
    );
}
