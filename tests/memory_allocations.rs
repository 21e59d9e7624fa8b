//! Heap allocations of the memory backend's check, counted exactly: this
//! test binary's global allocator is dhat's, in its testing mode (one
//! profiler per process, so one test function).
//!
//! A check of keys the store already holds, through
//! `MemoryBackend::check_into` (checks borrowed, the verdict's vectors
//! reused: how the layer checks), allocates nothing: on the
//! compare-and-swap path (token and leaky buckets), on the locked path
//! (fixed window, sliding window counter), allowed or denied, one tier or
//! four. The owned `Backend::check` allocates exactly its verdict's two
//! vectors.
//!
//! dhat counts the heap blocks of every thread in the process, so the
//! binary has its own `main` (`harness = false` in Cargo.toml) and runs on
//! one thread. Under libtest's harness the test ran on a spawned thread
//! while the harness's main thread (the only other thread) went on
//! allocating after spawning it: 4 blocks of that thread, counted here
//! whenever the scheduler ran it during a counted window. The checks
//! themselves allocated nothing in those runs (an allocator counting per
//! thread showed 0 on the checking thread in every failure).

use std::time::Duration;

use tiered_ratelimit::algorithm::{Gcra, Limit, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, TierCheck, Verdict};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const S: u64 = 1_000_000;

/// Heap blocks allocated so far (every thread; the test runs alone).
fn blocks() -> u64 {
    dhat::HeapStats::get().total_blocks
}

fn check(key: &str, limit: Limit) -> TierCheck {
    TierCheck {
        key: key.to_owned(),
        limit,
        cost: 1,
        home: None,
    }
}

/// Polls a future that is ready at once (the memory backend's).
fn now<F: std::future::Future>(f: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(f).poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the memory backend answers at once"),
    }
}

/// The harness: one test, on this (the only) thread; a failed assertion
/// panics, and the process exits non-zero.
fn main() {
    a_check_of_held_keys_allocates_nothing();
    println!("test a_check_of_held_keys_allocates_nothing ... ok");
}

fn a_check_of_held_keys_allocates_nothing() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let clock = ManualClock::new(1_700_000_000 * S);
    let store = MemoryBackend::with_manual_clock(clock.clone());
    let bucket = Limit::TokenBucket(TokenBucket::new(100, S, 100).expect("a quota"));
    let gcra = Limit::LeakyBucket(Gcra {
        bucket: TokenBucket::new(100, S, 100).expect("a quota"),
        max_delay_us: None,
    });
    let window = Window {
        limit: 100,
        window_us: S,
    };
    // A key longer than the 24 bytes kept inline: held on the heap, but
    // compared in place.
    let long = "rl:user:a-user-id-of-more-than-24-bytes";
    let cases: [(&str, Vec<TierCheck>); 5] = [
        ("token bucket", vec![check("rl:ip:198.51.100.7", bucket)]),
        ("leaky bucket", vec![check("rl:ip:198.51.100.8", gcra)]),
        (
            "four tiers",
            vec![
                check("rl:global:all", bucket),
                check("rl:ip:198.51.100.9", gcra),
                check(long, bucket),
                check("rl:endpoint:GET%20/users/{id}", bucket),
            ],
        ),
        (
            "fixed window",
            vec![check("rl:ip:198.51.100.10", Limit::FixedWindow(window))],
        ),
        (
            "sliding window counter",
            vec![check(
                "rl:ip:198.51.100.11",
                Limit::SlidingWindowCounter(window),
            )],
        ),
    ];
    let mut verdict = Verdict::default();
    for (name, checks) in &cases {
        // The first check stores the keys (and grows the verdict's vectors).
        store.check_into(checks, &mut verdict);
        assert!(verdict.allowed(), "{name}");
        let before = blocks();
        // At half the rate: every check allowed and charged.
        for _ in 0..300 {
            clock.advance(Duration::from_millis(20));
            store.check_into(checks, &mut verdict);
            assert!(verdict.allowed(), "{name}");
            assert_eq!(verdict.charges.len(), checks.len(), "{name}");
        }
        assert_eq!(blocks() - before, 0, "{name}: allocations in 300 checks");
        // At once, 150 more: the tier runs out, and the rest are denied.
        let before = blocks();
        let mut denied = 0;
        for _ in 0..150 {
            store.check_into(checks, &mut verdict);
            denied += usize::from(!verdict.allowed());
        }
        assert!(denied > 0, "{name}: some denied");
        assert_eq!(blocks() - before, 0, "{name}: allocations in 150 checks");
        clock.advance(Duration::from_secs(2));
    }

    // The owned API: the caller's vector and key are its own; the verdict's
    // decisions and charges are two allocations per check.
    let backend: Backend = store.into();
    let one = check("rl:ip:198.51.100.12", bucket);
    assert!(now(backend.check(vec![one.clone()])).unwrap().allowed());
    for _ in 0..10 {
        clock.advance(Duration::from_millis(20));
        let checks = vec![one.clone()];
        let before = blocks();
        let v = now(backend.check(checks)).unwrap();
        assert_eq!(blocks() - before, 2);
        assert!(v.allowed());
    }

    // Per-key demand (observe/demand/): what every planned check adds.
    // The table is sized once (its slot's first request); after that, new
    // keys, known keys and a key whose count crosses a power of two (its
    // name copied into a buffer allocated with the table) allocate nothing.
    let table = tiered_ratelimit::observe::demand::Table::default();
    let keys: Vec<String> = (0..1000).map(|i| format!("198.51.100.{i}")).collect();
    let before = blocks();
    for round in 0..100 {
        for k in &keys {
            assert!(table.add(7, k, 1), "round {round}: {k}");
        }
    }
    assert_eq!(
        blocks() - before,
        0,
        "allocations in 100 000 demand records of 1000 keys"
    );
}
