//! What a running [`RolloutPlan`](super::RolloutPlan) reports: its state
//! ([`PlanStatus`], as stored in the control hash's `plan:<tier>` field),
//! the operator's actions ([`PlanAction`]) and the log of its decisions
//! ([`RolloutEvent`]).

use serde::Serialize;
use std::fmt;

/// An operator's action on a tier's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanAction {
    /// Starts the plan at its first stage (when it is not running or paused).
    Start,
    /// Stops the clock: the tier stays in its stage's mode.
    Pause,
    /// Restarts the clock where it stopped.
    Resume,
    /// Stops the plan and puts the tier back in its first stage's mode.
    Abort,
}

impl PlanAction {
    /// `start`, `pause`, `resume` or `abort`.
    pub const fn name(self) -> &'static str {
        match self {
            PlanAction::Start => "start",
            PlanAction::Pause => "pause",
            PlanAction::Resume => "resume",
            PlanAction::Abort => "abort",
        }
    }
}

impl fmt::Display for PlanAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PlanAction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            PlanAction::Start,
            PlanAction::Pause,
            PlanAction::Resume,
            PlanAction::Abort,
        ]
        .into_iter()
        .find(|a| a.name() == s.trim())
        .ok_or_else(|| format!("unknown action {s:?} (start, pause, resume or abort)"))
    }
}

/// Where a tier's plan is, as the control hash stores it and as this
/// instance read it at its last poll. `GET /api/plan/{tier}` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PlanStatus {
    /// The tier.
    pub tier: String,
    /// The stage's index in the plan (0 before any start).
    pub stage: usize,
    /// The stage's mode (`canary:10`), as the plan of this instance names it.
    pub mode: String,
    /// `idle` (never started), `running`, `paused`, `done`, `aborted` or
    /// `fellback` (the guard stepped the tier back to shadow).
    pub status: String,
    /// When the stage began, in microseconds since the epoch (Redis's clock).
    pub since_us: u64,
    /// When the stage may end (its `for` has passed), in microseconds since
    /// the epoch; `null` for the last stage or a plan not running.
    pub next_at_us: Option<u64>,
    /// The gate that holds the plan and why, or `null`.
    pub holding: Option<String>,
    /// The plan's version: incremented by every change (0: none stored).
    pub version: u64,
    /// The instance holding the lease (the leader), or `null`.
    pub leader: Option<String>,
}

/// The stored field, parsed (see `lua/plan.lua`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Stored {
    pub(crate) version: u64,
    pub(crate) stage: usize,
    pub(crate) status: String,
    pub(crate) since_us: u64,
    pub(crate) next_at_us: u64,
    pub(crate) paused_at_us: u64,
    pub(crate) leader: String,
    pub(crate) beat: u64,
    pub(crate) holding: String,
}

impl Stored {
    /// No plan stored: idle at version 0.
    pub(crate) fn idle() -> Self {
        Self {
            status: "idle".into(),
            leader: "-".into(),
            ..Self::default()
        }
    }

    /// Parses `version stage status since next_at paused_at leader beat
    /// holding…`; `None` when malformed.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.splitn(9, ' ');
        let mut num = || parts.next()?.parse::<u64>().ok();
        let version = num()?;
        let stage = usize::try_from(num()?).ok()?;
        let status = parts.next()?.to_owned();
        let mut num = || parts.next()?.parse::<u64>().ok();
        let since_us = num()?;
        let next_at_us = num()?;
        let paused_at_us = num()?;
        let leader = parts.next()?.to_owned();
        let beat = parts.next()?.parse::<u64>().ok()?;
        let holding = parts.next().unwrap_or("").to_owned();
        Some(Self {
            version,
            stage,
            status,
            since_us,
            next_at_us,
            paused_at_us,
            leader,
            beat,
            holding,
        })
    }

    /// Whether the leader advances it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn running(&self) -> bool {
        self.status == "running"
    }

    /// The status a caller reads, with `mode` the stage's mode.
    pub(crate) fn status_of(&self, tier: &str, mode: String) -> PlanStatus {
        PlanStatus {
            tier: tier.to_owned(),
            stage: self.stage,
            mode,
            status: self.status.clone(),
            since_us: self.since_us,
            next_at_us: (self.next_at_us > 0
                && matches!(self.status.as_str(), "running" | "paused"))
            .then_some(self.next_at_us),
            holding: (!self.holding.is_empty()).then(|| self.holding.clone()),
            version: self.version,
            leader: (self.leader != "-").then(|| self.leader.clone()),
        }
    }
}

/// One entry of the rollout log (`GET /api/rollout/log`): an automatic
/// decision or an operator's action on a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RolloutEvent {
    /// The stream entry's id (`<ms>-<n>`, Redis's).
    pub id: String,
    /// When, in microseconds since the epoch (the script's clock).
    pub at_us: u64,
    /// The tier.
    pub tier: String,
    /// `start`, `advance`, `hold`, `done`, `pause`, `resume`, `abort`,
    /// `takeover` or `fallback`.
    pub event: String,
    /// The stage after the event.
    pub stage: usize,
    /// That stage's mode.
    pub mode: String,
    /// The plan's version after the event.
    pub version: u64,
    /// The instance that made the change.
    pub instance: String,
    /// Who: `leader` (an automatic decision), `guard`, or the operator's
    /// door (`admin`, `handle`, or a name).
    pub by: String,
    /// Why (the gate that holds, the guard's reason), or empty.
    pub reason: String,
    /// The numbers the decision was made on (`requests=1200 keys=57 …`).
    pub evidence: String,
}

impl RolloutEvent {
    /// An entry from a stream entry's fields.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_fields(id: String, fields: &[(String, String)]) -> Self {
        let get = |name: &str| {
            fields
                .iter()
                .find(|(f, _)| f == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        Self {
            id,
            at_us: get("at_us").parse().unwrap_or(0),
            tier: get("tier"),
            event: get("event"),
            stage: get("stage").parse().unwrap_or(0),
            mode: get("mode"),
            version: get("version").parse().unwrap_or(0),
            instance: get("instance"),
            by: get("by"),
            reason: get("reason"),
            evidence: get("evidence"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_plan_parses_with_a_holding_of_several_words() {
        let s = Stored::parse("7 2 running 100 200 0 i-1 12 min_requests: 3 of 10").unwrap();
        assert_eq!(s.version, 7);
        assert_eq!(s.stage, 2);
        assert_eq!(s.next_at_us, 200);
        assert_eq!(s.leader, "i-1");
        assert_eq!(s.beat, 12);
        assert_eq!(s.holding, "min_requests: 3 of 10");
        let s = Stored::parse("1 0 done 5 0 0 i-1 3 ").unwrap();
        assert_eq!(s.holding, "");
        assert_eq!(Stored::parse("x 0 done"), None);
    }
}
