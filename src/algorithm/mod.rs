//! Pure, clock-free models of the rate-limiting algorithms.
//!
//! Each algorithm is a function of `(parameters, stored state, now, cost)` to
//! `(decision, new state)`. Nothing here does I/O or reads a clock: the memory
//! backend calls these functions directly, and the Redis Lua scripts in `lua/`
//! are line-by-line twins of them, so tests can use this module as the oracle
//! for both backends.
//!
//! All time is integer **microseconds** and all state is integer, so a bucket
//! never drifts, however many operations it sees.

pub mod token_bucket;

pub use token_bucket::{BucketState, TokenBucket};

/// The outcome of checking one tier for one request.
///
/// Durations are integer microseconds, relative to the `now` the check ran at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether this tier admits the request (and, if every tier does, charges it).
    pub allowed: bool,
    /// The tier's capacity in whole requests (the burst).
    pub limit: u64,
    /// Whole requests left after this decision (after charging, when allowed;
    /// untouched, when denied). Never above `limit`. When another tier denies
    /// the request, nothing is charged and an allowing tier's `remaining` is
    /// what it *would* have left.
    pub remaining: u64,
    /// Microseconds until the tier is back to its full capacity.
    pub reset_after_us: u64,
    /// Microseconds until this request's cost would be admitted; `0` when allowed.
    pub retry_after_us: u64,
}

/// `ceil(a / b)` for `b > 0`.
pub(crate) const fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}
