//! A plan's leader killed by its process id: three instances, each its own
//! process (this test binary run again as [`rollout_node_process`], an
//! app with the admin router on one real Redis), the plan started through
//! one of them, which leads it; `SIGKILL` to that process, and another
//! takes the lease over within the lease plus a poll (2 s + 1 s here, and
//! the poll's round trip), naming itself in the stored field and the log.

use super::rollout_plan::{post, BASE, LEASE, POLL, TOKEN};
use crate::support::*;
use serde_json::json;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::RedisBackend;
use tiered_ratelimit::handle::ControlKey;
use tiered_ratelimit::key::ClientIp;
use tiered_ratelimit::rollout::RolloutPlan;
use tiered_ratelimit::{admin, Quota, RateLimitLayer, Tier};

const REDIS_ENV: &str = "ROLLOUT_NODE_REDIS";
const ADDR_ENV: &str = "ROLLOUT_NODE_ADDR_FILE";

/// Not a test on its own: one fleet instance, run as a process by
/// [`a_leader_killed_by_pid_is_replaced_within_the_lease_and_a_poll`]
/// (it returns at once without its environment). Serves until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an instance process of the kill test"]
async fn rollout_node_process() {
    let (Ok(url), Ok(addr_file)) = (std::env::var(REDIS_ENV), std::env::var(ADDR_ENV)) else {
        return;
    };
    let plan = RolloutPlan::recipe(Duration::from_secs(3600)).lease(LEASE);
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_url(&url).unwrap())
        .backend_timeout(Duration::from_secs(2))
        .control_key(ControlKey::new("rl:control").poll_interval(POLL))
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(5)).rollout(plan))
        .build()
        .unwrap();
    let handle = layer.handle();
    let router = app(layer).nest(BASE, admin::router(handle.clone(), TOKEN));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    handle.ready().await;
    std::fs::write(&addr_file, addr.to_string()).unwrap();
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .unwrap();
}

/// The instance processes, killed when dropped (a failed test leaves none).
struct Fleet(Vec<(Child, SocketAddr)>);

impl Drop for Fleet {
    fn drop(&mut self) {
        for (c, _) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(redis: &RedisServer, n: usize) -> (Child, std::path::PathBuf) {
    let file = std::env::temp_dir().join(format!(
        "rollout-node-{}-{n}-{}",
        std::process::id(),
        redis.port()
    ));
    let _ = std::fs::remove_file(&file);
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rollout_kill::rollout_node_process",
            "--ignored",
            "--test-threads",
            "1",
        ])
        .env(REDIS_ENV, redis.url())
        .env(ADDR_ENV, &file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (child, file)
}

/// The stored plan's (leader, beat).
fn lease(redis: &RedisServer) -> Option<(String, u64)> {
    let raw = redis.cmd::<Option<String>>(&["HGET", "rl:control", "plan:ip"])?;
    let p: Vec<&str> = raw.split(' ').collect();
    Some((p[6].to_owned(), p[7].parse().unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_by_pid_is_replaced_within_the_lease_and_a_poll() {
    let redis = RedisServer::start();
    let spawned: Vec<_> = (0..3).map(|n| spawn(&redis, n)).collect();
    let mut fleet = Fleet(Vec::new());
    for (child, file) in spawned {
        let start = Instant::now();
        let addr = loop {
            if let Some(a) = std::fs::read_to_string(&file)
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok())
            {
                break a;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no instance");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let _ = std::fs::remove_file(&file);
        fleet.0.push((child, addr));
    }
    let pids: Vec<u32> = fleet.0.iter().map(|(c, _)| c.id()).collect();
    let (status, body) = post(
        fleet.0[0].1,
        "/api/plan",
        json!({"tier": "ip", "action": "start"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // The starter leads: its process id opens the leader's id.
    let (leader, _) = lease(&redis).unwrap();
    assert!(leader.starts_with(&format!("{}-", pids[0])), "{leader}");
    // Renewals move the beat at each of its polls.
    let b0 = lease(&redis).unwrap().1;
    tokio::time::sleep(POLL * 2 + Duration::from_millis(200)).await;
    assert!(lease(&redis).unwrap().1 > b0);

    // SIGKILL, by pid.
    let (mut killed, _) = fleet.0.remove(0);
    killed.kill().unwrap();
    killed.wait().unwrap();
    let killed_at = Instant::now();
    // The last renewal was before the kill: the lease and a poll from it,
    // and the poll's round trip.
    let bound = LEASE + POLL + Duration::from_millis(200);
    let took = loop {
        let (l, _) = lease(&redis).unwrap();
        if l != leader {
            break killed_at.elapsed();
        }
        assert!(killed_at.elapsed() < bound, "no takeover within {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (new, _) = lease(&redis).unwrap();
    assert!(
        pids[1..].iter().any(|p| new.starts_with(&format!("{p}-"))),
        "{new} is not one of {:?}",
        &pids[1..]
    );
    eprintln!("taken over {took:?} after the leader's kill");
    let entries: Vec<(String, Vec<(String, String)>)> =
        redis.cmd(&["XRANGE", "{rl:control}:rollout", "-", "+"]);
    let takeovers: Vec<&Vec<(String, String)>> = entries
        .iter()
        .map(|(_, f)| f)
        .filter(|f| f.iter().any(|(k, v)| k == "event" && v == "takeover"))
        .collect();
    assert_eq!(takeovers.len(), 1);
    assert!(takeovers[0]
        .iter()
        .any(|(k, v)| k == "instance" && *v == new));
}
