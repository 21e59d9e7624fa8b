//! Redis Cluster: a real 3-primary cluster of our own (with replicas where
//! a test needs them), the limiter through HTTP with exact headers, all or
//! nothing across hash slots (optimistic charge + refund), concurrency
//! exactness across app servers, NOSCRIPT per node, failover.

use crate::support::algorithms::{
    algorithm_limits_without, listed_twice_ops, quota_change_sets, script_args as encode,
    script_spec, Model, Outcomes, S,
};
use crate::support::algorithms_http as scenario;
use crate::support::cluster::{calls, failed_calls, RedisCluster};
use crate::support::rng::Rng;
use crate::support::*;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tiered_ratelimit::algorithm::Limit;
use tiered_ratelimit::backend::{Backend, ManualClock, RedisBackend, TierCheck};
use tiered_ratelimit::key::{ClientIp, Global, User};
use tiered_ratelimit::{
    rollout::Mode, Algorithm, FailurePolicy, LeakyBucket, Quota, RateLimitLayer,
    RateLimitLayerBuilder, Tier,
};

const W: Duration = Duration::from_secs(10);

/// The Redis key of a layer key in a cluster (the whole key is the hash tag).
fn ckey(key: &str) -> String {
    format!("{{{key}}}")
}

/// A scenario on a shared cluster: its own manual clock and key prefix.
struct Scn<'a> {
    cluster: &'a RedisCluster,
    clock: ManualClock,
    prefix: String,
}

impl<'a> Scn<'a> {
    fn new(cluster: &'a RedisCluster, prefix: &str) -> Self {
        Scn {
            cluster,
            clock: ManualClock::new(T0_US),
            prefix: prefix.to_owned(),
        }
    }

    fn backend(&self) -> RedisBackend {
        RedisBackend::cluster(self.cluster.urls())
            .expect("cluster urls")
            .with_manual_clock(self.clock.clone())
            // The clock stands still while Redis expires keys in real time.
            .with_test_ttl_slack(Duration::from_secs(600))
    }

    fn builder(&self) -> RateLimitLayerBuilder {
        RateLimitLayer::builder()
            .backend(self.backend())
            .key_prefix(self.prefix.as_str())
            .docs_url("https://example.com/docs/rate-limits")
            .backend_timeout(Duration::from_secs(2))
    }

    /// The Redis key of `<prefix>:<rest>`.
    fn key(&self, rest: &str) -> String {
        ckey(&format!("{}:{rest}", self.prefix))
    }
}

/// A backend timeout for the tests about correctness while the cluster
/// changes (failover, resharding): far above any round trip and above the
/// router's retry budget (16 attempts, about 2 s of back-off), so a loaded
/// host does not turn a slow check into a failure-policy answer; a check
/// that ends in an error then has been refused everywhere it was sent
/// (nothing ran), and a hang still fails the test.
const PATIENT: Duration = Duration::from_secs(30);

/// A client that waits longer than [`PATIENT`] (a hang detector).
fn patient_client() -> reqwest::Client {
    client_builder()
        .timeout(PATIENT + Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Waits until `answered` reaches `n` (a load's requests answered), so a
/// change to the cluster starts under load however slow the host is.
async fn until_answered(answered: &AtomicUsize, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while answered.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "the load never got going");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn get(c: &reqwest::Client, url: &str) -> Limits {
    limits(&c.get(url).send().await.expect("request"))
}

async fn get_as(c: &reqwest::Client, url: &str, user: &str) -> Limits {
    let res = c
        .get(url)
        .header("authorization", format!("Bearer {user}"))
        .send()
        .await
        .expect("request");
    limits(&res)
}

// ---------------------------------------------------------------------------
// Exact headers through HTTP (single-slot requests), manual clock.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_headers_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    burst_then_deny_then_refill(Scn::new(&cluster, "burst")).await;
    // The scenarios of tests/algorithms/algorithms_http.rs, each on its own prefix.
    let s = Scn::new(&cluster, "fixed");
    scenario::fixed_window(s.builder(), &s.clock).await;
    let s = Scn::new(&cluster, "calendar");
    scenario::calendar_day(s.builder(), &s.clock).await;
    let s = Scn::new(&cluster, "log");
    scenario::sliding_window_log(s.builder(), &s.clock).await;
    let s = Scn::new(&cluster, "counter");
    scenario::sliding_window_counter(s.builder(), &s.clock).await;
    let s = Scn::new(&cluster, "police");
    scenario::leaky_bucket_police(s.builder(), &s.clock).await;
    let s = Scn::new(&cluster, "shape");
    scenario::leaky_bucket_shape_delays_then_rejects(s.builder()).await;
    let s = Scn::new(&cluster, "weighted");
    scenario::weighted_and_oversized_costs(s.builder()).await;
}

async fn burst_then_deny_then_refill(s: Scn<'_>) {
    let layer = s
        .builder()
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(3)))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    assert_eq!(get(&c, &url).await, ok(3, 2, T0_S + 20));
    assert_eq!(get(&c, &url).await, ok(3, 1, T0_S + 40));
    assert_eq!(get(&c, &url).await, ok(3, 0, T0_S + 60));
    let res = c.get(&url).send().await.unwrap();
    assert_eq!(limits(&res), denied(3, 0, T0_S + 20, 20));
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"error":"rate_limit_exceeded","retry_after":20,"docs":"https://example.com/docs/rate-limits"}"#
    );
    s.clock.advance(Duration::from_micros(19_999_999));
    assert_eq!(get(&c, &url).await, denied(3, 0, T0_S + 20, 1));
    s.clock.advance(Duration::from_micros(1));
    assert_eq!(get(&c, &url).await, ok(3, 0, T0_S + 80));
    s.clock.advance(Duration::from_secs(3600));
    let now = T0_S + 20 + 3600;
    assert_eq!(get(&c, &url).await, ok(3, 2, now + 20));
    // One key, hash-tagged, on the node that owns its slot.
    let key = s.key("ip:127.0.0.1");
    assert_eq!(s.cluster.get(&key).as_deref(), Some("1700003640000000"));
}

// ---------------------------------------------------------------------------
// All or nothing across slots.

/// A user whose `user` tier key is served by another primary than `other`.
fn user_on_another_node(s: &Scn<'_>, tier: &str, other: &str) -> String {
    let other_node = s.cluster.primary_of(other);
    (0..100)
        .map(|i| format!("user{i}"))
        .find(|u| s.cluster.primary_of(&s.key(&format!("{tier}:{u}"))) != other_node)
        .expect("a user key on another node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denial_on_one_slot_leaves_the_others_untouched() {
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "aon");
    let global = s.key("global:all");
    let alice = user_on_another_node(&s, "user", &global);
    let user_key = s.key(&format!("user:{alice}"));
    assert_ne!(cluster.keyslot(&global), cluster.keyslot(&user_key));
    assert_ne!(cluster.primary_of(&global), cluster.primary_of(&user_key));

    let layer = s
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(100)))
        .tier(Tier::new("user", User, Quota::per_minute(2)))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    assert_eq!(get_as(&c, &url, &alice).await, ok(2, 1, T0_S + 30));
    assert_eq!(get_as(&c, &url, &alice).await, ok(2, 0, T0_S + 60));
    let before = cluster.get(&global);
    assert_eq!(before.as_deref(), Some("1700000001200000"));
    for _ in 0..3 {
        assert_eq!(get_as(&c, &url, &alice).await, denied(2, 0, T0_S + 30, 30));
        // Charged optimistically on the global slot, refunded before the 429.
        assert_eq!(cluster.get(&global), before);
    }
    // The denied requests took nothing from the global tier: 100 - 2.
    assert_eq!(get(&c, &url).await, ok(100, 97, T0_S + 2));
    assert_eq!(cluster.get(&global).as_deref(), Some("1700000001800000"));
    assert_eq!(cluster.get(&user_key).as_deref(), Some("1700000060000000"));

    // The other way round: the global tier denies, a user's key is never
    // created (charged, then deleted by the refund: a full bucket is no key).
    let s2 = Scn::new(&cluster, "aon2");
    let layer = s2
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(1)))
        .tier(Tier::new("user", User, Quota::per_minute(5)))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    assert_eq!(get_as(&c, &url, "carol").await, ok(1, 0, T0_S + 60));
    for u in ["dave", "erin", "frank", "grace"] {
        assert_eq!(get_as(&c, &url, u).await, denied(1, 0, T0_S + 60, 60));
        assert!(!cluster.exists(&s2.key(&format!("user:{u}"))), "{u}");
    }
    assert_eq!(
        cluster.keys(),
        vec![
            global.clone(),
            s2.key("global:all"),
            s2.key("user:carol"),
            user_key.clone(),
        ]
        .into_iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect::<Vec<_>>()
    );
}

/// A cross-slot refund that lands is not reported as failed. The refund
/// answers one integer; it was read as the check's list, so every refund
/// was logged "cross-slot refund failed" (and counted) although Redis had
/// applied it. One thread (the current-thread runtime runs the server and
/// the backend's calls too), so the thread's log subscriber sees every
/// event; the first failure in a second is always logged.
#[tokio::test]
async fn a_cross_slot_refund_that_lands_is_not_reported_as_failed() {
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "refund_ok");
    let global = s.key("global:all");
    let alice = user_on_another_node(&s, "user", &global);
    let log = LogBuf::default();
    let _log = tracing::subscriber::set_default(log.subscriber(tracing::Level::WARN));
    let layer = s
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(100)))
        .tier(Tier::new("user", User, Quota::per_minute(1)))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    assert_eq!(get_as(&c, &url, &alice).await, ok(1, 0, T0_S + 60));
    let before = cluster.get(&global);
    assert_eq!(get_as(&c, &url, &alice).await, denied(1, 0, T0_S + 60, 60));
    // The refund landed ...
    assert_eq!(cluster.get(&global), before);
    // ... and nothing says otherwise.
    let text = log.text();
    assert!(!text.contains("refund failed"), "{text}");
}

/// Every algorithm as the tier that is charged and then refunded: after
/// denials on another slot its stored value is exactly what it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_restore_every_algorithm_exactly() {
    let cluster = RedisCluster::start(0);
    let algorithms = [
        ("fixed", Algorithm::FixedWindow),
        ("log", Algorithm::SlidingWindowLog),
        ("counter", Algorithm::SlidingWindowCounter),
        ("bucket", Algorithm::TokenBucket),
        ("police", Algorithm::LeakyBucket(LeakyBucket::Police)),
        (
            "shape",
            Algorithm::LeakyBucket(LeakyBucket::Shape {
                max_delay: Duration::from_secs(60),
            }),
        ),
    ];
    let c = client();
    for (name, algorithm) in algorithms {
        let s = Scn::new(&cluster, &format!("rf-{name}"));
        let victim = s.key("victim:all");
        let gate_user = user_on_another_node(&s, "gate", &victim);
        let layer = s
            .builder()
            .tier(Tier::new("victim", Global, Quota::new(50, W)).algorithm(algorithm))
            .tier(Tier::new("gate", User, Quota::per_minute(1)))
            .build()
            .unwrap();
        let url = format!("http://{}/", serve(app(layer)).await);
        // Two admitted (one through the gate), at two instants.
        assert_eq!(get(&c, &url).await.status, 200, "{name}");
        s.clock.advance(Duration::from_millis(1500));
        assert_eq!(get_as(&c, &url, &gate_user).await.status, 200, "{name}");
        let snapshot = |key: &str| -> (Option<String>, Vec<String>) {
            let t: String = cluster.cmd_for_key(key, &["TYPE", key]);
            if t == "zset" {
                let members: Vec<String> =
                    cluster.cmd_for_key(key, &["ZRANGE", key, "0", "-1", "WITHSCORES"]);
                (None, members)
            } else {
                (cluster.get(key), Vec::new())
            }
        };
        let before = snapshot(&victim);
        assert!(before.0.is_some() || !before.1.is_empty(), "{name}");
        for _ in 0..3 {
            assert_eq!(get_as(&c, &url, &gate_user).await.status, 429, "{name}");
            assert_eq!(snapshot(&victim), before, "{name}: refund not exact");
        }
        // And the headers go on as if the denials never happened.
        let l = get(&c, &url).await;
        assert_eq!(l.status, 200, "{name}");
        assert_eq!(l.limit, Some(50), "{name}");
    }
}

/// A shadow tier that would deny on one slot does not block charging the
/// enforced tier on another, and nothing is refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_denial_on_one_slot_charges_the_others() {
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "shadow");
    let global = s.key("global:all");
    let alice = user_on_another_node(&s, "user", &global);
    let layer = s
        .builder()
        .tier(Tier::new("global", Global, Quota::per_minute(100)))
        .tier(Tier::new("user", User, Quota::per_minute(1)).mode(Mode::Shadow))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    for _ in 0..4 {
        assert_eq!(get_as(&c, &url, &alice).await.status, 200);
    }
    // 4 charged on the enforced tier; the shadow tier admitted one.
    assert_eq!(cluster.get(&global).as_deref(), Some("1700000002400000"));
    assert_eq!(
        cluster.get(&s.key(&format!("user:{alice}"))).as_deref(),
        Some("1700000060000000")
    );
}

// ---------------------------------------------------------------------------
// Model agreement across slots: with the charge and its refund at the same
// instant, the cluster decides exactly as one atomic all-or-nothing check.

/// The shared algorithm table without `fixed` (the odd window covers it).
fn limits_list() -> Vec<(&'static str, Limit)> {
    algorithm_limits_without("fixed")
}

/// A manual clock, and a backend on `cluster` whose scripts read it.
fn on_a_manual_clock(cluster: &RedisCluster) -> (ManualClock, Backend) {
    let clock = ManualClock::new(T0_US + 123_457);
    let backend = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    (clock, backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_slot_checks_agree_with_the_model() {
    let cluster = RedisCluster::start(0);
    let (clock, backend) = on_a_manual_clock(&cluster);
    let all = limits_list();
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    let (mut cross, mut denied, mut total) = (0, 0, 0);
    for (i, (na, a)) in all.iter().enumerate() {
        for (j, (nb, b)) in all.iter().enumerate() {
            let mut model = Model::default();
            for op in 0..50 {
                let step = match rng.next() % 4 {
                    0 => 0,
                    1 => rng.next() % 300_000,
                    _ => rng.next() % 2_000_000,
                };
                clock.advance(Duration::from_micros(step));
                let now = clock.now_us();
                let key = rng.next() % 3;
                let cost = 1 + rng.next() % 3;
                let checks = vec![
                    TierCheck {
                        key: format!("m{i}{j}:a:k{key}"),
                        limit: *a,
                        cost,
                        home: None,
                    },
                    TierCheck {
                        key: format!("m{i}{j}:b:all"),
                        limit: *b,
                        cost: 1,
                        home: None,
                    },
                ];
                if cluster.keyslot(&ckey(&checks[0].key)) != cluster.keyslot(&ckey(&checks[1].key))
                {
                    cross += 1;
                }
                let want = model.check(&checks, now);
                let got = backend.check(checks).await.unwrap();
                assert_eq!(got.now_us, now);
                assert_eq!(got.decisions, want, "{na}×{nb} diverged at op {op}");
                total += 1;
                if !want.iter().all(|d| d.allowed) {
                    denied += 1;
                }
            }
        }
    }
    eprintln!("{total} checks, {cross} across slots, {denied} denied");
    assert!(cross > total * 9 / 10, "{cross} of {total} across slots");
    assert!(denied > total / 10 && denied < total * 9 / 10, "{denied}");
}

/// Quota changes on a cluster: two tiers on keys of different slots, each
/// changing among the quotas of a set (tests/support/algorithms.rs,
/// `quota_change_sets`: the first the configured one, sent as `home` for
/// the others) between random requests and clock steps. Each key's used
/// capacity carries over on the per-slot calls as in the model, and a
/// slot charged while the other denied is refunded on the new quota's
/// terms (docs/rollout.md, "A quota change").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_changes_agree_with_the_model() {
    let cluster = RedisCluster::start(0);
    let (clock, backend) = on_a_manual_clock(&cluster);
    let mut rng = Rng::new(0x2545_F491_4F6C_DD1D);
    let (mut cross, mut denied, mut total) = (0, 0, 0);
    for (n, set) in quota_change_sets().iter().enumerate() {
        let mut model = Model::default();
        for op in 0..150 {
            let step = match rng.next() % 4 {
                0 => 0,
                1 => rng.next() % 300_000,
                2 => rng.next() % 3_000_000,
                _ => rng.next() % 40_000_000,
            };
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let tier = |name: &str, q: u64, cost| {
                let limit = set[usize::try_from(q).unwrap() % set.len()];
                TierCheck {
                    key: format!("q{n}:{name}"),
                    limit,
                    cost,
                    home: (limit != set[0]).then_some(set[0]),
                }
            };
            let checks = vec![
                tier("a:k", rng.next(), 1 + rng.next() % 2),
                tier("b:all", rng.next(), 1),
            ];
            if cluster.keyslot(&ckey(&checks[0].key)) != cluster.keyslot(&ckey(&checks[1].key)) {
                cross += 1;
            }
            let want = model.check(&checks, now);
            let got = backend.check(checks).await.unwrap();
            assert_eq!(got.decisions, want, "set {n} diverged at op {op}");
            total += 1;
            if !want.iter().all(|d| d.allowed) {
                denied += 1;
            }
        }
    }
    eprintln!("{total} checks, {cross} across slots, {denied} denied");
    assert!(cross > total / 2, "{cross} of {total} across slots");
    assert!(denied > total / 10 && denied < total * 9 / 10, "{denied}");
}

/// A key listed twice in one check (a `Backend::check` caller's list), beside
/// a key of another slot: each listing decided on the state before the
/// check, each charged in turn (the repeat flag, lua/dispatch.lua), as the
/// model; on the cluster's per-slot calls as on a single Redis
/// (tests/algorithms/algorithms.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_listed_twice_agrees_with_the_model() {
    let cluster = RedisCluster::start(0);
    let (clock, backend) = on_a_manual_clock(&cluster);
    let mut rng = Rng::new(0x2545_F491_4F6C_DD1D);
    let mut next = || rng.next();
    for (i, (name, limit)) in limits_list().into_iter().enumerate() {
        let mut model = Model::default();
        let mut outcomes = Outcomes::default();
        let ops = listed_twice_ops(&mut next, &format!("twice{i}"), limit, 150, true);
        for (op, (step, checks)) in ops.into_iter().enumerate() {
            clock.advance(Duration::from_micros(step));
            let want = model.check(&checks, clock.now_us());
            let got = backend.check(checks).await.unwrap();
            assert_eq!(got.decisions, want, "{name} diverged at op {op}");
            outcomes.note(&want);
        }
        outcomes.assert_both(name);
    }
}

// ---------------------------------------------------------------------------
// A refund never frees more than the charge took, whatever happened between
// the charge and the refund (refill, new windows, other requests). Driven
// directly through the cluster script on a single redis-server.

const CLUSTER_SCRIPT: &str = concat!(
    // The head every script has (`script!` in src/backend/redis/wire/mod.rs).
    "local redis, string, math, table, tonumber, tostring, type, unpack, pairs, ipairs = ",
    "redis, string, math, table, tonumber, tostring, type, unpack, pairs, ipairs\n",
    "local rcall, floor, format = redis.call, math.floor, string.format\n",
    include_str!("../../lua/common.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/calendar.lua"),
    include_str!("../../lua/sliding_window_log.lua"),
    include_str!("../../lua/sliding_window_counter.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/leaky_bucket.lua"),
    include_str!("../../lua/concurrency.lua"),
    include_str!("../../lua/penalty.lua"),
    include_str!("../../lua/override.lua"),
    include_str!("../../lua/refund.lua"),
    include_str!("../../lua/dispatch.lua"),
    include_str!("../../lua/cluster.lua"),
);

struct Lua {
    conn: redis::Connection,
}

impl Lua {
    fn clock(now: u64) -> String {
        format!("{now}:600000")
    }

    /// The first tier's (allowed, remaining) in a check reply (see
    /// src/backend/redis/wire/mod.rs: `r` is remaining when allowed,
    /// `-(remaining + 1)` when denied).
    fn first_tier(r: &[i64]) -> (bool, u64) {
        if r[1] >= 0 {
            (true, r[1] as u64)
        } else {
            (false, (-(r[1] + 1)) as u64)
        }
    }

    /// Check (and charge if allowed) `cost` on `key`: (decision fields, undo).
    fn charge(&mut self, key: &str, limit: &Limit, now: u64, cost: u64) -> (bool, u64, i64) {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(CLUSTER_SCRIPT)
            .arg(1)
            .arg(key)
            .arg("check")
            .arg(Self::clock(now))
            // flags: the undo value, as the cluster backend asks
            .arg(script_spec(limit, cost, 2));
        let r: Vec<i64> = cmd.query(&mut self.conn).unwrap();
        let (allowed, remaining) = Self::first_tier(&r);
        // The trailer (tier 1, delay, undo) when the undo is not 0.
        let undo = if r.len() == 7 { r[6] } else { 0 };
        (allowed, remaining, undo)
    }

    fn refund(
        &mut self,
        key: &str,
        limit: &Limit,
        now: u64,
        charged_at: u64,
        cost: u64,
        undo: i64,
    ) {
        // The refund layout (src/backend/redis/wire/args.rs, refund_args):
        // a bucket's p4 is its home suffix, 0 at the configured quota (the
        // leaky bucket's maximum delay is not sent).
        let mut args = encode(limit);
        if args[0] == 5 {
            args[4] = 0;
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(CLUSTER_SCRIPT)
            .arg(1)
            .arg(key)
            .arg("refund")
            .arg(Self::clock(now))
            .arg(&args[..])
            .arg(cost)
            .arg(charged_at)
            .arg(undo);
        let n: i64 = cmd.query(&mut self.conn).unwrap();
        assert_eq!(n, 1);
    }

    /// The decision for `cost` on `key` without charging (an enforced tier
    /// that can never pass rides along).
    fn probe(&mut self, key: &str, limit: &Limit, now: u64, cost: u64) -> (bool, u64) {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(CLUSTER_SCRIPT)
            .arg(2)
            .arg(key)
            .arg("never")
            .arg("check")
            .arg(Self::clock(now))
            .arg(script_spec(limit, cost, 0))
            .arg("1 1 1000000 0 0 2 0");
        let r: Vec<i64> = cmd.query(&mut self.conn).unwrap();
        // The second tier (r at index 4) is enforced and denies.
        assert!(r[4] < 0, "a probe never commits");
        Self::first_tier(&r)
    }
}

#[test]
fn a_refund_never_frees_more_than_its_charge() {
    let redis = RedisServer::start();
    let mut lua = Lua {
        conn: redis::Client::open(redis.url())
            .unwrap()
            .get_connection()
            .unwrap(),
    };
    let mut rng = Rng::new(0xD1B5_4A32_D192_ED03);
    let (mut exact, mut absorbed, mut trials) = (0, 0, 0);
    for (name, limit) in limits_list() {
        let cap = limit.capacity();
        for trial in 0..80 {
            let (x, y) = (format!("x:{name}:{trial}"), format!("y:{name}:{trial}"));
            let mut now = T0_US + rng.next() % (10 * S);
            // The same admitted history on both keys.
            for _ in 0..rng.next() % 6 {
                now += rng.next() % 1_500_000;
                let cost = 1 + rng.next() % cap;
                let (ax, rx, _) = lua.charge(&x, &limit, now, cost);
                if ax {
                    let (ay, ry, _) = lua.charge(&y, &limit, now, cost);
                    assert!(ay && ry == rx, "{name}: histories diverged");
                } else {
                    assert!(!lua.probe(&y, &limit, now, cost).0);
                }
            }
            // The charge that will be refunded: on x only.
            now += rng.next() % 1_000_000;
            let cost = 1 + rng.next() % cap;
            let (allowed, _, undo) = lua.charge(&x, &limit, now, cost);
            if !allowed {
                continue;
            }
            let charged_at = now;
            // Time and other requests between the charge and its refund
            // (admitted on y too whenever x admits them).
            let quiet = rng.next().is_multiple_of(3);
            if !quiet {
                for _ in 0..rng.next() % 4 {
                    now += rng.next() % 2_000_000;
                    let c = 1 + rng.next() % cap;
                    if lua.charge(&x, &limit, now, c).0 {
                        assert!(
                            lua.charge(&y, &limit, now, c).0,
                            "{name}: y denied what x took"
                        );
                    }
                }
                now += rng.next() % 3_000_000;
            }
            lua.refund(&x, &limit, now, charged_at, cost, undo);
            trials += 1;
            // From now on x must never admit what y would not.
            let mut same = true;
            let mut t = now;
            for _ in 0..4 {
                for q in 1..=cap {
                    let (ax, rx) = lua.probe(&x, &limit, t, q);
                    let (ay, ry) = lua.probe(&y, &limit, t, q);
                    assert!(
                        (!ax || ay) && (ax != ay || rx <= ry),
                        "{name} trial {trial}: after the refund x admits more than y \
                         (cost {q} at +{} µs: x {ax}/{rx}, y {ay}/{ry})",
                        t - now
                    );
                    same &= ax == ay && rx == ry;
                }
                t += rng.next() % 2_000_000;
            }
            if quiet {
                assert!(
                    same,
                    "{name} trial {trial}: an immediate refund must be exact"
                );
            }
            if same {
                exact += 1;
            } else {
                absorbed += 1;
            }
        }
    }
    eprintln!("{trials} refunds: {exact} exact, {absorbed} partly absorbed by refill or windows");
    assert!(trials > 200);
}

// ---------------------------------------------------------------------------
// Concurrency: two app servers, one key, exactly the quota.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_app_servers_admit_exactly_the_quota() {
    let cluster = RedisCluster::start(0);
    let c = client();
    for round in 0..20 {
        let prefix = format!("conc{round}");
        let mk = || {
            RateLimitLayer::builder()
                .backend(RedisBackend::cluster(cluster.urls()).unwrap())
                .key_prefix(prefix.as_str())
                .tier(Tier::new("global", Global, Quota::per_hour(50)))
                .backend_timeout(Duration::from_secs(10))
                .build()
                .unwrap()
        };
        let a = serve(app(mk())).await;
        let b = serve(app(mk())).await;
        let (ok_count, limited) = burst(&c, [a, b], 200, None).await;
        assert_eq!((ok_count, limited), (50, 350), "round {round}");
    }
}

/// Cross-slot under concurrency: the user tier admits exactly its quota and
/// every one of the 350 refunds on the global slot is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_cross_slot_denials_are_all_refunded() {
    let cluster = RedisCluster::start(0);
    let c = client();
    for round in 0..3 {
        let s = Scn::new(&cluster, &format!("xconc{round}"));
        let global = s.key("global:all");
        let alice = user_on_another_node(&s, "user", &global);
        let mk = || {
            s.builder()
                .backend_timeout(Duration::from_secs(10))
                .tier(Tier::new("global", Global, Quota::per_hour(1000)))
                .tier(Tier::new("user", User, Quota::per_hour(50)))
                .build()
                .unwrap()
        };
        let a = serve(app(mk())).await;
        let b = serve(app(mk())).await;
        let (ok_count, limited) = burst(&c, [a, b], 200, Some(&alice)).await;
        assert_eq!((ok_count, limited), (50, 350), "round {round}");
        // 950 tokens of 3 600 000 units each: only the 50 admitted remain charged.
        assert_eq!(
            cluster.get(&global).as_deref(),
            Some("1700000180000000"),
            "round {round}"
        );
    }
}

/// `per_server` concurrent requests to each server; (200s, 429s).
async fn burst(
    c: &reqwest::Client,
    servers: [std::net::SocketAddr; 2],
    per_server: usize,
    user: Option<&str>,
) -> (usize, usize) {
    let mut handles = Vec::new();
    for i in 0..2 * per_server {
        let mut r = c.get(format!("http://{}/", servers[i % 2]));
        if let Some(u) = user {
            r = r.header("authorization", format!("Bearer {u}"));
        }
        handles.push(tokio::spawn(async move {
            r.send().await.unwrap().status().as_u16()
        }));
    }
    let (mut ok_count, mut limited) = (0, 0);
    for h in handles {
        match h.await.unwrap() {
            200 => ok_count += 1,
            429 => limited += 1,
            s => panic!("unexpected status {s}"),
        }
    }
    (ok_count, limited)
}

// ---------------------------------------------------------------------------
// One round trip: the per-slot calls are sent together.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_slot_calls_are_sent_concurrently() {
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "rt");
    let global = s.key("global:all");
    let alice = user_on_another_node(&s, "user", &global);
    let (g_node, u_node) = (
        cluster.primary_of(&global),
        cluster.primary_of(&s.key(&format!("user:{alice}"))),
    );
    // The user tier first: a sequential implementation would wait on it
    // before sending anything to the global tier's node.
    // The frozen node's call waits for the backend timeout: longer than
    // the wait below for the other node's call, so a sequential sender
    // would still be stuck on the first when that wait ends.
    let layer = s
        .builder()
        .backend_timeout(PATIENT)
        .tier(Tier::new("user", User, Quota::per_minute(10)))
        .tier(Tier::new("global", Global, Quota::per_minute(100)))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = patient_client();
    // Warm up (connections, topology, script cache on both nodes).
    assert_eq!(get_as(&c, &url, &alice).await, ok(10, 9, T0_S + 6));
    let sent_before = calls(g_node, "evalsha");

    cluster.signal(u_node, "-STOP");
    let pending = tokio::spawn({
        let c = c.clone();
        let url = url.clone();
        let alice = alice.clone();
        async move { get_as(&c, &url, &alice).await }
    });
    // Liveness slack for a loaded host, well inside the backend timeout:
    // concurrent calls reach the global node within milliseconds, a
    // sequential sender never before the frozen node answers.
    let deadline = Instant::now() + Duration::from_secs(10);
    while calls(g_node, "evalsha") == sent_before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reached_global = calls(g_node, "evalsha") > sent_before;
    cluster.signal(u_node, "-CONT");
    assert!(
        reached_global,
        "the global slot's call waited for the frozen user slot"
    );
    assert_eq!(pending.await.unwrap(), ok(10, 8, T0_S + 12));
}

// ---------------------------------------------------------------------------
// NOSCRIPT: reloaded on the node that lost the script, and only there.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noscript_is_handled_on_that_node_only() {
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "ns");
    let layer = s
        .builder()
        .tier(Tier::new("global", Global, Quota::per_hour(100)))
        .failure_policy(FailurePolicy::Closed)
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    let node = cluster.primary_of(&s.key("global:all"));
    let others: Vec<u16> = cluster
        .primaries()
        .into_iter()
        .filter(|p| *p != node)
        .collect();
    // First request: the node has never seen the script.
    assert_eq!(get(&c, &url).await, ok(100, 99, T0_S + 36));
    assert_eq!(failed_calls(node, "evalsha"), 1);
    assert_eq!(calls(node, "eval"), 1);
    for p in cluster.primaries() {
        assert_eq!(calls(p, "script|load"), 0, "node {p}");
    }
    assert_eq!(get(&c, &url).await, ok(100, 98, T0_S + 72));
    assert_eq!(calls(node, "eval"), 1, "cached after one EVAL");

    cluster.cmd_for_key::<()>(&s.key("global:all"), &["SCRIPT", "FLUSH"]);
    for want in [97, 96] {
        assert_eq!(get(&c, &url).await.remaining, Some(want), "no 503");
    }
    assert_eq!(failed_calls(node, "evalsha"), 2);
    assert_eq!(calls(node, "eval"), 2);
    for p in others {
        assert_eq!(
            calls(p, "eval") + calls(p, "evalsha") + calls(p, "script|load"),
            0
        );
    }
}

// ---------------------------------------------------------------------------
// deadpool-redis cluster pool: one shared connection.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadpool_cluster_pool_backend() {
    let cluster = RedisCluster::start(0);
    let pool = deadpool_redis::cluster::Config::from_urls(cluster.urls())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let clock = ManualClock::new(T0_US);
    let layer = RateLimitLayer::builder()
        .backend(RedisBackend::from_cluster_pool(pool.clone()).with_manual_clock(clock))
        .key_prefix("dp")
        .tier(Tier::new("global", Global, Quota::per_minute(2)))
        .tier(Tier::new("user", User, Quota::per_minute(5)))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    assert_eq!(get_as(&c, &url, "zoe").await, ok(2, 1, T0_S + 30));
    assert_eq!(get_as(&c, &url, "zoe").await, ok(2, 0, T0_S + 60));
    assert_eq!(get_as(&c, &url, "zoe").await, denied(2, 0, T0_S + 30, 30));
    // One cluster connection taken out of the pool (`Connection::take`) and
    // shared: no checkout per request, no new sockets per request.
    assert_eq!(pool.status().size, 0);
    let clients = || -> Vec<usize> {
        cluster
            .primaries()
            .into_iter()
            .map(|p| {
                let list: String =
                    crate::support::cluster::node_cmd(p, &["CLIENT", "LIST"]).unwrap();
                list.lines().count() - 1 // this CLIENT LIST itself
            })
            .collect()
    };
    let before = clients();
    for u in ["ann", "ben", "cat", "dan", "eve", "fay"] {
        get_as(&c, &url, u).await;
    }
    assert_eq!(clients(), before);
    assert!(before.iter().all(|&n| n <= 2), "{before:?}");
    eprintln!("client connections per primary: {before:?}");
    assert!(cluster.exists("{dp:user:zoe}"));
    assert_eq!(
        cluster.get("{dp:user:zoe}").as_deref(),
        Some("1700000024000000")
    );
}

// ---------------------------------------------------------------------------
// Failover.

/// `CLUSTER FAILOVER` on the replica of the primary holding the key, under
/// load with `FailurePolicy::Closed`: MOVED is followed, the new primary
/// gets the script by one EVAL, no request is answered 5xx, and no charge is
/// lost or doubled (manual clock: `Remaining` counts down without a gap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_failover_loses_and_doubles_nothing() {
    let cluster = Arc::new(RedisCluster::start(1));
    let s = Scn::new(&cluster, "fo");
    let key = s.key("global:all");
    let primary = cluster.primary_of(&key);
    let replica = cluster.replicas_of(primary)[0];
    let layer = s
        .builder()
        .tier(Tier::new("global", Global, Quota::per_hour(1_000_000)))
        .failure_policy(FailurePolicy::Closed)
        // Requests wait out the failover (the old primary pauses its
        // clients meanwhile), which a loaded host slows down.
        .backend_timeout(PATIENT)
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = patient_client();
    assert_eq!(get(&c, &url).await.remaining, Some(999_999));

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (c, url, stop, answered) = (c.clone(), url.clone(), stop.clone(), answered.clone());
        workers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                let l = get(&c, &url).await;
                seen.push((l, t.elapsed()));
                answered.fetch_add(1, Ordering::SeqCst);
            }
            seen
        }));
    }
    // The failover starts under load: once the loops are answered.
    until_answered(&answered, 20).await;
    let started = Instant::now();
    let cl = cluster.clone();
    tokio::task::spawn_blocking(move || cl.failover(replica))
        .await
        .unwrap();
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let statuses: BTreeSet<u16> = all.iter().map(|(l, _)| l.status).collect();
    let slowest = all.iter().map(|(_, t)| *t).max().unwrap();
    eprintln!(
        "manual failover took {took:?}; {} requests during it, statuses {statuses:?}, slowest {slowest:?}",
        all.len()
    );
    assert_eq!(statuses, BTreeSet::from([200]), "no 5xx, no fail-open");
    let mut remaining: Vec<u64> = all.iter().map(|(l, _)| l.remaining.unwrap()).collect();
    remaining.sort_unstable();
    let n = remaining.len() as u64;
    let want: Vec<u64> = (999_999 - n..999_999).collect();
    assert_eq!(remaining, want, "every charge counted exactly once");

    assert_eq!(
        cluster.primary_of(&key),
        replica,
        "the replica serves the slot"
    );
    assert!(
        calls(replica, "eval") >= 1,
        "the new primary got the script by EVAL"
    );
    for p in cluster.primaries() {
        assert_eq!(calls(p, "script|load"), 0, "node {p}");
    }
    assert_eq!(get(&c, &url).await.remaining, Some(999_998 - n));
}

/// The primary holding the key is killed: its replica takes over after the
/// node timeout. Meanwhile requests follow the failure policy (measured:
/// fail-open passes without headers, fail-closed answers 503); no other 5xx;
/// limiting resumes on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_primary_is_replaced_and_limiting_resumes() {
    let mut cluster = RedisCluster::start(1);
    let s = Scn::new(&cluster, "kill");
    let key = s.key("global:all");
    let primary = cluster.primary_of(&key);
    let replica = cluster.replicas_of(primary)[0];
    // While the node is dead a check ends when the router has spent its
    // retries on it (refused at once on loopback), so the patient timeout
    // costs the outage nothing and keeps a loaded host from failing open
    // the exact checks before and after it.
    let mk = |policy| {
        s.builder()
            .tier(Tier::new("global", Global, Quota::per_hour(1_000_000)))
            .failure_policy(policy)
            .backend_timeout(PATIENT)
            .build()
            .unwrap()
    };
    let open = format!("http://{}/", serve(app(mk(FailurePolicy::Open))).await);
    let closed = format!("http://{}/", serve(app(mk(FailurePolicy::Closed))).await);
    let c = patient_client();
    assert_eq!(get(&c, &open).await.remaining, Some(999_999));
    assert_eq!(get(&c, &closed).await.remaining, Some(999_998));
    // The replica has both charges before the kill (replication is
    // asynchronous: wait for its offset, not for a while).
    let offset = |port: u16, field: &str| -> Option<u64> {
        crate::support::cluster::info(port, "replication")
            .get(field)
            .and_then(|v| v.parse().ok())
    };
    let written = offset(primary, "master_repl_offset").expect("primary offset");
    let deadline = Instant::now() + Duration::from_secs(30);
    while offset(replica, "slave_repl_offset").is_none_or(|o| o < written) {
        assert!(Instant::now() < deadline, "the replica never caught up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    cluster.kill(primary);
    let killed = Instant::now();
    let (mut open_passed, mut closed_503, mut other) = (0, 0, Vec::new());
    let mut resumed = None;
    // Liveness: the replica takes over after the node timeout (2 s) and an
    // election, a few seconds on an idle host; a loaded one gets a minute.
    while killed.elapsed() < Duration::from_secs(60) {
        let (o, cl) = (get(&c, &open).await, get(&c, &closed).await);
        match (o.status, o.remaining) {
            (200, None) => open_passed += 1,
            (200, Some(_)) => {}
            (s, _) => other.push(s),
        }
        match cl.status {
            503 => closed_503 += 1,
            200 => {}
            s => other.push(s),
        }
        if o.remaining.is_some() && cl.remaining.is_some() {
            resumed = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "primary killed: limiting resumed after {resumed:?}; meanwhile {open_passed} fail-open passes, \
         {closed_503} fail-closed 503s"
    );
    assert!(other.is_empty(), "unexpected statuses {other:?}");
    resumed.expect("limiting resumed within 60 s");
    assert_eq!(cluster.primary_of(&key), replica);
    // The replica had both charges (replicated before the kill).
    let l = get(&c, &open).await;
    assert!(l.remaining.unwrap() <= 999_996, "{l:?}");
}

/// Every node is killed and comes back empty on the same ports: requests
/// fail open meanwhile, then the one shared cluster connection reconnects
/// by itself and each node gets the script again by one `EVAL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_cluster_restart_reconnects() {
    let mut cluster = RedisCluster::start(0);
    let (urls, clock) = (cluster.urls(), ManualClock::new(T0_US));
    let builder = |prefix: &str| {
        RateLimitLayer::builder()
            .backend(
                RedisBackend::cluster(&urls)
                    .unwrap()
                    .with_manual_clock(clock.clone())
                    .with_test_ttl_slack(Duration::from_secs(600)),
            )
            .key_prefix(prefix)
    };
    let layer = builder("rs")
        .tier(Tier::new("global", Global, Quota::per_hour(1000)))
        .failure_policy(FailurePolicy::Open)
        .backend_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = client();
    assert_eq!(get(&c, &url).await, ok(1000, 999, T0_S + 4));
    assert_eq!(get(&c, &url).await, ok(1000, 998, T0_S + 8));

    cluster.stop_all();
    // A second app whose backend first connects while the cluster is down.
    let late = builder("rs-late")
        .tier(Tier::new("global", Global, Quota::per_hour(1000)))
        .backend_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let late = format!("http://{}/", serve(app(late)).await);
    for _ in 0..3 {
        assert_eq!(get(&c, &url).await, NO_LIMITS, "fail-open while down");
        assert_eq!(get(&c, &late).await, NO_LIMITS, "fail-open while down");
    }
    cluster.restart_all();
    let back = Instant::now();
    for url in [&url, &late] {
        // A fail-open answer after the restart may be a timeout whose script
        // still ran and charged (300 ms is short on a loaded host): each
        // may have taken one token.
        let mut open = 0;
        loop {
            let l = get(&c, url).await;
            if l.remaining.is_some() {
                // No persistence: the bucket starts full again, less what
                // the timed-out checks charged (3.6 s of refill a token).
                let charged = 999 - l.remaining.unwrap_or(0);
                assert!(charged <= open, "{l:?} after {open} fail-open answers");
                assert_eq!(
                    l,
                    ok(
                        1000,
                        999 - charged,
                        T0_S + (36 * (charged + 1)).div_ceil(10)
                    )
                );
                assert_eq!(
                    get(&c, url).await,
                    ok(
                        1000,
                        998 - charged,
                        T0_S + (36 * (charged + 2)).div_ceil(10)
                    )
                );
                break;
            }
            assert_eq!(l, NO_LIMITS, "fail-open until it resumes");
            open += 1;
            // Liveness slack for a loaded host.
            assert!(
                back.elapsed() < Duration::from_secs(60),
                "limiting did not resume"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    eprintln!(
        "limiting resumed {:?} after the cluster was healthy again",
        back.elapsed()
    );
}

// ---------------------------------------------------------------------------
// Live resharding: ASK, TRYAGAIN and MOVED while keys move.

/// Slots holding live keys are moved to other primaries, key by key, as
/// `redis-cli --cluster reshard` does, while 200 requests are in flight at
/// any time (fail-closed, no deny cache: every request runs the script).
/// Each user's `user` and `pair` keys share one slot (so a slot half-moved
/// holds one of them: `TRYAGAIN`), the global tier is in another slot that
/// moves too (cross-slot charges and refunds under `ASK`). Zero 5xx, the
/// breaker never opens, each user is admitted exactly its quota with every
/// `Remaining` value once, and the keys left behind hold exactly the charges
/// of the admitted requests.
///
/// Failed before the script calls got their own router (`router.rs`): 503
/// for the 216 requests open when the first `MOVED` made redis-rs 1.8.1's
/// cluster connection wedge in `refresh_slots` (waiting for
/// `conn_lock.write()` while request futures holding read permits were not
/// polled), so it served nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_resharding_loses_and_doubles_nothing() {
    use redis::cluster_routing::Slot;
    const USERS: usize = 16;
    const QUOTA: u64 = 60;
    const GLOBAL: u64 = 1_000_000;
    let cluster = Arc::new(RedisCluster::start(0));
    let s = Scn::new(&cluster, "resh");
    // Per user a `pair` key (by the `x-pair` header) in the user key's slot.
    let users: Vec<(String, String)> = (0..USERS)
        .map(|i| {
            let u = format!("c{i}");
            let slot = Slot::for_key(s.key(&format!("user:{u}")));
            let p = (0u64..)
                .map(|j| format!("p{i}x{j}"))
                .find(|p| Slot::for_key(s.key(&format!("pair:{p}"))) == slot)
                .unwrap();
            (u, p)
        })
        .collect();
    let layer = s
        .builder()
        .tier(Tier::new("global", Global, Quota::per_hour(GLOBAL)))
        .tier(Tier::new("user", User, Quota::per_hour(QUOTA)))
        .tier(Tier::new("pair", PairKey, Quota::per_hour(2 * QUOTA)))
        .failure_policy(FailurePolicy::Closed)
        .deny_cache(0)
        // What is proved is that no request is lost, doubled or answered
        // 5xx while slots move, not how fast: the checks wait behind the
        // moves (`TRYAGAIN` until a half-moved slot is whole), and on a
        // loaded host the resharding takes seconds (10.8 s once), so a
        // short timeout would answer 503 for a slow check, not a wrong one.
        .backend_timeout(PATIENT)
        .build()
        .unwrap();
    let handle = layer.handle();
    let url = format!("http://{}/", serve(app(layer)).await);
    let c = patient_client();
    // Every key exists before its slot moves.
    for (u, p) in &users {
        assert_eq!(
            send_pair(&c, &url, u, p).await.remaining,
            Some(QUOTA - 1),
            "{u}"
        );
    }
    // The units a key is short of full: its TAT (rate 1, so in µs) less
    // the clock, which stands still at T0.
    let charged = |key: &str| -> u64 {
        let v = cluster.get(key).unwrap_or_else(|| panic!("{key} exists"));
        v.parse::<u64>().unwrap() - T0_US
    };
    let global = s.key("global:all");
    let unit_global = charged(&global) / USERS as u64;
    let unit_pair = charged(&s.key(&format!("pair:{}", users[0].1)));

    // The slots to move, each to the next primary.
    let primaries = cluster.primaries();
    let mut moves: Vec<(u16, u16)> = Vec::new();
    for key in std::iter::once(global.clone())
        .chain(users.iter().map(|(u, _)| s.key(&format!("user:{u}"))))
    {
        let slot = cluster.keyslot(&key);
        if moves.iter().any(|(s, _)| *s == slot) {
            continue;
        }
        let from = cluster.primary_of(&key);
        let i = primaries.iter().position(|p| *p == from).unwrap();
        moves.push((slot, primaries[(i + 1) % primaries.len()]));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..200 {
        let (c, url, stop, users, answered) = (
            c.clone(),
            url.clone(),
            stop.clone(),
            users.clone(),
            answered.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut i = w;
            while !stop.load(Ordering::SeqCst) {
                let (u, p) = &users[i % users.len()];
                seen.push((u.clone(), send_pair(&c, &url, u, p).await));
                answered.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
            seen
        }));
    }
    let breaker = tokio::spawn({
        let (handle, stop) = (handle.clone(), stop.clone());
        async move {
            let mut states = BTreeSet::new();
            while !stop.load(Ordering::SeqCst) {
                states.insert(handle.circuit_state());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            states
        }
    });
    // The slots move under load: once every loop has been answered.
    until_answered(&answered, 200).await;
    let started = Instant::now();
    let cl = cluster.clone();
    let moved_keys = tokio::task::spawn_blocking(move || {
        moves
            .iter()
            .map(|&(slot, to)| cl.migrate_slot(slot, to, 1, Duration::from_millis(15)))
            .sum::<usize>()
    })
    .await
    .unwrap();
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::SeqCst);
    let mut all: Vec<(String, Limits)> = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let breaker_states = breaker.await.unwrap();
    let during = all.len();
    // Then every user until its first 429, one request at a time.
    for (u, p) in &users {
        loop {
            let l = send_pair(&c, &url, u, p).await;
            let status = l.status;
            all.push((u.clone(), l));
            if status != 200 {
                break;
            }
        }
    }
    let statuses: BTreeSet<u16> = all.iter().map(|(_, l)| l.status).collect();
    let count = |s: u16| all.iter().filter(|(_, l)| l.status == s).count();
    eprintln!(
        "resharding moved {moved_keys} keys in {took:?}; {during} requests meanwhile; \
         200: {}, 429: {}, 503: {}; breaker states {breaker_states:?}",
        count(200),
        count(429),
        count(503)
    );
    assert!(moved_keys > USERS, "{moved_keys}");
    assert_eq!(
        statuses,
        BTreeSet::from([200, 429]),
        "no 5xx, nothing unlimited"
    );
    assert_eq!(
        breaker_states,
        BTreeSet::from(["closed"]),
        "the breaker never opened"
    );
    assert_eq!(handle.circuit_state(), "closed");
    for (u, p) in &users {
        let mut remaining: Vec<u64> = all
            .iter()
            .filter(|(v, l)| v == u && l.status == 200)
            .map(|(_, l)| l.remaining.unwrap())
            .collect();
        remaining.sort_unstable();
        let want: Vec<u64> = (0..QUOTA - 1).collect();
        assert_eq!(remaining, want, "{u}: the warm-up took {}", QUOTA - 1);
        assert_eq!(
            charged(&s.key(&format!("pair:{p}"))),
            QUOTA * unit_pair,
            "{u}: the pair tier holds exactly the admitted charges"
        );
    }
    assert_eq!(
        charged(&global),
        USERS as u64 * QUOTA * unit_global,
        "the global tier holds exactly the admitted charges (every refund exact)"
    );
    // Every moved slot is served by its new primary.
    for (u, p) in &users {
        assert!(cluster.exists(&s.key(&format!("user:{u}"))));
        assert!(cluster.exists(&s.key(&format!("pair:{p}"))));
    }
}

/// Keys a tier by the `x-pair` header, verbatim.
struct PairKey;

impl tiered_ratelimit::key::KeyExtractor for PairKey {
    fn extract(
        &self,
        parts: &http::request::Parts,
    ) -> Result<Option<String>, tiered_ratelimit::key::KeyError> {
        Ok(parts
            .headers
            .get("x-pair")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned))
    }
}

async fn send_pair(c: &reqwest::Client, url: &str, user: &str, pair: &str) -> Limits {
    let res = c
        .get(url)
        .header("authorization", format!("Bearer {user}"))
        .header("x-pair", pair)
        .send()
        .await
        .expect("request");
    limits(&res)
}

// ---------------------------------------------------------------------------
// The fleet control key on a cluster (routed by slot like the script calls).

/// `set_fleet_mode` writes the control hash on the node holding its slot and
/// reads it back; a second instance's watcher sees it there; after the slot
/// moved to another primary (`MOVED` for the old owner) both still read and
/// write it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_key_follows_its_slot() {
    use tiered_ratelimit::handle::ControlKey;
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "ctl");
    let poll = Duration::from_millis(50);
    let mk = || {
        s.builder()
            .control_key(ControlKey::new("ctl:control").poll_interval(poll))
            .tier(Tier::new("global", Global, Quota::per_hour(100)))
            .build()
            .unwrap()
    };
    let (la, lb) = (mk(), mk());
    let (ha, hb) = (la.handle(), lb.handle());
    let a = format!("http://{}/", serve(app(la)).await);
    let b = format!("http://{}/", serve(app(lb)).await);
    let c = client();
    assert_eq!(get(&c, &a).await.remaining, Some(99));
    assert_eq!(get(&c, &b).await.remaining, Some(98));

    let wait_for = |h: &tiered_ratelimit::RateLimitHandle, m: Mode| {
        let h = h.clone();
        within_5s(
            poll,
            move || h.effective_mode() == m,
            format!("switched to {m:?}"),
        )
    };
    ha.set_fleet_mode(None, Mode::Off).await.unwrap();
    assert_eq!(ha.effective_mode(), Mode::Off, "applied at once");
    let stored: HashMap<String, String> =
        cluster.cmd_for_key("ctl:control", &["HGETALL", "ctl:control"]);
    assert_eq!(
        stored,
        HashMap::from([("mode".to_owned(), "off".to_owned())])
    );
    wait_for(&hb, Mode::Off).await;
    assert_eq!(get(&c, &b).await, NO_LIMITS);

    // Move the control key's slot to another primary.
    let slot = cluster.keyslot("ctl:control");
    let from = cluster.primary_of("ctl:control");
    let to = cluster
        .primaries()
        .into_iter()
        .find(|p| *p != from)
        .unwrap();
    assert_eq!(cluster.migrate_slot(slot, to, 10, Duration::ZERO), 1);
    assert_eq!(cluster.primary_of("ctl:control"), to);
    ha.set_fleet_mode(None, Mode::Enforce).await.unwrap();
    assert_eq!(ha.effective_mode(), Mode::Enforce);
    wait_for(&hb, Mode::Enforce).await;
    assert_eq!(get(&c, &a).await.remaining, Some(97));
    assert_eq!(get(&c, &b).await.remaining, Some(96));
}

/// Fleet-wide settings on a cluster: the compare-and-set script runs on the
/// node of the control key's slot, the other instance applies the change
/// at its next poll, and both keep writing after the slot moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_settings_follow_the_control_keys_slot() {
    use tiered_ratelimit::handle::ControlKey;
    let cluster = RedisCluster::start(0);
    let s = Scn::new(&cluster, "set");
    let poll = Duration::from_millis(50);
    let mk = || {
        s.builder()
            .control_key(ControlKey::new("set:control").poll_interval(poll))
            .tier(Tier::new("global", Global, Quota::per_hour(100)))
            .build()
            .unwrap()
    };
    let (la, lb) = (mk(), mk());
    let (ha, hb) = (la.handle(), lb.handle());
    let b = format!("http://{}/", serve(app(lb)).await);
    let _a = serve(app(la)).await;
    let c = client();
    assert_eq!(get(&c, &b).await.limit, Some(100));
    let wait_for = |h: &tiered_ratelimit::RateLimitHandle, v: u64| {
        let h = h.clone();
        within_5s(
            poll,
            move || h.settings_version() == v,
            format!("version {v} applied"),
        )
    };
    assert_eq!(
        ha.set_fleet_quota("global", None, Quota::per_hour(200), "test")
            .await
            .unwrap(),
        1
    );
    let stored: Option<String> =
        cluster.cmd_for_key("set:control", &["HGET", "set:control", "settings_version"]);
    assert_eq!(stored.as_deref(), Some("1"));
    wait_for(&hb, 1).await;
    assert_eq!(get(&c, &b).await.limit, Some(200));

    let slot = cluster.keyslot("set:control");
    let from = cluster.primary_of("set:control");
    let to = cluster
        .primaries()
        .into_iter()
        .find(|p| *p != from)
        .unwrap();
    assert_eq!(cluster.migrate_slot(slot, to, 10, Duration::ZERO), 1);
    assert_eq!(
        ha.reset_fleet_quota("global", None, "test").await.unwrap(),
        2
    );
    wait_for(&hb, 2).await;
    assert_eq!(get(&c, &b).await.limit, Some(100));
}

/// Waits until `done` holds, polling every quarter `poll`; fails the test
/// after 5 s naming `what`.
async fn within_5s(poll: Duration, done: impl Fn() -> bool, what: String) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "not {what} within 5 s");
        tokio::time::sleep(poll / 4).await;
    }
}

/// Candidate quotas across slots (docs/rollout.md, "Candidate quotas"):
/// two tiers on keys of different slots, two candidates on each (their
/// keys in their live key's slot). Each slot charges its candidates by the
/// rule among its own checks, and a candidate charged while the other
/// slot's enforced tier denied is refunded at the same instant: the
/// cluster's decisions equal the model's, every candidate's included, on
/// every algorithm pair, and the live decisions equal the model's without
/// candidates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_slot_candidates_agree_with_the_model() {
    let cluster = RedisCluster::start(0);
    let (clock, backend) = on_a_manual_clock(&cluster);
    let all = limits_list();
    let mut rng = Rng::new(0x51_7CC1_B727_220A);
    let (mut cross, mut denied, mut total) = (0, 0, 0);
    for (i, (na, a)) in all.iter().enumerate() {
        for (j, (nb, b)) in all.iter().enumerate() {
            let mut model = Model::default();
            let mut bare = Model::default();
            let (ca, cb) = (
                all[(i + j) % all.len()].1,
                all[(i + 2 * j + 1) % all.len()].1,
            );
            for op in 0..40 {
                let step = match rng.next() % 4 {
                    0 => 0,
                    1 => rng.next() % 300_000,
                    _ => rng.next() % 2_000_000,
                };
                clock.advance(Duration::from_micros(step));
                let now = clock.now_us();
                let key = rng.next() % 3;
                let cost = 1 + rng.next() % 3;
                let shadow = if rng.next().is_multiple_of(4) {
                    0b10
                } else {
                    0
                };
                let at = |key: String, limit: Limit, cost: u64| TierCheck {
                    key,
                    cost: cost.min(limit.capacity() + 1),
                    limit,
                    home: None,
                };
                let (ka, kb) = (format!("n{i}{j}:a:k{key}"), format!("n{i}{j}:b:all"));
                let checks = vec![
                    at(ka.clone(), *a, cost),
                    at(kb.clone(), *b, 1),
                    at(format!("{ka}{{c:0}}"), ca, cost),
                    at(format!("{ka}{{c:1}}"), cb, cost),
                    at(format!("{kb}{{c:0}}"), ca, 1),
                    at(format!("{kb}{{c:1}}"), cb, 1),
                ];
                let live_of = [0u8, 0, 1, 1];
                // Each candidate in its live key's slot: one call a slot.
                assert_eq!(
                    cluster.keyslot(&format!("{}{{c:0}}", ckey(&ka))),
                    cluster.keyslot(&ckey(&ka))
                );
                if cluster.keyslot(&ckey(&ka)) != cluster.keyslot(&ckey(&kb)) {
                    cross += 1;
                }
                let want = model.check_candidates(&checks, shadow, &live_of, now);
                let want_live = bare.check_candidates(&checks[..2], shadow, &[], now);
                assert_eq!(want[..2], want_live[..]);
                let got = backend
                    .check_candidates(checks, shadow, &live_of)
                    .await
                    .unwrap();
                assert_eq!(got.decisions, want, "{na}×{nb} diverged at op {op}");
                total += 1;
                if want[2..].iter().any(|d| !d.allowed) {
                    denied += 1;
                }
            }
        }
    }
    eprintln!("{total} checks, {cross} across slots, {denied} with a candidate denying");
    assert!(cross > total * 9 / 10, "{cross} of {total} across slots");
    assert!(denied > total / 10 && denied < total * 9 / 10, "{denied}");
}
