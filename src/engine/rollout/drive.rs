//! The leader's work at each poll of the control hash: one script call per
//! running plan (renew the lease, and advance or hold when the stage is
//! due), and the other instances' watch on the lease.

use super::super::Shared;
use super::{args, log_key, read_states, store_states};
use crate::backend::RedisBackend;
use crate::rollout::{Stored, LEASE_POLLS};
use std::time::{Duration, Instant};

/// Runs after each read of the control hash (`fields`), on the watcher's
/// task: stores every tier's plan state, then, for each running plan
/// configured here, renews the lease this instance holds (advancing the
/// plan when due and the gates pass), or takes over a lease whose beat has
/// not moved for its lifetime. `poll`: the control key's poll interval.
pub(crate) async fn drive(
    shared: &Shared,
    redis: &RedisBackend,
    key: &str,
    fields: &[(String, String)],
    poll: Duration,
) {
    let plans = &shared.live.plans;
    if !plans.any() {
        return;
    }
    let previous = plans.read.load_full();
    let states = read_states(shared, fields, &previous);
    store_states(shared, states.clone());
    super::gates::flush_stages(shared, redis, key, &states, poll).await;
    for (i, state) in states.iter().enumerate() {
        let Some(plan) = &plans.configured[i] else {
            continue;
        };
        if !state.running() {
            forget(shared, i);
            continue;
        }
        let lease = plan.lease.unwrap_or(poll * LEASE_POLLS);
        let seen_beat = if state.leader == plans.instance {
            forget(shared, i);
            None
        } else if lapsed(shared, i, state, lease) {
            Some(state.beat)
        } else {
            continue;
        };
        let due = local_now_us(shared) + poll_us(poll) >= state.next_at_us && state.next_at_us > 0;
        let verdict = if due {
            super::gates::evaluate(shared, i, plan, state, poll).await
        } else {
            super::gates::Verdict::default()
        };
        // Not due by this clock: renew the lease only (the script would
        // take an unasked gate for a pass).
        let (op, reason) = match &verdict.fall_back {
            Some(why) => ("fallback", why.as_str()),
            None if due => ("tick", verdict.holding.as_str()),
            None => ("renew", ""),
        };
        let tier = &shared.config.tiers[i].name;
        let a = args(
            tier,
            &plans.instance,
            state.version,
            op,
            seen_beat,
            reason,
            if op == "fallback" { "guard" } else { "leader" },
            &verdict.evidence,
            plan,
        );
        let log = log_key(key);
        let call = redis.plan_step(key, &log, &a);
        match tokio::time::timeout(poll.max(Duration::from_millis(100)), call).await {
            Ok(Ok((code, text))) => after(shared, i, tier, code, &text, seen_beat.is_some()),
            Ok(Err(e)) => {
                tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier, error = %e,
                "rollout plan: the leader's step failed; trying again at the next poll")
            }
            Err(_) => tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier,
                "rollout plan: the leader's step timed out; trying again at the next poll"),
        }
    }
}

/// Records the script's answer to a step of tier `i`.
fn after(shared: &Shared, i: usize, tier: &str, code: i64, text: &str, takeover: bool) {
    let Some(now) = Stored::parse(text) else {
        return;
    };
    if code == 1 {
        let before = shared.live.plans.read.load();
        let was = before.get(i);
        if takeover {
            tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, version = now.version,
                "rollout plan: this instance took the lapsed lease over and leads the plan");
        }
        if was.is_some_and(|w| w.stage != now.stage || w.status != now.status) {
            tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, stage = now.stage,
                status = now.status, version = now.version, "rollout plan: stage changed");
        } else if !now.holding.is_empty() {
            tracing::info!(target: super::super::CONTROL_LOG_TARGET, tier, stage = now.stage,
                holding = now.holding, "rollout plan: holding");
        }
    }
    if code >= 0 {
        let mut states = (**shared.live.plans.read.load()).clone();
        if let Some(s) = states.get_mut(i) {
            *s = now;
        }
        store_states(shared, states);
    }
}

/// Whether tier `i`'s lease has shown the same leader and beat for
/// `lease` of this process's time.
fn lapsed(shared: &Shared, i: usize, state: &Stored, lease: Duration) -> bool {
    let mut seen = shared
        .live
        .plans
        .seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(slot) = seen.get_mut(i) else {
        return false;
    };
    match slot {
        Some((leader, beat, since)) if *leader == state.leader && *beat == state.beat => {
            since.elapsed() >= lease
        }
        _ => {
            *slot = Some((state.leader.clone(), state.beat, Instant::now()));
            false
        }
    }
}

fn forget(shared: &Shared, i: usize) {
    let mut seen = shared
        .live
        .plans
        .seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(slot) = seen.get_mut(i) {
        *slot = None;
    }
}

/// This process's clock in µs (the backend's manual clock in tests).
fn local_now_us(shared: &Shared) -> u64 {
    shared.local_clock.now_us()
}

fn poll_us(poll: Duration) -> u64 {
    u64::try_from(poll.as_micros()).unwrap_or(u64::MAX)
}
