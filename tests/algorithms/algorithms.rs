//! Every algorithm, proved three ways: the pure model (the oracle, driven
//! here by hand), the memory backend and the Redis scripts must return
//! identical decisions for random sequences of (time step, key, cost), with
//! every tier pair checked all or nothing; and the model's answers must
//! keep the invariants (Retry-After and Reset tell the truth, the sliding
//! log never admits more than the limit in any window). Before every check,
//! a peek of the first tier on each backend must equal the model's check of
//! that tier with nothing charged (and the check after it must still agree).

use crate::support::algorithms::{
    algorithm_limits, clock_step, listed_twice_ops, quota_change_sets, Model, Outcomes, S,
};
use crate::support::rng::Rng;
use crate::support::*;
use proptest::prelude::*;
use std::collections::HashMap;
use std::time::Duration;
use tiered_ratelimit::algorithm::{Gcra, Limit, State, TierDecision, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend, TierCheck};

/// Checks the invariants of one denied or allowed decision against the model
/// state it was made from.
fn check_invariants(limit: &Limit, state: Option<&State>, now: u64, cost: u64, d: &TierDecision) {
    let cap = limit.capacity();
    assert!(d.remaining <= d.limit && d.limit == cap, "{d:?}");
    if d.allowed {
        assert_eq!(d.retry_after_us, 0);
        return;
    }
    assert_eq!(d.delay_us, 0);
    if cost > cap {
        assert_eq!(
            d.retry_after_us, d.reset_after_us,
            "over-capacity wait is the reset"
        );
        return;
    }
    // Retry-After is exact: allowed at that instant, not a microsecond before.
    assert!(d.retry_after_us > 0, "{d:?}");
    assert!(
        limit.check(state, now + d.retry_after_us, cost).allowed,
        "{limit:?} not allowed after retry_after {d:?}"
    );
    assert!(
        !limit.check(state, now + d.retry_after_us - 1, cost).allowed,
        "{limit:?} allowed before retry_after {d:?}"
    );
    // Reset: the tier is back to full capacity.
    let full = limit.check(state, now + d.reset_after_us, cap);
    assert!(
        full.allowed && full.delay_us == 0,
        "{limit:?} not full at reset {d:?}"
    );
}

struct Harness {
    rt: tokio::runtime::Runtime,
    _redis: RedisServer,
    redis_url: String,
}

impl Harness {
    fn new() -> Self {
        let redis = RedisServer::start();
        Harness {
            rt: current_thread_runtime(),
            redis_url: redis.url(),
            _redis: redis,
        }
    }

    /// A manual clock, and a memory backend and a Redis backend on it.
    fn backends(&self) -> (ManualClock, Backend, Backend) {
        let clock = ManualClock::new(T0_US + 123_457);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let redis: Backend = RedisBackend::from_url(&self.redis_url)
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
            .into();
        (clock, memory, redis)
    }

    /// Runs one sequence through model, memory and Redis; returns the number
    /// of denied requests.
    fn run(&self, case: u64, a: Limit, b: Limit, ops: &[(u64, u8, u64)]) -> usize {
        let clock = ManualClock::new(T0_US + 123_457);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let redis: Backend = RedisBackend::from_url(&self.redis_url)
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
            .into();
        let mut model = Model::default();
        let mut admitted: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
        let mut denied = 0;
        for (i, &(step, key, cost)) in ops.iter().enumerate() {
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let checks = vec![
                TierCheck {
                    key: format!("p{case}:a:k{key}"),
                    limit: a,
                    cost,
                    home: None,
                },
                TierCheck {
                    key: format!("p{case}:b:all"),
                    limit: b,
                    cost: 1,
                    home: None,
                },
            ];
            let before: Vec<Option<State>> = checks
                .iter()
                .map(|c| model.state(&c.key, now).cloned())
                .collect();
            // A peek is one tier's check with nothing charged, on every
            // backend (Redis: the read-only lua/peek.lua).
            let peek = &checks[0];
            let cost_in = peek.cost.min(peek.limit.capacity() + 1);
            let want_peek = peek.limit.check(before[0].as_ref(), now, cost_in);
            for (name, backend, key) in [
                ("memory", &memory, peek.key.clone()),
                ("redis", &redis, peek.key.clone()),
            ] {
                let on_own = TierCheck {
                    key,
                    ..peek.clone()
                };
                let got = self.rt.block_on(backend.peek(&on_own)).unwrap();
                assert_eq!(
                    got.decisions,
                    vec![want_peek],
                    "{name} peek diverged at op {i}"
                );
                assert!(got.charges.is_empty());
            }
            let want = model.check(&checks, now);
            for ((c, d), s) in checks.iter().zip(&want).zip(&before) {
                check_invariants(&c.limit, s.as_ref(), now, c.cost, d);
            }
            let got_mem = self.rt.block_on(memory.check(checks.clone())).unwrap();
            let got_red = self.rt.block_on(redis.check(checks.clone())).unwrap();
            assert_eq!(got_mem.now_us, now);
            assert_eq!(got_red.now_us, now);
            assert_eq!(got_mem.decisions, want, "memory diverged at op {i}");
            assert_eq!(got_red.decisions, want, "redis diverged at op {i}");
            if want.iter().all(|d| d.allowed) {
                for c in &checks {
                    admitted
                        .entry(c.key.clone())
                        .or_default()
                        .push((now, c.cost));
                }
            } else {
                denied += 1;
            }
        }
        // Sliding log exactness: no window-length span holds more than the limit.
        for (limit, prefix) in [(a, "a"), (b, "b")] {
            if let Limit::SlidingWindowLog(w) = limit {
                for (key, log) in admitted
                    .iter()
                    .filter(|(k, _)| k.contains(&format!(":{prefix}:")))
                {
                    for &(t, _) in log {
                        let used: u64 = log
                            .iter()
                            .filter(|(u, _)| *u <= t && u + w.window_us > t)
                            .map(|(_, c)| c)
                            .sum();
                        assert!(used <= w.limit, "{key}: {used} in the window ending {t}");
                    }
                }
            }
        }
        denied
    }
}

fn ops() -> impl Strategy<Value = Vec<(u64, u8, u64)>> {
    prop::collection::vec(
        (
            clock_step(),
            0u8..3,
            prop_oneof![8 => Just(1u64), 3 => 1u64..=4, 1 => 5u64..=8],
        ),
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn model_memory_and_redis_agree(pair in (0usize..7, 0usize..7), ops in ops()) {
        thread_local!(static H: Harness = Harness::new());
        let all = algorithm_limits();
        let (a, b) = (all[pair.0].1, all[pair.1].1);
        H.with(|h| {
            let case = rand_case();
            h.run(case, a, b, &ops);
        });
    }
}

fn rand_case() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Every algorithm against itself and every other, on a long fixed sequence:
/// a deterministic complement to the random cases above.
#[test]
fn every_pair_on_a_long_sequence() {
    let h = Harness::new();
    let mut rng = Rng::with_multiplier(0x2545_F491_4F6C_DD1D, 0x9E37_79B9_7F4A_7C15);
    let mut next = move || rng.next();
    let ops: Vec<(u64, u8, u64)> = (0..300)
        .map(|_| {
            let step = match next() % 4 {
                0 => 0,
                1 => next() % 300_000,
                _ => next() % 2_000_000,
            };
            (step, (next() % 3) as u8, 1 + next() % 3)
        })
        .collect();
    let all = algorithm_limits();
    for (i, (na, a)) in all.iter().enumerate() {
        for (j, (nb, b)) in all.iter().enumerate() {
            let denied = h.run(1_000_000 + (i * 10 + j) as u64, *a, *b, &ops);
            assert!(
                denied > 0 && denied < ops.len(),
                "{na}×{nb}: {denied} denied proves little"
            );
        }
    }
}

/// The concurrency tier, proved like the others: random sequences of
/// takes (a fresh slot id each, checked all or nothing with a rate tier
/// on a shared key) and releases of held leases (the backends' refund, which
/// is also a cross-slot refund's), with clock steps past slot expiries:
/// the model, the memory backend and the Redis scripts return identical
/// decisions, and every denial's Retry-After is between 1 µs and 1 s.
#[test]
fn concurrency_model_memory_and_redis_agree() {
    use tiered_ratelimit::algorithm::{Concurrency, RETRY_ESTIMATE_US};
    use tiered_ratelimit::backend::{Charge, TierRefund};
    let (h, mut next) = (Harness::new(), seeded());
    let c = Concurrency {
        limit: 3,
        ttl_us: 4 * S,
        slot: 0,
    };
    for (case, (_, rate)) in algorithm_limits().into_iter().enumerate() {
        let (clock, memory, redis) = h.backends();
        let mut model = Model::default();
        // Held slots: (check, charged at).
        let mut held: Vec<(TierCheck, u64)> = Vec::new();
        let (mut admitted, mut denied) = (0, 0);
        for op in 0..400u64 {
            let step = match next() % 4 {
                0 => 0,
                1 => next() % 300_000,
                2 => next() % 1_500_000,
                _ => next() % 5_000_000,
            };
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            if !held.is_empty() && next() % 3 == 0 {
                let (check, at) = held.swap_remove((next() % held.len() as u64) as usize);
                let refund = TierRefund {
                    check: check.clone(),
                    charge: Charge {
                        at_us: at,
                        undo: 0,
                        next_after_us: 0,
                    },
                    debt: false,
                };
                model.refund(&check, now, at, 0);
                h.rt.block_on(memory.refund(vec![refund.clone()])).unwrap();
                h.rt.block_on(redis.refund(vec![refund])).unwrap();
                continue;
            }
            let key = next() % 2;
            let checks = vec![
                TierCheck {
                    key: format!("c{case}:inflight:k{key}"),
                    limit: Limit::Concurrency(c.with_slot(op + 1)),
                    cost: 1,
                    home: None,
                },
                TierCheck {
                    key: format!("c{case}:rate:all"),
                    limit: rate,
                    cost: 1,
                    home: None,
                },
            ];
            let want = model.check(&checks, now);
            let got_mem = h.rt.block_on(memory.check(checks.clone())).unwrap();
            let got_red = h.rt.block_on(redis.check(checks.clone())).unwrap();
            assert_eq!(got_mem.decisions, want, "memory diverged at op {op}");
            assert_eq!(got_red.decisions, want, "redis diverged at op {op}");
            let peek = h.rt.block_on(redis.peek(&checks[0])).unwrap();
            assert_eq!(
                peek.decisions[0],
                model_peek(&model, &checks[0], now),
                "redis peek diverged at op {op}"
            );
            let d = &want[0];
            if !d.allowed {
                assert!((1..=RETRY_ESTIMATE_US).contains(&d.retry_after_us), "{d:?}");
            }
            if want.iter().all(|d| d.allowed) {
                admitted += 1;
                held.push((checks[0].clone(), now));
            } else {
                denied += 1;
            }
        }
        assert!(
            admitted > 20 && denied > 20,
            "{admitted} admitted, {denied} denied"
        );
    }
}

/// The penalty box, proved like the algorithms: behind every algorithm, on
/// random sequences (keys, clock steps past windows, blocks and the
/// memory of offences), the model, the memory backend and the Redis
/// scripts return identical decisions: the same strikes, the same blocks
/// and backoffs, the same Retry-After.
#[test]
fn penalty_box_model_memory_and_redis_agree() {
    use tiered_ratelimit::algorithm::{PenaltyBox, PENALTY_KEY_SUFFIX};
    let (h, mut next) = (Harness::new(), seeded());
    let p = PenaltyBox {
        violations: 2,
        window_us: 3 * S,
        block_us: 2 * S,
        backoff: 2,
        memory_us: 10 * S,
        max_block_us: 7 * S,
    };
    for (case, (name, rate)) in algorithm_limits().into_iter().enumerate() {
        let (clock, memory, redis) = h.backends();
        let mut model = Model::default();
        let mut blocks = 0;
        for op in 0..400 {
            let step = match next() % 5 {
                0 | 1 => 0,
                2 => next() % 300_000,
                3 => next() % 1_500_000,
                _ => next() % 6_000_000,
            };
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let key = format!("pb{case}:t:k{}", next() % 2);
            let checks = vec![
                TierCheck {
                    key: key.clone(),
                    limit: rate,
                    cost: 1 + next() % 2,
                    home: None,
                },
                TierCheck {
                    key: format!("{key}{PENALTY_KEY_SUFFIX}"),
                    limit: Limit::Penalty(p),
                    cost: 1,
                    home: None,
                },
            ];
            let want = model.check(&checks, now);
            let got_mem = h.rt.block_on(memory.check(checks.clone())).unwrap();
            let got_red = h.rt.block_on(redis.check(checks.clone())).unwrap();
            assert_eq!(
                got_mem.decisions, want,
                "{name}: memory diverged at op {op}"
            );
            assert_eq!(got_red.decisions, want, "{name}: redis diverged at op {op}");
            if !want[1].allowed && want[1].retry_after_us > p.block_us {
                blocks += 1;
            }
        }
        assert!(blocks > 0, "{name}: no repeat offence was tried");
    }
}

/// A key listed twice in one check (a `Backend::check` caller's list; the
/// layer's keys carry their tier's name, so it never lists one twice):
/// every listing is decided on the key's state before the check and, when
/// all allow, charged in turn, each charge on the last. The model, the
/// memory backend and the Redis scripts agree on every algorithm, with the
/// key alone and beside a second tier, on a fixed random sequence.
#[test]
fn a_key_listed_twice_agrees_on_model_memory_and_redis() {
    let (h, mut next) = (Harness::new(), seeded());
    for (case, (name, limit)) in algorithm_limits().into_iter().enumerate() {
        let (clock, memory, redis) = h.backends();
        let mut model = Model::default();
        let mut outcomes = Outcomes::default();
        let ops = listed_twice_ops(&mut next, &format!("dup{case}"), limit, 300, false);
        for (op, (step, checks)) in ops.into_iter().enumerate() {
            clock.advance(Duration::from_micros(step));
            let want = model.check(&checks, clock.now_us());
            let got_mem = h.rt.block_on(memory.check(checks.clone())).unwrap();
            let got_red = h.rt.block_on(redis.check(checks)).unwrap();
            assert_eq!(
                got_mem.decisions, want,
                "{name}: memory diverged at op {op}"
            );
            assert_eq!(got_red.decisions, want, "{name}: redis diverged at op {op}");
            outcomes.note(&want);
        }
        outcomes.assert_both(name);
    }
}

/// A token bucket listed twice at its last token: the first listing takes
/// it, the second no longer fits and charges nothing, so giving the second
/// listing's charge back (a refund by response status) gives nothing back,
/// on memory and on Redis; giving the first's back frees its token.
#[test]
fn the_refund_of_a_listing_that_no_longer_fit_gives_nothing_back() {
    use tiered_ratelimit::backend::TierRefund;
    let h = Harness::new();
    let (_clock, memory, redis) = h.backends();
    let k = TierCheck {
        key: "refund-twice:k".to_owned(),
        limit: Limit::TokenBucket(TokenBucket::new(2, 3_600 * S, 2).unwrap()),
        cost: 1,
        home: None,
    };
    for (name, backend) in [("memory", &memory), ("redis", &redis)] {
        let one = |b: &Backend| h.rt.block_on(b.check(vec![k.clone()])).unwrap();
        assert!(one(backend).allowed(), "{name}");
        let twice =
            h.rt.block_on(backend.check(vec![k.clone(), k.clone()]))
                .unwrap();
        assert!(twice.allowed(), "{name}: both decided on the last token");
        let refund = |i: usize| TierRefund {
            check: k.clone(),
            charge: twice.charges[i].expect("charged"),
            debt: false,
        };
        h.rt.block_on(backend.refund(vec![refund(1)])).unwrap();
        // A peek decides a request of cost 1: denied with no token left,
        // allowed (none left after it) with one.
        let peek = h.rt.block_on(backend.peek(&k)).unwrap();
        assert!(!peek.decisions[0].allowed, "{name}: nothing given back");
        assert_eq!(peek.decisions[0].retry_after_us, 1_800 * S, "{name}");
        h.rt.block_on(backend.refund(vec![refund(0)])).unwrap();
        let peek = h.rt.block_on(backend.peek(&k)).unwrap();
        assert!(peek.decisions[0].allowed, "{name}: the first's token back");
        assert_eq!(peek.decisions[0].remaining, 0, "{name}");
    }
}

/// One key listed under a sliding log, then a fixed window (two limits on
/// one key, which the backends do not reconcile): the window's charge
/// reads the log's sorted set as no value, as the check's read did,
/// rather than failing the check with WRONGTYPE (as the charge-again's
/// read did for a moment); both backends decide it alike.
#[test]
fn a_key_listed_under_a_log_then_a_window_is_not_an_error() {
    let h = Harness::new();
    let (_clock, memory, redis) = h.backends();
    let at = |limit| TierCheck {
        key: "log-then-window:k".to_owned(),
        limit,
        cost: 1,
        home: None,
    };
    let checks = vec![
        at(Limit::SlidingWindowLog(Window {
            limit: 6,
            window_us: 3 * S,
        })),
        at(Limit::FixedWindow(Window {
            limit: 5,
            window_us: 2 * S,
        })),
    ];
    let got_mem = h.rt.block_on(memory.check(checks.clone())).unwrap();
    let got_red = h.rt.block_on(redis.check(checks)).unwrap();
    assert_eq!(got_red.decisions, got_mem.decisions);
    let remaining: Vec<u64> = got_red.decisions.iter().map(|d| d.remaining).collect();
    assert_eq!(remaining, [5, 4]);
}

/// A fixed random sequence (the same every run).
fn seeded() -> impl FnMut() -> u64 {
    let mut rng = Rng::with_multiplier(0x2545_F491_4F6C_DD1D, 0x9E37_79B9_7F4A_7C15);
    move || rng.next()
}

/// The model's answer to a peek: the check, nothing charged.
fn model_peek(model: &Model, c: &TierCheck, now: u64) -> TierDecision {
    c.limit.check(model.state(&c.key, now), now, c.cost)
}

/// The fixed window's documented boundary burst: 2 × limit within a span
/// far shorter than the window.
#[test]
fn fixed_window_boundary_burst_is_twice_the_limit() {
    let w = Window {
        limit: 10,
        window_us: 60 * S,
    };
    let limit = Limit::FixedWindow(w);
    let mut model = Model::default();
    let end_of_window = T0_US - T0_US % (60 * S) + 60 * S - 1;
    let mut admitted = 0;
    for now in [end_of_window, end_of_window + 2] {
        for _ in 0..15 {
            let c = TierCheck {
                key: "k".into(),
                limit,
                cost: 1,
                home: None,
            };
            if model.check(&[c], now)[0].allowed {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 20, "2 × limit within 2 µs");
    // The sliding log admits only the limit in the same pattern.
    let log = Limit::SlidingWindowLog(w);
    let mut model = Model::default();
    let mut admitted = 0;
    for now in [end_of_window, end_of_window + 2] {
        for _ in 0..15 {
            let c = TierCheck {
                key: "k".into(),
                limit: log,
                cost: 1,
                home: None,
            };
            if model.check(&[c], now)[0].allowed {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 10);
}

/// Police GCRA and the token bucket are the same meter.
#[test]
fn police_leaky_bucket_equals_token_bucket() {
    let tb = TokenBucket::new(7, 60 * S, 4).unwrap();
    let a = Limit::TokenBucket(tb);
    let b = Limit::LeakyBucket(Gcra {
        bucket: tb,
        max_delay_us: None,
    });
    let (mut ma, mut mb) = (Model::default(), Model::default());
    let mut now = T0_US;
    let mut x = 7u64;
    for _ in 0..20_000 {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        now += (x >> 33) % 9_000_000;
        let cost = 1 + (x >> 20) % 3;
        let da = ma.check(
            &[TierCheck {
                key: "k".into(),
                limit: a,
                cost,
                home: None,
            }],
            now,
        );
        let db = mb.check(
            &[TierCheck {
                key: "k".into(),
                limit: b,
                cost,
                home: None,
            }],
            now,
        );
        assert_eq!(da, db);
    }
}

/// The sliding window counter's error against the exact log, for the
/// adversarial boundary pattern: documented in docs/algorithms.md.
#[test]
fn sliding_counter_error_bound() {
    let w = Window {
        limit: 100,
        window_us: 60 * S,
    };
    let counter = Limit::SlidingWindowCounter(w);
    let mut model = Model::default();
    let mut times = Vec::new();
    // Flood once per 10 ms across three windows.
    let mut now = T0_US;
    while now < T0_US + 180 * S {
        let c = TierCheck {
            key: "k".into(),
            limit: counter,
            cost: 1,
            home: None,
        };
        if model.check(&[c], now)[0].allowed {
            times.push(now);
        }
        now += 10_000;
    }
    let worst = times
        .iter()
        .map(|&t| {
            times
                .iter()
                .filter(|&&u| u <= t && u + w.window_us > t)
                .count()
        })
        .max()
        .unwrap();
    // The interpolation assumes the previous window's requests were spread
    // evenly; a flood front-loads them, so a true 60 s span holds up to a
    // third more than the limit here (never more than 2 × limit in general).
    // docs/algorithms.md quotes this number.
    assert_eq!(worst, 133, "worst 60 s span under a 100/min flood");
}

/// The largest quota each algorithm accepts (the bounds on `Quota`, which
/// tests/setup/config.rs checks `build()` enforces): model, memory and Redis give
/// identical answers for costs from 1 to the capacity + 1 (the most the
/// layer ever sends), so no value the script computes has left 2^53.
#[test]
fn largest_accepted_quotas_agree() {
    const P52: u64 = 1 << 52;
    let h = Harness::new();
    let bucket_fast = TokenBucket::new(1 << 51, 1, P52).unwrap();
    let bucket_slow = TokenBucket::new(1, 1 << 20, 1 << 32).unwrap();
    let cases = [
        (
            "fixed",
            Limit::FixedWindow(Window {
                limit: P52 - 1,
                window_us: 60 * S,
            }),
        ),
        (
            "log",
            Limit::SlidingWindowLog(Window {
                limit: P52 - 1,
                window_us: 60 * S,
            }),
        ),
        (
            "counter",
            Limit::SlidingWindowCounter(Window {
                limit: 4_503_599_626,
                window_us: S,
            }),
        ),
        ("bucket_fast", Limit::TokenBucket(bucket_fast)),
        ("bucket_slow", Limit::TokenBucket(bucket_slow)),
        (
            "police",
            Limit::LeakyBucket(Gcra {
                bucket: bucket_slow,
                max_delay_us: None,
            }),
        ),
        (
            "shape",
            Limit::LeakyBucket(Gcra {
                bucket: TokenBucket::new(1, 1 << 20, (1 << 32) - (1 << 20)).unwrap(),
                max_delay_us: Some(1 << 40),
            }),
        ),
    ];
    for (i, (name, limit)) in cases.iter().enumerate() {
        let cap = limit.capacity();
        let ops = vec![
            (0, 0, 1),
            (0, 0, cap / 2),
            (0, 0, cap / 2),
            (0, 0, cap + 1),
            (1, 0, 1),
            (0, 0, cap - 1),
            (S / 3, 0, cap / 3),
            (S, 0, 1),
            (0, 1, cap),
            (0, 1, 1),
            (0, 1, cap + 1),
            (3, 1, 2),
            (S / 2, 2, cap - 1),
            (0, 2, 3),
            (61 * S, 0, cap + 1),
            (0, 0, cap),
            (0, 0, 1),
            (1 << 20, 0, 1),
        ];
        let denied = h.run(3_000_000 + i as u64, *limit, *limit, &ops);
        assert!(denied > 0 && denied < ops.len(), "{name}: {denied} denied");
    }
}

/// A quota change mid-sequence on one key: every check picks one of
/// several quotas of the same algorithm (rate 1, whose TAT is one integer
/// that carries over to any quota; rates 2..44, whose TAT is one coded
/// integer read under any quota of the same rate, whatever its unit; and a
/// rate above 44, a string, read the same way). The model, the memory
/// backend and the Redis scripts return identical decisions, and the
/// model's keep the invariants (Retry-After and Reset tell the truth).
/// Returns the number of denied requests.
fn quota_changes_agree(h: &Harness, case: u64, quotas: &[Limit], ops: &[(u64, u8, u64)]) -> usize {
    let mut denied = 0;
    let clock = ManualClock::new(T0_US + 777);
    let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
    let redis: Backend = RedisBackend::from_url(&h.redis_url)
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    let mut model = Model::default();
    for (i, &(step, q, cost)) in ops.iter().enumerate() {
        clock.advance(Duration::from_micros(step));
        let now = clock.now_us();
        // The first quota is the tier's configured one: the others are
        // run-time changes (what the engine sends as `home`).
        let limit = quotas[usize::from(q) % quotas.len()];
        let check = TierCheck {
            key: format!("q{case}:k"),
            limit,
            cost,
            home: (limit != quotas[0]).then_some(quotas[0]),
        };
        // What the key holds for this quota: carried over a change.
        let before = model.state(&check.key, now).cloned();
        let before = check
            .limit
            .carry(before.as_ref(), now)
            .map(|(s, _)| s)
            .or(before);
        let want = model.check(std::slice::from_ref(&check), now);
        check_invariants(&check.limit, before.as_ref(), now, cost, &want[0]);
        let got_mem = h.rt.block_on(memory.check(vec![check.clone()])).unwrap();
        let got_red = h.rt.block_on(redis.check(vec![check.clone()])).unwrap();
        assert_eq!(got_mem.decisions, want, "memory diverged at op {i}");
        assert_eq!(got_red.decisions, want, "redis diverged at op {i}");
        denied += usize::from(!want[0].allowed);
    }
    denied
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_quota_change_agrees(
        set in 0usize..5,
        ops in prop::collection::vec(
            (clock_step(), 0u8..8, prop_oneof![4 => Just(1u64), 1 => 1u64..=3]),
            1..60,
        ),
    ) {
        thread_local!(static H: Harness = Harness::new());
        H.with(|h| quota_changes_agree(h, rand_case(), &quota_change_sets()[set], &ops));
    }
}

/// The same on a long fixed sequence of each set, every quota change
/// reached.
#[test]
fn quota_changes_on_a_long_sequence() {
    let h = Harness::new();
    let mut rng = Rng::with_multiplier(0x2545_F491_4F6C_DD1D, 0x9E37_79B9_7F4A_7C15);
    let ops: Vec<(u64, u8, u64)> = (0..400)
        .map(|_| {
            let step = match rng.next() % 4 {
                0 => 0,
                1 => rng.next() % 300_000,
                2 => rng.next() % 3_000_000,
                _ => rng.next() % 40_000_000,
            };
            (step, (rng.next() % 8) as u8, 1 + rng.next() % 2)
        })
        .collect();
    for (i, set) in quota_change_sets().iter().enumerate() {
        let denied = quota_changes_agree(&h, 2_000_000 + i as u64, set, &ops);
        assert!(
            denied > 20 && denied + 20 < ops.len(),
            "set {i}: {denied} denied of {} proves little",
            ops.len()
        );
    }
}
