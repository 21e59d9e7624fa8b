//! The decision engine: everything between a request's facts and its
//! decision, apart from the tower service that calls it.
//!
//! The steps, each in its own file, in the order a request meets them:
//!
//! 1. [`plan`]: the gate (global mode with the control key's override,
//!    denylist, allowlist), then one check per applicable tier;
//! 2. [`deny`]: the deny cache (cached denials, the single flight of a
//!    lapsed key);
//! 3. [`check`]: the circuit breaker, then one backend call for all checks;
//! 4. [`outcome`]: breaker and deny-cache bookkeeping, observation, and the
//!    failure policy when the backend failed;
//! 5. [`decide`]: the binding tier, its headers, the 429.
//!
//! [`runtime`] holds the state all of them read ([`runtime::Shared`]);
//! [`watch`] keeps the control key's overrides in it up to date.

pub(crate) mod check;
pub(crate) mod decide;
pub(crate) mod deny;
pub(crate) mod outcome;
pub(crate) mod plan;
pub(crate) mod runtime;
pub(crate) mod watch;
