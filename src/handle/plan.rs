//! Staged rollout plans through the handle: start, pause, resume and abort
//! a tier's [`RolloutPlan`](crate::rollout::RolloutPlan), read where it
//! is, and read the rollout log (see `docs/rollout.md`, "The rollout plan").

use super::RateLimitHandle;
use crate::engine::ControlError;
use crate::rollout::{PlanAction, PlanStatus, RolloutEvent};

impl RateLimitHandle {
    /// Does `action` on tier `tier`'s rollout plan for the whole fleet: one
    /// compare-and-set on the plan's state in the control hash (a start
    /// sets the first stage's mode, an abort puts the first stage's mode
    /// back), applied here at once and by every other instance within one
    /// poll interval (plus its round trip), and recorded in the rollout
    /// log with `by`. A start or resume makes this instance the plan's
    /// leader. Answers the plan's new status.
    ///
    /// # Errors
    /// [`ControlError::UnknownTier`]; [`ControlError::Invalid`] (field
    /// `tier`: it has no plan; field `action`: not in this status, e.g. a
    /// start while it runs); [`ControlError::NotConfigured`] without a
    /// control key on Redis; [`ControlError::Malformed`],
    /// [`ControlError::Contended`] or [`ControlError::Backend`].
    pub async fn plan(
        &self,
        tier: &str,
        action: PlanAction,
        by: &str,
    ) -> Result<PlanStatus, ControlError> {
        crate::engine::rollout::act(&self.shared, tier, action, by).await
    }

    /// Where tier `tier`'s plan is, as this instance read it at its last
    /// poll of the control hash (no Redis call).
    ///
    /// # Errors
    /// [`ControlError::UnknownTier`], or [`ControlError::Invalid`] (field
    /// `tier`) for a tier without a plan.
    pub fn plan_status(&self, tier: &str) -> Result<PlanStatus, ControlError> {
        crate::engine::rollout::status(self.shared(), tier)
    }

    /// The rollout log's newest `count` entries, newest first: every
    /// automatic decision (advance, hold, takeover, fall back) and every
    /// operator action on a plan, with who, which instance and the evidence.
    ///
    /// # Errors
    /// [`ControlError::NotConfigured`] without a control key on Redis, or
    /// [`ControlError::Backend`].
    pub async fn rollout_log(&self, count: usize) -> Result<Vec<RolloutEvent>, ControlError> {
        crate::engine::rollout::log(self.shared(), count).await
    }

    /// The tiers that have a rollout plan, in tier order.
    pub fn planned_tiers(&self) -> Vec<String> {
        let shared = self.shared();
        shared
            .config
            .tiers
            .iter()
            .zip(shared.live.plans.configured.iter())
            .filter(|(_, p)| p.is_some())
            .map(|(t, _)| t.name.to_string())
            .collect()
    }
}
