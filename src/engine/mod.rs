//! The decision engine: everything between a request's facts and its
//! decision, apart from the tower service that calls it.
//!
//! The steps, each in its own file, in the order a request meets them:
//!
//! A front door hands the engine a request's [`facts`] and gets a typed
//! [`decision`] back; [`check`] holds the state machine between the two.
//!
//! 1. [`plan`]: the gate (global mode with the control key's mode override,
//!    denylist, allowlist), then one check per applicable tier;
//! 2. [`deny`]: the deny cache (cached denials, the single flight of a
//!    lapsed key);
//! 3. [`check`]: the circuit breaker, then one backend call for all checks
//!    (or a wait for another request's probe first);
//! 4. [`outcome`]: breaker and deny-cache bookkeeping, observation, and the
//!    failure policy when the backend failed;
//! 5. [`decide`]: the binding tier, its headers, the denial.
//!
//! [`state`] holds what all of them read ([`state::Shared`], in four bags);
//! [`watch`] keeps the control key's mode overrides in it up to date.

mod breaker;
mod build;
mod builder;
pub(crate) mod candidates;
mod check;
mod decide;
mod decision;
mod deny;
mod deny_cache;
mod facts;
mod limits;
mod meta;
mod meters;
mod no_key;
mod outcome;
mod plan;
pub(crate) mod rollout;
mod runtime;
mod settings;
mod settle;
mod slots;
mod spare;
mod spec;
mod state;
// The one public submodule: lease mode's contract (its settings, its
// guarantees and their proofs) is documented on the module, which users read
// as `tiered_ratelimit::token_lease` (lib.rs re-exports it); its public types
// have that path only.
pub mod token_lease;
mod watch;

#[cfg(test)]
mod tests;

/// The `tracing` target of a check's span and events: the module they came
/// from before the engine had modules of its own, so that log filters such
/// as `RUST_LOG=tiered_ratelimit::service=debug` keep working.
pub(crate) const LOG_TARGET: &str = "tiered_ratelimit::service";

/// The fleet-wide hourly sets: `<prefix>:blocked:<hour>` counts the keys
/// refused (429), `<prefix>:shadow_limited:<hour>` those a tier not enforced
/// for the key would have refused (lua/check.lua adds to both).
pub(crate) const BLOCKED_SET: &str = "blocked";
/// See [`BLOCKED_SET`].
pub(crate) const SHADOW_LIMITED_SET: &str = "shadow_limited";

/// The same for the control key's watcher (formerly `control.rs`).
pub(crate) const CONTROL_LOG_TARGET: &str = "tiered_ratelimit::control";

/// The most tiers one layer may have.
pub const MAX_TIERS: usize = 64;

// The engine's one face: everything the front doors, the handle, the admin
// page and the policy files use is named here (`crate::engine::Name`); none
// of them reaches into a step's module.
pub use breaker::CircuitBreaker;
pub(crate) use builder::engine_settings;
pub use builder::EngineBuilder;
pub use runtime::FailurePolicy;
pub use watch::{ControlError, ControlKey};

pub(crate) use check::{Engine, Pending, Step};
pub(crate) use decision::{Allow, Block, Decision};
pub(crate) use facts::Facts;
pub(crate) use limits::checked_limit;
pub(crate) use no_key::DEFAULT_NO_KEY_WARN_AFTER;
pub(crate) use runtime::Runtime;
pub(crate) use settings::{
    quota_of, set_plan_quota, set_tier_quota, setting_of, write as write_settings, Invalid,
    QuotaSetting, Settings, UPDATES,
};
pub(crate) use settle::{Landing, Reservation};
pub(crate) use slots::Slots;
pub(crate) use spec::TierSpec;
pub(crate) use state::Shared;
pub(crate) use token_lease::{
    deserialize_sync, lease_from_policy, LeaseCounts, LeaseStatus, TokenLease,
};
pub(crate) use watch::{announce_change, control_hash_key, write_mode};
