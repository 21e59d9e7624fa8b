//! An operator's actions on a plan (start, pause, resume, abort), its
//! status as this instance read it, and the rollout log.

use super::super::watch::{control_hash_key, ControlError};
use super::super::Shared;
use super::{args, field, log_key, Stored};
use crate::rollout::{PlanAction, PlanStatus, RolloutEvent};
use std::sync::Arc;

/// How many times an action reads again when the plan moved under it.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
const ATTEMPTS: usize = 8;

/// Tier `tier`'s index and plan, or why not.
fn planned<'a>(
    shared: &'a Shared,
    tier: &str,
) -> Result<(usize, &'a crate::rollout::RolloutPlan), ControlError> {
    let i = shared
        .config
        .tier_index(tier)
        .map_err(|_| ControlError::UnknownTier(tier.to_owned()))?;
    let plan = shared.live.plans.configured[i]
        .as_ref()
        .ok_or_else(|| ControlError::Invalid {
            field: "tier".into(),
            reason: format!("tier \"{tier}\" has no rollout plan"),
        })?;
    Ok((i, plan))
}

/// Does `action` on tier `tier`'s plan (one compare-and-set; read again and
/// retried when another change came first), then reads the control hash
/// and applies it here at once; the other instances follow within a poll.
/// `by`: who asked (`admin`, `handle`, …), for the log.
pub(crate) async fn act(
    shared: &Arc<Shared>,
    tier: &str,
    action: PlanAction,
    by: &str,
) -> Result<PlanStatus, ControlError> {
    let (_, plan) = planned(shared, tier)?;
    let Some(key) = control_hash_key(shared) else {
        return Err(ControlError::NotConfigured);
    };
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        let me = &shared.live.plans.instance;
        let name = field(tier);
        for _ in 0..ATTEMPTS {
            let fields = redis.hgetall(key).await?;
            let stored = match fields.iter().find(|(f, _)| *f == name) {
                None => Stored::idle(),
                Some((_, v)) => Stored::parse(v).ok_or_else(|| {
                    ControlError::Malformed(format!("{name} {v:?} is not a plan state"))
                })?,
            };
            let reason = match action {
                PlanAction::Abort => format!("aborted by {by}"),
                _ => String::new(),
            };
            let a = args(
                tier,
                me,
                stored.version,
                action.name(),
                None,
                &reason,
                by,
                "",
                plan,
            );
            let (code, _) = redis.plan_step(key, &log_key(key), &a).await?;
            match code {
                1 => {
                    tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, action = action.name(), by,
                        "rollout plan: operator action");
                    super::super::watch::refresh(shared, key).await?;
                    return status(shared, tier);
                }
                -1 => continue,
                -3 => {
                    return Err(ControlError::Invalid {
                        field: "action".into(),
                        reason: format!(
                            "the plan of tier \"{tier}\" is {}: cannot {action} it",
                            stored.status
                        ),
                    })
                }
                _ => {
                    return Err(ControlError::Malformed(format!(
                        "{name} is not a plan state"
                    )))
                }
            }
        }
        return Err(ControlError::Contended);
    }
    let _ = (key, action, by);
    Err(ControlError::NotConfigured)
}

/// Tier `tier`'s plan as this instance read it at its last poll (or its
/// own last action).
pub(crate) fn status(shared: &Shared, tier: &str) -> Result<PlanStatus, ControlError> {
    let (i, plan) = planned(shared, tier)?;
    let read = shared.live.plans.read.load();
    let stored = read.get(i).cloned().unwrap_or_else(Stored::idle);
    let mode = match stored.status.as_str() {
        "running" | "paused" | "done" => plan.stages.get(stored.stage).map(|s| s.mode),
        _ => None,
    }
    .unwrap_or_else(|| {
        let ov = shared.live.mode_overrides.load();
        ov.tiers
            .get(i)
            .copied()
            .flatten()
            .unwrap_or(shared.live.runtime.load().tiers[i].mode)
    });
    Ok(stored.status_of(tier, mode.to_string()))
}

/// The newest `count` entries of the rollout log, newest first.
pub(crate) async fn log(shared: &Shared, count: usize) -> Result<Vec<RolloutEvent>, ControlError> {
    let Some(key) = control_hash_key(shared) else {
        return Err(ControlError::NotConfigured);
    };
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        let entries = redis.stream_newest(&log_key(key), count).await?;
        return Ok(entries
            .into_iter()
            .map(|(id, fields)| RolloutEvent::from_fields(id, &fields))
            .collect());
    }
    let _ = (key, count);
    Err(ControlError::NotConfigured)
}
