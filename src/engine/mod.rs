//! The decision engine: everything between a request's facts and its
//! decision, apart from the tower service that calls it.
//!
//! The steps, each in its own file, in the order a request meets them:
//!
//! A front door hands the engine a request's [`facts`] and gets a typed
//! [`decision`] back; [`check`] holds the state machine between the two.
//!
//! 1. [`plan`]: the gate (global mode with the control key's override,
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
//! [`watch`] keeps the control key's overrides in it up to date.

pub(crate) mod breaker;
mod build;
pub(crate) mod builder;
pub(crate) mod check;
pub(crate) mod decide;
pub(crate) mod decision;
pub(crate) mod deny;
pub(crate) mod deny_cache;
pub(crate) mod facts;
pub(crate) mod limits;
pub(crate) mod meta;
mod meters;
pub(crate) mod no_key;
pub(crate) mod outcome;
pub(crate) mod plan;
pub(crate) mod runtime;
pub(crate) mod settle;
pub(crate) mod slots;
pub(crate) mod spare;
pub(crate) mod spec;
pub(crate) mod state;
pub mod token_lease;
pub(crate) mod watch;

#[cfg(test)]
mod tests;

/// The `tracing` target of a check's span and events: the module they came
/// from before the engine had modules of its own, so that log filters such
/// as `RUST_LOG=tiered_ratelimit::service=debug` keep working.
pub(crate) const LOG_TARGET: &str = "tiered_ratelimit::service";

/// The same for the control key's watcher (formerly `control.rs`).
pub(crate) const CONTROL_LOG_TARGET: &str = "tiered_ratelimit::control";

/// The most tiers one layer may have.
pub const MAX_TIERS: usize = 64;

pub(crate) use check::{Engine, Pending, Step};
pub(crate) use decision::{Allow, Block, Decision};
pub(crate) use facts::Facts;
