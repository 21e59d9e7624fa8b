//! A control-key poll's rollout work in one Redis call (`lua/poll.lua`).
//!
//! Before the call, from the plan states and modes read at the last poll,
//! the instance gathers its parts: its stage counts since its last poll
//! (`gates.rs`, when it has any, or when it leads a stage that is due), its
//! guard counts and the guard's lease (`guard.rs`, one part per guarded
//! tier), and the leader's step (`drive.rs`: a renewal, a tick whose sample floors the
//! script judges on the fleet-wide totals the stage part just answered, or
//! the takeover of a lapsed lease). The call runs them in that order and
//! ends with the read of the control hash the poll makes anyway; without
//! any part the poll is the plain `HGETALL`. One call a poll, leader or
//! not, with or without traffic or guards; the only exception is the poll
//! at which a guard falls back (`guard.rs`: its step and a read back, once
//! per fall back, made at once rather than a poll later).
//!
//! The decisions are taken on the state read at the last poll, so the
//! plan's compare-and-set is fenced by that version: a change in between
//! (an operator's action, a guard's fall back) makes the step a no-op
//! (`-1`), tried again at the next poll.

use super::super::Shared;
use crate::backend::{PollPart, RedisBackend};
use std::sync::Arc;
use std::time::Duration;

/// What one part of the call was, to route its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum What {
    /// Tier `i`'s stage counts, as read before the call.
    Stage {
        i: usize,
        since: u64,
        requests: u64,
        enforced: u64,
        bits: u64,
    },
    /// Tier `i`'s guard counts, and the bucket it reads (`judged`).
    Guard { i: usize, judged: u64 },
    /// The leader's step on tier `i`'s plan (or a takeover).
    Step { i: usize, takeover: bool },
}

/// A poll's parts and what each is.
#[derive(Debug, Default)]
pub(crate) struct Parts {
    pub(crate) parts: Vec<PollPart>,
    pub(crate) what: Vec<What>,
}

impl Parts {
    pub(crate) fn push(&mut self, part: PollPart, what: What) {
        self.parts.push(part);
        self.what.push(what);
    }
}

/// The parts of this instance's next poll (none: the poll is the plain
/// `HGETALL`), taken from the state read at its last poll. Asks a plan's
/// guard callback when the leader's stage is due (given a poll interval),
/// so it is awaited before the call, outside the call's timeout.
pub(crate) async fn gather(shared: &Arc<Shared>, key: &str, poll: Duration) -> Parts {
    let mut out = Parts::default();
    let plans = &shared.live.plans;
    if !plans.any() && plans.guards.iter().all(Option::is_none) {
        return out;
    }
    let states = plans.read.load_full();
    let mut steps = Parts::default();
    let gated = super::drive::steps(shared, &states, poll, &mut steps).await;
    super::gates::stage_parts(shared, key, &states, &gated, &mut out);
    super::guard::guard_parts(shared, key, poll, &mut out);
    out.parts.extend(steps.parts);
    out.what.extend(steps.what);
    out
}

/// One poll of the control hash `key`: `parts` and the hash's read in one
/// call (the hash alone without parts). Answers the hash's fields and each
/// part's answer, in order.
pub(crate) async fn call(
    redis: &RedisBackend,
    key: &str,
    parts: &Parts,
) -> Result<(Vec<(String, String)>, Vec<::redis::Value>), crate::error::BackendError> {
    if parts.parts.is_empty() {
        return Ok((redis.hgetall(key).await?, Vec::new()));
    }
    let (answers, fields) = redis.poll(key, &super::log_key(key), &parts.parts).await?;
    Ok((fields, answers))
}

/// Applies the call's answers after the control hash's `fields` are
/// stored: the plan states, the stage totals, the guards' judgements, the
/// steps' logs and the leases' watch; then makes a fall back a guard found
/// due (a call of its own, once per fall back).
pub(crate) async fn after(
    shared: &Arc<Shared>,
    redis: &RedisBackend,
    key: &str,
    fields: &[(String, String)],
    parts: &Parts,
    answers: Vec<::redis::Value>,
) {
    let plans = &shared.live.plans;
    if !plans.any() && plans.guards.iter().all(Option::is_none) {
        return;
    }
    let previous = plans.read.load_full();
    let states = super::read_states(shared, fields, &previous);
    super::store_states(shared, states.clone());
    let mut fall_backs = Vec::new();
    for (what, answer) in parts.what.iter().zip(answers) {
        match *what {
            What::Stage {
                i,
                since,
                requests,
                enforced,
                bits,
            } => super::gates::staged(shared, i, since, (requests, enforced, bits), answer),
            What::Guard { i, judged } => {
                if let Some(why) = super::guard::guarded(shared, i, judged, answer) {
                    fall_backs.push((i, why));
                }
            }
            What::Step { i, takeover } => {
                super::drive::stepped(shared, i, &previous, answer, takeover);
            }
        }
    }
    super::drive::watch_leases(shared, &states);
    for (i, (reason, evidence)) in fall_backs {
        super::guard::fall_back(shared, redis, key, i, &reason, &evidence).await;
    }
}
