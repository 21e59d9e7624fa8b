//! The two state formats on a real Redis (`StateFormat`, docs/redis.md,
//! "Stored values"): the exact value each algorithm writes in each, what an
//! idle key costs (`MEMORY USAGE … SAMPLES 0`), the integer forms against
//! the model, and what a quota change does to a token bucket in each.

mod support;

use std::time::Duration;
use support::algorithms::{Model, S};
use support::rng::Rng;
use support::*;
use tiered_ratelimit::algorithm::{Decision, Gcra, Limit, TokenBucket, Window};
use tiered_ratelimit::backend::{
    Backend, ManualClock, MemoryBackend, RedisBackend, StateFormat, TierCheck,
};

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

fn backend(redis: &RedisServer, clock: &ManualClock, format: StateFormat) -> Backend {
    RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .with_state_format(format)
        .into()
}

/// What one request at T0 leaves under `KEY`: the value (a string's, or the
/// log's one member), its object encoding and `MEMORY USAGE … SAMPLES 0`.
fn after_one_request(
    redis: &RedisServer,
    limit: Limit,
    format: StateFormat,
) -> (String, String, i64) {
    let _: () = redis.cmd(&["FLUSHALL"]);
    let clock = ManualClock::new(T0_US);
    let b = backend(redis, &clock, format);
    let rt = current_thread_runtime();
    let d = rt
        .block_on(b.check(vec![TierCheck {
            key: KEY.to_owned(),
            limit,
            cost: 1,
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

/// Every algorithm's value after one request, in both formats, at T0
/// (1 700 000 000 s). The figures are printed for docs/performance.md.
#[test]
fn the_values_each_format_writes() {
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
            "59000000:1700000000000000:1000000",
        ),
        (
            "token bucket 300/min (unit 2 × 10^5, rate 1)",
            Limit::TokenBucket(per_minute(300)),
            "1700000000200000",
            "59800000:1700000000000000:200000",
        ),
        (
            "token bucket 7/min (unit 6 × 10^7, rate 7)",
            Limit::TokenBucket(per_minute(7)),
            "1700000008571428:4:7:60000000",
            "360000000:1700000000000000:60000000",
        ),
        (
            "leaky bucket 60/min",
            police(per_minute(60)),
            "1700000001000000",
            "1700000001000000:0:1",
        ),
        (
            "leaky bucket 7/min",
            police(per_minute(7)),
            "1700000008571428553",
            "1700000008571428:4:7",
        ),
        (
            "fixed window 100/min",
            Limit::FixedWindow(window(100)),
            "1699999980000001",
            "1699999980000000:1",
        ),
        (
            "sliding window counter 100/min",
            Limit::SlidingWindowCounter(window(100)),
            "1699999980000001",
            "1699999980000000:1:0",
        ),
        (
            "sliding window log 100/min (its member)",
            Limit::SlidingWindowLog(window(100)),
            "1700000000000000000",
            "1700000000000000:0:1",
        ),
    ];
    for (name, limit, compact, legacy) in cases {
        let (c, c_enc, c_bytes) = after_one_request(&redis, limit, StateFormat::Compact);
        let (l, l_enc, l_bytes) = after_one_request(&redis, limit, StateFormat::Legacy);
        eprintln!("{name}: legacy {l} ({l_enc}, {l_bytes} B), compact {c} ({c_enc}, {c_bytes} B)");
        assert_eq!((c.as_str(), l.as_str()), (compact, legacy), "{name}");
        if !c.contains(':') && !matches!(limit, Limit::SlidingWindowLog(_)) {
            assert_eq!(c_enc, "int", "{name}");
        }
    }
    // The goal: an idle IPv4 token-bucket key in at most 72 bytes.
    for n in [60, 300] {
        let (_, _, bytes) = after_one_request(
            &redis,
            Limit::TokenBucket(per_minute(n)),
            StateFormat::Compact,
        );
        assert!(bytes <= 72, "{n}/min: {bytes} B");
    }
}

/// The integer forms the shared algorithm table does not reach (a token
/// bucket with rate 1, whose TAT is one integer), against the model and
/// the memory backend, with the legacy format alongside.
#[test]
fn integer_forms_agree_with_the_model() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let limits = [
        Limit::TokenBucket(TokenBucket::new(2, S, 3).unwrap()),
        Limit::TokenBucket(TokenBucket::new(60, 60 * S, 5).unwrap()),
        Limit::LeakyBucket(Gcra {
            bucket: TokenBucket::new(60, 60 * S, 5).unwrap(),
            max_delay_us: Some(2 * S),
        }),
    ];
    let mut rng = Rng::new(0x0C0F_FEE0_0000_0001);
    for (i, limit) in limits.iter().enumerate() {
        let clock = ManualClock::new(T0_US + 99);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let slack = Duration::from_secs(600);
        let backends = [StateFormat::Legacy, StateFormat::Compact].map(|f| {
            let b: Backend = RedisBackend::from_url(&redis.url())
                .unwrap()
                .with_manual_clock(clock.clone())
                .with_test_ttl_slack(slack)
                .with_state_format(f)
                .into();
            (f, b)
        });
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
            };
            let want = model.check(std::slice::from_ref(&check), now);
            let got = rt.block_on(memory.check(vec![check.clone()])).unwrap();
            assert_eq!(got.decisions, want, "memory, limit {i} op {op}");
            for (f, b) in &backends {
                let c = TierCheck {
                    key: format!("{f:?}:{}", check.key),
                    ..check.clone()
                };
                let got = rt.block_on(b.check(vec![c])).unwrap();
                assert_eq!(got.decisions, want, "{f:?}, limit {i} op {op}");
            }
        }
        for k in 0..2 {
            if let Some(v) = redis.get(&format!("Compact:{i}:k{k}")) {
                assert!(v.parse::<u64>().is_ok(), "{v}");
            }
        }
    }
}

/// The decision for `cost` on `key` under `limit`.
fn check(rt: &tokio::runtime::Runtime, b: &Backend, key: &str, limit: TokenBucket) -> Decision {
    rt.block_on(b.check(vec![TierCheck {
        key: key.to_owned(),
        limit: Limit::TokenBucket(limit),
        cost: 1,
    }]))
    .unwrap()
    .decisions[0]
}

/// A quota change on a live token bucket. The compact format (the model,
/// and the memory backend) keeps a TAT written under rate 1 (one integer)
/// under any new quota: the time until full carries over, so lowering a
/// quota never hands out a fresh bucket, and a new burst keeps the missing
/// tokens. A state of another rate above 1 (a string) or unit starts full.
/// The legacy format starts full under another unit, and under the same
/// unit keeps the tokens (capped to the new burst), as every earlier
/// release does.
#[test]
fn a_quota_change_on_a_token_bucket() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let clock = ManualClock::new(T0_US);
    let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
    let compact = backend(&redis, &clock, StateFormat::Compact);
    let legacy = backend(&redis, &clock, StateFormat::Legacy);
    let burst = |n| TokenBucket::new(60, 60 * S, n).unwrap();
    let all = [
        ("memory", &memory),
        ("compact", &compact),
        ("legacy", &legacy),
    ];
    for (name, b) in all {
        let legacy = name == "legacy";
        // 1/min, one request: full again in 60 s. Then 10/min: 60 s from
        // full is all 10 tokens short, a token in 6 s (legacy: a fresh
        // bucket of 10).
        assert_eq!(check(&rt, b, name, per_minute(1)).remaining, 0);
        let d = check(&rt, b, name, per_minute(10));
        let want = if legacy {
            (true, 9, 0)
        } else {
            (false, 0, 6 * S)
        };
        assert_eq!((d.allowed, d.remaining, d.retry_after_us), want, "{name}");
        // Lowered: 60/min, 30 requests (full again in 30 s); then 1/min:
        // half its one token short, so the next request waits 30 s
        // (legacy: a fresh bucket).
        let key = format!("{name}:lowered");
        for _ in 0..30 {
            check(&rt, b, &key, per_minute(60));
        }
        let d = check(&rt, b, &key, per_minute(1));
        let want = if legacy {
            (true, 0, 0)
        } else {
            (false, 0, 30 * S)
        };
        assert_eq!((d.allowed, d.remaining, d.retry_after_us), want, "{name}");
        // 8/min (rate 1), one request: 7.5 s from full; then 7/min (rate
        // 7, 6 × 10^7 units a token): 7 × 7.5 × 10^6 units short, 6.125
        // tokens left before this one (legacy, another unit: 7).
        let key = format!("{name}:to-rate-7");
        check(&rt, b, &key, per_minute(8));
        let d = check(&rt, b, &key, per_minute(7));
        let want = if legacy { 6 } else { 5 };
        assert_eq!((d.allowed, d.remaining), (true, want), "{name}");
        // 7/min (rate 7: a string of its rate and unit), one request; then
        // 8/min: another rate, so a fresh bucket in every format.
        let key = format!("{name}:from-rate-7");
        check(&rt, b, &key, per_minute(7));
        let d = check(&rt, b, &key, per_minute(8));
        assert_eq!((d.allowed, d.remaining), (true, 7), "{name}");
        // 60/min with a burst of 10: 4 requests leave 6 (4 missing).
        let key = format!("{name}:burst");
        for _ in 0..4 {
            check(&rt, b, &key, burst(10));
        }
        // The burst raised to 20.
        let d = check(&rt, b, &key, burst(20));
        let want = if name == "legacy" { 5 } else { 15 };
        assert_eq!((d.allowed, d.remaining), (true, want), "{name}");
    }
}

/// A clock that steps back (Redis `TIME` after a failover to a node whose
/// clock is behind): the compact format (the model, the memory backend)
/// keeps the TAT, so the bucket is as far from full as the clock is behind;
/// the legacy format freezes the bucket until the clock is back, as every
/// earlier release does. Neither ever fills it.
#[test]
fn a_clock_that_steps_back() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let t = T0_US + 5 * S;
    let slow = TokenBucket::new(1, S, 2).unwrap();
    // 2^20 units per µs: a clock 2 h behind is past the 2^52-unit bound.
    let fast = TokenBucket::new(1 << 20, 1, 1 << 10).unwrap();
    for (i, (limit, back, compact, legacy)) in [
        // (remaining, reset, retry) of a 1-cost check after the step back.
        (slow, S / 2, (0, 5 * S / 2, 3 * S / 2), (0, 2 * S, S)),
        (slow, 4 * S, (0, 6 * S, 5 * S), (0, 2 * S, S)),
        (
            fast,
            7_200 * S,
            (0, (1 << 32) + 1, (1 << 32) + 1),
            (0, 1, 1),
        ),
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
        };
        let drain = limit.burst();
        for (name, b) in [
            ("memory", memory),
            ("compact", backend(&redis, &clock, StateFormat::Compact)),
            ("legacy", backend(&redis, &clock, StateFormat::Legacy)),
        ] {
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
            let want = if name == "legacy" { legacy } else { compact };
            assert_eq!(
                (allowed, (remaining, reset, retry)),
                (false, want),
                "{name} {i}"
            );
            if name == "memory" {
                assert!(model.check(&[tier(drain)], t)[0].allowed);
                let d = model.check(&[tier(1)], t - back)[0];
                assert_eq!((d.remaining, d.reset_after_us, d.retry_after_us), compact);
            }
        }
    }
}

/// Values of the earlier compact format, `<TAT><ddd>` (19 digits: the TAT
/// in µs and three digits that named the quota), are read as their TAT:
/// nothing they hold resets. The next charge rewrites each as the plain
/// TAT.
#[test]
fn earlier_compact_values_keep_their_state() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let clock = ManualClock::new(T0_US);
    let b = backend(&redis, &clock, StateFormat::Compact);
    let police = |b: TokenBucket| {
        Limit::LeakyBucket(Gcra {
            bucket: b,
            max_delay_us: None,
        })
    };
    let leaky = |n, burst| police(TokenBucket::new(n, 60 * S, burst).unwrap());
    for (key, stored, limit, want, rewritten) in [
        // 60/min (code 016), drained at T0: empty, a token in 1 s.
        (
            "drained",
            "1700000060000000016",
            Limit::TokenBucket(per_minute(60)),
            (false, 0, S),
            None,
        ),
        // 60/min, 30 s from full: 30 left, 29 after this one.
        (
            "half",
            "1700000030000000016",
            Limit::TokenBucket(per_minute(60)),
            (true, 29, 0),
            Some("1700000031000000"),
        ),
        // Written under 300/min (code 025), read under 60/min: 30 s from
        // full carries over.
        (
            "another quota",
            "1700000030000000025",
            Limit::TokenBucket(per_minute(60)),
            (true, 29, 0),
            Some("1700000031000000"),
        ),
        // Leaky 60/min, burst 5 (code 501: rate 1): a backlog of 3 s.
        (
            "leaky",
            "1700000003000000501",
            leaky(60, 5),
            (true, 1, 0),
            Some("1700000004000000"),
        ),
        // Leaky 7/min, burst 3 (code 553 = 500 + 7² + 4): one token's
        // backlog, exactly.
        (
            "leaky rate 7",
            "1700000008571428553",
            leaky(7, 3),
            (true, 1, 0),
            Some("1700000017142857550"),
        ),
    ] {
        let _: () = redis.cmd(&["SET", key, stored, "PX", "600000"]);
        let d = rt
            .block_on(b.check(vec![TierCheck {
                key: key.to_owned(),
                limit,
                cost: 1,
            }]))
            .unwrap()
            .decisions[0];
        assert_eq!((d.allowed, d.remaining, d.retry_after_us), want, "{key}");
        let now = redis.get(key);
        assert_eq!(now.as_deref(), rewritten.or(Some(stored)), "{key}");
    }
}
