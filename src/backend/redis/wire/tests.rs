use super::*;
use crate::algorithm::{Gcra, State, TokenBucket, Window};
use crate::algorithm::{Limit, TierDecision};
use crate::backend::{Charge, Shadow, TierCheck, Verdict};
use crate::error::BackendError;

mod short;

fn limits() -> Vec<Limit> {
    let w = Window {
        limit: 10,
        window_us: 60_000_000,
    };
    let b = TokenBucket {
        capacity: 5_000_000,
        rate: 3,
        unit: 1_000_000,
    };
    vec![
        Limit::FixedWindow(w),
        Limit::SlidingWindowLog(w),
        Limit::SlidingWindowCounter(w),
        Limit::TokenBucket(b),
        Limit::LeakyBucket(Gcra {
            bucket: b,
            max_delay_us: None,
        }),
        Limit::LeakyBucket(Gcra {
            bucket: b,
            max_delay_us: Some(250_000),
        }),
    ]
}

/// What the scripts read back from seven tier `ARGV` (the inverse of
/// [`tier_args`], as `lua/dispatch.lua` and the algorithm files read it).
fn decode(a: [i64; 7]) -> (Limit, u64, u8) {
    let u = |v: i64| u64::try_from(v).unwrap();
    let w = Window {
        limit: u(a[1]),
        window_us: u(a[2]),
    };
    let b = TokenBucket {
        capacity: u(a[1]),
        rate: u(a[2]),
        unit: u(a[3]),
    };
    let limit = match a[0] {
        1 => Limit::FixedWindow(w),
        2 => Limit::SlidingWindowLog(w),
        3 => Limit::SlidingWindowCounter(w),
        4 => Limit::TokenBucket(b),
        5 => Limit::LeakyBucket(Gcra {
            bucket: b,
            max_delay_us: (a[4] >= 0).then(|| u(a[4])),
        }),
        other => panic!("algorithm {other}"),
    };
    (limit, u(a[5]), u8::try_from(a[6]).unwrap())
}

#[test]
fn tier_args_round_trip() {
    for limit in limits() {
        for flags in [0, SHADOW, UNDO, SHADOW | UNDO] {
            let check = TierCheck {
                key: "rl:t:k".to_owned(),
                limit,
                cost: 3,
                home: None,
            };
            assert_eq!(decode(tier_args(&check, flags)), (limit, 3, flags));
        }
    }
}

#[test]
fn a_tier_is_one_spec_argument() {
    let check = TierCheck {
        key: "k".to_owned(),
        limit: limits()[5],
        cost: 2,
        home: None,
    };
    let mut cmd = ::redis::cmd("EVALSHA");
    write_tier(&mut cmd, &check, SHADOW | UNDO);
    let args: Vec<Vec<u8>> = cmd.args_iter().skip(1).map(arg_bytes).collect();
    let want: Vec<&[u8]> = vec![b"5 5000000 3 1000000 250000 2 3"];
    assert_eq!(args, want);
    // The longest spec fits its buffer: seven 20-character numbers.
    let widest = TierCheck {
        key: "k".to_owned(),
        limit: Limit::LeakyBucket(Gcra {
            bucket: TokenBucket {
                capacity: i64::MAX as u64,
                rate: i64::MAX as u64,
                unit: i64::MAX as u64,
            },
            max_delay_us: None,
        }),
        cost: i64::MAX as u64,
        home: None,
    };
    let spec = TierSpec::new(&widest, 7);
    assert_eq!(
        spec.as_bytes(),
        b"5 9223372036854775807 9223372036854775807 9223372036854775807 -1 9223372036854775807 7"
    );
}

fn arg_bytes(a: ::redis::Arg<&[u8]>) -> Vec<u8> {
    match a {
        ::redis::Arg::Simple(b) => b.to_vec(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn refund_args_carry_the_charge() {
    let check = TierCheck {
        key: "k".to_owned(),
        limit: limits()[3],
        cost: 2,
        home: None,
    };
    let charge = Charge {
        at_us: 1_700_000_000_000_123,
        undo: 3_000_000,
        next_after_us: 9,
    };
    // algorithm, p1..p4, cost, charged_at, undo (the next-pass wait is
    // not sent).
    let want = [4, 5_000_000, 3, 1_000_000, 0, 2, 1_700_000_000_000_123];
    assert_eq!(refund_args(&check, &charge, false)[..7], want);
    assert_eq!(refund_args(&check, &charge, false)[7], 3_000_000);
}

#[test]
fn clock_args() {
    assert_eq!(ClockArg::redis().as_bytes(), b"");
    assert_eq!(
        ClockArg::deadline(1_700_000_000_000_000).as_bytes(),
        b"-1700000000000000"
    );
    assert_eq!(
        ClockArg::deadline(i64::MAX).as_bytes(),
        b"-9223372036854775807"
    );
    assert_eq!(ClockArg::manual(42, 0).as_bytes(), b"42");
    assert_eq!(ClockArg::manual(42, 600_000).as_bytes(), b"42:600000");
    assert_eq!(
        ClockArg::manual(u64::MAX, u64::MAX).as_bytes(),
        b"18446744073709551615:18446744073709551615"
    );
}

/// One tier as the scripts see it, for [`reply_of`].
struct Tier {
    d: TierDecision,
    /// The allowed tier's wait before the next request (w).
    next: u64,
    undo: u64,
}

/// The reply the scripts build (`check_request` in lua/dispatch.lua)
/// for these tiers; `charged`: whether the call charged.
fn reply_of(now: i64, tiers: &[Tier], charged: bool) -> Vec<i64> {
    let i = |v: u64| i64::try_from(v).unwrap();
    let mut out = vec![now];
    for t in tiers {
        if t.d.allowed {
            out.extend([i(t.d.remaining), i(t.d.reset_after_us), i(t.next)]);
        } else {
            out.extend([
                -i(t.d.remaining) - 1,
                i(t.d.reset_after_us),
                i(t.d.retry_after_us),
            ]);
        }
    }
    for (n, t) in tiers.iter().enumerate() {
        let undo = if charged { t.undo } else { 0 };
        if t.d.allowed && (t.d.delay_us > 0 || undo != 0) {
            out.extend([i(n as u64 + 1), i(t.d.delay_us), i(undo)]);
        }
    }
    out
}

fn tier(allowed: bool, remaining: u64, delay: u64, undo: u64) -> Tier {
    Tier {
        d: TierDecision {
            allowed,
            limit: 10,
            remaining,
            reset_after_us: 1_000 + remaining,
            retry_after_us: if allowed { 0 } else { 500 },
            delay_us: delay,
        },
        next: if allowed { 77 } else { 0 },
        undo,
    }
}

/// `n` tiers answering long: fixed windows of a `limit` of 10.
fn long(n: usize) -> Vec<ReplyTier> {
    long_of(n, 10)
}

fn long_of(n: usize, limit: u64) -> Vec<ReplyTier> {
    let w = Window {
        limit,
        window_us: 60_000_000,
    };
    vec![
        ReplyTier {
            limit: Limit::FixedWindow(w),
            cost: 1,
            repeat: false,
        };
        n
    ]
}

fn decided(r: Result<CheckReply, BackendError>) -> Verdict {
    match r {
        Ok(CheckReply::Decided(v)) => v,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_charged_reply_round_trips() {
    let tiers = [
        tier(true, 9, 0, 0),
        tier(true, 0, 250, 12),
        tier(true, 3, 0, 7),
    ];
    let reply = reply_of(1_700_000_000_000_000, &tiers, true);
    assert_eq!(reply.len(), 1 + 3 * 3 + 3 * 2);
    let v = decided(parse_check(&reply, &long(3), 0, Shadow::NONE));
    assert_eq!(v.now_us, 1_700_000_000_000_000);
    let want: Vec<TierDecision> = tiers.iter().map(|t| t.d).collect();
    assert_eq!(v.decisions, want);
    let charges: Vec<Option<Charge>> = tiers
        .iter()
        .map(|t| {
            Some(Charge {
                at_us: 1_700_000_000_000_000,
                undo: t.undo,
                next_after_us: 77,
            })
        })
        .collect();
    assert_eq!(v.charges, charges);
}

#[test]
fn an_enforced_denial_charges_nothing() {
    let tiers = [tier(true, 4, 100, 5), tier(false, 0, 0, 0)];
    let reply = reply_of(5, &tiers, false);
    let v = decided(parse_check(&reply, &long(2), 0, Shadow::NONE));
    let want: Vec<TierDecision> = tiers.iter().map(|t| t.d).collect();
    assert_eq!(v.decisions, want);
    assert_eq!(v.decisions[0].delay_us, 100);
    assert!(v.charges.is_empty());
}

#[test]
fn a_shadow_denial_charges_the_others() {
    let tiers = [tier(false, 2, 0, 0), tier(true, 1, 0, 8)];
    let reply = reply_of(5, &tiers, true);
    let v = decided(parse_check(&reply, &long(2), 0, Shadow(0b01)));
    assert_eq!(v.decisions[0].remaining, 2);
    assert!(!v.decisions[0].allowed);
    assert_eq!(v.decisions[0].retry_after_us, 500);
    assert_eq!(
        v.charges,
        vec![
            None,
            Some(Charge {
                at_us: 5,
                undo: 8,
                next_after_us: 77,
            })
        ]
    );
}

#[test]
fn no_tiers_and_late() {
    let v = decided(parse_check(&[9], &[], 0, Shadow::NONE));
    assert_eq!((v.now_us, v.decisions.len(), v.charges.len()), (9, 0, 0));
    assert_eq!(
        parse_check(&[9], &long(1), 0, Shadow::NONE).unwrap(),
        CheckReply::Late
    );
}

fn is_reply_error(r: Result<CheckReply, BackendError>) -> bool {
    matches!(r, Err(BackendError::Reply(_)))
}

#[test]
fn malformed_replies_are_reply_errors() {
    let ok = reply_of(5, &[tier(true, 4, 100, 5), tier(true, 1, 0, 0)], true);
    assert!(parse_check(&ok, &long(2), 0, Shadow::NONE).is_ok());
    let bad: Vec<(&str, Vec<i64>)> = vec![
        ("empty", vec![]),
        ("short body", ok[..6].to_vec()),
        ("partial trailer", ok[..ok.len() - 1].to_vec()),
        ("extra value", [&ok[..], &[0]].concat()),
        ("negative now", [&[-5], &ok[1..]].concat()),
        ("negative reset", {
            let mut r = ok.clone();
            r[2] = -1;
            r
        }),
        ("negative wait", {
            let mut r = ok.clone();
            r[3] = -3;
            r
        }),
        ("tier 0", {
            let mut r = ok.clone();
            r[7] = 0;
            r
        }),
        ("tier past the end", {
            let mut r = ok.clone();
            r[7] = 3;
            r
        }),
        ("tier i64::MIN", {
            let mut r = ok.clone();
            r[7] = i64::MIN;
            r
        }),
        ("negative delay", {
            let mut r = ok.clone();
            r[8] = -1;
            r
        }),
        ("negative undo", {
            let mut r = ok.clone();
            r[9] = -1;
            r
        }),
        ("trailer of a denying tier", {
            let mut r = ok.clone();
            r[1] = -1;
            r
        }),
    ];
    for (what, reply) in bad {
        assert!(
            is_reply_error(parse_check(&reply, &long(2), 0, Shadow::NONE)),
            "{what}: {reply:?}"
        );
    }
    // Extreme values parse without overflow.
    let r = [0, i64::MIN, i64::MAX, i64::MAX];
    let v = decided(parse_check(&r, &long_of(1, 1), 0, Shadow::NONE));
    assert_eq!(v.decisions[0].remaining, i64::MAX.unsigned_abs());
    let r = [0, i64::MAX, 0, 0];
    let v = decided(parse_check(&r, &long_of(1, 1), 0, Shadow::NONE));
    assert_eq!(v.decisions[0].remaining, i64::MAX.unsigned_abs());
}

/// A group commit's reply: the call's now, then per request its counts
/// inline (increment-first) or its own reply as an array; split by each
/// request's number of tiers.
#[test]
fn a_batch_reply_splits_by_tiers() {
    use ::redis::{FromRedisValue, Value};
    let arr = |v: &[i64]| Value::Array(v.iter().map(|&n| Value::Int(n)).collect());
    let reply = Value::Array(vec![
        Value::Int(77),
        Value::Int(3),
        arr(&[70, 1, 2, 3]),
        Value::Int(-5),
        Value::Int(0),
        arr(&[77]),
        Value::Array(vec![Value::BulkString(b"bad tier spec x".to_vec())]),
    ]);
    let values = BatchValues::from_redis_value_ref(&reply).unwrap();
    assert_eq!(values.now(), Some(77));
    let split = BatchValues::from_redis_value_ref(&reply)
        .unwrap()
        .replies([1, 3, 2, 2, 1])
        .unwrap();
    let want: Vec<BatchReply> = vec![
        Ok([77, 3].into_iter().collect()),
        Ok([70, 1, 2, 3].into_iter().collect()),
        Ok([77, -5, 0].into_iter().collect()),
        Ok([77].into_iter().collect()),
        Err("bad tier spec x".to_owned()),
    ];
    assert_eq!(split, want);
    // Another number of tiers than the reply holds: not that layout.
    for tiers in [
        &[1, 3, 2, 2][..],
        &[1, 3, 2, 2, 1, 1],
        &[2, 3, 2, 2, 1],
        &[1, 3, 1, 2, 1],
    ] {
        let v = BatchValues::from_redis_value_ref(&reply).unwrap();
        assert_eq!(v.replies(tiers.iter().copied()), None, "{tiers:?}");
    }
    // A request of no tiers never answers inline.
    let v = BatchValues::from_redis_value_ref(&Value::Array(vec![Value::Int(1), Value::Int(0)]));
    assert_eq!(v.unwrap().replies([0]), None);
}

/// Which packs a call carries in their live check's spec
/// (`embedded_packs`): those at the end of the call that their tier key
/// holds, in their live checks' order; a pack a log's own key holds
/// (`{c}`), a candidate on its own key, or a pack out of order after them
/// leaves the ones before it sent with a key and spec of their own.
#[test]
fn packs_at_the_end_that_the_tier_key_holds_ride_in_its_spec() {
    let w = Window {
        limit: 10,
        window_us: 60_000_000,
    };
    let bucket = Limit::TokenBucket(TokenBucket::new(10, 60_000_000, 10).unwrap());
    let check = |key: &str, limit: Limit| TierCheck {
        key: key.to_owned(),
        limit,
        cost: 1,
        home: None,
    };
    let fixed = Limit::FixedWindow(w);
    let log = Limit::SlidingWindowLog(w);
    // Live a (bucket), b (log), c (fixed); candidates of each.
    let live = [check("a", bucket), check("b", log), check("c", fixed)];
    let calls: [(&[u8], usize); 5] = [
        (&[0, 2], 2),
        (&[0, 1], 0),
        (&[1, 0], 1),
        (&[2, 0], 1),
        (&[0, 0, 2], 2),
    ];
    for (live_of, want) in calls {
        let mut checks = live.to_vec();
        for &of in live_of {
            let key = format!("{}{{c:{}}}", live[usize::from(of)].key, checks.len());
            checks.push(check(&key, fixed));
        }
        let sent = packs(&checks, live_of);
        assert_eq!(embedded_packs(&checks, &sent, 3), want, "{live_of:?}");
    }
}
