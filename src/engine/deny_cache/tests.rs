use super::*;
use crate::algorithm::State;
use crate::engine::limits::checked_limit;
use crate::{algorithm::kind::Algorithm, quota::Quota};
use proptest::prelude::*;

fn limit(algorithm: Algorithm, n: u64, period_ms: u64) -> Limit {
    checked_limit(
        "t",
        algorithm,
        Quota::new(n, Duration::from_millis(period_ms)),
        1,
    )
    .expect("a valid quota")
}

fn entry(until_us: u64, cost: u64, quota: Limit) -> Denied {
    Denied::new(until_us, cost, quota, 0, Duration::from_secs(60))
}

#[test]
fn lookup_matches_key_cost_and_limit_and_lapses_for_a_second() {
    let c = DenyCache::new(100);
    let l = limit(Algorithm::TokenBucket, 10, 1000);
    let other = limit(Algorithm::TokenBucket, 20, 1000);
    assert!(matches!(c.lookup("k", 1, &l, 0), Lookup::Miss));
    c.insert("k".into(), entry(5_000, 1, l));
    assert!(matches!(c.lookup("k", 1, &l, 4_999), Lookup::Denied(d) if d.until_us == 5_000));
    // Another cost, another limit (a plan), another key: not this entry.
    assert!(matches!(c.lookup("k", 2, &l, 4_999), Lookup::Miss));
    assert!(matches!(c.lookup("k", 1, &other, 4_999), Lookup::Miss));
    assert!(matches!(c.lookup("j", 1, &l, 4_999), Lookup::Miss));
    // From the retry instant on: lapsed for LAPSED_FOR, then nothing.
    assert!(matches!(c.lookup("k", 1, &l, 5_000), Lookup::Lapsed));
    assert!(matches!(
        c.lookup("k", 1, &l, 5_000 + LAPSED_FOR_US - 1),
        Lookup::Lapsed
    ));
    assert!(matches!(
        c.lookup("k", 1, &l, 5_000 + LAPSED_FOR_US),
        Lookup::Miss
    ));
}

#[test]
fn forget_remove_lapsed_and_clear() {
    let c = DenyCache::new(100);
    let l = limit(Algorithm::FixedWindow, 1, 1000);
    c.insert("a".into(), entry(5_000, 1, l));
    c.insert("b".into(), entry(5_000, 1, l));
    // A live entry survives remove_lapsed; a charge forgets it.
    c.remove_lapsed("a", 4_000);
    assert!(matches!(c.lookup("a", 1, &l, 4_000), Lookup::Denied(_)));
    c.forget("a", || 4_000);
    assert!(matches!(c.lookup("a", 1, &l, 4_000), Lookup::Miss));
    c.remove_lapsed("b", 5_000);
    assert!(matches!(c.lookup("b", 1, &l, 5_000), Lookup::Miss));
    c.insert("b".into(), entry(9_000, 1, l));
    c.clear();
    assert!(matches!(c.lookup("b", 1, &l, 4_000), Lookup::Miss));
    // Off: nothing is kept.
    let off = DenyCache::new(0);
    off.insert("a".into(), entry(5_000, 1, l));
    assert!(!off.enabled());
    assert!(matches!(off.lookup("a", 1, &l, 0), Lookup::Miss));
}

#[test]
fn one_probe_leads_the_others_follow() {
    let c = DenyCache::new(100);
    let Role::Lead(guard) = c.join("k") else {
        panic!("the first request leads");
    };
    assert_eq!(guard.key(), "k");
    assert!(matches!(c.join("k"), Role::Follow(_)));
    assert!(matches!(c.join("other"), Role::Lead(_)));
    drop(guard);
    assert!(matches!(c.join("k"), Role::Lead(_)));
}

#[test]
fn stays_exact_only_where_remaining_cannot_move() {
    let fixed = limit(Algorithm::FixedWindow, 10, 1000);
    let bucket = limit(Algorithm::TokenBucket, 10, 1000);
    assert!(stays_exact(&fixed, 5, 0));
    assert!(stays_exact(&bucket, 1, 0));
    assert!(stays_exact(&bucket, 3, 2));
    assert!(!stays_exact(&bucket, 3, 1));
}

proptest! {
    /// Whatever the key's history, a denial's wait is never longer than
    /// `longest_wait_us` (the bound that lets an uncached tier be
    /// ruled out of binding a cached 429).
    #[test]
    fn no_denial_waits_longer_than_the_bound(
        alg in 0..4usize,
        n in 1u64..20,
        period_ms in 1u64..5_000,
        ops in proptest::collection::vec((0u64..3_000_000, 1u64..25), 1..60),
    ) {
        let algorithm = [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindowLog,
            Algorithm::SlidingWindowCounter,
            Algorithm::TokenBucket,
        ][alg];
        let l = limit(algorithm, n, period_ms);
        let mut state: Option<State> = None;
        let mut now = 1_700_000_000_000_000u64;
        for (advance, cost) in ops {
            now += advance;
            let cost = cost.min(l.capacity() + 1);
            let d = l.check(state.as_ref(), now, cost);
            if d.allowed {
                state = Some(l.charge(state, now, cost).0);
            } else {
                prop_assert!(
                    d.retry_after_us <= longest_wait_us(&l, cost, now),
                    "{algorithm:?} cost {cost}: waits {} > bound {}",
                    d.retry_after_us,
                    longest_wait_us(&l, cost, now)
                );
            }
        }
    }
}

/// A room fact answers for the cost that still fits, with every check in
/// flight charging first; the charges fed while its own check was in
/// flight are taken off; a check that ends without its answer fed (an
/// error, a dropped request) voids the facts of checks sent before.
#[test]
fn room_facts_count_the_charges_they_cannot_see() {
    let c = DenyCache::new(100);
    let l = limit(Algorithm::TokenBucket, 10, 1000);
    let other = limit(Algorithm::TokenBucket, 20, 1000);
    let ttl = Duration::from_secs(60);
    // Seen with room for 5 more, nothing else in flight.
    let a = c.start_flight(1);
    a.answered();
    c.note_room("k", 5, l, &a, true, 5_000, ttl);
    drop(a);
    assert!(matches!(c.lookup("k", 5, &l, 4_000), Lookup::Room));
    assert!(matches!(c.lookup("k", 6, &l, 4_000), Lookup::Miss));
    assert!(matches!(c.lookup("k", 1, &other, 4_000), Lookup::Miss));
    // Past its instant (time only adds room), until the entry goes.
    assert!(matches!(
        c.lookup("k", 5, &l, 5_000 + LAPSED_FOR_US - 1),
        Lookup::Room
    ));
    assert!(matches!(
        c.lookup("k", 5, &l, 5_000 + LAPSED_FOR_US),
        Lookup::Miss
    ));
    // Two checks of cost 1 and 2 in flight: 3 of the 5 are reserved.
    let b = c.start_flight(1);
    let d = c.start_flight(2);
    assert!(matches!(c.lookup("k", 2, &l, 4_000), Lookup::Room));
    assert!(matches!(c.lookup("k", 3, &l, 4_000), Lookup::Miss));
    // d's answer is fed first (its charge may have landed after b's on the
    // backend): b's fact leaves d's cost out.
    d.answered();
    drop(d);
    b.answered();
    c.note_room("j", 5, l, &b, true, 5_000, ttl);
    drop(b);
    assert!(matches!(c.lookup("j", 3, &l, 4_000), Lookup::Room));
    assert!(matches!(c.lookup("j", 4, &l, 4_000), Lookup::Miss));
    // Nothing left once they are taken off: no fact.
    let e = c.start_flight(1);
    let f = c.start_flight(4);
    f.answered();
    e.answered();
    c.note_room("i", 4, l, &e, true, 5_000, ttl);
    assert!(matches!(c.lookup("i", 1, &l, 4_000), Lookup::Miss));
    drop((e, f));
    // A check dropped unanswered: every fact written so far is void, and
    // so is one from a check sent before it ends.
    let g = c.start_flight(1);
    drop(c.start_flight(1));
    assert!(matches!(c.lookup("k", 1, &l, 4_000), Lookup::Miss));
    g.answered();
    c.note_room("h", 5, l, &g, true, 5_000, ttl);
    assert!(matches!(c.lookup("h", 1, &l, 4_000), Lookup::Miss));
    drop(g);
    let h = c.start_flight(1);
    h.answered();
    c.note_room("h", 5, l, &h, true, 5_000, ttl);
    drop(h);
    assert!(matches!(c.lookup("h", 5, &l, 4_000), Lookup::Room));
    // A charge forgets it.
    c.forget("h", || 4_000);
    assert!(matches!(c.lookup("h", 1, &l, 4_000), Lookup::Miss));
    // Uncharged (another tier denied the request), a check leaves a denial
    // cached for another cost; charged, it replaces it.
    c.insert("g".into(), entry(5_000, 3, l));
    let k = c.start_flight(1);
    k.answered();
    c.note_room("g", 1, l, &k, false, 5_000, ttl);
    assert!(matches!(c.lookup("g", 3, &l, 4_000), Lookup::Denied(_)));
    c.note_room("g", 1, l, &k, true, 5_000, ttl);
    drop(k);
    assert!(matches!(c.lookup("g", 3, &l, 4_000), Lookup::Miss));
    assert!(matches!(c.lookup("g", 1, &l, 4_000), Lookup::Room));
}
