//! [`RolloutPlan`]: a tier's staged rollout (shadow, then canary 1 % →
//! 10 %, then enforce), written once and run by the fleet itself.
//!
//! See [`RolloutPlan`]'s docs.

use super::Mode;
use serde::Deserialize;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// One stage of a [`RolloutPlan`]: a mode and how long the tier stays in it.
///
/// In a policy file, `{ mode = "canary:1", for = "1h" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Stage {
    /// The tier's mode during the stage.
    pub mode: Mode,
    /// How long the stage lasts at least (gates may hold it longer);
    /// `None` on the last stage only.
    #[serde(default, rename = "for", with = "humantime_serde")]
    pub hold_for: Option<Duration>,
}

impl Stage {
    /// A stage in `mode`, without a duration (the last stage).
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            hold_for: None,
        }
    }

    /// Stays in this stage at least `duration`.
    #[must_use]
    pub fn hold_for(mut self, duration: Duration) -> Self {
        self.hold_for = Some(duration);
        self
    }
}

/// What the application's guard answers (see [`RolloutPlan::guard`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GuardVerdict {
    /// The business metrics are fine: the plan may advance.
    Healthy,
    /// Hold the plan at its stage, with the reason given.
    Hold(String),
    /// Step the tier back to shadow fleet-wide and stop the plan, with the
    /// reason given.
    FallBack(String),
}

/// The application guard: an async callback given the tier's name.
pub type Guard =
    Arc<dyn Fn(&str) -> Pin<Box<dyn Future<Output = GuardVerdict> + Send>> + Send + Sync>;

/// The gates every stage passes before the next one (`[tier.rollout_gates]`
/// in a policy file).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RolloutGates {
    /// Checks of the tier the fleet saw in the stage, at least (default 0).
    #[serde(default)]
    pub min_requests: u64,
    /// Distinct keys of the tier the fleet saw in the stage, at least
    /// (default 0; counted exactly up to 65 536).
    #[serde(default)]
    pub min_keys: u64,
    /// How much the check latency's p99 in the stage may exceed the p99 of
    /// the stage before (humantime; default 3 ms).
    #[serde(default = "default_p99_increase", with = "humantime_serde")]
    pub max_check_p99_increase: Duration,
}

fn default_p99_increase() -> Duration {
    Duration::from_millis(3)
}

impl Default for RolloutGates {
    fn default() -> Self {
        Self {
            min_requests: 0,
            min_keys: 0,
            max_check_p99_increase: default_p99_increase(),
        }
    }
}

/// How long a leader's lease lasts unless told otherwise: three poll
/// intervals (see [`RolloutPlan::lease`]).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) const LEASE_POLLS: u32 = 3;

/// A tier's staged rollout: its stages, gates and guard.
///
/// A plan is a list of [`Stage`]s: each names a [`Mode`] and how long the
/// tier stays in it; the last stage has no duration (the plan ends there).
/// A stage advances only when its time has passed and every gate
/// ([`RolloutGates`]) passes; a gate that fails holds the plan and says
/// why. The plan's state lives in Redis beside the fleet-wide control key,
/// and one instance at a time (the leader, under a lease) advances it, so
/// a plan needs a [`ControlKey`](crate::handle::ControlKey): `build()`
/// refuses a plan without one. See `docs/rollout.md`, "The rollout plan".
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::rollout::{Mode, RolloutPlan, Stage};
/// let hour = Duration::from_secs(3600);
/// let plan = RolloutPlan::new([
///     Stage::new(Mode::Shadow).hold_for(hour),
///     Stage::new(Mode::Canary { percent: 1 }).hold_for(hour),
///     Stage::new(Mode::Canary { percent: 10 }).hold_for(hour),
///     Stage::new(Mode::Enforce),
/// ])
/// .min_requests(1000)
/// .min_keys(50);
/// ```
///
/// The gates read the fleet's stage: every instance adds its checks of
/// the tier (and its map of keys seen) to the stage's totals in Redis at
/// each poll where it has any, and the leader reads the sum.
#[derive(Clone)]
#[must_use]
pub struct RolloutPlan {
    pub(crate) stages: Vec<Stage>,
    pub(crate) gates: RolloutGates,
    pub(crate) guard: Option<Guard>,
    pub(crate) lease: Option<Duration>,
}

impl fmt::Debug for RolloutPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RolloutPlan")
            .field("stages", &self.stages)
            .field("gates", &self.gates)
            .field("guard", &self.guard.as_ref().map(|_| "<fn>"))
            .field("lease", &self.lease)
            .finish()
    }
}

impl RolloutPlan {
    /// A plan of `stages`, in order, with the default gates (no sample
    /// floor, p99 increase at most 3 ms) and no guard. Checked at `build()`.
    pub fn new(stages: impl IntoIterator<Item = Stage>) -> Self {
        Self {
            stages: stages.into_iter().collect(),
            gates: RolloutGates::default(),
            guard: None,
            lease: None,
        }
    }

    /// The recipe of `docs/rollout.md`: shadow, canary 1 %, canary 10 %,
    /// each for `each`, then enforce.
    pub fn recipe(each: Duration) -> Self {
        Self::new([
            Stage::new(Mode::Shadow).hold_for(each),
            Stage::new(Mode::Canary { percent: 1 }).hold_for(each),
            Stage::new(Mode::Canary { percent: 10 }).hold_for(each),
            Stage::new(Mode::Enforce),
        ])
    }

    /// Advances only after at least `n` checks of the tier in the stage.
    pub fn min_requests(mut self, n: u64) -> Self {
        self.gates.min_requests = n;
        self
    }

    /// Advances only after at least `n` distinct keys in the stage.
    pub fn min_keys(mut self, n: u64) -> Self {
        self.gates.min_keys = n;
        self
    }

    /// Holds when the check latency's p99 rose more than `d` over the stage
    /// before's (default 3 ms).
    pub fn max_check_p99_increase(mut self, d: Duration) -> Self {
        self.gates.max_check_p99_increase = d;
        self
    }

    /// All gates at once (a policy file's `[tier.rollout_gates]`).
    pub fn gates(mut self, gates: RolloutGates) -> Self {
        self.gates = gates;
        self
    }

    /// The application guard, asked by the leader once a poll while a
    /// stage is due: [`GuardVerdict::Hold`] holds the plan,
    /// [`GuardVerdict::FallBack`] steps the tier back to shadow fleet-wide
    /// and stops the plan. A guard that takes longer than the poll
    /// interval holds.
    pub fn guard<F, Fut>(mut self, guard: F) -> Self
    where
        F: Fn(&str) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = GuardVerdict> + Send + 'static,
    {
        self.guard = Some(Arc::new(move |tier: &str| Box::pin(guard(tier))));
        self
    }

    /// How long the leader's lease lasts without renewal (default three
    /// control-key poll intervals): a stopped leader is replaced within
    /// this plus one poll interval.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The stages, in order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Checks the plan as `build()` does: the field (`rollout[3].for`) and why.
    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        if self.stages.is_empty() {
            return Err(("rollout".into(), "a plan needs at least one stage".into()));
        }
        let last = self.stages.len() - 1;
        for (i, s) in self.stages.iter().enumerate() {
            match s.mode {
                Mode::Off => {
                    return Err((
                        format!("rollout[{i}].mode"),
                        "a stage cannot be \"off\" (use the kill switch); give shadow, canary:<1-100> or enforce".into(),
                    ))
                }
                Mode::Canary { percent } if percent > 100 => {
                    return Err((
                        format!("rollout[{i}].mode"),
                        format!("canary:{percent}: the percent is 0-100"),
                    ))
                }
                _ => {}
            }
            match (i == last, s.hold_for) {
                (true, Some(_)) => {
                    return Err((
                        format!("rollout[{i}].for"),
                        "the last stage is where the plan ends: it has no `for`".into(),
                    ))
                }
                (false, None) => {
                    return Err((
                        format!("rollout[{i}].for"),
                        "every stage but the last needs a `for` (how long it lasts)".into(),
                    ))
                }
                (false, Some(d)) if d.is_zero() => {
                    return Err((format!("rollout[{i}].for"), "must be greater than 0".into()))
                }
                _ => {}
            }
        }
        if self.lease.is_some_and(|l| l.is_zero()) {
            return Err(("rollout.lease".into(), "must be greater than 0".into()));
        }
        Ok(())
    }
}
