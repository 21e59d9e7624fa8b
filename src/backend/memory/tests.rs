use super::*;
use crate::algorithm::{Limit, TokenBucket};
use crate::backend::{Shadow, TierCheck, Verdict};

fn check(key: &str, tb: TokenBucket) -> TierCheck {
    TierCheck {
        key: key.to_owned(),
        limit: Limit::TokenBucket(tb),
        cost: 1,
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
