//! Requests priced by their response (issue 29), the model: random
//! sequences of reservations (a check at the estimate) and settles (the
//! refund of `estimate − actual`, or the debt of `actual − estimate`) give
//! the same decisions on the pure model (`Limit::check/charge/refund/debt`),
//! the memory backend and a real Redis (`lua/refund.lua` through the
//! cluster script's refund mode); and on a clock that does not move, the
//! ledger is exact: after every settle the tier holds its capacity less
//! Σ actual, in debt when that is negative. The same under a per-key
//! override of another quota (the settle after the override's read).

use crate::support::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::time::Duration;
use tiered_ratelimit::algorithm::{Limit, Refund, State, TierDecision, TokenBucket, Window};
use tiered_ratelimit::backend::{
    Backend, Charge, ManualClock, MemoryBackend, TierCheck, TierRefund, Verdict,
};
use tiered_ratelimit::handle::Override;
use tiered_ratelimit::{key::Global, Algorithm, Quota, RateLimitLayer, Tier};

const S: u64 = 1_000_000;

/// The limits a priced tier may have.
fn priced_limits() -> Vec<Limit> {
    vec![
        // 10 tokens per second, burst 10.
        Limit::TokenBucket(TokenBucket::new(10, S, 10).unwrap()),
        // 7 per minute, burst 3: units that do not divide.
        Limit::TokenBucket(TokenBucket::new(7, 60 * S, 3).unwrap()),
        // 100 tokens per minute, burst 100.
        Limit::TokenBucket(TokenBucket::new(100, 60 * S, 100).unwrap()),
        // 12 per second, fixed.
        Limit::FixedWindow(Window {
            limit: 12,
            window_us: S,
        }),
    ]
}

/// The pure model of one key: its state and expiry.
#[derive(Default)]
struct Model {
    state: Option<(State, u64)>,
}

impl Model {
    fn live(&self, now: u64) -> Option<&State> {
        self.state
            .as_ref()
            .filter(|(_, exp)| *exp > now)
            .map(|(s, _)| s)
    }

    /// A reservation: check at the estimate, charge when allowed; the
    /// charge's undo value.
    fn reserve(
        &mut self,
        limit: &Limit,
        now: u64,
        cost: u64,
    ) -> (tiered_ratelimit::algorithm::TierDecision, Option<u64>) {
        let state = self.live(now).cloned();
        let d = limit.check(state.as_ref(), now, cost);
        if !d.allowed {
            return (d, None);
        }
        let (s, ttl) = limit.charge(state, now, cost);
        let undo = limit.undo_of(&s, now);
        self.state = Some((s, now + ttl));
        (d, Some(undo))
    }

    fn settle(&mut self, limit: &Limit, now: u64, at: u64, undo: u64, estimate: u64, actual: u64) {
        let state = self.live(now).cloned();
        if actual > estimate {
            if let Some((s, ttl)) = limit.debt(state.as_ref(), now, actual - estimate) {
                self.state = Some((s, now + ttl));
            }
        } else if actual < estimate {
            match limit.refund(state.as_ref(), now, at, estimate - actual, undo) {
                Refund::Keep => {}
                Refund::Delete => self.state = None,
                Refund::Store(s, ttl) => {
                    let exp = match ttl {
                        Some(t) => now + t,
                        None => self.state.as_ref().map_or(0, |(_, e)| *e),
                    };
                    self.state = Some((s, exp));
                }
                _ => unreachable!("no other refund"),
            }
        }
    }
}

/// The settle the layer sends for one reservation (as `engine/settle.rs`).
fn settle_of(check: &TierCheck, charge: Charge, estimate: u64, actual: u64) -> Option<TierRefund> {
    if actual == estimate {
        return None;
    }
    let mut check = check.clone();
    check.cost = estimate.abs_diff(actual);
    Some(TierRefund {
        check,
        charge,
        debt: actual > estimate,
    })
}

/// One op: advance the clock (µs), reserve `estimate` (its actual cost
/// `actual`), and maybe settle an earlier reservation (by index modulo
/// those open).
type Op = (u64, u64, u64, Option<usize>);

/// An open reservation: the check, the memory and Redis charges, the
/// model's (at, undo), the estimate and the actual.
type Open = (TierCheck, Charge, Charge, (u64, u64), u64, u64);

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        (
            prop_oneof![4 => Just(0u64), 2 => 1u64..200_000, 1 => 1u64..5 * S],
            1u64..=6,
            0u64..=12,
            prop::option::weighted(0.6, 0usize..1000),
        ),
        1..60,
    )
}

/// A property runner of `cases` cases, nothing persisted.
fn runner(cases: u32) -> proptest::test_runner::TestRunner {
    proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    })
}

#[test]
fn model_memory_and_redis_agree_on_reserve_and_settle() {
    let server = RedisServer::start();
    let rt = current_thread_runtime();
    let mut runner = runner(128);
    let cases = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&(0usize..4, ops()), |(which, ops)| {
            let case = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let limit = priced_limits()[which];
            let clock = ManualClock::new(T0_US + 123_457);
            let (redis, memory) = server.redis_and_memory(&clock);
            let twins = Twins {
                memory,
                redis,
                clock,
                key: format!("p{case}"),
                tier: limit,
                read: None,
            };
            twins.run(&rt, limit, &ops)
        })
        .unwrap();
}

/// The same under a per-key override of another quota: each check is the
/// override's read and its tier's (as the engine plans them), each settle
/// the read and its refund or debt (as `engine/settle.rs` sends them), and
/// the model runs on the override's limit throughout.
#[test]
fn under_an_override_model_memory_and_redis_agree() {
    let server = RedisServer::start();
    let rt = current_thread_runtime();
    let mut runner = runner(64);
    let cases = std::sync::atomic::AtomicU64::new(0);
    // The tier (10 a second, burst 10, or a fixed window of 12 a second)
    // and its override (25 a second, burst 25; a fixed window of 20).
    let pairs = [
        (
            Algorithm::TokenBucket,
            Quota::per_second(10),
            Quota::per_second(25),
            Limit::TokenBucket(TokenBucket::new(25, S, 25).unwrap()),
        ),
        (
            Algorithm::FixedWindow,
            Quota::per_second(12),
            Quota::per_second(20),
            Limit::FixedWindow(Window {
                limit: 20,
                window_us: S,
            }),
        ),
    ];
    runner
        .run(&(0usize..2, ops()), |(which, ops)| {
            let case = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (algorithm, quota, over, model_limit) = pairs[which];
            let tier = [priced_limits()[0], priced_limits()[3]][which];
            let clock = ManualClock::new(T0_US + 123_457);
            let (redis, memory) = server.redis_and_memory(&clock);
            let name = format!("o{case}");
            for b in [&memory, &redis] {
                let layer = RateLimitLayer::builder()
                    .backend(b.clone())
                    .tier(
                        Tier::new(name.clone(), Global, quota)
                            .algorithm(algorithm)
                            .overrides(true),
                    )
                    .build()
                    .unwrap();
                rt.block_on(layer.handle().set_override(
                    &name,
                    "all",
                    Override::Quota(over),
                    None,
                    "test",
                ))
                .unwrap();
            }
            let key = format!("rl:{name}:all");
            let twins = Twins {
                memory,
                redis,
                clock,
                read: Some(TierCheck {
                    key: format!("{key}{{ov}}"),
                    limit: Limit::Override,
                    cost: 1,
                    home: None,
                }),
                key,
                tier,
            };
            twins.run(&rt, model_limit, &ops)
        })
        .unwrap();
}

/// One key on both backends: checked with the tier's limit, after the
/// override's read `read` if any.
struct Twins {
    memory: Backend,
    redis: Backend,
    clock: ManualClock,
    key: String,
    tier: Limit,
    read: Option<TierCheck>,
}

impl Twins {
    /// `read` then the tier's check of `cost`.
    fn checks(&self, cost: u64) -> Vec<TierCheck> {
        let tier = TierCheck {
            key: self.key.clone(),
            limit: self.tier,
            cost,
            home: None,
        };
        self.read.iter().cloned().chain([tier]).collect()
    }

    /// The tier's decision and charge in a verdict (its limit as `limit`:
    /// the backends report the tier's own, the engine shows the override's).
    fn tier_of(&self, v: &Verdict, limit: &Limit) -> (TierDecision, Option<Charge>) {
        let i = usize::from(self.read.is_some());
        let mut d = v.decisions[i];
        d.limit = limit.capacity();
        (d, v.charges.get(i).copied().flatten())
    }

    /// The settle, after the override's read if any.
    fn settles(
        &self,
        c: &TierCheck,
        charge: Charge,
        estimate: u64,
        actual: u64,
    ) -> Vec<TierRefund> {
        let Some(s) = settle_of(c, charge, estimate, actual) else {
            return Vec::new();
        };
        let read = self.read.iter().map(|r| TierRefund {
            check: r.clone(),
            charge,
            debt: false,
        });
        read.chain([s]).collect()
    }

    /// Runs `ops` on both backends and on the model of `limit` (the tier's,
    /// or its override's).
    fn run(
        &self,
        rt: &tokio::runtime::Runtime,
        limit: Limit,
        ops: &[Op],
    ) -> Result<(), TestCaseError> {
        let (memory, redis, clock) = (&self.memory, &self.redis, &self.clock);
        let mut model = Model::default();
        let mut open: Vec<Open> = Vec::new();
        for (i, &(step, estimate, actual, settle)) in ops.iter().enumerate() {
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let checks = self.checks(estimate);
            let m = rt.block_on(memory.check(checks.clone())).unwrap();
            let r = rt.block_on(redis.check(checks.clone())).unwrap();
            let (m, r) = (self.tier_of(&m, &limit), self.tier_of(&r, &limit));
            let (d, undo) = model.reserve(&limit, now, estimate);
            prop_assert_eq!(m.0, r.0, "reserve: memory vs Redis at op {}", i);
            prop_assert_eq!(m.0, d, "reserve: memory vs model at op {}", i);
            if let Some(undo) = undo {
                let c = checks.last().unwrap().clone();
                open.push((c, m.1.unwrap(), r.1.unwrap(), (now, undo), estimate, actual));
            }
            if let (Some(k), false) = (settle, open.is_empty()) {
                let (c, mc, rc, (at, undo), estimate, actual) = open.remove(k % open.len());
                let ms = self.settles(&c, mc, estimate, actual);
                if !ms.is_empty() {
                    rt.block_on(memory.refund(ms)).unwrap();
                }
                let rs = self.settles(&c, rc, estimate, actual);
                if !rs.is_empty() {
                    rt.block_on(redis.refund(rs)).unwrap();
                }
                model.settle(&limit, now, at, undo, estimate, actual);
                // The state after the settle, read without charging (a
                // cost above the capacity is always denied and shows
                // remaining, reset and, in debt, the wait), as the key's
                // check reads it: with `limit`.
                for cost in [1, limit.capacity() + 1] {
                    let probe = TierCheck {
                        key: self.key.clone(),
                        limit,
                        cost,
                        home: None,
                    };
                    let m = rt.block_on(memory.peek(&probe)).unwrap();
                    let r = rt.block_on(redis.peek(&probe)).unwrap();
                    let d = limit.check(model.live(now), now, cost);
                    prop_assert_eq!(
                        &m.decisions,
                        &r.decisions,
                        "settle: memory vs Redis at op {}",
                        i
                    );
                    prop_assert_eq!(m.decisions[0], d, "settle: memory vs model at op {}", i);
                }
            }
        }
        Ok(())
    }
}

/// On a clock that does not move, every settle landed: a token bucket of
/// capacity C holds C − Σ actual (admitted requests), shown as `remaining`
/// when positive; in debt, `remaining` is 0 and the wait for one token is
/// exactly (Σ actual − C + 1) / rate.
#[test]
fn settled_ledger_is_exact_on_a_still_clock() {
    let server = RedisServer::start();
    let rt = current_thread_runtime();
    let limit = Limit::TokenBucket(TokenBucket::new(100, S, 100).unwrap());
    let clock = ManualClock::new(T0_US);
    for backend in [
        Backend::from(MemoryBackend::with_manual_clock(clock.clone())),
        server.backend_on(&clock).into(),
    ] {
        let key = |cost| TierCheck {
            key: "ledger".into(),
            limit,
            cost,
            home: None,
        };
        // Reserve 30 + 30 + 30 (90 of 100), then a 20 is denied.
        let mut charges = Vec::new();
        for _ in 0..3 {
            let v = rt.block_on(backend.check(vec![key(30)])).unwrap();
            assert!(v.decisions[0].allowed);
            charges.push(v.charges[0].unwrap());
        }
        let v = rt.block_on(backend.check(vec![key(20)])).unwrap();
        assert!(!v.decisions[0].allowed, "a denied request reserves nothing");
        // Actuals 10, 30 and 75: Σ = 115, 15 over the capacity.
        for (charge, actual) in charges.iter().zip([10, 30, 75]) {
            if let Some(s) = settle_of(&key(30), *charge, 30, actual) {
                rt.block_on(backend.refund(vec![s])).unwrap();
            }
        }
        let d = rt.block_on(backend.peek(&key(1))).unwrap().decisions[0];
        assert_eq!(
            (d.allowed, d.remaining, d.retry_after_us, d.reset_after_us),
            // 16 tokens to refill before one fits: 160 ms; full in 1.15 s.
            (false, 0, 160_000, 1_150_000),
            "{}",
            backend.name()
        );
        // 160 ms later exactly one token fits.
        clock.advance(Duration::from_micros(160_000));
        let d = rt.block_on(backend.peek(&key(1))).unwrap().decisions[0];
        assert_eq!((d.allowed, d.remaining), (true, 0), "{}", backend.name());
        clock.advance(Duration::from_micros(990_000));
        let d = rt.block_on(backend.peek(&key(1))).unwrap().decisions[0];
        assert_eq!((d.allowed, d.remaining), (true, 99), "{}", backend.name());
        clock.set(T0_US);
    }
}
