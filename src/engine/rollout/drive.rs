//! The leader's step at each poll of the control hash, one part of the
//! poll's call (`poll.rs`) per running plan it leads (renew the lease, and
//! tick when the stage is due), and the other instances' watch on the
//! lease (a beat unchanged for the lease's lifetime: a takeover part).

use super::super::Shared;
use super::poll::{Parts, What};
use super::{args, Stored};
use crate::backend::PollPart;
use crate::rollout::LEASE_POLLS;
use std::time::{Duration, Instant};

/// Adds, for each running plan configured here and read at the last poll,
/// the step of this instance if it holds the lease (or may take it over,
/// its beat unchanged for the lease's lifetime): a renewal, or when the
/// stage is due by this clock a tick (`gated`: the sample floors judged in
/// the call on the fleet's totals) or the guard callback's fall back.
/// Answers, per tier,
/// whether its step is a gated tick (its stage part must then be in the
/// call, before it).
pub(crate) async fn steps(
    shared: &Shared,
    states: &[Stored],
    poll: Duration,
    out: &mut Parts,
) -> Vec<bool> {
    let plans = &shared.live.plans;
    let mut gated = vec![false; states.len()];
    for (i, state) in states.iter().enumerate() {
        let Some(Some(plan)) = plans.configured.get(i) else {
            continue;
        };
        if !state.running() {
            continue;
        }
        let lease = plan.lease.unwrap_or(poll * LEASE_POLLS);
        let seen_beat = if state.leader == plans.instance {
            None
        } else if lapsed(shared, i, state, lease) {
            Some(state.beat)
        } else {
            continue;
        };
        let due = local_now_us(shared) + poll_us(poll) >= state.next_at_us && state.next_at_us > 0;
        let tier = &shared.config.tiers[i].name;
        let (op, reason, by, evidence, gate) = if due {
            let v = super::gates::evaluate(shared, i, plan, state, poll).await;
            match v.fall_back.clone() {
                Some(why) => ("fallback", why, "guard", v.full_evidence(), None),
                None => (
                    "tick",
                    String::new(),
                    "leader",
                    String::new(),
                    Some(v.gate_args(plan, state)),
                ),
            }
        } else {
            // Not due by this clock: renew the lease only (the script would
            // take an unasked gate for a pass).
            ("renew", String::new(), "leader", String::new(), None)
        };
        let step = args(
            tier,
            &plans.instance,
            state.version,
            op,
            seen_beat,
            &reason,
            by,
            &evidence,
            plan,
        );
        let (kind, all) = match gate {
            Some(mut g) => {
                gated[i] = true;
                g.extend(step);
                ("gated", g)
            }
            None => ("plan", step),
        };
        out.push(
            PollPart {
                kind,
                tier: tier.to_string(),
                keys: Vec::new(),
                args: all.into_iter().map(String::into_bytes).collect(),
            },
            What::Step {
                i,
                takeover: seen_beat.is_some(),
            },
        );
    }
    gated
}

/// Logs the answer to a step of tier `i` (`previous`: the states it was
/// taken on; the call's read of the hash is stored already).
pub(crate) fn stepped(
    shared: &Shared,
    i: usize,
    previous: &[Stored],
    answer: ::redis::Value,
    takeover: bool,
) {
    let tier = &*shared.config.tiers[i].name;
    let (code, text) = match ::redis::from_redis_value::<(i64, Option<String>)>(answer) {
        Ok((code, text)) => (code, text.unwrap_or_default()),
        Err(e) => {
            tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, error = %e,
                "rollout plan: the leader's step failed; trying again at the next poll");
            return;
        }
    };
    let Some(now) = Stored::parse(&text) else {
        return;
    };
    if code != 1 {
        return;
    }
    if takeover {
        tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, version = now.version,
            "rollout plan: this instance took the lapsed lease over and leads the plan");
    }
    let was = previous.get(i);
    if was.is_some_and(|w| w.stage != now.stage || w.status != now.status) {
        tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, stage = now.stage,
            status = now.status, version = now.version, "rollout plan: stage changed");
    } else if !now.holding.is_empty() {
        tracing::info!(target: super::super::CONTROL_LOG_TARGET, tier, stage = now.stage,
            holding = now.holding, "rollout plan: holding");
    }
}

/// After each read: for each running plan led by another instance, notes
/// its leader and beat when they change (the lease's watch); forgets the
/// others.
pub(crate) fn watch_leases(shared: &Shared, states: &[Stored]) {
    let plans = &shared.live.plans;
    let mut seen = plans
        .seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (i, state) in states.iter().enumerate() {
        let Some(slot) = seen.get_mut(i) else {
            continue;
        };
        let watched = plans.configured.get(i).is_some_and(Option::is_some)
            && state.running()
            && state.leader != plans.instance;
        if !watched {
            *slot = None;
            continue;
        }
        match slot {
            Some((leader, beat, _)) if *leader == state.leader && *beat == state.beat => {}
            _ => *slot = Some((state.leader.clone(), state.beat, Instant::now())),
        }
    }
}

/// Whether tier `i`'s lease has shown the same leader and beat (`state`'s)
/// for `lease` of this process's time, from the read that first showed
/// them.
fn lapsed(shared: &Shared, i: usize, state: &Stored, lease: Duration) -> bool {
    let seen = shared
        .live
        .plans
        .seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match seen.get(i) {
        Some(Some((leader, beat, since))) if *leader == state.leader && *beat == state.beat => {
            since.elapsed() >= lease
        }
        _ => false,
    }
}

/// This process's clock in µs (the backend's manual clock in tests).
fn local_now_us(shared: &Shared) -> u64 {
    shared.local_clock.now_us()
}

fn poll_us(poll: Duration) -> u64 {
    u64::try_from(poll.as_micros()).unwrap_or(u64::MAX)
}
