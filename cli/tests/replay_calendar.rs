//! `tiered-ratelimit replay` with a calendar tier (issue 28): replayed
//! across a local midnight, the direct engine and the layer engine (a real
//! axum Router) both decide exactly as the layer does live: the request
//! 1 µs before the boundary counts in the old window, the one at the
//! boundary in the new.

use tiered_ratelimit::policy::Policy;
use tiered_ratelimit_cli::replay::{Admission, Engine, LineOutcome, ReplayOptions, Replayer};

/// A day of 2 per IP in Berlin. Berlin's midnight of 2024-10-27 (before a
/// 25-hour day) is 2024-10-26T22:00Z; the log's times carry +0200 and
/// microseconds.
const POLICY: &str = "[[tier]]\nname = 'daily'\nkey = 'ip'\nlimit = 2\nperiod = 'day'\n\
                      time_zone = 'Europe/Berlin'\n";

fn line(clf_time: &str) -> String {
    format!("198.51.100.4 - - [{clf_time}] \"GET / HTTP/1.1\" 200 512 \"-\" \"test-agent/1.0\"")
}

fn replay(engine: Engine, lines: &[String]) -> Vec<bool> {
    let policy = Policy::from_toml_str(POLICY).unwrap();
    let mut options = ReplayOptions::default();
    options.engine = engine;
    let mut r = Replayer::new(&policy, options).unwrap();
    r.start_input("calendar");
    lines
        .iter()
        .map(|l| match r.replay_line(l.as_bytes()).unwrap() {
            LineOutcome::Replayed(Admission::Allowed { .. }) => true,
            LineOutcome::Replayed(Admission::Rejected { tier }) => {
                assert_eq!(&*tier, "daily");
                false
            }
            other => panic!("{l}: {other:?}"),
        })
        .collect()
}

#[test]
fn replay_across_a_local_midnight_decides_as_the_layer() {
    let lines: Vec<String> = [
        "26/Oct/2024:23:00:00 +0200",
        "26/Oct/2024:23:59:59.999998 +0200",
        // 1 µs before Berlin's midnight: the old day, spent.
        "26/Oct/2024:23:59:59.999999 +0200",
        // At midnight: the new day.
        "27/Oct/2024:00:00:00 +0200",
        "27/Oct/2024:00:00:00.000001 +0200",
        "27/Oct/2024:00:00:00.000002 +0200",
        // 24 hours later it is still 27 October in Berlin (a 25-hour day).
        "27/Oct/2024:23:00:00 +0100",
        // The next midnight, 25 hours after the last.
        "28/Oct/2024:00:00:00 +0100",
    ]
    .iter()
    .map(|t| line(t))
    .collect();
    let want = [true, true, false, true, true, false, false, true];
    assert_eq!(replay(Engine::Direct, &lines), want);
    assert_eq!(replay(Engine::Layer, &lines), want);
}
