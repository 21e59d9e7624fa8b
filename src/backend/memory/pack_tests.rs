//! The candidate packs (`pack.rs`): one entry of a tier key for its
//! candidates, deciding as keys of their own would.

use super::*;
use crate::algorithm::{Limit, TokenBucket};
use crate::backend::{Shadow, TierCheck, Verdict};

/// A xorshift64 sequence from `seed` (a test's repeatable choices).
fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

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
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
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
    // Three tier keys and the global one: each tier key's pack in its
    // own entry, not four keys more each.
    assert_eq!(packed.len(), 4, "packed");
    assert_eq!(apart.len(), 4 + 3 * 4, "apart");
    assert_eq!(named.len(), 4, "named");
}

/// A pack lives as long as its longest-lived candidate's state, each
/// state as long as its own key would, and its entry as long as the later
/// of the pack and the live state: the sweep drops it only once the last
/// has expired, and a candidate whose own time is up starts again from
/// nothing while the others keep theirs.
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
    // The pack's expiry, after a sweep of its shard (`None`: swept),
    // and that of the entry's live state.
    let swept_then_expiry = || {
        let key = "rl:ip:a";
        let guard = m.inner.collector.enter();
        let h = m.hash(key);
        let held = shard::Held::new(&guard);
        let mut w = shard::Writer::lock(&m.inner.shards[shard::shard_of(h)]);
        w.sweep(&held, m.now_us());
        let mut held = held;
        match w.find(shard::Lookup { hash: h, text: key }, &held) {
            Some(e @ shard::Entry::Packed(p)) => {
                Some((shard::locked(&p.pack).expires_us(), held.expires_us(e)))
            }
            Some(_) => panic!("no pack in the entry of {key}"),
            None => None,
        }
    };
    // The long window's end (the short one's state ends at start + 2 s);
    // the live bucket's, a token (10 ms) after its last charge.
    let start = clock.now_us() - 1_000_000;
    let long_end = start + 10_000_000;
    assert_eq!(swept_then_expiry(), Some((long_end, start + 1_010_000)));
    clock.advance(std::time::Duration::from_micros(8_999_999));
    assert_eq!(swept_then_expiry(), Some((long_end, start + 1_010_000)));
    assert_eq!(run("rl:ip:a"), [true, true, false]);
    // Past the pack's, the entry stays for its live state.
    clock.advance(std::time::Duration::from_micros(1));
    let live_end = start + 9_999_999 + 10_000;
    assert_eq!(swept_then_expiry(), Some((long_end, live_end)));
    // Past both, the sweep drops the entry; the next request starts afresh.
    clock.advance(std::time::Duration::from_micros(live_end - long_end));
    assert_eq!(swept_then_expiry(), None);
    assert_eq!(run("rl:ip:a"), [true, true, true]);
}

/// A tier key's candidates live in its own entry, beside its live state:
/// candidates charged on a key whose live check denied without a state
/// hold the entry alone; the live state's first charge joins them (and
/// is charged without a lock there after, as anywhere); a reset of the
/// key forgets its live state and keeps its candidates'. One key all
/// along.
#[test]
fn a_tier_keys_candidates_share_its_entry() {
    let clock = ManualClock::new(1_000_000_000_000);
    let m = MemoryBackend::with_manual_clock(clock.clone());
    let live = check("rl:ip:a", TokenBucket::new(3, 1_000_000, 3).unwrap());
    let candidate = check(
        "rl:ip:a{c:5/1s}",
        TokenBucket::new(5, 1_000_000, 5).unwrap(),
    );
    let run = |cost: u64| {
        let checks = [live.clone(), candidate.clone()].map(|c| TierCheck { cost, ..c });
        let mut v = Verdict::default();
        m.check_with_candidates(&checks, Shadow::NONE, &[0], &[], true, &mut v);
        v.decisions
            .iter()
            .map(|d| (d.allowed, d.remaining))
            .collect::<Vec<_>>()
    };
    // 4 tokens: over the live burst (denied, nothing stored), not the
    // candidate's (charged).
    assert_eq!(run(4), [(false, 3), (true, 1)]);
    assert_eq!(m.len(), 1);
    assert_eq!(run(1), [(true, 2), (true, 0)]);
    assert_eq!(m.len(), 1);
    // The live tier alone (the lock-free path), on the same state.
    let mut v = Verdict::default();
    m.check_into(std::slice::from_ref(&live), &mut v);
    assert_eq!(
        (v.decisions[0].allowed, v.decisions[0].remaining),
        (true, 1)
    );
    assert!(m.reset("rl:ip:a"));
    assert_eq!(m.len(), 1);
    // A fresh live bucket; the candidate's still empty.
    assert_eq!(run(1), [(true, 2), (false, 0)]);
    assert!(m.reset("rl:ip:a"));
    assert!(!m.reset("rl:ip:a"), "no live state left to forget");
    assert_eq!(m.len(), 1);
}

/// A token bucket candidate's state kept in ticks gives way to a state as
/// the algorithm keeps it whenever the ticks cannot decide (the clock
/// stepped back before the pack's anchor, or so far that a bucket is
/// further from full than its capacity). On a long sequence of requests
/// naming two of four candidates (three token buckets, a fixed window),
/// the clock now and then stepping back, the other tier now and then
/// denying, the packed candidates decide as keys of their own, with their
/// decisions in full (`check_with_candidates`) and as denial bits
/// (`check_with_packs`, the replay's way), and each packed store keeps one
/// entry for the tier key.
#[test]
fn a_buckets_ticks_give_way_when_they_cannot_decide() {
    use crate::algorithm::Window;
    let origin = 1_000_000_000_000;
    let clock = ManualClock::new(origin);
    let packed = MemoryBackend::with_manual_clock(clock.clone());
    let bits = MemoryBackend::with_manual_clock(clock.clone());
    let apart = MemoryBackend::with_manual_clock(clock.clone());
    let live = TokenBucket::new(50, 1_000_000, 50).unwrap();
    let other = TokenBucket::new(3, 1_000_000, 3).unwrap();
    // Each name's quota (a name is its quota, as the engine's are).
    let quotas = [
        Limit::TokenBucket(TokenBucket::new(2, 1_000_000, 2).unwrap()),
        Limit::TokenBucket(TokenBucket::new(3, 2_000_000, 4).unwrap()),
        Limit::TokenBucket(TokenBucket::new(7, 60_000_000, 3).unwrap()),
        Limit::FixedWindow(Window {
            limit: 2,
            window_us: 1_000_000,
        }),
    ];
    let names = ["{c:0}", "{c:1}", "{c:2}", "{c:3}"];
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    let (mut first, mut denied, mut allowed, mut back) = (0, 0, 0, 0);
    for op in 0..4_000 {
        match next() % 16 {
            // First every candidate's state, the clock moving on only: a
            // pack forgets an expired state when it stores a new one, and
            // a clock stepping back would find it live again on a key of
            // its own (not swept yet).
            _ if op < 4 => {
                first = op % 2 * 2;
                clock.advance(std::time::Duration::from_micros(next() % 400_000));
            }
            0 => first = (next() % 4) as usize,
            1 => {
                // Back by up to 3 s, or late in the sequence to about the
                // first request's time (the pack's anchor), a little before
                // or after it.
                let to = match next() % 4 {
                    0 if op > 3_000 => origin + next() % 1_000_000 - 500_000,
                    _ => clock.now_us() - next() % 3_000_000,
                };
                clock.set(to);
                back += 1;
            }
            _ => clock.advance(std::time::Duration::from_micros(next() % 400_000)),
        }
        let cost = 1 + next() % 2;
        let pair = [first, (first + 1) % 4];
        // The candidates' keys under `under`: the live key's own (packed),
        // or another (keys of their own).
        let checks = |under: &str| {
            let mut all = vec![
                TierCheck {
                    key: "rl:ip:k".to_owned(),
                    limit: Limit::TokenBucket(live),
                    cost,
                    home: None,
                },
                check("rl:global:all", other),
            ];
            for q in pair {
                all.push(TierCheck {
                    key: format!("{under}{}", names[q]),
                    limit: quotas[q],
                    cost,
                    home: None,
                });
            }
            all
        };
        let tags = pair.map(|q| candidate_tag(names[q]));
        let (mut a, mut b, mut c) = (Verdict::default(), Verdict::default(), Verdict::default());
        let own = checks("rl:ip:k");
        packed.check_with_candidates(&own, Shadow::NONE, &[0, 0], &tags, true, &mut a);
        let mut denials = Denials::default();
        let groups = [PackGroup {
            live: 0,
            checks: &own[2..],
            tags: &tags,
        }];
        bits.check_with_packs(&own[..2], Shadow::NONE, &groups, true, &mut c, &mut denials);
        let apart_checks = checks("apart:k");
        apart.check_with_candidates(&apart_checks, Shadow::NONE, &[0, 0], &[], true, &mut b);
        assert_eq!(a.decisions, b.decisions, "op {op}");
        assert_eq!(c.decisions[..], b.decisions[..2], "op {op}, bits");
        let expected = b.decisions[2..]
            .iter()
            .enumerate()
            .fold(0, |bits, (k, d)| bits | (u64::from(!d.allowed) << k));
        assert_eq!(denials.bits, expected, "op {op}, bits");
        for d in &b.decisions[2..] {
            if d.allowed {
                allowed += 1;
            } else {
                denied += 1;
            }
        }
    }
    assert!(back > 100, "{back} steps back");
    assert!(
        denied > 500 && allowed > 500,
        "{denied} denied, {allowed} allowed"
    );
    assert_eq!(packed.len(), 2, "packed");
    assert_eq!(bits.len(), 2, "bits");
    assert_eq!(apart.len(), 2 + 4, "apart");
}
