//! Redis Sentinel: a real primary, its replica and three sentinels of our
//! own; the primary is killed under HTTP load and the limiter follows the
//! failover to the promoted replica.

use crate::support::sentinel::{info, named_primary, SentinelSet, MASTER};
use crate::support::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::{ManualClock, RedisBackend, SentinelMaster};
use tiered_ratelimit::key::Global;
use tiered_ratelimit::{ConfigError, FailurePolicy, Quota, RateLimitLayer, Tier};

/// The layer's backend timeout in the failover test.
const BACKEND_TIMEOUT: Duration = Duration::from_millis(250);

/// One request of the load: when it was sent, how long it took, what came
/// back.
#[derive(Debug, Clone, Copy)]
struct Sample {
    sent: Instant,
    took: Duration,
    status: u16,
    remaining: Option<u64>,
}

/// One look at the replica: its role and how many script calls it ran.
struct Look {
    at: Instant,
    role: String,
    script_calls: u64,
    readonly_errors: u64,
    /// The primary's port as the first sentinel names it then.
    named: Option<u16>,
}

/// Requests until one is limited (a check answered within the backend
/// timeout, not passed by the failure policy): that answer, and how many
/// passed by the policy before it. Liveness: a minute.
async fn until_limited(c: &reqwest::Client, url: &str) -> (crate::support::Limits, u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut passed = 0;
    loop {
        let l = limits(&c.get(url).send().await.unwrap());
        assert_eq!(l.status, 200, "{l:?}");
        if l.remaining.is_some() {
            return (l, passed);
        }
        passed += 1;
        assert!(Instant::now() < deadline, "never limited");
    }
}

/// `calls=` of a command in an `INFO commandstats` field value.
fn calls(info: &std::collections::HashMap<String, String>, command: &str) -> u64 {
    info.get(&format!("cmdstat_{command}"))
        .and_then(|v| v.split(',').find_map(|kv| kv.strip_prefix("calls=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// `count=` of an error code in `INFO errorstats`.
fn error_count(info: &std::collections::HashMap<String, String>, code: &str) -> u64 {
    info.get(&format!("errorstat_{code}"))
        .and_then(|v| v.strip_prefix("count="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The primary is killed (SIGKILL) under four concurrent request loops,
/// `FailurePolicy::Open`, `backend_timeout` 250 ms. Asserted: no 5xx (every
/// answer is 200: limited, or passed by the failure policy while there is
/// no primary), no request waits past the backend timeout + 1 s, limiting
/// resumes on the promoted replica (on its own: liveness, given a minute,
/// as a loaded host slows the sentinels' election; about 2 s when idle),
/// and no check ever runs on a replica (the replica ran no script call
/// while it was one, and never refused one with `READONLY`). The clock is
/// a manual one that stands still: no refill blurs the charges, however
/// long a loaded host takes between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_primary_fails_over_and_limiting_resumes_on_the_promoted_replica() {
    let mut set = tokio::task::spawn_blocking(SentinelSet::start)
        .await
        .unwrap();
    let replica = set.replica.port();
    let layer = RateLimitLayer::builder()
        .backend(
            RedisBackend::sentinel(set.sentinel_urls(), MASTER)
                .unwrap()
                .with_manual_clock(ManualClock::new(T0_US))
                // The clock stands still while Redis expires keys in real time.
                .with_test_ttl_slack(Duration::from_secs(600)),
        )
        .tier(Tier::new("global", Global, Quota::per_hour(1_000_000)))
        .failure_policy(FailurePolicy::Open)
        .backend_timeout(BACKEND_TIMEOUT)
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    // The first limited answer: the first check also asks the sentinels,
    // connects and loads the library, which a loaded host can stretch past
    // the 250 ms (that request passes by the failure policy; its check may
    // still land, the clock standing still: one unit each).
    let (first, tries) = until_limited(&c, &url).await;
    assert_eq!((first.status, first.limit), (200, Some(1_000_000)));
    let left = first.remaining.unwrap();
    assert!(
        (999_999 - tries..=999_999).contains(&left),
        "{left} after {tries} answers by the failure policy"
    );
    assert!(set.primary.script_calls() >= 1, "checks run on the primary");
    assert_eq!(set.replica.script_calls(), 0, "and never on the replica");

    // The load: four request loops, every request timed.
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (c, url, stop, samples) = (c.clone(), url.clone(), stop.clone(), samples.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let sent = Instant::now();
                let (status, remaining) = match c.get(&url).send().await {
                    Ok(r) => {
                        let l = limits(&r);
                        (l.status, l.remaining)
                    }
                    Err(_) => (0, None),
                };
                samples.lock().unwrap().push(Sample {
                    sent,
                    took: sent.elapsed(),
                    status,
                    remaining,
                });
            }
        }));
    }
    // The replica, watched every 10 ms: its role and its script calls, read
    // in one INFO.
    let looks = {
        let stop = stop.clone();
        let sentinel = set.sentinel_ports()[0];
        tokio::task::spawn_blocking(move || {
            let mut looks = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let i = info(replica, "replication commandstats errorstats");
                if let Some(role) = i.get("role") {
                    looks.push(Look {
                        at: Instant::now(),
                        role: role.clone(),
                        script_calls: calls(&i, "evalsha") + calls(&i, "eval"),
                        readonly_errors: error_count(&i, "READONLY"),
                        named: named_primary(sentinel),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            looks
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    set.primary.stop();
    let killed = Instant::now();
    // Until a request sent after the kill is limited again (it can only
    // have been checked by the promoted replica), then 500 ms more.
    let mut resumed = None;
    while killed.elapsed() < Duration::from_secs(60) {
        resumed = samples
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.sent > killed && s.remaining.is_some())
            .map(|s| s.sent + s.took - killed)
            .min();
        if resumed.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    let looks = looks.await.unwrap();
    let samples = samples.lock().unwrap().clone();

    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for s in &samples {
        *statuses.entry(s.status).or_default() += 1;
    }
    let slowest = samples.iter().map(|s| s.took).max().unwrap();
    let passed = samples
        .iter()
        .filter(|s| s.sent > killed && s.remaining.is_none())
        .count();
    let promoted = looks
        .iter()
        .find(|l| l.role == "master")
        .map(|l| l.at.saturating_duration_since(killed));
    let named = looks
        .iter()
        .find(|l| l.named == Some(replica))
        .map(|l| l.at.saturating_duration_since(killed));
    eprintln!(
        "primary killed: {} requests, statuses {statuses:?}, slowest {slowest:?}; replica promoted \
         after {promoted:?}, named by the sentinels after {named:?}; limiting resumed after \
         {resumed:?}; meanwhile {passed} passed by the failure policy",
        samples.len()
    );

    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        [200],
        "no 5xx: limited, or passed by the failure policy"
    );
    // The layer stops waiting for the backend at the timeout; the second
    // on top is the HTTP round trip's share on a loaded host (a wait on
    // the dead primary without the timeout lasts until the failover).
    assert!(
        slowest <= BACKEND_TIMEOUT + Duration::from_secs(1),
        "slowest request {slowest:?}"
    );
    resumed.expect("limiting resumed within 60 s");
    assert!(passed > 0, "the outage was seen");

    // The replica was promoted, and is the primary the sentinels name.
    assert!(promoted.is_some(), "the replica was promoted");
    assert_eq!(set.named_primary(), Some(replica));
    // No check ran on the replica while it was one...
    let as_replica: Vec<&Look> = looks.iter().filter(|l| l.role == "slave").collect();
    assert!(!as_replica.is_empty());
    assert!(
        as_replica.iter().all(|l| l.script_calls == 0),
        "script calls on the replica"
    );
    // ...nor was refused there as a write to a replica, before or after.
    assert!(looks.iter().all(|l| l.readonly_errors == 0));
    assert_eq!(
        error_count(&info(replica, "errorstats"), "READONLY"),
        0,
        "a check reached the replica"
    );
    // Limiting runs on the promoted replica, with the charges it had
    // replicated before the kill and those since (the clock stands still:
    // no refill gives them back, however slow the host).
    let (after, _) = until_limited(&c, &url).await;
    assert!(after.remaining.is_some_and(|r| r < 999_999), "{after:?}");
    assert!(set.replica.script_calls() > 0);
}

#[test]
fn constructors_check_their_arguments() {
    let err = |r: Result<RedisBackend, ConfigError>| r.unwrap_err().to_string();
    assert_eq!(
        err(RedisBackend::sentinel(Vec::<String>::new(), MASTER)),
        "redis url: sentinel: at least one sentinel URL is required"
    );
    assert_eq!(
        err(RedisBackend::sentinel(["redis://127.0.0.1:26379"], "")),
        "redis url: sentinel: the master name is empty"
    );
    assert!(err(RedisBackend::sentinel(["nope://x"], MASTER))
        .starts_with("redis url: sentinel: nope://x: "));
    // Nothing connects before the first request.
    let b = RedisBackend::sentinel_with(
        ["redis://127.0.0.1:1"],
        SentinelMaster::new(MASTER).db(3).password("secret"),
    )
    .unwrap();
    assert!(!b.is_cluster());
    assert!(!format!("{b:?}").contains("secret"));
    assert!(!format!("{:?}", SentinelMaster::new("m").password("secret")).contains("secret"));
}

/// The primary is demoted by hand without its clients being closed
/// (`REPLICAOF` to its replica, made primary by `REPLICAOF NO ONE`), under
/// one request loop. The one check sent on the shared connection after the
/// demotion is refused with `READONLY`: a connection error (that request
/// passes by the failure policy; it is never an answer), the connection is
/// dropped, and no other check reaches the demoted node: the sentinels are
/// asked again (redis-rs checks the role of the node they name, and so do
/// we on our own connection) until they name the new primary, where
/// limiting resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_that_answers_readonly_is_left_for_the_new_one() {
    let set = tokio::task::spawn_blocking(SentinelSet::start)
        .await
        .unwrap();
    let (old, new) = (set.primary.port(), set.replica.port());
    let layer = RateLimitLayer::builder()
        .backend(
            RedisBackend::sentinel(set.sentinel_urls(), MASTER)
                .unwrap()
                .with_manual_clock(ManualClock::new(T0_US))
                .with_test_ttl_slack(Duration::from_secs(600)),
        )
        .tier(Tier::new("global", Global, Quota::per_hour(1_000_000)))
        .failure_policy(FailurePolicy::Open)
        .backend_timeout(BACKEND_TIMEOUT)
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    // The primary serves (the first limited answer, as above).
    let (first, tries) = until_limited(&c, &url).await;
    let left = first.remaining.unwrap();
    assert!((999_999 - tries..=999_999).contains(&left), "{left}");

    let _: String = set.replica.cmd(&["REPLICAOF", "NO", "ONE"]);
    let _: String = set
        .primary
        .cmd(&["REPLICAOF", "127.0.0.1", &new.to_string()]);
    let demoted = Instant::now();
    let mut seen = Vec::new();
    let mut failover = None;
    while demoted.elapsed() < Duration::from_secs(15) {
        let l = limits(&c.get(&url).send().await.unwrap());
        seen.push(l);
        if l.remaining.is_some() {
            break;
        }
        // The sentinels would take 20 s to deem a primary that says it is
        // a replica down (down-after + two INFO periods): tell one to fail
        // over now, once the demoted node has been left for 500 ms.
        if failover.is_none() && demoted.elapsed() > Duration::from_millis(500) {
            let port = set.sentinel_ports()[0];
            let ok: String =
                crate::support::cluster::node_cmd(port, &["SENTINEL", "FAILOVER", MASTER])
                    .expect("SENTINEL FAILOVER");
            assert_eq!(ok, "OK");
            failover = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let failover = failover.expect("a failover was asked for");
    eprintln!(
        "primary demoted: {} requests passed by the failure policy; limiting resumed {:?} after \
         SENTINEL FAILOVER",
        seen.len() - 1,
        failover.elapsed()
    );
    assert!(seen.iter().all(|l| l.status == 200), "{seen:?}");
    assert_eq!(seen[0].remaining, None, "READONLY is no answer");
    assert!(seen.last().unwrap().remaining.is_some(), "limiting resumed");
    assert_eq!(
        error_count(&info(old, "errorstats"), "READONLY"),
        1,
        "one check refused by the demoted node, then no other sent there"
    );
    assert_eq!(set.named_primary(), Some(new));
}
