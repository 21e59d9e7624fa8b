//! The plan's compare-and-set (`lua/plan.lua`) under interleaved would-be
//! leaders: random sequences of three instances reading the plan at random
//! moments and acting on what they read (stale or not) — leader ticks,
//! takeovers of a lease they believe lapsed, operator actions — against a
//! real Redis. Every call is fenced: a stale version changes nothing, a
//! lease held by another with a beat that moved changes nothing, a stage
//! advances only by one, only when due and only with the gates passing,
//! the tier's mode field always follows the stage, and the log holds one
//! entry per change. The fall back guard's step (`guard`, under its own
//! lease, not the plan's) is fenced by the version too, puts the mode in
//! shadow once, and stops a running or paused plan (`fellback`). The
//! leader's tick as it is made now, a part of its poll's one call
//! (`lua/poll.lua`: the stage's counts added, then the sample floor judged
//! on the fleet's totals), is fenced the same way, advances only when the
//! floor passes and the other gates were asked, and answers the control
//! hash as it left it.

use crate::support::*;
use proptest::prelude::*;

const SCRIPT: &str = include_str!("../../lua/plan.lua");

/// The poll's script as `src/backend/redis/poll.rs` composes it: the
/// three scripts as local functions, then `lua/poll.lua`.
fn poll_source() -> String {
    let part = |name: &str, body: &str| format!("local function {name}(KEYS, ARGV)\n{body}\nend\n");
    [
        part("stage_part", include_str!("../../lua/stage.lua")),
        part("guard_part", include_str!("../../lua/guard.lua")),
        part("plan_part", SCRIPT),
        include_str!("../../lua/poll.lua").to_owned(),
    ]
    .concat()
}

/// The gates of a tick made in the poll's call.
#[derive(Debug, Clone, Copy)]
enum Gate {
    /// The floor met on the fleet's totals, the other gates passing.
    Pass,
    /// The floor not met.
    Floor,
    /// The floor met, the other gates not asked: a renewal only.
    Unasked,
}
const MODES: [&str; 4] = ["shadow", "canary:1", "canary:10", "enforce"];
/// Each stage but the last lasts this long (µs of the script's clock).
const STAGE_US: u64 = 100;

#[derive(Debug, Clone)]
enum Op {
    /// Instance i reads the plan (its snapshot for later calls).
    Read(usize),
    /// Instance i's tick on its snapshot, the gates passing or not.
    Tick(usize, bool),
    /// Instance i's renewal of the lease alone (the stage not due by its
    /// clock).
    Renew(usize),
    /// Instance i's tick in its poll's call (`lua/poll.lua`).
    Poll(usize, Gate),
    /// Instance i's operator action on its snapshot.
    Act(usize, &'static str),
    /// The clock moves.
    Wait(u64),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0usize..3).prop_map(Op::Read),
            6 => ((0usize..3), prop::bool::weighted(0.8)).prop_map(|(i, p)| Op::Tick(i, p)),
            2 => (0usize..3).prop_map(Op::Renew),
            4 => ((0usize..3), prop::sample::select(vec![Gate::Pass, Gate::Pass, Gate::Floor, Gate::Unasked]))
                .prop_map(|(i, g)| Op::Poll(i, g)),
            1 => ((0usize..3), prop::sample::select(vec!["start", "pause", "resume", "abort", "guard"]))
                .prop_map(|(i, a)| Op::Act(i, a)),
            3 => (0u64..=250).prop_map(Op::Wait),
        ],
        1..80,
    )
}

/// The stored field: (version, stage, status, next_at, leader, beat).
type State = (u64, u64, String, u64, String, u64);

fn parse(raw: &str) -> State {
    let p: Vec<&str> = raw.splitn(9, ' ').collect();
    (
        p[0].parse().unwrap(),
        p[1].parse().unwrap(),
        p[2].to_owned(),
        p[4].parse().unwrap(),
        p[6].to_owned(),
        p[7].parse().unwrap(),
    )
}

fn read(c: &mut redis::Connection) -> Option<State> {
    let raw: Option<String> = redis::cmd("HGET")
        .arg("rl:control")
        .arg("plan:ip")
        .query(c)
        .unwrap();
    raw.as_deref().map(parse)
}

#[allow(clippy::too_many_arguments)]
fn call(
    c: &mut redis::Connection,
    now: u64,
    me: &str,
    version: u64,
    op: &str,
    seen_beat: Option<u64>,
    holding: &str,
) -> i64 {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SCRIPT)
        .arg(2)
        .arg("rl:control")
        .arg("{rl:control}:rollout")
        .arg(now)
        .arg("ip")
        .arg(me)
        .arg(version)
        .arg(op)
        .arg(seen_beat.map(|b| b.to_string()).unwrap_or_default())
        .arg(holding)
        .arg("test")
        .arg("")
        .arg(1000)
        .arg(MODES.len());
    for (i, m) in MODES.iter().enumerate() {
        cmd.arg(*m).arg(if i + 1 == MODES.len() {
            -1
        } else {
            STAGE_US as i64
        });
    }
    let (code, _): (i64, String) = cmd.query(c).unwrap();
    code
}

/// Instance `me`'s poll call: one checked request added to the stage,
/// then its tick gated by `gate`. Answers the step's code and the control
/// hash's `plan:ip` as the call read it at its end.
fn poll_call(
    c: &mut redis::Connection,
    now: u64,
    me: &str,
    version: u64,
    seen_beat: Option<u64>,
    gate: Gate,
) -> (i64, Option<String>) {
    let stage = "{rl:control}:stage:ip:0";
    let mut plan: Vec<String> = vec![
        "ip".into(),
        me.into(),
        version.to_string(),
        "tick".into(),
        seen_beat.map(|b| b.to_string()).unwrap_or_default(),
        String::new(),
        "leader".into(),
        String::new(),
        "1000".into(),
        MODES.len().to_string(),
    ];
    for (i, m) in MODES.iter().enumerate() {
        plan.push((*m).into());
        plan.push(if i + 1 == MODES.len() {
            "-1".into()
        } else {
            STAGE_US.to_string()
        });
    }
    let min_requests = match gate {
        Gate::Floor => "1000000000",
        Gate::Pass | Gate::Unasked => "0",
    };
    let known = match gate {
        Gate::Unasked => "0",
        Gate::Pass | Gate::Floor => "1",
    };
    let gated: Vec<String> = [
        min_requests,
        "0",
        "-1",
        "gate",
        "keys",
        "share",
        known,
        "",
        "check_p99_us=none",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .chain(plan)
    .collect();
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(poll_source())
        .arg(5)
        .arg("rl:control")
        .arg("{rl:control}:rollout")
        .arg(stage)
        .arg(format!("{stage}:keys"))
        .arg(format!("{stage}:scratch:{me}"))
        .arg(now)
        .arg(2)
        .arg("stage")
        .arg("ip")
        .arg(3)
        .arg(4)
        .arg(1)
        .arg(0)
        .arg("")
        .arg(60)
        .arg("gated")
        .arg("ip")
        .arg(0)
        .arg(gated.len());
    for a in &gated {
        cmd.arg(a);
    }
    let mut answers: Vec<redis::Value> = cmd.query(c).unwrap();
    assert_eq!(answers.len(), 3);
    let fields: Vec<(String, String)> = redis::from_redis_value(answers.pop().unwrap()).unwrap();
    let (code, _): (i64, Option<String>) = redis::from_redis_value(answers.pop().unwrap()).unwrap();
    let (requests, _, _): (u64, u64, u64) =
        redis::from_redis_value(answers.pop().unwrap()).unwrap();
    assert!(requests >= 1);
    (
        code,
        fields
            .into_iter()
            .find(|(f, _)| f == "plan:ip")
            .map(|(_, v)| v),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_step_happens_once_under_interleaved_leaders(ops in ops()) {
        thread_local!(static REDIS: RedisServer = RedisServer::start());
        REDIS.with(|redis| {
            redis.cmd::<()>(&["FLUSHALL"]);
            let mut c = redis::Client::open(redis.url()).unwrap().get_connection().unwrap();
            let names = ["i-0", "i-1", "i-2"];
            let mut snapshot: [Option<State>; 3] = [None, None, None];
            let mut now = 1_000_000u64;
            let mut changes = 0u64;
            let mut advances = 0u64;
            for op in &ops {
                let before = read(&mut c);
                let (version, stage, status, next_at, leader, beat) = before
                    .clone()
                    .unwrap_or((0, 0, "idle".into(), 0, "-".into(), 0));
                let (i, code, pass) = match op {
                    Op::Read(i) => {
                        snapshot[*i] = before.clone();
                        continue;
                    }
                    Op::Wait(dt) => {
                        now += dt;
                        continue;
                    }
                    Op::Tick(i, pass) => {
                        let Some(s) = &snapshot[*i] else { continue };
                        let seen = (s.4 != names[*i]).then_some(s.5);
                        let code = call(&mut c, now, names[*i], s.0, "tick", seen, if *pass { "" } else { "gate" });
                        (*i, code, *pass)
                    }
                    Op::Renew(i) => {
                        let Some(s) = &snapshot[*i] else { continue };
                        let seen = (s.4 != names[*i]).then_some(s.5);
                        (*i, call(&mut c, now, names[*i], s.0, "renew", seen, ""), false)
                    }
                    Op::Poll(i, gate) => {
                        let Some(s) = &snapshot[*i] else { continue };
                        let seen = (s.4 != names[*i]).then_some(s.5);
                        let (code, read_back) = poll_call(&mut c, now, names[*i], s.0, seen, *gate);
                        // The call's own read is the hash as it left it.
                        let raw: Option<String> = redis::cmd("HGET").arg("rl:control").arg("plan:ip").query(&mut c).unwrap();
                        prop_assert_eq!(read_back, raw);
                        (*i, code, matches!(gate, Gate::Pass))
                    }
                    Op::Act(i, action) => {
                        let v = snapshot[*i].as_ref().map_or(0, |s| s.0);
                        (*i, call(&mut c, now, names[*i], v, action, None, ""), true)
                    }
                };
                let after = read(&mut c);
                let read_version = match op {
                    Op::Tick(..) | Op::Renew(..) | Op::Poll(..) | Op::Act(..) => snapshot[i].as_ref().map_or(0, |s| s.0),
                    _ => unreachable!(),
                };
                if read_version != version {
                    // Fenced by the version: nothing written.
                    prop_assert_eq!(code, -1, "{:?}", op);
                    prop_assert_eq!(&after, &before);
                    continue;
                }
                if let Op::Tick(..) | Op::Renew(..) | Op::Poll(..) = op {
                    let s = snapshot[i].as_ref().unwrap();
                    let claims = s.4 == names[i];
                    if status == "running" && leader != names[i] && (claims || s.5 != beat) {
                        // Another holds the lease and its beat moved (or
                        // the caller thought it led): fenced.
                        prop_assert_eq!(code, -2, "{:?}", op);
                        prop_assert_eq!(&after, &before);
                        continue;
                    }
                }
                if let (Op::Act(_, "guard"), 1) = (op, code) {
                    let mode: Option<String> = redis::cmd("HGET").arg("rl:control").arg("tier:ip").query(&mut c).unwrap();
                    prop_assert_eq!(mode.as_deref(), Some("shadow"));
                    match (&before, &after) {
                        // No plan stored: the mode alone (and the log).
                        (None, None) => {}
                        (Some(_), Some(a)) => {
                            changes += 1;
                            prop_assert_eq!(a.0, version + 1);
                            prop_assert_eq!(a.1, stage);
                            let want = if status == "running" || status == "paused" { "fellback" } else { status.as_str() };
                            prop_assert_eq!(a.2.as_str(), want);
                        }
                        other => prop_assert!(false, "{:?}", other),
                    }
                    snapshot[i] = after;
                    continue;
                }
                if let (Op::Act(_, "guard"), 0) = (op, code) {
                    // The mode was shadow already: nothing written.
                    let mode: Option<String> = redis::cmd("HGET").arg("rl:control").arg("tier:ip").query(&mut c).unwrap();
                    prop_assert_eq!(mode.as_deref(), Some("shadow"));
                    prop_assert_eq!(&after, &before);
                    continue;
                }
                match code {
                    1 => {
                        changes += 1;
                        let a = after.clone().unwrap();
                        prop_assert_eq!(a.0, version + 1, "one version a change");
                        if let Op::Poll(_, Gate::Unasked) = op {
                            // A renewal (or a takeover): nothing held.
                            prop_assert_eq!(a.1, stage, "an unasked gate never advances");
                        }
                        if let Op::Tick(..) | Op::Renew(..) | Op::Poll(..) = op {
                            if a.1 != stage {
                                prop_assert_eq!(a.1, stage + 1, "one stage at a time");
                                prop_assert!(pass, "a failed gate never advances");
                                prop_assert!(now >= next_at && next_at > 0, "never before its time");
                                advances += 1;
                            }
                        }
                        let mode: Option<String> = redis::cmd("HGET").arg("rl:control").arg("tier:ip").query(&mut c).unwrap();
                        let want = match a.2.as_str() {
                            "aborted" => MODES[0],
                            "fellback" => "shadow",
                            _ => MODES[a.1 as usize],
                        };
                        prop_assert_eq!(mode.as_deref(), Some(want));
                    }
                    0 => {
                        // A renewal (the beat only) or nothing to do.
                        if let Some(a) = &after {
                            prop_assert_eq!(a.0, version);
                            prop_assert_eq!(a.1, stage);
                        }
                    }
                    -3 => prop_assert_eq!(&after, &before),
                    other => prop_assert!(false, "unexpected code {} for {:?}", other, op),
                }
                // The snapshot is the instance's own view: it saw its reply.
                if code >= 0 {
                    snapshot[i] = after;
                }
            }
            let entries: Vec<(String, Vec<(String, String)>)> = redis.cmd(&["XRANGE", "{rl:control}:rollout", "-", "+"]);
            let events: Vec<String> = entries
                .iter()
                .map(|(_, f)| f.iter().find(|(k, _)| k == "event").unwrap().1.clone())
                .collect();
            prop_assert_eq!(events.iter().filter(|e| *e == "advance").count() as u64, advances);
            // Every change wrote at least one entry (a takeover that also
            // advances writes two; reaching the last stage adds `done`).
            prop_assert!(events.len() as u64 >= changes);
            let stored_version = read(&mut c).map_or(0, |s| s.0);
            prop_assert_eq!(stored_version, changes);
            Ok(())
        })?;
    }
}
