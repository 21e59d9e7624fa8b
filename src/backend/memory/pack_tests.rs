//! The candidate packs (`pack.rs`): one entry of a tier key for its
//! candidates, deciding as keys of their own would.

use super::*;
use crate::algorithm::{Limit, TokenBucket};
use crate::backend::{Shadow, TierCheck, Verdict};

fn check(key: &str, tb: TokenBucket) -> TierCheck {
    TierCheck {
        key: key.to_owned(),
        limit: Limit::TokenBucket(tb),
        cost: 1,
        home: None,
    }
}

/// Four candidates of different algorithms and periods (a token bucket of
/// 1 s, a fixed window of 2 s, a sliding window counter of 3 s, a sliding
/// log of 5 s), packed in one entry of their tier key, decide on a long
/// sequence exactly as the same four on keys of their own (keys not
/// under the tier key are not packed), with the other tier now and then
/// denying (the candidates then peeked, not charged): one entry for the
/// four instead of four. Named by their suffixes' tags alone, keys left
/// empty (as the engine plans them), they decide the same again, and on
/// the same state: each third request's candidates are named so on the
/// packed backend.
#[test]
fn a_pack_of_four_candidates_decides_as_four_keys() {
    use crate::algorithm::Window;
    let clock = ManualClock::new(1_000_000_000_000);
    let packed = MemoryBackend::with_manual_clock(clock.clone());
    let apart = MemoryBackend::with_manual_clock(clock.clone());
    let named = MemoryBackend::with_manual_clock(clock.clone());
    let live = TokenBucket::new(4, 1_000_000, 4).unwrap();
    let other = TokenBucket::new(3, 1_000_000, 3).unwrap();
    let candidates = [
        Limit::TokenBucket(TokenBucket::new(2, 1_000_000, 2).unwrap()),
        Limit::FixedWindow(Window {
            limit: 5,
            window_us: 2_000_000,
        }),
        Limit::SlidingWindowCounter(Window {
            limit: 6,
            window_us: 3_000_000,
        }),
        Limit::SlidingWindowLog(Window {
            limit: 7,
            window_us: 5_000_000,
        }),
    ];
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (mut denied, mut allowed) = (0, 0);
    for op in 0..3_000 {
        clock.advance(std::time::Duration::from_micros(match next() % 4 {
            0 => 0,
            1 => next() % 100_000,
            _ => next() % 700_000,
        }));
        let key = format!("rl:ip:k{}", next() % 3);
        let cost = 1 + next() % 2;
        let checks = |under: &str| {
            let mut all = vec![
                TierCheck {
                    key: key.clone(),
                    limit: Limit::TokenBucket(live),
                    cost,
                    home: None,
                },
                check("rl:global:all", other),
            ];
            for (j, l) in candidates.iter().enumerate() {
                all.push(TierCheck {
                    key: format!("{under}{{c:{j}}}"),
                    limit: *l,
                    cost,
                    home: None,
                });
            }
            all
        };
        let live_of = [0u8; 4];
        let tags = ["{c:0}", "{c:1}", "{c:2}", "{c:3}"].map(candidate_tag);
        // The same checks, the candidates' keys left empty.
        let unkeyed = || {
            let mut all = checks(&key);
            for c in &mut all[2..] {
                c.key.clear();
            }
            all
        };
        let (mut a, mut b, mut c) = (Verdict::default(), Verdict::default(), Verdict::default());
        if op % 3 == 0 {
            packed.check_with_candidates(&unkeyed(), Shadow::NONE, &live_of, &tags, true, &mut a);
        } else {
            packed.check_with_candidates(&checks(&key), Shadow::NONE, &live_of, &[], true, &mut a);
        }
        let own = format!("apart:{key}");
        apart.check_with_candidates(&checks(&own), Shadow::NONE, &live_of, &[], true, &mut b);
        named.check_with_candidates(&unkeyed(), Shadow::NONE, &live_of, &tags, true, &mut c);
        assert_eq!(a.decisions, b.decisions, "op {op}");
        assert_eq!(a.charges, b.charges, "op {op}");
        assert_eq!(c.decisions, b.decisions, "op {op}, named");
        assert_eq!(c.charges, b.charges, "op {op}, named");
        for d in &a.decisions[2..] {
            if d.allowed {
                allowed += 1;
            } else {
                denied += 1;
            }
        }
    }
    assert!(
        denied > 500 && allowed > 500,
        "{denied} denied, {allowed} allowed"
    );
    // Three tier keys and the global one: a pack each, not four keys each.
    assert_eq!(packed.len(), 4 + 3, "packed");
    assert_eq!(apart.len(), 4 + 3 * 4, "apart");
    assert_eq!(named.len(), 4 + 3, "named");
}

/// A pack lives as long as its longest-lived candidate's state, each
/// state as long as its own key would: the sweep drops it only once the
/// last has expired, and a candidate whose own time is up starts again
/// from nothing while the others keep theirs.
#[test]
fn a_pack_expires_with_its_longest_candidate() {
    use crate::algorithm::Window;
    let clock = ManualClock::new(1_000_000_000_000);
    let m = MemoryBackend::with_manual_clock(clock.clone());
    let short = Limit::FixedWindow(Window {
        limit: 1,
        window_us: 1_000_000,
    });
    let long = Limit::FixedWindow(Window {
        limit: 1,
        window_us: 10_000_000,
    });
    let live = TokenBucket::new(100, 1_000_000, 100).unwrap();
    let checks = |key: &str| {
        vec![
            check(key, live),
            TierCheck {
                key: format!("{key}{{c:short}}"),
                limit: short,
                cost: 1,
                home: None,
            },
            TierCheck {
                key: format!("{key}{{c:long}}"),
                limit: long,
                cost: 1,
                home: None,
            },
        ]
    };
    let run = |key: &str| {
        let mut v = Verdict::default();
        m.check_with_candidates(&checks(key), Shadow::NONE, &[0, 0], &[], true, &mut v);
        v.decisions.iter().map(|d| d.allowed).collect::<Vec<_>>()
    };
    // At a window start: both charged, then both deny.
    clock.advance(std::time::Duration::from_micros(
        10_000_000 - clock.now_us() % 10_000_000,
    ));
    assert_eq!(run("rl:ip:a"), [true, true, true]);
    assert_eq!(run("rl:ip:a"), [true, false, false]);
    // The short window over: it starts again, the long one still denies.
    clock.advance(std::time::Duration::from_secs(1));
    assert_eq!(run("rl:ip:a"), [true, true, false]);
    // The pack's expiry, after a sweep of its shard (`None`: swept).
    let swept_then_expiry = || {
        let key = "rl:ip:a{c}";
        let guard = m.inner.collector.enter();
        let h = m.hash(key);
        let held = shard::Held::new(&guard);
        let mut w = shard::Writer::lock(&m.inner.shards[shard::shard_of(h)]);
        w.sweep(&held, m.now_us());
        match w.find(shard::Lookup { hash: h, text: key }, &held) {
            Some(shard::Entry::Pack(p)) => Some(shard::locked(p).expires_us()),
            Some(_) => panic!("another entry under {key}"),
            None => None,
        }
    };
    // The long window's end (the short one's state ends at start + 2 s).
    let start = clock.now_us() - 1_000_000;
    assert_eq!(swept_then_expiry(), Some(start + 10_000_000));
    clock.advance(std::time::Duration::from_micros(8_999_999));
    assert_eq!(swept_then_expiry(), Some(start + 10_000_000));
    assert_eq!(run("rl:ip:a"), [true, true, false]);
    // Past it, the sweep drops the pack; the next request starts afresh.
    clock.advance(std::time::Duration::from_micros(1));
    assert_eq!(swept_then_expiry(), None);
    assert_eq!(run("rl:ip:a"), [true, true, true]);
}
