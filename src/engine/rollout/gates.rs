//! The gates a stage passes before the next one, read by the leader from
//! this process's own counters (nothing added to a request's path): the
//! sample floor from the anomaly observer's per-tier buckets, and the
//! application guard.

use super::super::Shared;
use crate::rollout::{GuardVerdict, RolloutPlan, Stored};
use std::time::Duration;

/// What the gates read of one tier in its current stage (reset when a new
/// stage is read).
#[derive(Debug, Default)]
pub(crate) struct StageStats {
    /// How many stages this instance has seen begin (for the tests'
    /// bookkeeping and the log's evidence).
    began: std::sync::atomic::AtomicU64,
}

impl StageStats {
    /// A new stage was read.
    pub(crate) fn begin_stage(&self) {
        self.began
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The gates' answer for one tier at one poll.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// The gate that holds and why (empty: every gate passes).
    pub(crate) holding: String,
    /// The numbers read, for the log.
    pub(crate) evidence: String,
    /// The guard asked to fall back to shadow, with its reason.
    pub(crate) fall_back: Option<String>,
}

/// Checks of tier `i` this process saw since `since_us` (whole anomaly
/// buckets that began at or after it: a conservative count).
fn requests_since(shared: &Shared, i: usize, since_us: u64) -> u64 {
    let since_s = since_us / 1_000_000;
    let observer = &shared.telemetry.observer;
    let closed: u64 = observer
        .history(i)
        .iter()
        .filter(|b| b.start >= since_s)
        .map(|b| b.requests)
        .sum();
    let open = observer
        .open_bucket(i)
        .filter(|b| b.start >= since_s)
        .map_or(0, |b| b.requests);
    closed + open
}

/// The gates of tier `i`'s plan at its stage `state`, asked only when the
/// stage's time has (about) passed: the guard is asked with at most
/// `budget` to answer (a slower one holds).
pub(crate) async fn evaluate(
    shared: &Shared,
    i: usize,
    plan: &RolloutPlan,
    state: &Stored,
    budget: Duration,
) -> Verdict {
    let tier = &shared.config.tiers[i].name;
    let requests = requests_since(shared, i, state.since_us);
    let mut v = Verdict {
        evidence: format!("requests={requests}"),
        ..Verdict::default()
    };
    let gates = &plan.gates;
    if requests < gates.min_requests {
        v.holding = format!(
            "min_requests: {requests} checked in the stage, {} needed",
            gates.min_requests
        );
        return v;
    }
    if let Some(guard) = &plan.guard {
        match tokio::time::timeout(budget, guard(tier)).await {
            Ok(GuardVerdict::Healthy) => v.evidence.push_str(" guard=healthy"),
            Ok(GuardVerdict::Hold(why)) => {
                v.evidence.push_str(" guard=hold");
                v.holding = format!("guard: {why}");
            }
            Ok(GuardVerdict::FallBack(why)) => {
                v.evidence.push_str(" guard=fall_back");
                v.fall_back = Some(format!("guard: {why}"));
            }
            Err(_) => {
                v.evidence.push_str(" guard=timeout");
                v.holding = format!("guard: no answer within {budget:?}");
            }
        }
    }
    v
}
