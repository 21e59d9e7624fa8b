//! The model test of lease mode: N instances with random, changing arrival
//! rates share one token bucket (a model of the shared bucket: an integer
//! count, refilled per tick, taken from atomically). Each instance runs the
//! real [`Entry`]: its spending, its lease sizing and trigger, the landing
//! of a lease; leases are taken at the bucket after a random delay and land
//! after another (in flight meanwhile), and expire after their lifetime.
//!
//! Over long runs of many seeds it checks, at every step:
//! * over-admission is 0: admitted ≤ what left the bucket (and the books
//!   balance: left = admitted + held + in flight − returned);
//! * every denial happens with at most `instances × max` tokens held or in
//!   flight fleet-wide (the documented false-denial bound).

use super::entry::Entry;
use super::pool::TierLease;
use crate::algorithm::TierDecision;
use crate::engine::limits::checked_limit;
use crate::{algorithm::kind::Algorithm, quota::Quota};
use std::sync::atomic::Ordering;

/// xorshift64*: seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A lease on its way: taken from the bucket (`k` tokens) at `taken_at`,
/// landing at `lands_at` on instance `i`.
struct InFlight {
    i: usize,
    k: u64,
    lands_at: u64,
    started: u64,
}

struct Outcome {
    admitted: u64,
    denied: u64,
    false_denials: u64,
    calls: u64,
}

const TICK_US: u64 = 1_000;

fn run(seed: u64, instances: usize, capacity: u64, refill_per_tick: u64, max: u64) -> Outcome {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    // Only the capacity matters to the entries (headers); the model bucket
    // refills by itself.
    let quota = Quota::per_second(1_000).burst(capacity);
    let limit = checked_limit("m", Algorithm::TokenBucket, quota, 1).unwrap();
    let lease = TierLease {
        interval_us: 20 * TICK_US,
        max: Some(max),
        min: 2,
    };
    let bound = instances as u64 * max;
    let mut now = 1_000_000_000;
    let entries: Vec<Entry> = (0..instances)
        .map(|_| Entry::new("k", limit, None, lease, now))
        .collect();
    let mut bucket = capacity;
    // Tokens that left the bucket, net of returns; admitted requests.
    let (mut out, mut returned, mut admitted) = (0u64, 0u64, 0u64);
    let (mut denied, mut false_denials, mut calls) = (0, 0, 0);
    let mut flights: Vec<InFlight> = Vec::new();
    // Per-instance arrivals per tick (×1/4), changed now and then.
    let mut rates: Vec<u64> = (0..instances).map(|_| rng.below(40)).collect();
    for tick in 0..20_000u64 {
        now += TICK_US;
        bucket = (bucket + refill_per_tick).min(capacity);
        if tick % 2_000 == 0 {
            for r in &mut rates {
                *r = match rng.below(4) {
                    0 => 0,
                    1 => rng.below(4),
                    _ => rng.below(60),
                };
            }
        }
        // Leases that land now.
        let mut i = 0;
        while i < flights.len() {
            if flights[i].lands_at <= now {
                let f = flights.swap_remove(i);
                let e = &entries[f.i];
                let d = TierDecision {
                    allowed: true,
                    limit: capacity,
                    remaining: bucket,
                    reset_after_us: 0,
                    retry_after_us: 0,
                    delay_us: 0,
                };
                assert!(e.land(f.k, None, &d, f.started).is_none());
                e.fetching.store(false, Ordering::Release);
            } else {
                i += 1;
            }
        }
        // Expired leases go back (the sweeper), never above the capacity.
        for e in &entries {
            let exp = e.expires_us.load(Ordering::Acquire);
            if exp != 0 && now >= exp {
                let n = e.tokens.swap(0, Ordering::AcqRel);
                returned += n;
                bucket = (bucket + n).min(capacity);
            }
        }
        // This tick's requests, instances interleaved at random.
        let mut arrivals: Vec<usize> = Vec::new();
        for (i, r) in rates.iter().enumerate() {
            for _ in 0..(*r / 4 + u64::from(rng.below(4) < *r % 4)) {
                arrivals.push(i);
            }
        }
        for j in (1..arrivals.len()).rev() {
            let k = rng.below(j as u64 + 1) as usize;
            arrivals.swap(j, k);
        }
        for i in arrivals {
            let e = &entries[i];
            e.note_demand(1, now);
            if e.spend(1, now).is_some() {
                admitted += 1;
            } else if bucket >= 1 {
                // Its own check, as without lease mode.
                bucket -= 1;
                out += 1;
                admitted += 1;
                e.seen.store(bucket, Ordering::Release);
            } else {
                denied += 1;
                e.seen.store(bucket, Ordering::Release);
                let held: u64 = entries
                    .iter()
                    .map(|e| e.tokens.load(Ordering::Acquire))
                    .sum::<u64>()
                    + flights.iter().map(|f| f.k).sum::<u64>();
                if held > 0 {
                    false_denials += 1;
                }
                assert!(held <= bound, "seed {seed}: {held} held at a denial");
            }
            if let Some(k) = e.wants(now) {
                // The take runs at the bucket atomically (maybe with a
                // retry at a quarter of what is left) and lands later.
                e.fetching.store(true, Ordering::Release);
                calls += 1;
                let k = if bucket >= k {
                    k
                } else {
                    calls += 1;
                    let again = k.min(bucket / 4);
                    e.seen.store(bucket, Ordering::Release);
                    if again >= 2 {
                        again
                    } else {
                        0
                    }
                };
                if k == 0 {
                    e.fetching.store(false, Ordering::Release);
                } else {
                    bucket -= k;
                    out += k;
                    flights.push(InFlight {
                        i,
                        k,
                        lands_at: now + rng.below(4) * TICK_US,
                        started: now,
                    });
                }
            }
            // The invariants, at every step.
            let held: u64 = entries
                .iter()
                .map(|e| e.tokens.load(Ordering::Acquire))
                .sum();
            let flying: u64 = flights.iter().map(|f| f.k).sum();
            // Never over: admitted ≤ what left the bucket, net of returns.
            assert!(admitted <= out - returned, "seed {seed}: over-admission");
            assert_eq!(
                out - returned,
                admitted + held + flying,
                "seed {seed}: the books balance"
            );
            assert!(
                held + flying <= bound,
                "seed {seed}: {} held",
                held + flying
            );
        }
    }
    Outcome {
        admitted,
        denied,
        false_denials,
        calls,
    }
}

#[test]
fn never_over_the_quota_and_false_denials_within_the_bound() {
    let mut totals = (0, 0, 0, 0);
    for seed in 1..=40u64 {
        let instances = 2 + (seed % 7) as usize;
        let capacity = [20, 100, 1_000][(seed % 3) as usize];
        let refill = [0, 1, 5][(seed % 3 + seed / 3) as usize % 3];
        let o = run(seed, instances, capacity, refill, 8);
        totals.0 += o.admitted;
        totals.1 += o.denied;
        totals.2 += o.false_denials;
        totals.3 += o.calls;
    }
    eprintln!("admitted, denied, false denials, lease calls: {totals:?}");
    // The runs exercised both sides: leases, denials, false denials.
    assert!(
        totals.0 > 0 && totals.1 > 0 && totals.2 > 0 && totals.3 > 0,
        "{totals:?}"
    );
}
