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

impl MemoryBackend {
    fn check_all(&self, checks: &[TierCheck]) -> Verdict {
        self.check(checks, Shadow::NONE, true)
    }
}

#[test]
fn all_or_nothing_across_tiers() {
    let clock = ManualClock::new(1_000_000_000_000);
    let m = MemoryBackend::with_manual_clock(clock);
    let wide = TokenBucket::new(10, 60_000_000, 10).unwrap();
    let narrow = TokenBucket::new(1, 60_000_000, 1).unwrap();
    let v = m.check_all(&[check("rl:g:all", wide), check("rl:u:a", narrow)]);
    assert!(v.allowed());
    let v = m.check_all(&[check("rl:g:all", wide), check("rl:u:a", narrow)]);
    assert!(!v.allowed());
    assert_eq!(v.decisions[1].remaining, 0);
    // The global tier was not charged for the denied request: 10 - 1 - 1.
    let v = m.check_all(&[check("rl:g:all", wide)]);
    assert_eq!(v.decisions[0].remaining, 8);
}

/// A key listed twice in one check is charged twice (the second charge
/// sees the first), as it was before the token bucket's state was kept
/// from the decision.
#[test]
fn a_key_listed_twice_is_charged_twice() {
    let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000));
    let tb = TokenBucket::new(10, 10_000_000, 10).unwrap();
    let v = m.check(&[check("k", tb), check("k", tb)], Shadow::NONE, true);
    assert!(v.allowed());
    // Both decided on the full bucket; both charged.
    assert_eq!(v.decisions[0].remaining, 9);
    assert_eq!(v.decisions[1].remaining, 9);
    let next = m.check(&[check("k", tb)], Shadow::NONE, true);
    assert_eq!(next.decisions[0].remaining, 7);
}

/// More tiers than the check's stack scratch holds (8), with new keys,
/// known keys, a key listed twice and keys longer than the 24 bytes
/// kept inline: every one charged exactly once per listing.
#[test]
fn a_check_of_many_tiers_charges_each_once() {
    let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000));
    let tb = TokenBucket::new(5, 10_000_000, 5).unwrap();
    let long = "rl:api_key:0123456789abcdef0123456789abcdef";
    let mut keys: Vec<String> = (0..10).map(|i| format!("rl:t{i}:k")).collect();
    keys.push(long.to_owned());
    let checks: Vec<TierCheck> = keys.iter().map(|k| check(k, tb)).collect();
    assert!(m.check_all(&checks[..3]).allowed());
    let mut twice = checks.clone();
    twice.push(check("rl:t0:k", tb));
    let v = m.check_all(&twice);
    assert!(v.allowed());
    assert_eq!(v.charges.len(), 12);
    assert!(v.charges.iter().all(Option::is_some));
    let after: Vec<u64> = m
        .check_all(&checks)
        .decisions
        .iter()
        .map(|d| d.remaining)
        .collect();
    // t0: 1 + 2 (listed twice), t1, t2: 1 + 1, the rest 1, now 1 more.
    assert_eq!(after, [1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]);
    assert_eq!(m.len(), 11);
}

#[test]
fn memory_stays_bounded_under_a_key_flood() {
    let clock = ManualClock::new(1_000_000_000_000);
    let m = MemoryBackend::with_manual_clock(clock.clone()).max_keys(64 * 100);
    let tb = TokenBucket::new(1, 3_600_000_000, 1).unwrap();
    for i in 0..100_000u32 {
        let v = m.check_all(&[check(&format!("rl:ip:{i}"), tb)]);
        assert!(v.allowed());
    }
    assert!(m.len() <= 64 * (100 + 1), "len {}", m.len());
    // After an hour every bucket is full again and sweeps drop them all.
    clock.advance(std::time::Duration::from_secs(3601));
    for i in 0..64 * 1100u32 {
        m.check_all(&[check(&format!("rl:ip:new{i}"), tb)]);
    }
    assert!(m.len() <= 64 * 101);
}

/// 8 threads × 2 000 requests (started together) against two tiers, a wide
/// one (100 000) then a narrow one (5 000), on a stopped clock: exactly
/// 5 000 are admitted, and once
/// every thread is done the wide tier holds exactly those 50 charges (a
/// request the narrow tier denied after its wide charge was swapped in had
/// that charge given back). Token and leaky buckets (charged by
/// compare-and-swap), and a fixed window (locked) in either place.
#[test]
fn concurrent_checks_admit_exactly_the_smaller_quota() {
    const WIDE: u64 = 100_000;
    const NARROW: u64 = 5_000;
    let tb = |n| Limit::TokenBucket(TokenBucket::new(n, 3_600_000_000, n).unwrap());
    let gcra = |n| {
        Limit::LeakyBucket(crate::algorithm::Gcra {
            bucket: TokenBucket::new(n, 3_600_000_000, n).unwrap(),
            max_delay_us: None,
        })
    };
    let fixed = |n| {
        Limit::FixedWindow(crate::algorithm::Window {
            limit: n,
            window_us: 3_600_000_000,
        })
    };
    let pairs = [
        (tb(WIDE), tb(NARROW)),
        (gcra(WIDE), tb(NARROW)),
        (tb(WIDE), gcra(NARROW)),
        (fixed(WIDE), tb(NARROW)),
        (tb(WIDE), fixed(NARROW)),
    ];
    for (case, (wide, narrow)) in pairs.into_iter().enumerate() {
        let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000_000));
        let checks = [
            TierCheck {
                key: format!("rl:g{case}:all"),
                limit: wide,
                cost: 1,
                home: None,
            },
            TierCheck {
                key: format!("rl:u{case}:a"),
                limit: narrow,
                cost: 1,
                home: None,
            },
        ];
        let start = std::sync::Barrier::new(8);
        let admitted: usize = std::thread::scope(|s| {
            let workers: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        (0..2000)
                            .filter(|_| m.check(&checks, Shadow::NONE, false).allowed())
                            .count()
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(admitted, NARROW as usize, "case {case}");
        let v = m.check_all(&checks[..1]);
        assert_eq!(v.decisions[0].remaining, WIDE - NARROW - 1, "case {case}");
        let v = m.check_all(&checks[1..]);
        assert!(!v.allowed(), "case {case}");
    }
}

/// 8 threads × 2 000 requests (started together) of one tier on one key
/// (the single-tier fast path), on a stopped clock: exactly the burst of
/// 5 000 is admitted, each admission's `remaining` is distinct (every
/// charge seen exactly once), and the bucket is then empty; token and
/// leaky buckets, shadow mode charging the same.
#[test]
fn concurrent_single_tier_checks_admit_exactly_the_burst() {
    const BURST: u64 = 5_000;
    let tb = Limit::TokenBucket(TokenBucket::new(BURST, 3_600_000_000, BURST).unwrap());
    let gcra = Limit::LeakyBucket(crate::algorithm::Gcra {
        bucket: TokenBucket::new(BURST, 3_600_000_000, BURST).unwrap(),
        max_delay_us: None,
    });
    for (case, limit) in [tb, gcra].into_iter().enumerate() {
        let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000_000));
        let checks = [TierCheck {
            key: format!("rl:ip{case}:198.51.100.7"),
            limit,
            cost: 1,
            home: None,
        }];
        // The key exists first: the other 4 999 charges are compare-and-swaps.
        assert!(m.check_all(&checks).allowed());
        let start = std::sync::Barrier::new(8);
        let mut remaining: Vec<u64> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        (0..2000)
                            .map(|_| m.check(&checks, Shadow::NONE, true))
                            .filter(|v| v.allowed())
                            .map(|v| {
                                assert_eq!(v.charges.len(), 1);
                                v.decisions[0].remaining
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect()
        });
        remaining.sort_unstable();
        let expected: Vec<u64> = (0..BURST - 1).collect();
        assert_eq!(remaining, expected, "case {case}");
        let v = m.check_all(&checks);
        assert!(!v.allowed(), "case {case}");
        assert_eq!(v.decisions[0].remaining, 0, "case {case}");
        assert!(v.charges.is_empty(), "case {case}");
    }
}

/// A shadow tier that would deny is decided but not charged; one that
/// allows is charged, as when enforced (the single-tier fast path).
#[test]
fn a_single_shadow_tier_is_charged_only_when_it_allows() {
    let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000_000));
    let checks = [check(
        "rl:ip:198.51.100.7",
        TokenBucket::new(2, 60_000_000, 2).unwrap(),
    )];
    let shadow = Shadow(1);
    for left in [1, 0] {
        let v = m.check(&checks, shadow, true);
        assert!(v.decisions[0].allowed);
        assert_eq!(v.decisions[0].remaining, left);
        assert!(v.charges[0].is_some());
    }
    let v = m.check(&checks, shadow, true);
    assert!(!v.decisions[0].allowed);
    assert_eq!(v.decisions[0].remaining, 0);
    assert_eq!(v.decisions[0].retry_after_us, 30_000_000);
    assert_eq!(v.charges, vec![None]);
}

/// A charge given back after another request charged the same cell leaves
/// exactly that other charge, and never moves the bucket past full.
#[test]
fn a_charge_given_back_leaves_the_others() {
    use super::cell::TatCell;
    let now = 1_000_000_000;
    let tb = TokenBucket::new(7, 60_000_000, 10).unwrap();
    let limit = Limit::TokenBucket(tb);
    let (_, charged) = tb.check(None, now, 1);
    let (first, _) = charged.unwrap();
    let cell = TatCell::new(&crate::algorithm::State::Bucket(first), now).unwrap();
    // Ours: from `seen` to `mine`; then another request's, on top.
    let seen = cell.load();
    let (d, mine) = cell.decide(&limit, seen, now, 2).unwrap();
    assert_eq!(d.remaining, 7);
    let mine = mine.unwrap();
    // The undo value a check computes is what `undo` computes again.
    assert_eq!(mine.undo, cell.undo(&limit, mine.ticks, now));
    let mine = mine.ticks;
    cell.swap_from(seen, mine).unwrap();
    let (d, theirs) = cell.decide(&limit, mine, now, 3).unwrap();
    assert_eq!(d.remaining, 4);
    let theirs = theirs.unwrap();
    assert_eq!(theirs.undo, cell.undo(&limit, theirs.ticks, now));
    cell.swap_from(mine, theirs.ticks).unwrap();
    assert!(cell.give_back(seen, mine, now));
    // 10 − 1 (first) − 3 (theirs) = 6 left.
    let (d, _) = cell.decide(&limit, cell.load(), now, 1).unwrap();
    assert_eq!(d.remaining, 5);
    // Giving back more than was charged stops at a full bucket.
    assert!(cell.give_back(0, u64::MAX / 2, now));
    let (d, _) = cell.decide(&limit, cell.load(), now, 1).unwrap();
    assert_eq!(d.remaining, 9);
    // A cell of another quota cannot answer.
    let other = Limit::TokenBucket(TokenBucket::new(7, 1_000_000, 10).unwrap());
    assert!(cell.decide(&other, cell.load(), now, 1).is_none());
}

#[test]
fn an_entry_fits_two_cache_lines() {
    // The key (inline up to 24 bytes) and a bucket's cell in one
    // allocation of papaya's (its node is the key and the value).
    let node = std::mem::size_of::<(shard::Key, shard::Entry)>();
    println!(
        "node {node} key {} entry {}",
        std::mem::size_of::<shard::Key>(),
        std::mem::size_of::<shard::Entry>()
    );
    assert!(node <= 128, "{node}");
}

/// Lock-free checks of one key racing every writer that freezes its cell:
/// two-tier checks with a fixed window (always the locked path), with a
/// new key each (the locked path, inserting, and with `max_keys` small,
/// sweeping and evicting other keys at every doubling), and with a
/// second bucket of a small quota (charges given back when it turns to
/// deny, some of them meeting a frozen cell). On a stopped clock exactly
/// the burst is admitted, whatever the interleaving: a charge lost under
/// a writer would admit more, a give-back lost fewer.
#[test]
fn lock_free_checks_and_writers_admit_exactly_the_burst() {
    const BURST: u64 = 20_000;
    let tb =
        |n: u64, window_us: u64| Limit::TokenBucket(TokenBucket::new(n, window_us, n).unwrap());
    let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000_000)).max_keys(6_400);
    let hot = TierCheck {
        key: "rl:ip:198.51.100.7".to_owned(),
        limit: tb(BURST, 3_600_000_000),
        cost: 1,
        home: None,
    };
    let narrow = TierCheck {
        key: "rl:user:narrow".to_owned(),
        limit: tb(1_000, 3_600_000_000),
        cost: 1,
        home: None,
    };
    assert!(m.check_all(std::slice::from_ref(&hot)).allowed());
    let start = std::sync::Barrier::new(8);
    let admitted: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                let (m, hot, narrow, start) = (&m, &hot, &narrow, &start);
                s.spawn(move || {
                    start.wait();
                    let mut admitted = 0;
                    for i in 0..3_500u64 {
                        let checks = match t % 4 {
                            0 => vec![hot.clone()],
                            1 => vec![
                                hot.clone(),
                                TierCheck {
                                    key: format!("rl:fixed:{t}"),
                                    limit: Limit::FixedWindow(crate::algorithm::Window {
                                        limit: 1_000_000,
                                        window_us: 3_600_000_000,
                                    }),
                                    cost: 1,
                                    home: None,
                                },
                            ],
                            2 => vec![
                                hot.clone(),
                                TierCheck {
                                    key: format!("rl:new:{t}:{i}"),
                                    limit: tb(10, 1_000_000),
                                    cost: 1,
                                    home: None,
                                },
                            ],
                            _ => vec![hot.clone(), narrow.clone()],
                        };
                        admitted += u64::from(m.check(&checks, Shadow::NONE, false).allowed());
                    }
                    admitted
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    assert_eq!(admitted + 1, BURST);
    let v = m.check_all(std::slice::from_ref(&hot));
    assert!(!v.allowed());
    assert_eq!(v.decisions[0].remaining, 0);
    assert!(m.len() <= 6_400, "{}", m.len());
}

/// A lock-free charge given back after its key was reset and made anew by
/// another request: the reset took the charge with it, so the give-back
/// leaves the new key's charge alone (it used to refund the new key). One
/// whose cell is still in the table is given back on it.
#[test]
fn a_give_back_after_a_reset_leaves_the_new_key_alone() {
    use super::fast::Step;
    use super::shard::{shard_of, Entry, Lookup};
    let now = 1_000_000_000_000;
    let m = MemoryBackend::with_manual_clock(ManualClock::new(now));
    let a = check(
        "rl:ip:198.51.100.7",
        TokenBucket::new(3, 3_600_000_000, 3).unwrap(),
    );
    let h = m.hash(&a.key);
    // One token charged by compare-and-swap, as the fast path does: the
    // step its give-back takes.
    let charge_lock_free = |guard| {
        let key = Lookup {
            hash: h,
            text: &a.key,
        };
        let Some(Entry::Cell(cell)) = m.inner.shards[shard_of(h)].table.get(&key, guard) else {
            panic!("a cell");
        };
        let seen = cell.load();
        let (_, charged) = cell.decide(&a.limit, seen, now, 1).unwrap();
        cell.swap_from(seen, charged.unwrap().ticks).unwrap();
        Step {
            cell,
            seen,
            charged,
        }
    };
    let give_back = |step| m.give_back(std::slice::from_ref(&a), &[h], &[step], now);
    assert!(m.check_all(std::slice::from_ref(&a)).allowed());
    let guard = m.inner.collector.enter();
    // A lock-free charge (1 token left), then a reset and a new request;
    // the charge's give-back meets a cell that left the table.
    let step = charge_lock_free(&guard);
    assert!(m.reset(&a.key));
    assert_eq!(
        m.check_all(std::slice::from_ref(&a)).decisions[0].remaining,
        2
    );
    give_back(step);
    // 2 tokens left: a peek says 1 would be left after it.
    assert_eq!(
        m.peek(&a).decisions[0].remaining,
        1,
        "the new key's charge kept"
    );
    // A cell still in the table (1 token left): given back on it.
    let step = charge_lock_free(&guard);
    assert_eq!(m.peek(&a).decisions[0].remaining, 0);
    give_back(step);
    assert_eq!(m.peek(&a).decisions[0].remaining, 1, "given back");
}

/// A key listed twice when one token is left: both listings are decided on
/// that token (as `a_key_listed_twice_is_charged_twice` says), the first
/// takes it, and the second finds the bucket empty and leaves it so. It
/// used to store the bucket with a time-to-live of 0, as expired: full
/// again at once.
#[test]
fn a_key_listed_twice_at_its_last_token_leaves_the_bucket_empty() {
    let m = MemoryBackend::with_manual_clock(ManualClock::new(1_000_000_000_000));
    let k = check("rl:k", TokenBucket::new(2, 3_600_000_000, 2).unwrap());
    assert!(m.check_all(std::slice::from_ref(&k)).allowed());
    assert!(m.check_all(&[k.clone(), k.clone()]).allowed());
    let after = m.check_all(std::slice::from_ref(&k));
    assert!(!after.allowed());
    assert_eq!(after.decisions[0].remaining, 0);
    assert_eq!(after.decisions[0].retry_after_us, 1_800_000_000);
}
