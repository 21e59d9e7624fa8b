//! What operators use: the admin router, inspection, per-key overrides, fleet-wide actions, rollout modes, metrics.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod admin;
mod candidates;
mod fleet_actions;
mod fleet_settings;
mod inspect;
mod observability;
mod overrides;
mod overrides_admin;
mod rollout;
mod rollout_calls;
mod rollout_gates;
mod rollout_guard;
mod rollout_kill;
mod rollout_plan;
mod rollout_plan_cas;
mod suggest;
