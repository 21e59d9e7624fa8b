//! Upgrading from the previous release's state format (`StateFormat`): keys
//! written by the previous release's scripts (d088e0c's `lua/`, kept
//! verbatim in tests/fixtures/lua_v1/ and run with `EVAL`) keep their exact
//! state when this release takes over, in either format it writes, on a
//! single Redis and on a cluster; a rolling deploy (the two releases on the
//! same keys, request by request) decides exactly as one release would; and
//! what the previous release does with a compact value is pinned down (it
//! reads it as no state: why `Legacy` is the default, see docs/redis.md,
//! "Upgrading").

mod support;

use std::time::Duration;
use support::algorithms::{algorithm_limits, script_args as encode, Model, S};
use support::cluster::RedisCluster;
use support::rng::Rng;
use support::*;
use tiered_ratelimit::algorithm::{Decision, Gcra, Limit, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, RedisBackend, StateFormat, TierCheck};

/// The previous release's single-Redis script, as its `wire.rs` joined it.
const V1_CHECK: &str = concat!(
    include_str!("fixtures/lua_v1/common.lua"),
    include_str!("fixtures/lua_v1/fixed_window.lua"),
    include_str!("fixtures/lua_v1/sliding_window_log.lua"),
    include_str!("fixtures/lua_v1/sliding_window_counter.lua"),
    include_str!("fixtures/lua_v1/token_bucket.lua"),
    include_str!("fixtures/lua_v1/leaky_bucket.lua"),
    include_str!("fixtures/lua_v1/dispatch.lua"),
    include_str!("fixtures/lua_v1/check.lua"),
);

/// The previous release's cluster script.
const V1_CLUSTER: &str = concat!(
    include_str!("fixtures/lua_v1/common.lua"),
    include_str!("fixtures/lua_v1/fixed_window.lua"),
    include_str!("fixtures/lua_v1/sliding_window_log.lua"),
    include_str!("fixtures/lua_v1/sliding_window_counter.lua"),
    include_str!("fixtures/lua_v1/token_bucket.lua"),
    include_str!("fixtures/lua_v1/leaky_bucket.lua"),
    include_str!("fixtures/lua_v1/refund.lua"),
    include_str!("fixtures/lua_v1/dispatch.lua"),
    include_str!("fixtures/lua_v1/cluster.lua"),
);

/// The TTL slack both releases run with on the manual clock (ms).
const SLACK_MS: u64 = 600_000;

/// Every algorithm of the shared table, plus limits whose compact value is
/// one integer where the shared table's is not (a token bucket with a whole
/// number of µs per unit) or that fall back to strings (a window too short
/// for its limit).
fn limits() -> Vec<(&'static str, Limit)> {
    let mut all = algorithm_limits();
    all.push((
        "bucket_round",
        Limit::TokenBucket(TokenBucket::new(2, S, 3).unwrap()),
    ));
    all.push((
        "police_round",
        Limit::LeakyBucket(Gcra {
            bucket: TokenBucket::new(60, 60 * S, 4).unwrap(),
            max_delay_us: None,
        }),
    ));
    all.push((
        "counter_dense",
        Limit::SlidingWindowCounter(Window {
            limit: 40,
            window_us: 1_500,
        }),
    ));
    all
}

/// One tier's decision from a check reply of either release (`{ now, r,
/// reset, w, then the trailer i, delay, undo }`, src/backend/redis/wire/mod.rs).
fn decision(reply: &[i64], limit: &Limit) -> Decision {
    let allowed = reply[1] >= 0;
    let remaining = if allowed { reply[1] } else { -(reply[1] + 1) };
    let delay = if reply.len() == 7 { reply[5] } else { 0 };
    Decision {
        allowed,
        limit: limit.capacity(),
        remaining: remaining as u64,
        reset_after_us: reply[2] as u64,
        retry_after_us: if allowed { 0 } else { reply[3] as u64 },
        delay_us: delay as u64,
    }
}

/// An app server of the previous release: its script by `EVAL`, on a single
/// Redis or on the cluster node that holds the key.
enum Old<'a> {
    Single(&'a RedisServer),
    Cluster(&'a RedisCluster),
}

impl Old<'_> {
    /// One tier's check (and charge if allowed) of `cost` on `key` (the
    /// layer's key; on a cluster the stored key is `{key}`).
    fn check(&self, key: &str, limit: &Limit, now: u64, cost: u64) -> Decision {
        let mut args: Vec<String> = vec!["EVAL".into()];
        let stored = match self {
            Old::Single(_) => {
                args.extend([V1_CHECK.to_owned(), "1".into(), key.to_owned()]);
                key.to_owned()
            }
            Old::Cluster(_) => {
                let k = format!("{{{key}}}");
                args.extend([V1_CLUSTER.to_owned(), "1".into(), k.clone(), "check".into()]);
                k
            }
        };
        args.push(format!("{now}:{SLACK_MS}"));
        args.extend(encode(limit).iter().map(|v| v.to_string()));
        args.push(cost.to_string());
        args.push("0".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let reply: Vec<i64> = match self {
            Old::Single(r) => r.cmd(&args),
            Old::Cluster(c) => c.cmd_for_key(&stored, &args),
        };
        decision(&reply, limit)
    }
}

/// Who serves an op: the previous release, or this one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    Old,
    New,
}

/// Runs ops (clock step, key, cost, who) on `limit`, each through the
/// previous release or `new`, and asserts every decision is the model's:
/// the model never changes release, so any state lost or misread in a
/// hand-over shows as a diverging decision.
#[allow(clippy::too_many_arguments)]
fn drive(
    rt: &tokio::runtime::Runtime,
    old: &Old<'_>,
    new: &Backend,
    clock: &ManualClock,
    model: &mut Model,
    prefix: &str,
    limit: &Limit,
    ops: &[(u64, u64, u64, Who)],
) {
    for (i, &(step, key, cost, who)) in ops.iter().enumerate() {
        clock.advance(Duration::from_micros(step));
        let now = clock.now_us();
        let check = TierCheck {
            key: format!("{prefix}:k{key}"),
            limit: *limit,
            cost,
        };
        let want = model.check(std::slice::from_ref(&check), now)[0];
        let got = match who {
            Who::Old => old.check(&check.key, limit, now, cost),
            Who::New => rt.block_on(new.check(vec![check])).unwrap().decisions[0],
        };
        assert_eq!(got, want, "{prefix}: op {i} ({who:?}) at {now}");
    }
}

/// A probe of every key by the new release (a cost above the capacity: never
/// charged, and its decision shows the remaining and the reset exactly).
fn probe_all(
    rt: &tokio::runtime::Runtime,
    new: &Backend,
    clock: &ManualClock,
    model: &mut Model,
    prefix: &str,
    limit: &Limit,
) {
    let now = clock.now_us();
    for key in 0..3 {
        let check = TierCheck {
            key: format!("{prefix}:k{key}"),
            limit: *limit,
            cost: limit.capacity() + 1,
        };
        let want = model.check(std::slice::from_ref(&check), now)[0];
        let got = rt.block_on(new.check(vec![check])).unwrap().decisions[0];
        assert_eq!(got, want, "{prefix}: k{key} after the upgrade");
    }
}

/// Random ops on three keys, all served by `who` (or by either, at random,
/// when `who` is `None`).
fn ops(rng: &mut Rng, n: usize, who: Option<Who>) -> Vec<(u64, u64, u64, Who)> {
    (0..n)
        .map(|_| {
            let step = match rng.next() % 4 {
                0 => 0,
                1 => rng.next() % 300_000,
                _ => rng.next() % 2_000_000,
            };
            let cost = if rng.next().is_multiple_of(3) {
                1 + rng.next() % 3
            } else {
                1
            };
            let by = who.unwrap_or(if rng.next().is_multiple_of(2) {
                Who::Old
            } else {
                Who::New
            });
            (step, rng.next() % 3, cost, by)
        })
        .collect()
}

fn new_backend(b: RedisBackend, clock: &ManualClock, format: StateFormat) -> Backend {
    b.with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_millis(SLACK_MS))
        .with_state_format(format)
        .into()
}

/// Whether a stored value is in the legacy format (a string with ':').
fn is_legacy(v: &str) -> bool {
    v.contains(':')
}

/// Keys filled by the previous release, then served by this one: every
/// remaining count, reset and later decision is exactly what one release
/// would have given, whichever format this release writes. In the compact
/// format the values are rewritten by the first charge after the upgrade.
#[test]
fn an_upgrade_keeps_every_count_on_a_single_redis() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let old = Old::Single(&redis);
    let mut rng = Rng::new(0x5151_C0DE_0000_0001);
    for format in [StateFormat::Legacy, StateFormat::Compact] {
        for (name, limit) in limits() {
            let prefix = format!("up:{format:?}:{name}");
            let clock = ManualClock::new(T0_US + 123_457);
            let new = new_backend(
                RedisBackend::from_url(&redis.url()).unwrap(),
                &clock,
                format,
            );
            let mut model = Model::default();
            drive(
                &rt,
                &old,
                &new,
                &clock,
                &mut model,
                &prefix,
                &limit,
                &ops(&mut rng, 40, Some(Who::Old)),
            );
            probe_all(&rt, &new, &clock, &mut model, &prefix, &limit);
            drive(
                &rt,
                &old,
                &new,
                &clock,
                &mut model,
                &prefix,
                &limit,
                &ops(&mut rng, 40, Some(Who::New)),
            );
            probe_all(&rt, &new, &clock, &mut model, &prefix, &limit);
            rewrite_all(&rt, &old, &new, &clock, &mut model, &prefix, &limit);
            assert_format(
                |k| redis.cmd(&["EVAL", STORED, "1", k]),
                &prefix,
                &limit,
                format,
            );
        }
    }
}

/// Charges each key once more, an hour later (every limit here is full
/// again by then), so that this release has written all of them.
fn rewrite_all(
    rt: &tokio::runtime::Runtime,
    old: &Old<'_>,
    new: &Backend,
    clock: &ManualClock,
    model: &mut Model,
    prefix: &str,
    limit: &Limit,
) {
    clock.advance(Duration::from_secs(3600));
    let ops: Vec<_> = (0..3).map(|k| (0, k, 1, Who::New)).collect();
    drive(rt, old, new, clock, model, prefix, limit, &ops);
}

/// Whether the compact format stores this limit's state as integers (a
/// bucket's TAT, a window's start plus its counts, the log's members of
/// cost 1), rather than as its strings.
fn integer_form(limit: &Limit) -> bool {
    let isqrt = |n: u64| (n as f64).sqrt() as u64;
    match limit {
        Limit::TokenBucket(b) => b.rate == 1,
        Limit::LeakyBucket(g) => g.bucket.rate <= 21,
        Limit::FixedWindow(w) => w.limit < w.window_us,
        Limit::SlidingWindowCounter(w) => w.limit < isqrt(w.window_us),
        _ => true,
    }
}

/// A key's stored value (a string), or a log's members, or nothing.
const STORED: &str = "local t = redis.call('TYPE', KEYS[1]).ok \
    if t == 'string' then return { redis.call('GET', KEYS[1]) } end \
    if t == 'zset' then return redis.call('ZRANGE', KEYS[1], 0, -1) end \
    return {}";

/// Asserts every value or member of the three keys is in `format` (for the
/// compact format: integers where [`integer_form`] says so).
fn assert_format(
    stored: impl Fn(&str) -> Vec<String>,
    prefix: &str,
    limit: &Limit,
    format: StateFormat,
) {
    for key in 0..3 {
        let key = format!("{prefix}:k{key}");
        let values = stored(&key);
        assert!(!values.is_empty(), "{key} was just charged");
        for v in values {
            let integer = format == StateFormat::Compact && integer_form(limit);
            assert_eq!(v.parse::<u64>().is_ok(), integer, "{key}: {v}");
            assert_eq!(is_legacy(&v), !integer, "{key}: {v}");
        }
    }
}

/// A rolling deploy: the previous release and this one (writing `Legacy`,
/// the default) serve the same keys, request by request, at random: every
/// decision is the model's, in both directions of the hand-over.
#[test]
fn a_rolling_deploy_decides_as_one_release() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let old = Old::Single(&redis);
    let mut rng = Rng::new(0x5151_C0DE_0000_0002);
    for (name, limit) in limits() {
        let prefix = format!("mix:{name}");
        let clock = ManualClock::new(T0_US + 654_321);
        let new = new_backend(
            RedisBackend::from_url(&redis.url()).unwrap(),
            &clock,
            StateFormat::Legacy,
        );
        let mut model = Model::default();
        drive(
            &rt,
            &old,
            &new,
            &clock,
            &mut model,
            &prefix,
            &limit,
            &ops(&mut rng, 120, None),
        );
    }
}

/// What the previous release does with a compact value: it reads it as no
/// state (a full bucket) and overwrites it. This is the hazard the default
/// `Legacy` format avoids during a deploy, and why a rollback switches back
/// to `Legacy` first; with `Legacy` the previous release reads this
/// release's values exactly.
#[test]
fn the_previous_release_reads_a_compact_value_as_no_state() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let old = Old::Single(&redis);
    let limit = Limit::TokenBucket(TokenBucket::new(60, 60 * S, 60).unwrap());
    let clock = ManualClock::new(T0_US);
    let drain = |format: StateFormat, key: &str| {
        let new = new_backend(
            RedisBackend::from_url(&redis.url()).unwrap(),
            &clock,
            format,
        );
        for i in 0..60 {
            let d = rt
                .block_on(new.check(vec![TierCheck {
                    key: key.to_owned(),
                    limit,
                    cost: 1,
                }]))
                .unwrap()
                .decisions[0];
            assert_eq!((d.allowed, d.remaining), (true, 59 - i));
        }
    };
    drain(StateFormat::Compact, "rl:ip:203.0.113.7");
    assert_eq!(
        redis.get("rl:ip:203.0.113.7").as_deref(),
        Some("1700000060000000")
    );
    // Empty for this release; a full bucket for the previous one.
    let d = old.check("rl:ip:203.0.113.7", &limit, T0_US, 1);
    assert_eq!((d.allowed, d.remaining, d.reset_after_us), (true, 59, S));
    assert_eq!(
        redis.get("rl:ip:203.0.113.7").as_deref(),
        Some("59000000:1700000000000000:1000000")
    );

    // Written as Legacy, the same bucket is empty for both.
    drain(StateFormat::Legacy, "rl:ip:198.51.100.7");
    let d = old.check("rl:ip:198.51.100.7", &limit, T0_US, 1);
    assert_eq!(
        (d.allowed, d.remaining, d.retry_after_us, d.reset_after_us),
        (false, 0, S, 60 * S)
    );
}

/// A rollback: this release wrote compact values, then is switched back to
/// `Legacy`; its next charge of each key rewrites it in the legacy format,
/// which the previous release reads exactly.
#[test]
fn switching_back_to_legacy_rewrites_each_key_on_its_next_charge() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let old = Old::Single(&redis);
    let mut rng = Rng::new(0x5151_C0DE_0000_0003);
    for (name, limit) in limits() {
        let prefix = format!("back:{name}");
        let clock = ManualClock::new(T0_US + 777);
        let compact = new_backend(
            RedisBackend::from_url(&redis.url()).unwrap(),
            &clock,
            StateFormat::Compact,
        );
        let legacy = new_backend(
            RedisBackend::from_url(&redis.url()).unwrap(),
            &clock,
            StateFormat::Legacy,
        );
        let mut model = Model::default();
        drive(
            &rt,
            &old,
            &compact,
            &clock,
            &mut model,
            &prefix,
            &limit,
            &ops(&mut rng, 40, Some(Who::New)),
        );
        rewrite_all(&rt, &old, &compact, &clock, &mut model, &prefix, &limit);
        assert_format(
            |k| redis.cmd(&["EVAL", STORED, "1", k]),
            &prefix,
            &limit,
            StateFormat::Compact,
        );
        // Back to Legacy: the next charge of each key rewrites it.
        rewrite_all(&rt, &old, &legacy, &clock, &mut model, &prefix, &limit);
        assert_format(
            |k| redis.cmd(&["EVAL", STORED, "1", k]),
            &prefix,
            &limit,
            StateFormat::Legacy,
        );
        drive(
            &rt,
            &old,
            &legacy,
            &clock,
            &mut model,
            &prefix,
            &limit,
            &ops(&mut rng, 60, None),
        );
    }
}

/// The same upgrade and rolling deploy on a Redis Cluster: the previous
/// release's cluster script on the node holding each key, then this
/// release's cluster backend.
#[test]
fn an_upgrade_keeps_every_count_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let rt = multi_thread_runtime();
    let old = Old::Cluster(&cluster);
    let mut rng = Rng::new(0x5151_C0DE_0000_0004);
    for format in [StateFormat::Legacy, StateFormat::Compact] {
        for (name, limit) in limits() {
            let prefix = format!("cup:{format:?}:{name}");
            let clock = ManualClock::new(T0_US + 4_242);
            let new = new_backend(
                RedisBackend::cluster(cluster.urls()).unwrap(),
                &clock,
                format,
            );
            let mut model = Model::default();
            drive(
                &rt,
                &old,
                &new,
                &clock,
                &mut model,
                &prefix,
                &limit,
                &ops(&mut rng, 30, Some(Who::Old)),
            );
            probe_all(&rt, &new, &clock, &mut model, &prefix, &limit);
            drive(
                &rt,
                &old,
                &new,
                &clock,
                &mut model,
                &prefix,
                &limit,
                &ops(&mut rng, 30, Some(Who::New)),
            );
            rewrite_all(&rt, &old, &new, &clock, &mut model, &prefix, &limit);
            assert_format(
                |k| {
                    let k = format!("{{{k}}}");
                    cluster.cmd_for_key(&k, &["EVAL", STORED, "1", &k])
                },
                &prefix,
                &limit,
                format,
            );
            if format == StateFormat::Legacy {
                // And both releases at once, as during the deploy.
                drive(
                    &rt,
                    &old,
                    &new,
                    &clock,
                    &mut model,
                    &prefix,
                    &limit,
                    &ops(&mut rng, 60, None),
                );
            }
        }
    }
}
