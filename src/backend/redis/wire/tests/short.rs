//! Short replies (a bucket's state, a window's count, an allowed log's
//! remaining) read as the long reply would be.

use super::*;

/// A bucket's short reply (its state) parses to exactly what the long
/// reply of the same check says: the model's decision, the wait for the
/// next request (the model's retry once charged) and the undo value.
#[test]
fn a_short_bucket_reply_equals_the_long_one() {
    let now = 1_700_000_000_000_000u64;
    let i = |v: u64| i64::try_from(v).unwrap();
    let buckets = [
        // 60/min, burst 10; 7/min, burst 3 (rate 7); a police and a
        // shaping leaky bucket of 5 per 3 s (rate 3).
        Limit::TokenBucket(TokenBucket::new(60, 60_000_000, 10).unwrap()),
        Limit::TokenBucket(TokenBucket::new(7, 60_000_000, 3).unwrap()),
        limits()[4],
        limits()[5],
    ];
    for limit in buckets {
        let (capacity, rate) = match limit {
            Limit::TokenBucket(b) => (b.capacity, b.rate),
            Limit::LeakyBucket(g) => (g.bucket.capacity, g.bucket.rate),
            _ => unreachable!(),
        };
        for state in [
            0,
            1,
            rate,
            capacity / 2,
            capacity - 1,
            capacity,
            capacity + 7 * rate,
        ] {
            for cost in [1, 2, limit.capacity(), limit.capacity() + 1] {
                // The state `state` units / ticks short of full (or behind).
                let stored = match limit {
                    Limit::TokenBucket(b) => {
                        (state > 0).then(|| State::Bucket(b.state_at(state, now)))
                    }
                    Limit::LeakyBucket(g) => (state > 0).then(|| {
                        State::Tat(crate::algorithm::TatState {
                            tat_us: now + state / rate,
                            frac: state % rate,
                            rate,
                            unit: g.bucket.unit,
                        })
                    }),
                    _ => unreachable!(),
                };
                let d = limit.check(stored.as_ref(), now, cost);
                let (next, undo) = if d.allowed {
                    let (charged, _) = limit.charge(stored.clone(), now, cost);
                    let again = limit.check(Some(&charged), now, cost);
                    let next = if again.allowed || cost > limit.capacity() {
                        0
                    } else {
                        again.retry_after_us
                    };
                    (next, limit.undo_of(&charged, now))
                } else {
                    (0, 0)
                };
                let long_reply = {
                    let mut r = vec![i(now)];
                    if d.allowed {
                        r.extend([i(d.remaining), i(d.reset_after_us), i(next)]);
                        if d.delay_us > 0 || undo != 0 {
                            r.extend([1, i(d.delay_us), i(undo)]);
                        }
                    } else {
                        r.extend([
                            -i(d.remaining) - 1,
                            i(d.reset_after_us),
                            i(d.retry_after_us),
                        ]);
                    }
                    r
                };
                let short_reply = vec![i(now), if d.allowed { i(state) } else { -i(state) - 1 }];
                let tiers = [ReplyTier {
                    limit,
                    cost,
                    repeat: false,
                }];
                let long = decided(parse_check(&long_reply, &tiers, UNDO, Shadow::NONE));
                let short = decided(parse_check(
                    &short_reply,
                    &tiers,
                    SHORT | UNDO,
                    Shadow::NONE,
                ));
                assert_eq!(short, long, "{limit:?} state {state} cost {cost}");
                assert_eq!(short.decisions, vec![d]);
                // Without the undo flag, no undo value (as the long form).
                let short = decided(parse_check(&short_reply, &tiers, SHORT, Shadow::NONE));
                assert!(short.charges.iter().flatten().all(|c| c.undo == 0));
                // A sign that contradicts the state is a reply error.
                let wrong = vec![i(now), if d.allowed { -i(state) - 1 } else { i(state) }];
                assert!(is_reply_error(parse_check(
                    &wrong,
                    &tiers,
                    SHORT,
                    Shadow::NONE
                )));
            }
        }
    }
}

/// After an override's read that applied (its r is not 0) the next tier
/// answers long, short flag or not; after one that did not, short.
#[test]
fn an_overridden_bucket_answers_long() {
    let bucket = Limit::TokenBucket(TokenBucket::new(60, 60_000_000, 10).unwrap());
    let tiers = [
        ReplyTier {
            limit: Limit::Override,
            cost: 1,
            repeat: false,
        },
        ReplyTier {
            limit: bucket,
            cost: 1,
            repeat: false,
        },
    ];
    // An override of another quota (capacity 5): the bucket's r, reset, w.
    let v = decided(parse_check(
        &[7, 3 + 5, 0, 0, 4, 12_000_000, 0],
        &tiers,
        SHORT,
        Shadow::NONE,
    ));
    assert_eq!(v.decisions[1].remaining, 4);
    assert_eq!(v.decisions[1].reset_after_us, 12_000_000);
    // None applied: the bucket's state, 0 (full): 9 left after this one.
    let v = decided(parse_check(&[7, 0, 0, 0, 0], &tiers, SHORT, Shadow::NONE));
    assert_eq!(v.decisions[1].remaining, 9);
    assert_eq!(v.decisions[1].reset_after_us, 1_000_000);
    // The same state read long would be a length error.
    assert!(is_reply_error(parse_check(
        &[7, 3 + 5, 0, 0, 0],
        &tiers,
        SHORT,
        Shadow::NONE
    )));
}

/// A fixed or calendar window's short reply (its count in the window of
/// `now`) parses to what the long reply of the same check says: the model's
/// decision and the wait for the next request (`window_decide` in
/// lua/fixed_window.lua); a window has no undo value.
#[test]
fn a_short_window_reply_equals_the_long_one() {
    let now = 1_700_000_030_000_000u64;
    let i = |v: u64| i64::try_from(v).unwrap();
    let windows = [
        limits()[0],
        Limit::Calendar(crate::algorithm::CalendarWindow {
            limit: 10,
            bounds: [
                1_699_999_000_000_000,
                1_700_000_100_000_000,
                1_700_001_000_000_000,
            ],
        }),
    ];
    for limit in windows {
        let (start, end) = match limit {
            Limit::FixedWindow(w) => {
                let s = now - now % w.window_us;
                (s, s + w.window_us)
            }
            Limit::Calendar(c) => c.window(now),
            _ => unreachable!(),
        };
        let end_in = end - now;
        for count in [0, 1, 5, 9, 10, 12] {
            for cost in [0, 1, 2, 10, 11] {
                let stored = State::FixedWindow(crate::algorithm::FixedWindowState {
                    start_us: start,
                    count,
                    end_us: end,
                });
                let d = limit.check(Some(&stored), now, cost);
                let long_reply = if d.allowed {
                    let next = if count + 2 * cost > 10 && cost <= 10 {
                        end_in
                    } else {
                        0
                    };
                    vec![i(now), i(d.remaining), i(d.reset_after_us), i(next)]
                } else {
                    vec![
                        i(now),
                        -i(d.remaining) - 1,
                        i(d.reset_after_us),
                        i(d.retry_after_us),
                    ]
                };
                let short_reply = vec![i(now), if d.allowed { i(count) } else { -i(count) - 1 }];
                let tiers = [ReplyTier {
                    limit,
                    cost,
                    repeat: false,
                }];
                let long = decided(parse_check(&long_reply, &tiers, UNDO, Shadow::NONE));
                let short = decided(parse_check(
                    &short_reply,
                    &tiers,
                    SHORT | UNDO,
                    Shadow::NONE,
                ));
                assert_eq!(short, long, "{limit:?} count {count} cost {cost}");
                assert_eq!(short.decisions, vec![d]);
                let wrong = vec![i(now), if d.allowed { -i(count) - 1 } else { i(count) }];
                assert!(is_reply_error(parse_check(
                    &wrong,
                    &tiers,
                    SHORT,
                    Shadow::NONE
                )));
            }
        }
    }
}

/// An allowing sliding log's short reply (its remaining) parses to exactly
/// what the long one does; a denying log answers long under the short
/// flag, and so does a log whose undo value (its seq) was asked for.
#[test]
fn a_short_log_reply_equals_the_long_one() {
    let w = Window {
        limit: 10,
        window_us: 60_000_000,
    };
    let tiers = [ReplyTier {
        limit: Limit::SlidingWindowLog(w),
        cost: 2,
        repeat: false,
    }];
    let now = 1_700_000_000_000_000;
    let long = decided(parse_check(
        &[now, 7, 60_000_000, 0],
        &tiers,
        0,
        Shadow::NONE,
    ));
    let short = decided(parse_check(&[now, 7], &tiers, SHORT, Shadow::NONE));
    assert_eq!(short, long);
    let denied = decided(parse_check(
        &[now, -4, 50_000_000, 20_000_000],
        &tiers,
        SHORT,
        Shadow::NONE,
    ));
    let d = denied.decisions[0];
    assert_eq!(
        (d.allowed, d.remaining, d.reset_after_us, d.retry_after_us),
        (false, 3, 50_000_000, 20_000_000)
    );
    let undo = decided(parse_check(
        &[now, 7, 60_000_000, 0, 1, 0, 5],
        &tiers,
        SHORT | UNDO,
        Shadow::NONE,
    ));
    assert_eq!(undo.decisions, long.decisions);
    assert_eq!(undo.charges[0].map(|c| c.undo), Some(5));
}
