//! What a tier's charge returned ([`Charge`]) and a refund of it
//! ([`TierRefund`]): the layer's refunds by response status and a priced
//! request's settle. Public only with the `__testing` feature, for the tests
//! that prove model = memory = Redis on refunds; the layer makes its
//! refunds itself.
// Without `__testing` these are crate-private (re-exported `pub(crate)`).
#![cfg_attr(not(feature = "__testing"), allow(unreachable_pub))]

use super::TierCheck;

/// What one tier's charge returned, for its refund.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The backend clock the charge ran at (Unix epoch µs).
    pub at_us: u64,
    /// The algorithm's undo value (see `lua/refund.lua` and
    /// [`Limit::undo_of`](crate::algorithm::Limit::undo_of)).
    pub undo: u64,
    /// Microseconds after `at_us` before another request of the same cost
    /// would pass this tier (0: at once, or unknown). A single Redis reports
    /// it for the token bucket, fixed window and leaky bucket; the layer
    /// primes its deny cache with it. 0 from the memory backend and a cluster.
    pub next_after_us: u64,
}

/// A refund of one tier's charge: the check it was, and its [`Charge`]; or,
/// with `debt`, a priced request's cost above its estimate, charged
/// whatever the state ([`Limit::debt`](crate::algorithm::Limit::debt)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierRefund {
    /// The check that was charged (same key and limit; the cost to give
    /// back, or with `debt` the cost to charge).
    pub check: TierCheck,
    /// What the charge returned.
    pub charge: Charge,
    /// Charge `check.cost` as debt instead of giving it back.
    pub debt: bool,
}
