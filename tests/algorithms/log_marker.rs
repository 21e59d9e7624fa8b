//! The sliding log's marker on a real Redis (docs/redis.md, "Stored
//! values"): the member `u` at score -inf, kept while every entry of the set
//! costs 1, so that the layer's path (`check_plain`, no undo value asked
//! for) counts the entries with one `ZREVRANK` instead of reading them.
//! Random sequences mix that path with `Backend::check` (undo values asked
//! for: the log's own function, which never adds the marker, so its keys
//! are in the form written before the marker existed), costs 0 to 3 and
//! refunds, against the model and the memory backend; after every step the
//! set holds the marker only if every entry in it costs 1.

use crate::support::algorithms::Model;
use crate::support::rng::Rng;
use crate::support::*;
use std::time::Duration;
use tiered_ratelimit::algorithm::{Limit, Window};
use tiered_ratelimit::backend::{
    Backend, ManualClock, MemoryBackend, RedisBackend, TierCheck, TierRefund, Verdict,
};

const S: u64 = 1_000_000;

/// Whether the log at `key` has the marker, after asserting the marker's
/// rule: with it, every other member costs 1 (no ':', or ':1' at the end).
fn marked(redis: &RedisServer, key: &str) -> bool {
    let members: Vec<(String, String)> = redis.cmd(&["ZRANGE", key, "0", "-1", "WITHSCORES"]);
    let has = members.iter().any(|(m, s)| m == "u" && s == "-inf");
    if has {
        for (m, _) in &members {
            assert!(
                m == "u" || !m.contains(':') || m.ends_with(":1"),
                "{key}: the marker beside {m} ({members:?})"
            );
        }
    }
    has
}

#[test]
fn the_layer_path_and_the_marker_agree_with_the_model() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let a = Limit::SlidingWindowLog(Window {
        limit: 6,
        window_us: 10 * S,
    });
    let b = Limit::SlidingWindowLog(Window {
        limit: 20,
        window_us: 7 * S,
    });
    let (mut marked_seen, mut fast, mut refunds) = (0, 0, 0);
    for seed in 1..=12u64 {
        let mut rng = Rng::new(seed * 7919);
        let clock = ManualClock::new(T0_US + 123_457);
        let memory: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let red: Backend = RedisBackend::from_url(&redis.url())
            .unwrap()
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600))
            .into();
        let mut model = Model::default();
        let mut charged: Vec<(TierRefund, TierRefund, TierCheck, u64, u64)> = Vec::new();
        for i in 0..160 {
            // Steps of 0 (two checks in one µs) to 4 s.
            let step = [0, 1, 250_000, S, 4 * S][rng.index(5)];
            clock.advance(Duration::from_micros(step));
            let now = clock.now_us();
            let cost = [1, 1, 1, 1, 1, 2, 3, 0][rng.index(8)];
            let checks = vec![
                TierCheck {
                    key: format!("m{seed}:a:k{}", rng.below(3)),
                    limit: a,
                    cost,
                    home: None,
                },
                TierCheck {
                    key: format!("m{seed}:b:all"),
                    limit: b,
                    cost: 1,
                    home: None,
                },
            ];
            let undo = rng.below(3) == 0;
            let want = model.check(&checks, now);
            let run = |backend: &Backend| -> Verdict {
                if undo {
                    rt.block_on(backend.check(checks.clone())).unwrap()
                } else {
                    rt.block_on(backend.check_without_undo(checks.clone()))
                        .unwrap()
                }
            };
            let got_mem = run(&memory);
            let got_red = run(&red);
            assert_eq!(
                got_mem.decisions, want,
                "seed {seed}: memory diverged at op {i}"
            );
            assert_eq!(
                got_red.decisions, want,
                "seed {seed}: redis diverged at op {i}"
            );
            if !undo {
                fast += 1;
            }
            if undo && want.iter().all(|d| d.allowed) {
                let charge = |v: &Verdict| TierRefund {
                    check: checks[0].clone(),
                    charge: v.charges[0].expect("a charge"),
                    debt: false,
                };
                let undo_value = got_red.charges[0].expect("a charge").undo;
                charged.push((
                    charge(&got_mem),
                    charge(&got_red),
                    checks[0].clone(),
                    now,
                    undo_value,
                ));
            }
            if !charged.is_empty() && rng.below(4) == 0 {
                let (rm, rr, c, at, undo_value) = charged.remove(rng.index(charged.len()));
                model.refund(&c, now, at, undo_value);
                rt.block_on(memory.refund(vec![rm])).unwrap();
                rt.block_on(red.refund(vec![rr])).unwrap();
                refunds += 1;
                // A refund that leaves no entry leaves no key (nor a lone
                // marker).
                let left: Vec<String> = redis.cmd(&["ZRANGE", &c.key, "0", "-1"]);
                assert_ne!(left, vec!["u".to_owned()], "seed {seed}: a lone marker");
            }
            for c in &checks {
                if marked(&redis, &c.key) {
                    marked_seen += 1;
                }
            }
        }
    }
    // Every path was taken: the layer's, the marker's, refunds.
    eprintln!("layer path {fast}, marked {marked_seen}, refunds {refunds}");
    assert!(fast > 500 && marked_seen > 500 && refunds > 20);
}

/// A log written before the marker existed (entries only) reads as before
/// on the layer's path, which adds the marker when every live entry costs
/// 1 and never while an entry of another cost is in the set; an entry of
/// another cost removes it.
#[test]
fn a_log_without_the_marker_reads_as_before() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let clock = ManualClock::new(T0_US);
    let backend: Backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    let limit = Limit::SlidingWindowLog(Window {
        limit: 10,
        window_us: 60 * S,
    });
    let key = "rl:ip:203.0.113.7";
    let check = |cost: u64| {
        rt.block_on(backend.check_without_undo(vec![TierCheck {
            key: key.to_owned(),
            limit,
            cost,
            home: None,
        }]))
        .unwrap()
        .decisions[0]
    };
    // The old form: two entries of cost 1 and one of cost 3, 30 s ago, and
    // one of cost 1 out of the window.
    let t = T0_US - 30 * S;
    let old = T0_US - 61 * S;
    let (t, old) = (t.to_string(), old.to_string());
    let _: i64 = redis.cmd(&[
        "ZADD",
        key,
        &old,
        &format!("{old}000"),
        &t,
        &format!("{t}000"),
        &t,
        &format!("{t}001"),
        &t,
        &format!("{t}:2:3"),
    ]);
    // 5 used: 5 left before this request of 1.
    let d = check(1);
    assert!(d.allowed);
    assert_eq!((d.remaining, d.reset_after_us), (4, 60 * S));
    assert!(!marked(&redis, key), "an entry of cost 3 is in the window");
    // 30 s on, the first three have left: one of cost 1 is live.
    clock.advance(Duration::from_secs(30));
    let d = check(1);
    assert_eq!((d.allowed, d.remaining), (true, 8));
    assert!(marked(&redis, key));
    let members: Vec<String> = redis.cmd(&["ZRANGE", key, "0", "-1"]);
    let now = clock.now_us();
    assert_eq!(
        members,
        vec!["u".to_owned(), format!("{}003", T0_US), format!("{now}001")]
    );
    // With the marker: counted without the members.
    let d = check(1);
    assert_eq!((d.allowed, d.remaining), (true, 7));
    // An entry of cost 2 removes it; the count goes on from the members.
    let d = check(2);
    assert_eq!((d.allowed, d.remaining), (true, 5));
    assert!(!marked(&redis, key));
    let d = check(6);
    assert!(!d.allowed);
    assert_eq!(
        (d.remaining, d.reset_after_us, d.retry_after_us),
        (5, 60 * S, 30 * S)
    );
}

/// What the layer's first request leaves in a log (docs/redis.md): the
/// marker and one member named by its time alone; the next in the same µs
/// takes the first free seq after the live entries.
#[test]
fn the_layer_path_writes_the_marker_and_the_time() {
    let redis = RedisServer::start();
    let rt = current_thread_runtime();
    let clock = ManualClock::new(T0_US);
    let backend: Backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    let key = "rl:ip:203.0.113.7";
    let check = TierCheck {
        key: key.to_owned(),
        limit: Limit::SlidingWindowLog(Window {
            limit: 100,
            window_us: 60 * S,
        }),
        cost: 1,
        home: None,
    };
    for remaining in [99, 98] {
        let d = rt
            .block_on(backend.check_without_undo(vec![check.clone()]))
            .unwrap()
            .decisions[0];
        assert_eq!((d.allowed, d.remaining), (true, remaining));
        if remaining == 99 {
            // The marker and one entry: a listpack of 120 B (perf/README.md,
            // "Memory per key"; one coded entry alone takes 104 B).
            let encoding: String = redis.cmd(&["OBJECT", "ENCODING", key]);
            let bytes: i64 = redis.cmd(&["MEMORY", "USAGE", key, "SAMPLES", "0"]);
            assert_eq!((encoding.as_str(), bytes), ("listpack", 120));
        }
    }
    let members: Vec<String> = redis.cmd(&["ZRANGE", key, "0", "-1"]);
    assert_eq!(members, ["u", "1700000000000000", "1700000000000000002"]);
    let ttl: i64 = redis.cmd(&["PTTL", key]);
    assert!(ttl > 600_000 && ttl <= 660_000, "{ttl}");
}
