//! Candidate quotas at the backends (docs/rollout.md, "Candidate quotas"):
//! on random sequences, the model, the memory backend and the Redis scripts
//! give every candidate the same decisions (so the same state), and the
//! live checks' decisions are those of the same sequence without
//! candidates, on every backend.

use crate::support::algorithms::{algorithm_limits, clock_step, Model};
use crate::support::*;
use proptest::prelude::*;
use std::time::Duration;
use tiered_ratelimit::algorithm::Limit;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend, TierCheck};

/// One request: clock step, key (0..3), cost on tier `a`, whether `b` is in
/// shadow mode.
type Op = (u64, u8, u64, bool);

struct Harness {
    rt: tokio::runtime::Runtime,
    _redis: RedisServer,
    url: String,
}

impl Harness {
    fn new() -> Self {
        let redis = RedisServer::start();
        Harness {
            rt: current_thread_runtime(),
            url: redis.url(),
            _redis: redis,
        }
    }

    fn redis(&self, clock: &ManualClock) -> Backend {
        RedisBackend::from_url(&self.url)
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
            .into()
    }

    /// Runs `ops` with tier `a` (per key, `la`) and tier `b` (one key,
    /// `lb`), candidates `ca` on `a` and `cb` on `b`: returns the candidate
    /// decisions denied and allowed (a sequence must see both).
    fn run(
        &self,
        case: u64,
        (la, lb): (Limit, Limit),
        ca: &[Limit],
        cb: &[Limit],
        ops: &[Op],
    ) -> (usize, usize) {
        let clock = ManualClock::new(T0_US + 123_457);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let bare_memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let redis = self.redis(&clock);
        let mut model = Model::default();
        let mut bare_model = Model::default();
        let (mut denied, mut allowed) = (0, 0);
        for (i, &(step, key, cost, b_shadow)) in ops.iter().enumerate() {
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let a_key = format!("c{case}:a:k{key}");
            let b_key = format!("c{case}:b:all");
            let live = vec![
                TierCheck {
                    key: a_key.clone(),
                    limit: la,
                    cost,
                    home: None,
                },
                TierCheck {
                    key: b_key.clone(),
                    limit: lb,
                    cost: 1,
                    home: None,
                },
            ];
            let mut checks = live.clone();
            let mut live_of = Vec::new();
            for (j, l) in ca.iter().enumerate() {
                checks.push(TierCheck {
                    key: format!("{a_key}{{c:{j}}}"),
                    limit: *l,
                    cost,
                    home: None,
                });
                live_of.push(0u8);
            }
            for (j, l) in cb.iter().enumerate() {
                checks.push(TierCheck {
                    key: format!("{b_key}{{c:{j}}}"),
                    limit: *l,
                    cost: 1,
                    home: None,
                });
                live_of.push(1u8);
            }
            let shadow = if b_shadow { 0b10 } else { 0 };
            // Costs clamped as the backends clamp them.
            let clamped: Vec<TierCheck> = checks
                .iter()
                .map(|c| TierCheck {
                    cost: c.cost.min(c.limit.capacity() + 1),
                    ..c.clone()
                })
                .collect();
            let want = model.check_candidates(&clamped, shadow, &live_of, now);
            let bare = bare_model.check_candidates(&clamped[..2], shadow, &[], now);
            assert_eq!(
                want[..2],
                bare[..],
                "the model's live decisions moved at op {i}"
            );
            let mem = self
                .rt
                .block_on(memory.check_candidates(checks.clone(), shadow, &live_of))
                .unwrap();
            let red = self
                .rt
                .block_on(redis.check_candidates(checks.clone(), shadow, &live_of))
                .unwrap();
            let mem_bare = self
                .rt
                .block_on(bare_memory.check_candidates(live.clone(), shadow, &[]))
                .unwrap();
            assert_eq!(mem.decisions, want, "memory diverged at op {i}");
            assert_eq!(red.decisions, want, "redis diverged at op {i}");
            assert_eq!(
                mem_bare.decisions[..],
                want[..2],
                "memory without candidates at op {i}"
            );
            // The live checks' charges (what refunds need) are theirs alone.
            let committed = want[..2]
                .iter()
                .enumerate()
                .all(|(k, d)| d.allowed || shadow & (1 << k) != 0);
            assert_eq!(
                !mem.charges.is_empty(),
                committed,
                "memory's charges at op {i}"
            );
            assert_eq!(
                !red.charges.is_empty(),
                committed,
                "redis's charges at op {i}"
            );
            for d in &want[2..] {
                if d.allowed {
                    allowed += 1;
                } else {
                    denied += 1;
                }
            }
        }
        (denied, allowed)
    }
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        (
            clock_step(),
            0u8..3,
            prop_oneof![8 => Just(1u64), 3 => 1u64..=4, 1 => 5u64..=8],
            prop::bool::weighted(0.25),
        ),
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Two live tiers (one per key, one for all), up to four candidates on
    /// the first and one or none on the second, any algorithm each.
    #[test]
    fn candidates_agree_on_model_memory_and_redis(
        live in (0usize..7, 0usize..7),
        ca in prop::collection::vec(0usize..8, 1..=4),
        cb in prop::collection::vec(0usize..8, 0..=1),
        ops in ops(),
    ) {
        thread_local!(static H: Harness = Harness::new());
        let all = algorithm_limits();
        let ca: Vec<Limit> = ca.iter().map(|&i| all[i].1).collect();
        let cb: Vec<Limit> = cb.iter().map(|&i| all[i].1).collect();
        H.with(|h| {
            let case = next_case();
            h.run(case, (all[live.0].1, all[live.1].1), &ca, &cb, &ops);
        });
    }
}

fn next_case() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Every algorithm as a candidate of every live algorithm, on one long
/// fixed sequence: each candidate sees both answers.
#[test]
fn every_candidate_on_a_long_sequence() {
    let h = Harness::new();
    let mut rng =
        crate::support::rng::Rng::with_multiplier(0x2545_F491_4F6C_DD1D, 0x9E37_79B9_7F4A_7C15);
    let mut next = move || rng.next();
    let ops: Vec<Op> = (0..300)
        .map(|_| {
            let step = match next() % 4 {
                0 => 0,
                1 => next() % 300_000,
                _ => next() % 2_000_000,
            };
            (
                step,
                (next() % 3) as u8,
                1 + next() % 3,
                next().is_multiple_of(4),
            )
        })
        .collect();
    let all = algorithm_limits();
    for (i, (na, a)) in all.iter().enumerate() {
        let ca: Vec<Limit> = all.iter().map(|(_, l)| *l).take(4).collect();
        let cb: Vec<Limit> = all.iter().map(|(_, l)| *l).skip(4).take(1).collect();
        let (denied, allowed) = h.run(
            2_000_000 + i as u64,
            (*a, all[(i + 3) % all.len()].1),
            &ca,
            &cb,
            &ops,
        );
        assert!(
            denied > 0 && allowed > 0,
            "{na}: {denied} denied, {allowed} allowed proves little"
        );
    }
}

/// The metric `tiered_ratelimit_candidate_decisions_total{tier,candidate,
/// decision}` counts every candidate check, by what it would have
/// answered: a user's 6 requests in a minute under a live 10/min and
/// candidates 2/min and 5/min.
#[test]
fn candidate_decisions_are_counted_in_the_metric() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tiered_ratelimit::{key::User, offline::Checks, Quota, RateLimitLayer, Tier};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let clock = ManualClock::new(T0_US);
        let layer = RateLimitLayer::builder()
            .backend(MemoryBackend::with_manual_clock(clock.clone()))
            .tier(
                Tier::new("user", User, Quota::per_minute(10))
                    .candidates([Quota::per_minute(2), Quota::per_minute(5)]),
            )
            .build()
            .unwrap();
        let offline = layer.offline().unwrap();
        let mut checks = Checks::default();
        for _ in 0..6 {
            let (mut parts, ()) = http::Request::new(()).into_parts();
            parts
                .extensions
                .insert(tiered_ratelimit::key::UserId("alice".into()));
            offline.decide(&parts, &mut checks);
        }
    });
    let mut got: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "tiered_ratelimit_candidate_decisions_total")
        .map(|(k, _, _, v)| {
            let mut labels: Vec<String> = k
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let DebugValue::Counter(n) = v else {
                panic!("{v:?}")
            };
            (labels.join(","), n)
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("candidate=2/1m,decision=allowed,tier=user".to_owned(), 2),
            ("candidate=2/1m,decision=would_deny,tier=user".to_owned(), 4),
            ("candidate=5/1m,decision=allowed,tier=user".to_owned(), 5),
            ("candidate=5/1m,decision=would_deny,tier=user".to_owned(), 1),
        ]
    );
}

/// Four candidates the Redis scripts pack, of four kinds and periods: a
/// token bucket of rate 1 (the limit divides the period), a fixed window,
/// a calendar window, a sliding window counter.
fn four_packed(all: &[(&'static str, Limit)]) -> [Limit; 4] {
    use crate::support::algorithms::S;
    use tiered_ratelimit::algorithm::TokenBucket;
    let named = |n: &str| all.iter().find(|(name, _)| *name == n).unwrap().1;
    [
        Limit::TokenBucket(TokenBucket::new(2, S, 3).unwrap()),
        named("fixed_odd"),
        named("calendar"),
        named("counter"),
    ]
}

/// The long sequences' numbers (a fixed seed).
fn seeded() -> impl FnMut() -> u64 {
    let mut rng =
        crate::support::rng::Rng::with_multiplier(0x2545_F491_4F6C_DD1D, 0x9E37_79B9_7F4A_7C15);
    move || rng.next()
}

/// A long sequence's clock step (µs): none, up to 0.3 s or up to 1.5 s.
fn step(next: &mut impl FnMut() -> u64) -> u64 {
    match next() % 4 {
        0 => 0,
        1 => next() % 300_000,
        _ => next() % 1_500_000,
    }
}

/// Candidates the Redis scripts pack (a token bucket and a policing leaky
/// bucket of rate 1, fixed and calendar windows, sliding window counters):
/// four of different kinds and periods on one tier, one on the other,
/// under every live algorithm, on one long sequence: the model, the memory
/// backend and Redis agree on every decision. Redis holds them in the tier
/// key's own value when the live algorithm's value is a string (no key of
/// theirs at all), else in one key per tier key, `<tier key>{c}`, never
/// one of a candidate's own.
#[test]
fn packed_candidates_agree_on_model_memory_and_redis() {
    use crate::support::algorithms::S;
    use tiered_ratelimit::algorithm::{Gcra, TokenBucket};
    let h = Harness::new();
    let all = algorithm_limits();
    let named = |n: &str| all.iter().find(|(name, _)| *name == n).unwrap().1;
    let police = Limit::LeakyBucket(Gcra {
        bucket: TokenBucket::new(4, 2 * S, 4).unwrap(),
        max_delay_us: None,
    });
    let ca = four_packed(&all);
    // The other tier's packed too, or on a key of its own: a sliding log
    // (its undo value in the reply's trailer, past the pack), a shaping
    // leaky bucket.
    let mut next = seeded();
    let ops: Vec<Op> = (0..300)
        .map(|_| {
            let step = step(&mut next);
            (
                step,
                (next() % 3) as u8,
                1 + next() % 3,
                next().is_multiple_of(4),
            )
        })
        .collect();
    for (i, (na, a)) in all.iter().enumerate() {
        let cb = [[police, named("log"), named("shape")][i % 3]];
        let (denied, allowed) = h.run(
            3_000_000 + i as u64,
            (*a, all[(i + 3) % all.len()].1),
            &ca,
            &cb,
            &ops,
        );
        assert!(
            denied > 0 && allowed > 0,
            "{na}: {denied} denied, {allowed} allowed proves little"
        );
    }
    // Tier a's candidates packed: in the tier key under a string-valued
    // live algorithm, else in `{c}`; tier b's log and shaping one on keys
    // of their own.
    for (i, (na, _)) in all.iter().enumerate() {
        let pattern = format!("c{}:a:*{{c*", 3_000_000 + i);
        let keys: Vec<String> = h._redis.cmd(&["KEYS", &pattern]);
        let tiers: Vec<String> = h._redis.cmd(&["KEYS", &pattern.replace("{c*", "")]);
        assert!(!tiers.is_empty(), "{na}");
        if matches!(*na, "log") {
            assert!(!keys.is_empty(), "{na}");
            assert!(
                keys.iter().all(|k| k.ends_with("{c}")),
                "{na}: a candidate on a key of its own: {keys:?}"
            );
        } else {
            assert_eq!(keys, Vec::<String>::new(), "{na}: packed in the tier key");
        }
    }
    let b: Vec<String> = h._redis.cmd(&["KEYS", "c3*:b:*{c*"]);
    assert!(b.iter().any(|k| k.ends_with("{c:0}")), "{b:?}");
}

/// A Redis server, a runtime, a clock just past the start of a 1 000 s
/// window and a Redis backend on it.
fn just_past_a_1000s_window() -> (RedisServer, tokio::runtime::Runtime, ManualClock, Backend) {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US - T0_US % (1_000 * crate::support::algorithms::S) + 123_457);
    let backend: Backend = redis.backend_on(&clock).into();
    (redis, current_thread_runtime(), clock, backend)
}

/// A tier key holding its candidates' pack expires with the longest-lived
/// of the live state and the candidates: fixed windows of 1 s, 10 s,
/// 100 s and 1 000 s, each charged once beside a token bucket full again
/// in 1 s, give the key the 1 000 s window's remaining time (as its own
/// key would have), not another's; no other key exists.
#[test]
fn a_packed_key_lives_as_long_as_its_longest_candidate() {
    use crate::support::algorithms::S;
    use tiered_ratelimit::algorithm::{TokenBucket, Window};
    let (redis, rt, clock, backend) = just_past_a_1000s_window();
    let live = TierCheck {
        key: "rl:ip:a".into(),
        limit: Limit::TokenBucket(TokenBucket::new(10, S, 10).unwrap()),
        cost: 1,
        home: None,
    };
    let windows = [S, 10 * S, 1_000 * S, 100 * S];
    let mut checks = vec![live];
    for w in windows {
        checks.push(TierCheck {
            key: format!("rl:ip:a{{c:5/{}s}}", w / S),
            limit: Limit::FixedWindow(Window {
                limit: 5,
                window_us: w,
            }),
            cost: 1,
            home: None,
        });
    }
    let v = rt
        .block_on(backend.check_candidates(checks, 0, &[0; 4]))
        .unwrap();
    assert!(v.decisions.iter().all(|d| d.allowed));
    let now = clock.now_us();
    let ends = windows.map(|w| (now - now % w + w - now).div_ceil(1000));
    let longest = ends[2];
    assert!(ends.iter().all(|&e| e == longest || e + 5_000 < longest));
    let pttl: u64 = redis.cmd(&["PTTL", "rl:ip:a"]);
    // (PTTL counts down in Redis's real time since the SET.)
    assert!(
        pttl <= longest && pttl + 5_000 > longest,
        "PTTL {pttl}, want {longest} (each window's end: {ends:?})"
    );
    let keys: Vec<String> = redis.cmd(&["KEYS", "*"]);
    assert_eq!(keys, ["rl:ip:a"]);
}

/// A tier key holding its candidates' pack never lives shorter than
/// either part needs, whichever the request charged: a request its live
/// bucket denies but a candidate allows keeps the live value with its own
/// expiry (~1 000 s, not the candidate's 1 s), and a request the live
/// bucket allows but the candidate denies keeps the stored pack as long as
/// its window runs (~1 000 s, not the live value's ~1 ms), so neither
/// hands out a fresh bucket or window early.
#[test]
fn a_tier_key_keeps_what_the_request_did_not_charge() {
    use crate::support::algorithms::S;
    use tiered_ratelimit::algorithm::{TokenBucket, Window};
    let (redis, rt, clock, backend) = just_past_a_1000s_window();
    let check = |key: &str, live: Limit, cand: Limit| {
        let checks = vec![
            TierCheck {
                key: key.into(),
                limit: live,
                cost: 1,
                home: None,
            },
            TierCheck {
                key: format!("{key}{{c:x}}"),
                limit: cand,
                cost: 1,
                home: None,
            },
        ];
        let v = rt
            .block_on(backend.check_candidates(checks, 0, &[0]))
            .unwrap();
        (v.decisions[0].allowed, v.decisions[1].allowed)
    };
    let pttl = |key: &str| -> i64 { redis.cmd(&["PTTL", key]) };
    // One token, back in 1 000 s; a candidate of 100 a second.
    let slow = Limit::TokenBucket(TokenBucket::new(1, 1_000 * S, 1).unwrap());
    let wide = Limit::FixedWindow(Window {
        limit: 100,
        window_us: S,
    });
    assert_eq!(check("rl:a", slow, wide), (true, true));
    assert_eq!(check("rl:a", slow, wide), (false, true));
    let left = pttl("rl:a");
    assert!(left > 990_000, "the live value's expiry kept: PTTL {left}");
    // A bucket of a million a second; a candidate of one per 1 000 s.
    let fast = Limit::TokenBucket(TokenBucket::new(1_000_000, S, 1_000_000).unwrap());
    let once = Limit::FixedWindow(Window {
        limit: 1,
        window_us: 1_000 * S,
    });
    assert_eq!(check("rl:b", fast, once), (true, true));
    assert_eq!(check("rl:b", fast, once), (true, false));
    let left = pttl("rl:b");
    assert!(left > 990_000, "the stored pack's window kept: PTTL {left}");
    clock.advance(std::time::Duration::from_secs(500));
    assert_eq!(check("rl:b", fast, once), (true, false));
}

/// A pack read with its candidates in another order (a tier's list
/// reordered at run time) finds each one's state by its name, on both
/// backends: every decision the model's, where each candidate has a key
/// of its own.
#[test]
fn a_reordered_pack_finds_each_candidates_state() {
    use crate::support::algorithms::S;
    use tiered_ratelimit::algorithm::TokenBucket;
    let h = Harness::new();
    let clock = ManualClock::new(T0_US + 123_457);
    let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
    let redis = h.redis(&clock);
    let mut model = Model::default();
    let all = algorithm_limits();
    let named = |n: &str| all.iter().find(|(name, _)| *name == n).unwrap().1;
    let candidates = [
        (
            "{c:bucket}",
            Limit::TokenBucket(TokenBucket::new(2, S, 3).unwrap()),
        ),
        ("{c:fixed}", named("fixed_odd")),
        ("{c:counter}", named("counter")),
    ];
    let orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 1, 0]];
    let (mut denied, mut allowed) = (0, 0);
    for op in 0..200u64 {
        clock.advance(Duration::from_micros((op * 7_919) % 400_000));
        let now = clock.now_us();
        let live = "reorder:a:k";
        let mut checks = vec![TierCheck {
            key: live.into(),
            limit: Limit::TokenBucket(TokenBucket::new(100, S, 100).unwrap()),
            cost: 1,
            home: None,
        }];
        for &j in &orders[(op % 4) as usize] {
            let (suffix, limit) = candidates[j];
            checks.push(TierCheck {
                key: format!("{live}{suffix}"),
                limit,
                cost: 1,
                home: None,
            });
        }
        let want = model.check_candidates(&checks, 0, &[0, 0, 0], now);
        let mem =
            h.rt.block_on(memory.check_candidates(checks.clone(), 0, &[0, 0, 0]))
                .unwrap();
        let red =
            h.rt.block_on(redis.check_candidates(checks, 0, &[0, 0, 0]))
                .unwrap();
        assert_eq!(mem.decisions, want, "memory at op {op}");
        assert_eq!(red.decisions, want, "redis at op {op}");
        for d in &want[1..] {
            if d.allowed {
                allowed += 1;
            } else {
                denied += 1;
            }
        }
    }
    assert!(
        denied > 20 && allowed > 20,
        "{denied} denied, {allowed} allowed"
    );
    let own: i64 = h._redis.cmd(&["EXISTS", "reorder:a:k{c:bucket}"]);
    assert_eq!(own, 0);
}

/// A fleet where some instances have a tier's candidates and some do not
/// (a policy rolled out instance by instance): the tier key then holds the
/// candidates' pack after its live value, and an instance without them
/// reads that value. Under every live algorithm, requests alternate
/// between a Redis backend checking four packed candidates and one
/// checking the live tiers alone, on one Redis: every live decision is the
/// model's without candidates, so no reader takes the pack for the live
/// state. (The candidates' own decisions are not compared: an instance
/// without them writes the live value alone, and their states start
/// again, docs/rollout.md, "Candidate quotas".)
#[test]
fn an_instance_without_the_candidates_reads_the_live_value_alone() {
    let h = Harness::new();
    let all = algorithm_limits();
    let ca = four_packed(&all);
    let mut next = seeded();
    for (n, (na, la)) in all.iter().enumerate() {
        let clock = ManualClock::new(T0_US + 123_457);
        let redis = h.redis(&clock);
        let mut model = Model::default();
        let (mut with, mut without, mut denied) = (0, 0, 0);
        for i in 0..400 {
            clock.advance(Duration::from_micros(step(&mut next)));
            let cost = 1 + next() % 3;
            let key = format!("m{n}:a:k{}", next() % 2);
            let live = TierCheck {
                key: key.clone(),
                limit: *la,
                cost,
                home: None,
            };
            let clamped = TierCheck {
                cost: cost.min(la.capacity() + 1),
                ..live.clone()
            };
            let want = model.check_candidates(&[clamped], 0, &[], clock.now_us());
            let got = if next().is_multiple_of(2) {
                let mut checks = vec![live];
                for (j, l) in ca.iter().enumerate() {
                    checks.push(TierCheck {
                        key: format!("{key}{{c:{j}}}"),
                        limit: *l,
                        cost,
                        home: None,
                    });
                }
                with += 1;
                h.rt.block_on(redis.check_candidates(checks, 0, &[0; 4]))
                    .unwrap()
            } else {
                without += 1;
                h.rt.block_on(redis.check_candidates(vec![live], 0, &[]))
                    .unwrap()
            };
            assert_eq!(
                got.decisions[..1],
                want[..],
                "{na}: live decision at op {i}"
            );
            denied += usize::from(!want[0].allowed);
        }
        assert!(
            with > 100 && without > 100 && denied > 0,
            "{na}: {with} with, {without} without, {denied} denied proves little"
        );
    }
}

/// The layer's commonest shape: a token bucket of rate 1 carrying its
/// four candidates' pack in its own spec (`wire::embedded_packs`) beside a
/// tier that never denies, both decided by the script's plain path. The
/// bucket alone denies often while its candidates, larger, allow: each
/// allowing candidate is charged then (its tier's live check is the only
/// one denying), and the model, the memory backend and Redis agree on
/// every decision; no key of the candidates' own exists.
#[test]
fn a_bucket_carrying_its_pack_charges_the_candidates_when_it_alone_denies() {
    use crate::support::algorithms::S;
    use tiered_ratelimit::algorithm::{TokenBucket, Window};
    let h = Harness::new();
    let all = algorithm_limits();
    let live = Limit::TokenBucket(TokenBucket::new(1, S, 2).unwrap());
    let never = Limit::FixedWindow(Window {
        limit: 1_000_000,
        window_us: 60 * S,
    });
    let ca = four_packed(&all);
    let mut next = seeded();
    let ops: Vec<Op> = (0..400)
        .map(|_| (next() % 400_000, (next() % 2) as u8, 1, false))
        .collect();
    let (denied, allowed) = h.run(4_000_000, (live, never), &ca, &[], &ops);
    assert!(
        denied > 0 && allowed > 0,
        "{denied} denied, {allowed} allowed"
    );
    let own: Vec<String> = h._redis.cmd(&["KEYS", "c4000000:*{c*"]);
    assert_eq!(own, Vec::<String>::new());
}
