//! The rollout's Redis calls per control-key poll (`src/engine/rollout/
//! poll.rs`, `lua/poll.lua`), counted on a real redis-server with
//! `MONITOR`: three instances with a running plan (hour-long stages, one
//! of them due and held by its sample floor, so the leader ticks at every
//! poll) and a fall back guard on the tier, first without traffic, then
//! with traffic through every instance. Every top-level command an
//! instance sends on the control key or the rollout's keys
//! (`{rl:control}:…`) is grouped into polls (calls less than half a poll
//! apart); each poll is exactly one call, leader or not, with or without
//! traffic. Requests' own calls (on the layer's keys) are not counted.

use super::rollout_plan::*;
use crate::support::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tiered_ratelimit::backend::ManualClock;
use tiered_ratelimit::rollout::{FallbackGuard, PlanAction, RolloutPlan};
use tiered_ratelimit::Tier;

/// One top-level command as `MONITOR` shows it.
#[derive(Debug, Clone)]
struct Seen {
    /// Redis's clock, in s.
    at: f64,
    client: String,
    args: Vec<String>,
}

/// A `MONITOR` line's quoted arguments (escapes kept as written).
fn quoted(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut arg = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    if let Some(n) = chars.next() {
                        arg.push('\\');
                        arg.push(n);
                    }
                }
                '"' => break,
                c => arg.push(c),
            }
        }
        out.push(arg);
    }
    out
}

/// Records every top-level command (`[db addr]`; not `[db lua]`, the
/// scripts' own) until the server closes the connection.
fn monitor(redis: &RedisServer) -> Arc<Mutex<Vec<Seen>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut stream = TcpStream::connect(("127.0.0.1", redis.port())).unwrap();
    stream.write_all(b"MONITOR\r\n").unwrap();
    let out = seen.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            let Some((at, rest)) = line.trim_start_matches('+').split_once(" [") else {
                continue;
            };
            let Some((who, args)) = rest.split_once("] ") else {
                continue;
            };
            let Some(client) = who.split(' ').nth(1) else {
                continue;
            };
            if client == "lua" {
                continue;
            }
            let Ok(at) = at.parse::<f64>() else { continue };
            out.lock().unwrap().push(Seen {
                at,
                client: client.to_owned(),
                args: quoted(args),
            });
        }
    });
    seen
}

/// Whether a command is the rollout's: the poll's read of the control
/// hash, or a script call whose first key is the control hash or one of
/// the rollout's keys.
fn rollout_call(s: &Seen) -> bool {
    let name = s.args.first().map(|a| a.to_ascii_uppercase());
    match name.as_deref() {
        Some("HGETALL") => s.args.get(1).is_some_and(|k| k == "rl:control"),
        Some("EVALSHA" | "EVAL" | "FCALL") => s
            .args
            .get(3)
            .is_some_and(|k| k == "rl:control" || k.starts_with("{rl:control}")),
        _ => false,
    }
}

/// Per client, its rollout calls between Redis times `from` and `to`,
/// grouped into polls (a call more than half a poll after the one before
/// starts a new poll): each poll's calls' names.
fn polls(seen: &[Seen], from: f64, to: f64) -> BTreeMap<String, Vec<Vec<String>>> {
    let mut per: BTreeMap<String, Vec<(f64, String)>> = BTreeMap::new();
    for s in seen
        .iter()
        .filter(|s| s.at >= from && s.at < to && rollout_call(s))
    {
        per.entry(s.client.clone())
            .or_default()
            .push((s.at, s.args[0].to_ascii_uppercase()));
    }
    per.into_iter()
        .map(|(client, calls)| {
            let mut groups: Vec<Vec<String>> = Vec::new();
            let mut last = f64::MIN;
            for (at, name) in calls {
                if at - last > POLL.as_secs_f64() / 2.0 {
                    groups.push(Vec::new());
                }
                groups.last_mut().unwrap().push(name);
                last = at;
            }
            (client, groups)
        })
        .collect()
}

fn redis_time(redis: &RedisServer) -> f64 {
    let (s, us): (String, String) = redis.cmd(&["TIME"]);
    s.parse::<f64>().unwrap() + us.parse::<f64>().unwrap() / 1e6
}

/// `ip` keyed by `x-user` (1000 a minute), the recipe's plan (a floor of
/// 1 000 000 checks: a due stage holds) and a fall back guard.
fn tier() -> Tier {
    super::rollout_gates::tier(
        RolloutPlan::recipe(Duration::from_secs(3600)).min_requests(1_000_000),
    )
    .guard(FallbackGuard::shadow().bucket(Duration::from_secs(2)))
}

/// Counts over `window`: per client, (polls, calls), and the polls' sizes.
async fn count(
    redis: &RedisServer,
    seen: &Mutex<Vec<Seen>>,
    window: Duration,
) -> Vec<(usize, usize, Vec<usize>)> {
    let from = redis_time(redis);
    tokio::time::sleep(window).await;
    let to = redis_time(redis);
    // MONITOR's lines lag a little behind.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let seen = seen.lock().unwrap().clone();
    polls(&seen, from, to)
        .into_values()
        .map(|groups| {
            let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
            (groups.len(), sizes.iter().sum(), sizes)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_instance_makes_one_rollout_call_a_poll_with_a_plan_and_a_guard() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let seen = monitor(&redis);
    let nodes = [
        node_with(&redis, &clock, tier()).await,
        node_with(&redis, &clock, tier()).await,
        node_with(&redis, &clock, tier()).await,
    ];
    nodes[0]
        .handle
        .plan("ip", PlanAction::Start, "test")
        .await
        .unwrap();
    // The stage due: the leader ticks (its floor holds) at every poll.
    clock.advance(Duration::from_secs(3600));
    until(&redis, POLL + LAG, "the hold", |s| s.0 == 2).await;

    let window = POLL * 5;
    let quiet = count(&redis, &seen, window).await;
    eprintln!("without traffic, per instance (polls, calls, calls per poll): {quiet:?}");

    let stop = Arc::new(AtomicBool::new(false));
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    let traffic = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let c = client();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let res = c
                    .get(format!("http://{}/", addrs[n % addrs.len()]))
                    .header("x-user", format!("u{}", n % 50))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(res.status(), 200);
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    tokio::time::sleep(POLL).await;
    let busy = count(&redis, &seen, window).await;
    eprintln!("with traffic, per instance (polls, calls, calls per poll): {busy:?}");
    stop.store(true, Ordering::Relaxed);
    traffic.await.unwrap();

    for (what, counts) in [("without traffic", &quiet), ("with traffic", &busy)] {
        // Three instances, each polling about five times in the window,
        // each poll one call.
        assert_eq!(counts.len(), 3, "{what}: {counts:?}");
        for (polls, calls, sizes) in counts {
            assert!((4..=6).contains(polls), "{what}: {counts:?}");
            assert_eq!(calls, polls, "{what}: {counts:?}");
            assert!(sizes.iter().all(|&s| s == 1), "{what}: {counts:?}");
        }
    }
    // The leader ticked in its one call: the floor's hold is still the
    // only hold logged, and the beat moved at each of its polls.
    assert_eq!(log_events(&redis), ["start:0", "hold:0"]);
    for n in nodes {
        n.stop().await;
    }
}
