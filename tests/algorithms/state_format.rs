//! The state format on a real Redis (docs/redis.md, "Stored values"): the
//! exact value each algorithm writes, what an idle key costs (`MEMORY USAGE
//! … SAMPLES 0`), the integer forms against the model, what a quota change
//! does to a token bucket, and what a value the scripts never write reads
//! as.

use crate::support::algorithms::{Model, S};
use crate::support::rng::Rng;
use crate::support::*;
use std::time::Duration;
use tiered_ratelimit::algorithm::{Gcra, Limit, TierDecision, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend, TierCheck};

/// A typical per-client key: `rl:ip:<IPv4>` (17 characters).
const KEY: &str = "rl:ip:203.0.113.7";

fn per_minute(n: u64) -> TokenBucket {
    TokenBucket::new(n, 60 * S, n).unwrap()
}

fn window(limit: u64) -> Window {
    Window {
        limit,
        window_us: 60 * S,
    }
}

fn backend(redis: &RedisServer, clock: &ManualClock) -> Backend {
    RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into()
}

/// What one request at T0 leaves under `KEY`: the value (a string's, or the
/// log's one member), its object encoding and `MEMORY USAGE … SAMPLES 0`.
fn after_one_request(redis: &RedisServer, limit: Limit) -> (String, String, i64) {
    let _: () = redis.cmd(&["FLUSHALL"]);
    let clock = ManualClock::new(T0_US);
    let b = backend(redis, &clock);
    let rt = current_thread_runtime();
    let d = rt
        .block_on(b.check(vec![TierCheck {
            key: KEY.to_owned(),
            limit,
            cost: 1,
            home: None,
        }]))
        .unwrap();
    assert!(d.decisions[0].allowed);
    let kind: String = redis.cmd(&["TYPE", KEY]);
    let value = if kind == "zset" {
        let m: Vec<String> = redis.cmd(&["ZRANGE", KEY, "0", "-1"]);
        assert_eq!(m.len(), 1);
        m[0].clone()
    } else {
        redis.get(KEY).unwrap()
    };
    let encoding: String = redis.cmd(&["OBJECT", "ENCODING", KEY]);
    let bytes: i64 = redis.cmd(&["MEMORY", "USAGE", KEY, "SAMPLES", "0"]);
    (value, encoding, bytes)
}

/// Every algorithm's value after one request at T0 (1 700 000 000 s). The
/// figures are printed for perf/README.md.
#[test]
fn the_values_each_algorithm_writes() {
    let redis = RedisServer::start();
    let police = |b: TokenBucket| {
        Limit::LeakyBucket(Gcra {
            bucket: b,
            max_delay_us: None,
        })
    };
    // The window of T0 starts at 1 699 999 980 s (a multiple of 60 s).
    let cases = [
        (
            "token bucket 60/min (unit 10^6, rate 1)",
            Limit::TokenBucket(per_minute(60)),
            "1700000001000000",
        ),
        (
            "token bucket 300/min (unit 2 × 10^5, rate 1)",
            Limit::TokenBucket(per_minute(300)),
            "1700000000200000",
        ),
        (
            "token bucket 100/h (unit 3.6 × 10^7, rate 1)",
            Limit::TokenBucket(TokenBucket::new(100, 3_600 * S, 100).unwrap()),
            "1700000036000000",
        ),
        // A token every 7 812.5 µs: TAT T0 + 7 812 µs and 1 tick of 1/2 µs,
        // code 000 + 1 (rate 2 has codes 000-001).
        (
            "token bucket 128/s (unit 15 625, rate 2)",
            Limit::TokenBucket(TokenBucket::new(128, S, 128).unwrap()),
            "1700000000007812001",
        ),
        // A token every 8 571 428 4/7 µs: code 020 + 4 (rate 7: 020-026).
        (
            "token bucket 7/min (unit 6 × 10^7, rate 7)",
            Limit::TokenBucket(per_minute(7)),
            "1700000008571428024",
        ),
        // A token every 1 395 348 36/43 µs: code 902 + 36 (rate 43: 902-944).
        (
            "token bucket 43/min (rate 43)",
            Limit::TokenBucket(per_minute(43)),
            "1700000001395348938",
        ),
        // Rate 47: above 44, a string.
        (
            "token bucket 47/min (rate 47)",
            Limit::TokenBucket(per_minute(47)),
            "1700000001276595:35:47",
        ),
        (
            "leaky bucket 60/min",
            police(per_minute(60)),
            "1700000001000000",
        ),
        (
            "leaky bucket 7/min",
            police(per_minute(7)),
            "1700000008571428024",
        ),
        (
            "fixed window 100/min",
            Limit::FixedWindow(window(100)),
            "1699999980000001",
        ),
        (
            "sliding window counter 100/min",
            Limit::SlidingWindowCounter(window(100)),
            "1699999980000001",
        ),
        (
            "sliding window log 100/min (its member)",
            Limit::SlidingWindowLog(window(100)),
            "1700000000000000000",
        ),
    ];
    for (name, limit, want) in cases {
        let (v, enc, bytes) = after_one_request(&redis, limit);
        eprintln!("{name}: {v} ({enc}, {bytes} B)");
        assert_eq!(v, want, "{name}");
        if matches!(limit, Limit::SlidingWindowLog(_)) {
            continue;
        }
        if v.contains(':') {
            assert_eq!((enc.as_str(), bytes), ("embstr", 104), "{name}");
        } else {
            assert_eq!((enc.as_str(), bytes), ("int", 72), "{name}");
        }
    }
}

/// The integer forms (rate 1: the TAT; rates 2..44: the TAT and a code)
/// and the string of a rate above 44, against the model and the memory
/// backend, on random sequences; every value stored is read back as the
/// form its rate says.
#[test]
fn integer_forms_agree_with_the_model() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let limits = [
        Limit::TokenBucket(TokenBucket::new(2, S, 3).unwrap()),
        Limit::TokenBucket(TokenBucket::new(60, 60 * S, 5).unwrap()),
        Limit::TokenBucket(TokenBucket::new(128, S, 4).unwrap()),
        Limit::TokenBucket(TokenBucket::new(43, 60 * S, 5).unwrap()),
        Limit::TokenBucket(TokenBucket::new(47, 60 * S, 5).unwrap()),
        Limit::LeakyBucket(Gcra {
            bucket: TokenBucket::new(60, 60 * S, 5).unwrap(),
            max_delay_us: Some(2 * S),
        }),
        Limit::LeakyBucket(Gcra {
            bucket: TokenBucket::new(44, 7 * S, 5).unwrap(),
            max_delay_us: Some(S),
        }),
    ];
    let mut rng = Rng::new(0x0C0F_FEE0_0000_0001);
    for (i, limit) in limits.iter().enumerate() {
        let clock = ManualClock::new(T0_US + 99);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let red = backend(&redis, &clock);
        let mut model = Model::default();
        for op in 0..400 {
            let step = match rng.next() % 4 {
                0 => 0,
                1 => rng.next() % 300_000,
                _ => rng.next() % 2_500_000,
            };
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let check = TierCheck {
                key: format!("{i}:k{}", rng.next() % 2),
                limit: *limit,
                cost: 1 + rng.next() % 2,
                home: None,
            };
            let want = model.check(std::slice::from_ref(&check), now);
            let got = rt.block_on(memory.check(vec![check.clone()])).unwrap();
            assert_eq!(got.decisions, want, "memory, limit {i} op {op}");
            let got = rt.block_on(red.check(vec![check])).unwrap();
            assert_eq!(got.decisions, want, "redis, limit {i} op {op}");
        }
        let rate = match limit {
            Limit::TokenBucket(b) => b.rate,
            Limit::LeakyBucket(g) => g.bucket.rate,
            _ => unreachable!(),
        };
        for k in 0..2 {
            if let Some(v) = redis.get(&format!("{i}:k{k}")) {
                let integer = v.parse::<u64>().is_ok();
                assert_eq!(integer, rate <= 44, "rate {rate}: {v}");
                assert_eq!(
                    v.len(),
                    if rate == 1 {
                        16
                    } else if rate <= 44 {
                        19
                    } else {
                        v.len()
                    }
                );
            }
        }
    }
}

/// The decision for `cost` 1 on `key` under `limit`, a tier whose
/// configured quota is `home`.
fn check_under(
    rt: &tokio::runtime::Runtime,
    b: &Backend,
    key: &str,
    limit: Limit,
    home: Limit,
) -> TierDecision {
    rt.block_on(b.check(vec![TierCheck {
        key: key.to_owned(),
        limit,
        cost: 1,
        home: (limit != home).then_some(home),
    }]))
    .unwrap()
    .decisions[0]
}

/// A quota change on a live key carries its used capacity over, on the
/// memory backend and on Redis alike (docs/rollout.md, "A quota change"):
/// the issue's own example on a token bucket and a fixed window, a denial
/// that stores the carried state (so its `Retry-After` holds at the new
/// rate), and the stored forms: the configured quota's compact integer,
/// any other quota's tagged string.
#[test]
fn a_quota_change_carries_used_capacity_over() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    // A minute into an hour.
    let clock = ManualClock::new(T0_US - T0_US % (3_600 * S) + 60 * S);
    let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
    let red = backend(&redis, &clock);
    let tb =
        |limit, period_us| Limit::TokenBucket(TokenBucket::new(limit, period_us, limit).unwrap());
    let fw = |limit, window_us| Limit::FixedWindow(Window { limit, window_us });
    let home = tb(100, 60 * S);
    let whome = fw(100, 60 * S);
    for (name, b) in [("memory", &memory), ("redis", &red)] {
        let t0 = clock.now_us();
        // 80 of 100/min used; raised to 200/min: 120 left (119 after this
        // request), lowered to 50/min: 30 in debt.
        let (up, down) = (format!("{name}:up"), format!("{name}:down"));
        for key in [&up, &down] {
            for _ in 0..80 {
                assert!(check_under(&rt, b, key, home, home).allowed);
            }
        }
        let d = check_under(&rt, b, &up, tb(200, 60 * S), home);
        assert_eq!((d.allowed, d.remaining), (true, 119), "{name}");
        if name == "redis" {
            // 81 tokens of 300 000 units (rate 1) short: tagged.
            assert_eq!(
                redis.get(&up).unwrap(),
                format!("{}:0:1:300000", t0 + 81 * 300_000)
            );
        }
        // 50/min: 80 tokens short of 50, refilled at 1.2 s a token: one
        // request passes after 31 tokens, 37.2 s; denied before.
        let d = check_under(&rt, b, &down, tb(50, 60 * S), home);
        assert_eq!(
            (d.allowed, d.remaining, d.retry_after_us),
            (false, 0, 37_200_000),
            "{name}"
        );
        // The denial stored the carried bucket: the wait holds though the
        // configured quota, 4 times faster per token, would have refilled
        // it sooner.
        clock.advance(Duration::from_micros(37_200_000 - 1));
        assert!(
            !check_under(&rt, b, &down, tb(50, 60 * S), home).allowed,
            "{name}"
        );
        clock.advance(Duration::from_micros(1));
        let d = check_under(&rt, b, &down, tb(50, 60 * S), home);
        assert_eq!((d.allowed, d.remaining), (true, 0), "{name}");
        // Back to the configured quota: 50 tokens short of 100, 49 left
        // after this request (the compact form again).
        let d = check_under(&rt, b, &down, home, home);
        assert_eq!((d.allowed, d.remaining), (true, 49), "{name}");
        if name == "redis" {
            let now = clock.now_us();
            assert_eq!(redis.get(&down).unwrap(), (now + 51 * 600_000).to_string());
        }
        // A burst raised under the same unit keeps the missing tokens.
        let key = format!("{name}:burst");
        let burst = |n| Limit::TokenBucket(TokenBucket::new(60, 60 * S, n).unwrap());
        for _ in 0..4 {
            check_under(&rt, b, &key, burst(10), burst(10));
        }
        let d = check_under(&rt, b, &key, burst(20), burst(10));
        assert_eq!((d.allowed, d.remaining), (true, 15), "{name}");

        // A fixed window of 100/min, 80 used; 200/hour: 120 left in the
        // hour's window; then 50/min: blocked until this minute ends.
        let t1 = clock.now_us();
        let key = format!("{name}:window");
        for _ in 0..80 {
            assert!(check_under(&rt, b, &key, whome, whome).allowed);
        }
        let d = check_under(&rt, b, &key, fw(200, 3_600 * S), whome);
        assert_eq!((d.allowed, d.remaining), (true, 119), "{name}");
        if name == "redis" {
            let hour = t1 - t1 % (3_600 * S);
            assert_eq!(
                redis.get(&key).unwrap(),
                format!("{hour}:81:{}", hour + 3_600 * S)
            );
        }
        let d = check_under(&rt, b, &key, fw(50, 60 * S), whome);
        let minute_left = 60 * S - t1 % (60 * S);
        assert_eq!(
            (d.allowed, d.remaining, d.retry_after_us),
            (false, 0, minute_left),
            "{name}"
        );
        clock.advance(Duration::from_micros(minute_left));
        let d = check_under(&rt, b, &key, fw(50, 60 * S), whome);
        assert_eq!((d.allowed, d.remaining), (true, 49), "{name}");
        // The next backend from a minute into the next hour.
        clock.set(t0 + 3_600 * S);
    }
}

/// A clock that steps back (Redis `TIME` after a failover to a node whose
/// clock is behind): Redis (as the model and the memory backend) keeps the
/// TAT, so the bucket is as far from full as the clock is behind; it never
/// fills.
#[test]
fn a_clock_that_steps_back() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let t = T0_US + 5 * S;
    let slow = TokenBucket::new(1, S, 2).unwrap();
    // 2^20 units per µs: a clock 2 h behind is past the 2^52-unit bound.
    let fast = TokenBucket::new(1 << 20, 1, 1 << 10).unwrap();
    for (i, (limit, back, want)) in [
        // (remaining, reset, retry) of a 1-cost check after the step back.
        (slow, S / 2, (0, 5 * S / 2, 3 * S / 2)),
        (slow, 4 * S, (0, 6 * S, 5 * S)),
        (fast, 7_200 * S, (0, (1 << 32) + 1, (1 << 32) + 1)),
    ]
    .into_iter()
    .enumerate()
    {
        let clock = ManualClock::new(t);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let mut model = Model::default();
        let key = format!("back:{i}");
        let tier = |cost| TierCheck {
            key: key.clone(),
            limit: Limit::TokenBucket(limit),
            cost,
            home: None,
        };
        let drain = limit.burst();
        for (name, b) in [("memory", memory), ("redis", backend(&redis, &clock))] {
            clock.set(t);
            let key = format!("{name}:{key}");
            let check = |cost| {
                let d = rt
                    .block_on(b.check(vec![TierCheck {
                        key: key.clone(),
                        ..tier(cost)
                    }]))
                    .unwrap()
                    .decisions[0];
                (d.allowed, d.remaining, d.reset_after_us, d.retry_after_us)
            };
            assert!(check(drain).0, "{name}");
            clock.set(t - back);
            let (allowed, remaining, reset, retry) = check(1);
            assert_eq!(
                (allowed, (remaining, reset, retry)),
                (false, want),
                "{name} {i}"
            );
            if name == "memory" {
                assert!(model.check(&[tier(drain)], t)[0].allowed);
                let d = model.check(&[tier(1)], t - back)[0];
                assert_eq!((d.remaining, d.reset_after_us, d.retry_after_us), want);
            }
        }
    }
}

/// Values the scripts never write (the strings of the format that was the
/// default before issue 25, the three-digit codes 989-999, which name no
/// rate, garbage) read as no state: a full bucket,
/// never an error (which would fail open), and the next charge replaces
/// them with the bucket's TAT.
#[test]
fn values_it_never_writes_read_as_no_state() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let clock = ManualClock::new(T0_US);
    let b = backend(&redis, &clock);
    for (key, stored, limit, rewritten) in [
        // The old token bucket string of a drained 60/min bucket.
        (
            "old token string",
            "0:1700000000000000:1000000",
            Limit::TokenBucket(per_minute(60)),
            "1700000001000000",
        ),
        // Code 990: no rate.
        (
            "no rate",
            "1700000060000000990",
            Limit::TokenBucket(per_minute(7)),
            "1700000008571428024",
        ),
        // A string whose remainder is not below its rate.
        (
            "bad remainder",
            "1700000060000000:47:47",
            Limit::TokenBucket(per_minute(47)),
            "1700000001276595:35:47",
        ),
        (
            "garbage",
            "x:y",
            Limit::TokenBucket(per_minute(60)),
            "1700000001000000",
        ),
    ] {
        let _: () = redis.cmd(&["SET", key, stored, "PX", "600000"]);
        let d = rt
            .block_on(b.check(vec![TierCheck {
                key: key.to_owned(),
                limit,
                cost: 1,
                home: None,
            }]))
            .unwrap()
            .decisions[0];
        let full = limit.capacity() - 1;
        assert_eq!((d.allowed, d.remaining), (true, full), "{key}");
        assert_eq!(redis.get(key).as_deref(), Some(rewritten), "{key}");
    }
}
