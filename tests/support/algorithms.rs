//! The shared algorithm tables: the limits every model-agreement test runs
//! (tests/algorithms/algorithms.rs, tests/algorithms/refunds.rs, tests/redis/cluster.rs), the oracle
//! they are checked against, and the clock steps their sequences draw.

use proptest::prelude::*;
use std::collections::HashMap;
use tiered_ratelimit::algorithm::{
    CalendarWindow, Gcra, Limit, Refund, State, TierDecision, TokenBucket, Window,
};
use tiered_ratelimit::backend::TierCheck;

/// One second in microseconds.
pub const S: u64 = 1_000_000;

/// One limit of every algorithm, named: odd windows (1.7 s, 2.5 s) so
/// windows and seconds do not line up, a token bucket with a burst above
/// its rate, the leaky bucket policing and shaping.
pub fn algorithm_limits() -> Vec<(&'static str, Limit)> {
    let tb = TokenBucket::new(3, 7 * S, 5).unwrap();
    vec![
        (
            "fixed",
            Limit::FixedWindow(Window {
                limit: 5,
                window_us: 2 * S,
            }),
        ),
        (
            "fixed_odd",
            Limit::FixedWindow(Window {
                limit: 4,
                window_us: 1_700_001,
            }),
        ),
        (
            // Calendar windows of unequal length around T0 (1.3 s, 2.3 s),
            // and the guessed ones outside them.
            "calendar",
            Limit::Calendar(CalendarWindow {
                limit: 4,
                bounds: [
                    super::T0_US - 1_300_000,
                    super::T0_US,
                    super::T0_US + 2_300_000,
                ],
            }),
        ),
        (
            "log",
            Limit::SlidingWindowLog(Window {
                limit: 6,
                window_us: 3 * S,
            }),
        ),
        (
            "counter",
            Limit::SlidingWindowCounter(Window {
                limit: 6,
                window_us: 2_500_000,
            }),
        ),
        ("bucket", Limit::TokenBucket(tb)),
        (
            "police",
            Limit::LeakyBucket(Gcra {
                bucket: tb,
                max_delay_us: None,
            }),
        ),
        (
            "shape",
            Limit::LeakyBucket(Gcra {
                bucket: TokenBucket::new(2, S, 1).unwrap(),
                max_delay_us: Some(1_500_000),
            }),
        ),
    ]
}

/// [`algorithm_limits`] without the one named `left_out`, in the same order.
pub fn algorithm_limits_without(left_out: &str) -> Vec<(&'static str, Limit)> {
    let mut all = algorithm_limits();
    let before = all.len();
    all.retain(|(name, _)| *name != left_out);
    assert_eq!(all.len(), before - 1, "no limit named {left_out}");
    all
}

/// The oracle: the models applied by hand, all or nothing, with expiry.
#[derive(Default)]
pub struct Model {
    keys: HashMap<String, (State, u64)>,
}

impl Model {
    pub fn state(&self, key: &str, now: u64) -> Option<&State> {
        self.keys
            .get(key)
            .filter(|(_, exp)| *exp > now)
            .map(|(s, _)| s)
    }

    /// Gives back a charge made at `charged_at` (as the backends' refund).
    pub fn refund(&mut self, c: &TierCheck, now: u64, charged_at: u64, undo: u64) {
        let Some((state, exp)) = self.keys.get(&c.key).filter(|(_, e)| *e > now).cloned() else {
            return;
        };
        match c.limit.refund(Some(&state), now, charged_at, c.cost, undo) {
            Refund::Keep => {}
            Refund::Delete => {
                self.keys.remove(&c.key);
            }
            Refund::Store(s, ttl) => {
                self.keys
                    .insert(c.key.clone(), (s, ttl.map_or(exp, |t| now + t)));
            }
            _ => unreachable!("a refund the model does not know"),
        }
    }

    /// A penalty box (right after its tier) sees its tier's decision and
    /// writes its strike whatever the commit; it is never charged.
    ///
    /// A state written under another quota is carried over first
    /// (`Limit::carry`), and the carried state stored whatever the commit
    /// (for a key's first listing).
    pub fn check(&mut self, checks: &[TierCheck], now: u64) -> Vec<TierDecision> {
        let mut ds: Vec<TierDecision> = Vec::with_capacity(checks.len());
        let mut strikes = Vec::new();
        let mut carried = Vec::new();
        for (i, c) in checks.iter().enumerate() {
            if checks[..i].iter().any(|o| o.key == c.key) {
                continue;
            }
            if let Some(w) = c.limit.carry(self.state(&c.key, now), now) {
                carried.push((c.key.clone(), w));
            }
        }
        for (key, (s, ttl)) in carried {
            self.keys.insert(key, (s, now + ttl));
        }
        for c in checks {
            let state = self.state(&c.key, now);
            let tier_allowed = ds.last().is_none_or(|d| d.allowed);
            match c.limit.penalty_check(state, now, tier_allowed) {
                Some((d, write)) => {
                    ds.push(d);
                    if let Some(w) = write {
                        strikes.push((c.key.clone(), w));
                    }
                }
                None => ds.push(c.limit.check(state, now, c.cost)),
            }
        }
        if ds.iter().all(|d| d.allowed) {
            for c in checks.iter().filter(|c| !c.limit.is_penalty()) {
                let old = self.state(&c.key, now).cloned();
                let (s, ttl) = c.limit.charge(old, now, c.cost);
                self.keys.insert(c.key.clone(), (s, now + ttl));
            }
        }
        for (key, (s, ttl)) in strikes {
            self.keys.insert(key, (s, now + ttl));
        }
        ds
    }
}

impl Model {
    /// [`Model::check`] with the checks whose bit is set in `shadow` in
    /// shadow mode (their denial does not stop the commit; each allowing
    /// check is charged when every enforced one allows), then the last
    /// `live_of.len()` checks as candidate quotas, each of the live check
    /// at its index in `live_of`: decided on its own state, and charged
    /// when it allows and every enforced live check but its own allows,
    /// whatever the live commit (docs/rollout.md, "Candidate quotas").
    /// No penalty box or key listed twice among them.
    pub fn check_candidates(
        &mut self,
        checks: &[TierCheck],
        shadow: u64,
        live_of: &[u8],
        now: u64,
    ) -> Vec<TierDecision> {
        let n = checks.len() - live_of.len();
        let live = &checks[..n];
        for c in live {
            if let Some((s, ttl)) = c.limit.carry(self.state(&c.key, now), now) {
                self.keys.insert(c.key.clone(), (s, now + ttl));
            }
        }
        let mut ds: Vec<TierDecision> = live
            .iter()
            .map(|c| c.limit.check(self.state(&c.key, now), now, c.cost))
            .collect();
        let shadowed = |i: usize| shadow & (1 << i) != 0;
        let commits = ds.iter().enumerate().all(|(i, d)| d.allowed || shadowed(i));
        if commits {
            for (c, d) in live.iter().zip(&ds) {
                if d.allowed {
                    let old = self.state(&c.key, now).cloned();
                    let (s, ttl) = c.limit.charge(old, now, c.cost);
                    self.keys.insert(c.key.clone(), (s, now + ttl));
                }
            }
        }
        for (c, &of) in checks[n..].iter().zip(live_of) {
            let d = c.limit.check(self.state(&c.key, now), now, c.cost);
            let others = ds[..n]
                .iter()
                .enumerate()
                .all(|(i, d)| d.allowed || shadowed(i) || i == usize::from(of));
            if d.allowed && others {
                let old = self.state(&c.key, now).cloned();
                let (s, ttl) = c.limit.charge(old, now, c.cost);
                self.keys.insert(c.key.clone(), (s, now + ttl));
            }
            ds.push(d);
        }
        ds
    }
}

/// `ops` checks of `limit` listing a key twice, each after a clock step
/// (µs: often none, mostly under a window): `<prefix>:k0` or `:k1` first
/// at cost 1 or 2, then, always when `beside` (else one time in two),
/// `<prefix>:other` at 1, then the key again at 1. The sequence of the
/// `a_key_listed_twice_*` tests, which run it through the model and the
/// backends (`next`: a seeded generator).
pub fn listed_twice_ops(
    next: &mut impl FnMut() -> u64,
    prefix: &str,
    limit: Limit,
    ops: usize,
    beside: bool,
) -> Vec<(u64, Vec<TierCheck>)> {
    let at = |key: String, cost| TierCheck {
        key,
        limit,
        cost,
        home: None,
    };
    (0..ops)
        .map(|_| {
            let step = match next() % 4 {
                0 => 0,
                1 => next() % 300_000,
                _ => next() % 2_000_000,
            };
            let key = format!("{prefix}:k{}", next() % 2);
            let mut checks = vec![at(key.clone(), 1 + next() % 2)];
            if beside || next().is_multiple_of(2) {
                checks.push(at(format!("{prefix}:other"), 1));
            }
            checks.push(at(key, 1));
            (step, checks)
        })
        .collect()
}

/// Counts a sequence's requests allowed and denied: a sequence that never
/// allows, or never denies, proves little.
#[derive(Default)]
pub struct Outcomes {
    allowed: usize,
    denied: usize,
}

impl Outcomes {
    pub fn note(&mut self, decisions: &[TierDecision]) {
        if decisions.iter().all(|d| d.allowed) {
            self.allowed += 1;
        } else {
            self.denied += 1;
        }
    }

    /// Panics unless both were seen.
    pub fn assert_both(&self, what: &str) {
        assert!(
            self.allowed > 0 && self.denied > 0,
            "{what}: {} allowed, {} denied proves little",
            self.allowed,
            self.denied
        );
    }
}

/// A clock advance between two operations (µs): often none, mostly under a
/// window, sometimes past every window's expiry.
pub fn clock_step() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => Just(0u64),
        4 => 0u64..300_000,
        3 => 0u64..3_000_000,
        1 => 0u64..20_000_000,
    ]
}

/// A tier's spec argument as this release's scripts take it:
/// "<algorithm> <p1> <p2> <p3> <p4> <cost> <flags>" (src/backend/redis/wire/).
pub fn script_spec(limit: &Limit, cost: u64, flags: u8) -> String {
    let [a, p1, p2, p3, p4] = script_args(limit);
    format!("{a} {p1} {p2} {p3} {p4} {cost} {flags}")
}

/// A limit as the Lua scripts take it: the algorithm number, then p1..p4
/// (src/backend/redis/wire/); the previous release's scripts take these as
/// separate arguments, followed by the cost and the flags.
pub fn script_args(limit: &Limit) -> [i64; 5] {
    let i = |v: u64| v as i64;
    match *limit {
        Limit::FixedWindow(w) => [1, i(w.limit), i(w.window_us), 0, 0],
        Limit::SlidingWindowLog(w) => [2, i(w.limit), i(w.window_us), 0, 0],
        Limit::SlidingWindowCounter(w) => [3, i(w.limit), i(w.window_us), 0, 0],
        Limit::TokenBucket(b) => [4, i(b.capacity), i(b.rate), i(b.unit), 0],
        Limit::LeakyBucket(g) => [
            5,
            i(g.bucket.capacity),
            i(g.bucket.rate),
            i(g.bucket.unit),
            g.max_delay_us.map_or(-1, i),
        ],
        Limit::Calendar(c) => [
            9,
            i(c.limit),
            i(c.bounds[0]),
            i(c.bounds[1]),
            i(c.bounds[2]),
        ],
        _ => unreachable!("a limit the scripts do not know"),
    }
}

/// Quotas a tier's quota changes among, per set: the first is the tier's
/// configured one (its `home`), the others run-time changes. Buckets of
/// rates 1, 3, 7 (under two units), 43 and 47; leaky buckets of the same;
/// fixed windows and sliding counters of five lengths; logs of one window.
pub fn quota_change_sets() -> [Vec<Limit>; 5] {
    let w = |limit, window_us| Window { limit, window_us };
    let tb = |limit, period_us, burst| TokenBucket::new(limit, period_us, burst).unwrap();
    let leaky = |b, max_delay_us| {
        Limit::LeakyBucket(Gcra {
            bucket: b,
            max_delay_us,
        })
    };
    [
        vec![
            // Rate 1: 60/min, 10/s, 20/min; rate 7 (7/min, and 7 / 2 min:
            // another unit), rate 3 (3 / 7 s), rate 43 (the last coded
            // integers) and rate 47 (a string).
            Limit::TokenBucket(tb(60, 60 * S, 5)),
            Limit::TokenBucket(tb(10, S, 3)),
            Limit::TokenBucket(tb(20, 60 * S, 4)),
            Limit::TokenBucket(tb(7, 60 * S, 3)),
            Limit::TokenBucket(tb(3, 7 * S, 5)),
            Limit::TokenBucket(tb(7, 120 * S, 4)),
            Limit::TokenBucket(tb(43, 60 * S, 4)),
            Limit::TokenBucket(tb(47, 60 * S, 5)),
        ],
        vec![
            leaky(tb(60, 60 * S, 5), None),
            leaky(tb(10, S, 3), Some(300_000)),
            leaky(tb(20, 60 * S, 4), None),
            leaky(tb(7, 60 * S, 3), None),
            leaky(tb(3, 7 * S, 5), Some(2 * S)),
            leaky(tb(7, 120 * S, 4), None),
            leaky(tb(43, 60 * S, 4), Some(S)),
            leaky(tb(47, 60 * S, 5), None),
        ],
        // Windows of other lengths and limits: a fixed window's count
        // carries into the new window of now; a counter's estimate does; a
        // log keeps its entries.
        vec![
            Limit::FixedWindow(w(5, S)),
            Limit::FixedWindow(w(3, S)),
            Limit::FixedWindow(w(8, 7 * S)),
            Limit::FixedWindow(w(4, 300_000)),
            Limit::FixedWindow(w(20, 60 * S)),
        ],
        vec![
            Limit::SlidingWindowCounter(w(5, S)),
            Limit::SlidingWindowCounter(w(3, S)),
            Limit::SlidingWindowCounter(w(8, 7 * S)),
            Limit::SlidingWindowCounter(w(4, 300_000)),
            Limit::SlidingWindowCounter(w(20, 60 * S)),
        ],
        // A log's entries are its state under any limit. (Under another
        // window it counts the entries in that window that are still
        // stored: its key lives one window of the quota that wrote it past
        // its last entry, which Redis measures in its own time, not this
        // test's clock.)
        vec![
            Limit::SlidingWindowLog(w(5, S)),
            Limit::SlidingWindowLog(w(3, S)),
            Limit::SlidingWindowLog(w(8, S)),
            Limit::SlidingWindowLog(w(1, S)),
        ],
    ]
}
