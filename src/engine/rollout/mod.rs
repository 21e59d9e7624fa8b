//! Staged rollout plans run by the fleet (`crate::rollout::RolloutPlan`).
//!
//! A tier's plan state is one field of the control hash, `plan:<tier>`
//! (see `lua/plan.lua` for its format), read by every instance with the
//! modes at each poll (the `HGETALL` that ends the poll's one call). Every change
//! goes through one compare-and-set script, `lua/plan.lua`, on the plan's
//! version, which also sets the tier's mode field (`tier:<tier>`) when a
//! stage begins, so every instance applies the new stage's mode at its
//! next poll, as it would an operator's, and appends the decision to the
//! rollout log (a stream capped at [`LOG_CAP`] entries, key [`log_key`]).
//!
//! One instance, the leader, advances a running plan (`drive.rs`): in each
//! of its polls' one call (`poll.rs`, `lua/poll.lua`, which also adds the
//! instance's stage and guard counts and reads the control hash) its step
//! renews its lease (the field's `beat`) and, when the stage's time has
//! passed, advances it if every gate passes (`gates.rs`) or records the
//! gate that holds. Another instance that sees
//! the beat unchanged for the lease's lifetime asks the script to take the
//! lease over, which it grants only if the beat is still the one it saw and
//! the version the one it read: two would-be leaders cannot both step.
//! Operators' actions (`act.rs`) are the same compare-and-set.

// Without Redis a plan can be configured (and is refused nothing at
// build) but never runs: the actions answer `NotConfigured`.
#![cfg_attr(
    not(feature = "redis"),
    allow(dead_code, unused_imports, unused_variables)
)]

mod act;
#[cfg(feature = "redis")]
mod drive;
mod gates;
mod guard;
#[cfg(feature = "redis")]
mod poll;

pub(crate) use act::{act, log, status};
pub(crate) use gates::{Latency, StageStats};
pub(crate) use guard::{GuardView, TierGuard};
#[cfg(feature = "redis")]
pub(crate) use poll::{after, call, gather};

use crate::rollout::{RolloutPlan, Stored};
use std::sync::Arc;

/// The rollout log's cap (XADD MAXLEN ~: Redis may keep a few more).
pub(crate) const LOG_CAP: u64 = 1000;

/// The control hash's field of `tier`'s plan.
pub(crate) fn field(tier: &str) -> String {
    format!("plan:{tier}")
}

/// The rollout log's key: in the control hash's hash slot (its hash tag,
/// or the whole control key as one), so the script may write both on a
/// cluster.
pub(crate) fn log_key(control: &str) -> String {
    let tagged = control
        .find('{')
        .and_then(|open| control[open + 1..].find('}').map(|len| len > 0))
        .unwrap_or(false);
    if tagged {
        format!("{control}:rollout")
    } else {
        format!("{{{control}}}:rollout")
    }
}

/// The engine's plans (in [`Live`](super::state::Live)).
pub(crate) struct Plans {
    /// Per tier: its configured plan, if any.
    pub(crate) configured: Box<[Option<RolloutPlan>]>,
    /// This instance's id in the plans' leases and the log.
    pub(crate) instance: String,
    /// Per tier: its plan's state as last read (idle when none is stored).
    pub(crate) read: arc_swap::ArcSwap<Vec<Stored>>,
    /// The watcher's view of each tier's lease: the leader and beat last
    /// seen, and when they were first seen (a beat unchanged for a lease's
    /// lifetime is a lapsed lease).
    pub(crate) seen: std::sync::Mutex<Vec<Option<(String, u64, std::time::Instant)>>>,
    /// Per planned tier: what the gates read in its current stage.
    pub(crate) stats: Box<[Option<StageStats>]>,
    /// The check latency while a plan runs.
    pub(crate) latency: Latency,
    /// Whether any plan runs (requests' latencies are recorded only then).
    running: std::sync::atomic::AtomicBool,
    /// Per tier: its fall back guard, if any (`guard.rs`).
    pub(crate) guards: Box<[Option<TierGuard>]>,
}

impl Plans {
    /// The plans of `configured`, one a tier (none yet read).
    pub(crate) fn new(
        configured: Vec<Option<RolloutPlan>>,
        guards: Vec<Option<crate::rollout::FallbackGuard>>,
    ) -> Self {
        let n = configured.len();
        Self {
            guards: guards.into_iter().map(|g| g.map(TierGuard::new)).collect(),
            instance: instance_id(),
            read: arc_swap::ArcSwap::from_pointee(vec![Stored::idle(); n]),
            seen: std::sync::Mutex::new(vec![None; n]),
            stats: configured
                .iter()
                .map(|p| p.as_ref().map(|_| StageStats::default()))
                .collect(),
            configured: configured.into_boxed_slice(),
            latency: Latency::default(),
            running: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Tier `i`'s stage statistics, while its plan runs.
    #[inline]
    pub(crate) fn counting(&self, i: usize) -> Option<&StageStats> {
        self.stats.get(i)?.as_ref().filter(|s| s.active())
    }

    /// Whether any plan runs (the latency gate's samples are taken).
    #[inline]
    pub(crate) fn running(&self) -> bool {
        self.running.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Tier `i`'s fall back guard, if any.
    #[inline]
    pub(crate) fn guarded(&self, i: usize) -> Option<&TierGuard> {
        self.guards.get(i)?.as_ref()
    }

    /// Whether any tier has a plan.
    pub(crate) fn any(&self) -> bool {
        self.configured.iter().any(Option::is_some)
    }
}

/// A process-unique id without spaces: the process id and 48 random bits.
fn instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    h.write_u64(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    format!(
        "{}-{:012x}",
        std::process::id(),
        h.finish() & 0xffff_ffff_ffff
    )
}

/// The script's arguments from ARGV[2] on (see `lua/plan.lua`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn args(
    tier: &str,
    me: &str,
    version: u64,
    op: &str,
    seen_beat: Option<u64>,
    reason: &str,
    by: &str,
    evidence: &str,
    plan: &RolloutPlan,
) -> Vec<String> {
    let mut a = vec![
        tier.to_owned(),
        me.to_owned(),
        version.to_string(),
        op.to_owned(),
        seen_beat.map(|b| b.to_string()).unwrap_or_default(),
        reason.to_owned(),
        by.to_owned(),
        evidence.to_owned(),
        LOG_CAP.to_string(),
        plan.stages.len().to_string(),
    ];
    for s in &plan.stages {
        a.push(s.mode.to_string());
        a.push(s.hold_for.map_or_else(
            || "-1".to_owned(),
            |d| d.as_micros().min(u128::from(u64::MAX >> 11)).to_string(),
        ));
    }
    a
}

/// Per tier, the plan state in one read of the control hash (idle when
/// absent; a malformed field is logged and read as the last good state).
pub(crate) fn read_states(
    shared: &super::Shared,
    fields: &[(String, String)],
    previous: &[Stored],
) -> Vec<Stored> {
    shared
        .config
        .tiers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = field(&t.name);
            match fields.iter().find(|(f, _)| *f == name) {
                None => Stored::idle(),
                Some((_, v)) => Stored::parse(v).unwrap_or_else(|| {
                    tracing::error!(target: super::CONTROL_LOG_TARGET, field = name, value = v.as_str(),
                        "control key: malformed rollout plan state ignored; keeping the last good one");
                    previous.get(i).cloned().unwrap_or_else(Stored::idle)
                }),
            }
        })
        .collect()
}

/// Stores the states read, resetting a tier's stage statistics when its
/// stage or version changed.
pub(crate) fn store_states(shared: &super::Shared, states: Vec<Stored>) {
    let plans = &shared.live.plans;
    let before = plans.read.load_full();
    let mut any = false;
    for (i, s) in states.iter().enumerate() {
        let Some(stats) = plans.stats.get(i).and_then(Option::as_ref) else {
            continue;
        };
        let tier = shared.config.tiers[i].name.to_string();
        #[allow(clippy::cast_precision_loss)] // stages and versions stay far below 2^53
        {
            use crate::observe::{ROLLOUT_HOLDING, ROLLOUT_STAGE, ROLLOUT_VERSION};
            metrics::gauge!(ROLLOUT_STAGE, "tier" => tier.clone()).set(s.stage as f64);
            metrics::gauge!(ROLLOUT_VERSION, "tier" => tier.clone()).set(s.version as f64);
            metrics::gauge!(ROLLOUT_HOLDING, "tier" => tier).set(if s.holding.is_empty() {
                0.0
            } else {
                1.0
            });
        }
        let live = matches!(s.status.as_str(), "running" | "paused");
        any |= live;
        stats.set_active(live);
        if before
            .get(i)
            .is_some_and(|b| b.stage != s.stage || b.since_us != s.since_us)
        {
            stats.begin_stage();
            plans.latency.begin_stage();
        }
    }
    plans
        .running
        .store(any, std::sync::atomic::Ordering::Relaxed);
    plans.read.store(Arc::new(states));
}

#[cfg(test)]
mod tests {
    use super::log_key;

    #[test]
    fn the_log_shares_the_control_keys_slot() {
        assert_eq!(log_key("rl:control"), "{rl:control}:rollout");
        assert_eq!(log_key("{rl}:control"), "{rl}:control:rollout");
    }
}
