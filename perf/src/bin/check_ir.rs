//! `check_ir <mode> <keys> <checks>`: stores `keys` live keys
//! `rl:ip:<IPv4>` (one token-bucket tier: 1000/s, a burst of 10^9, on a
//! stopped clock) and makes `checks` checks cycling through them, as
//! `memory_check/<n>` of `benches/hot_path.rs` does. Modes: `ours`,
//! `governor` (its keyed limiter, DashMap), `pingora_rate`; `ours_window`
//! (a sliding window counter on the same keys: the write-locked path),
//! `ours_new_keys` (every check a key not held: a flood); and two threads
//! on keys of their own: `ours_2_threads` (one store), `ours_2_stores` (a
//! store each) and `governor_2_threads` (`checks` checks each). Run under callgrind twice with different
//! `checks` by `perf/check_ir.sh`: the difference of the totals divided
//! by the difference of the checks is the instructions of one check, setup
//! excluded. Every mode prints (stderr) `loop cpu ns per check: <ns>`, the
//! process's CPU time from the first check to the last divided by the
//! checks (of both threads in a two-thread mode), which
//! `perf/check_time.sh` reports. `ours` prints the process's resident
//! memory once its keys are stored (stderr, KiB).
//!
//! Switch (environment): `SERIAL=1` (`ours`): each check's key depends on
//! the last check's answer, so checks do not overlap in the CPU (a
//! server's one check a request) and the figure is a latency.

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::num::NonZeroU32;
use std::time::Duration;

use tiered_ratelimit::algorithm::{Limit, TokenBucket};
use tiered_ratelimit::backend::{ManualClock, MemoryBackend, TierCheck, Verdict};

const S: u64 = 1_000_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: check_ir <ours|ours_window|ours_new_keys|ours_2_threads|ours_2_stores|\
                 governor|governor_2_threads|pingora_rate> <keys> <checks>";
    let (Some(which), Some(keys), Some(checks)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let (Ok(keys), Ok(checks)) = (keys.parse::<u32>(), checks.parse::<u64>()) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let limit = Limit::TokenBucket(TokenBucket::new(1000, S, 1_000_000_000).expect("a quota"));
    let n = keys.max(1) as usize;
    let mut cycle = {
        let mut i = 0usize;
        move || {
            i += 1;
            if i == n {
                i = 0;
            }
            i
        }
    };
    // `keys` keys `rl:ip:<IPv4>` from the address `first` on.
    let keys_from = |first: u32| -> Vec<TierCheck> {
        (0..keys.max(1))
            .map(|i| TierCheck {
                key: format!("rl:ip:{}", Ipv4Addr::from(first + i)),
                limit,
                cost: 1,
                home: None,
            })
            .collect()
    };
    let keys_of = keys_from(0x0a00_0000);
    match which.as_str() {
        "ours" => {
            let store = MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                .max_keys(4_000_000);
            let mut verdict = Verdict::default();
            for c in &keys_of {
                store.check_into(std::slice::from_ref(c), &mut verdict);
            }
            eprintln!("resident after filling {keys} keys: {} KiB", resident_kib());
            loop_starts();
            if std::env::var_os("SERIAL").is_some() {
                // Each key waits for the last check's answer: a latency, as
                // in a server's one check a request.
                let mut i = 0usize;
                for _ in 0..checks {
                    let last = usize::from(black_box(&verdict).allowed());
                    i += 1 + (last ^ 1);
                    if i >= n {
                        i = 0;
                    }
                    store.check_into(std::slice::from_ref(&keys_of[i]), &mut verdict);
                }
            } else {
                for _ in 0..checks {
                    let c = &keys_of[cycle()];
                    store.check_into(std::slice::from_ref(c), &mut verdict);
                    black_box(&verdict);
                }
            }
        }
        "ours_window" => {
            // The locked path: a sliding window counter (10^9 a second) on
            // the same keys, checked under its shard's write lock.
            let window = Limit::SlidingWindowCounter(tiered_ratelimit::algorithm::Window {
                limit: 1_000_000_000,
                window_us: S,
            });
            let keys_of: Vec<TierCheck> = keys_of
                .into_iter()
                .map(|c| TierCheck { limit: window, ..c })
                .collect();
            let store = MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                .max_keys(4_000_000);
            let mut verdict = Verdict::default();
            for c in &keys_of {
                store.check_into(std::slice::from_ref(c), &mut verdict);
            }
            loop_starts();
            for _ in 0..checks {
                store.check_into(std::slice::from_ref(&keys_of[cycle()]), &mut verdict);
                black_box(&verdict);
            }
        }
        "ours_new_keys" => {
            // A key flood: every check a key the store does not hold (after
            // the `keys` held ones), inserted under the write lock; past
            // `max_keys` (4·10^6) the sweeps evict.
            let store = MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                .max_keys(4_000_000);
            let mut verdict = Verdict::default();
            for c in &keys_of {
                store.check_into(std::slice::from_ref(c), &mut verdict);
            }
            let mut c = keys_of[0].clone();
            loop_starts();
            for i in 0..checks {
                use std::fmt::Write as _;
                c.key.clear();
                let _ = write!(c.key, "rl:ip:{}", Ipv4Addr::from(0x2000_0000 + i as u32));
                store.check_into(std::slice::from_ref(&c), &mut verdict);
                black_box(&verdict);
            }
        }
        "ours_2_threads" | "ours_2_stores" => {
            // Two threads, each cycling through its own `keys` keys
            // (`checks` checks each): the CPU time per check with the other
            // thread running, against `ours` alone. `ours_2_threads` shares one
            // store; `ours_2_stores` gives each thread a store of its own,
            // so that nothing is shared: what the host gives two threads
            // at all, the ceiling for the shared store.
            let new_store = || {
                MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S))
                    .max_keys(4_000_000)
            };
            let shared = new_store();
            let own = [new_store(), new_store()];
            let stores = if which == "ours_2_threads" {
                [&shared, &shared]
            } else {
                [&own[0], &own[1]]
            };
            let other = keys_from(0x0b00_0000);
            let mut verdict = Verdict::default();
            for (store, set) in stores.into_iter().zip([&keys_of, &other]) {
                for c in set {
                    store.check_into(std::slice::from_ref(c), &mut verdict);
                }
            }
            two_threads([&keys_of, &other], checks, |t, c, verdict| {
                stores[t].check_into(std::slice::from_ref(c), verdict);
            });
        }
        "governor_2_threads" => {
            // governor's keyed limiter shared by two threads, as
            // `ours_2_threads`.
            let limiter = governor_limiter();
            let other = keys_from(0x0b00_0000);
            for c in keys_of.iter().chain(&other) {
                let _ = limiter.check_key(&c.key);
            }
            two_threads([&keys_of, &other], checks, |_, c, _| {
                black_box(limiter.check_key(&c.key).is_ok());
            });
        }
        "governor" => {
            let limiter = governor_limiter();
            for c in &keys_of {
                let _ = limiter.check_key(&c.key);
            }
            loop_starts();
            for _ in 0..checks {
                black_box(limiter.check_key(&keys_of[cycle()].key).is_ok());
            }
        }
        "pingora_rate" => {
            let rate = pingora_limits::rate::Rate::new(Duration::from_secs(1));
            for c in &keys_of {
                rate.observe(&c.key, 1);
            }
            loop_starts();
            for _ in 0..checks {
                black_box(rate.observe(&keys_of[cycle()].key, 1));
            }
        }
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    }
    if let Some(start) = LOOP_START.get() {
        let ns = cpu_ns().saturating_sub(*start);
        // Two-thread modes make `checks` checks in each thread.
        let made = if which.contains("_2_") {
            2 * checks
        } else {
            checks
        };
        eprintln!(
            "loop cpu ns per check: {:.1}",
            ns as f64 / made.max(1) as f64
        );
    }
}

static LOOP_START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// The checks' loop starts: the process's CPU time from here on, divided by
/// the checks, is printed at the end (`loop cpu ns per check`).
fn loop_starts() {
    let _ = LOOP_START.set(cpu_ns());
}

fn cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64
}

type Governor = governor::RateLimiter<
    String,
    governor::state::keyed::DashMapStateStore<String>,
    governor::clock::FakeRelativeClock,
    governor::middleware::NoOpMiddleware<governor::nanos::Nanos>,
>;

/// governor's keyed limiter (its default DashMap store) with the quota of
/// ours: 1000/s, a burst of 10^9, on a stopped clock.
fn governor_limiter() -> Governor {
    let quota = governor::Quota::per_second(NonZeroU32::new(1000).expect("nonzero"))
        .allow_burst(NonZeroU32::new(1_000_000_000).expect("nonzero"));
    governor::RateLimiter::dashmap_with_clock(quota, governor::clock::FakeRelativeClock::default())
}

/// Two threads, started together, thread `t` making `checks` checks
/// cycling through `sets[t]` with `check(t, key, its verdict buffer)`.
fn two_threads<F>(sets: [&Vec<TierCheck>; 2], checks: u64, check: F)
where
    F: Fn(usize, &TierCheck, &mut Verdict) + Sync,
{
    let start = std::sync::Barrier::new(2);
    loop_starts();
    std::thread::scope(|scope| {
        for (t, set) in sets.into_iter().enumerate() {
            let (start, check) = (&start, &check);
            scope.spawn(move || {
                let mut verdict = Verdict::default();
                start.wait();
                let mut i = 0;
                for _ in 0..checks {
                    i += 1;
                    if i == set.len() {
                        i = 0;
                    }
                    check(t, &set[i], &mut verdict);
                    black_box(&verdict);
                }
            });
        }
    });
}

/// This process's resident set, KiB (`/proc/self/statm`, 4 KiB pages; 0
/// where there is none).
fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}
