//! Settling a priced request's charge once its actual cost is known: the
//! part above the estimate is charged whatever the state ([`Limit::debt`]);
//! the part below is given back by [`Limit::refund`] of the difference.
//! See `docs/algorithms.md`, "Priced requests", for the bound.

use super::{bucket, div_ceil, fixed, Limit, State, TokenBucket, MAX_EXACT};

impl Limit {
    /// Whether a tier of this limit can be priced by its response
    /// (`Tier::priced`): its charge can be settled afterwards, in part given
    /// back ([`Limit::refund`] of the difference) and in part charged over
    /// the limit ([`Limit::debt`]). The token bucket and the fixed window.
    pub fn settles(&self) -> bool {
        matches!(self, Limit::TokenBucket(_) | Limit::FixedWindow(_))
    }

    /// The largest debt one settle charges (in the tier's cost units): a
    /// token bucket's 2^52 units, a fixed window's 2^52; more is clamped so
    /// that the Lua twin's arithmetic stays exact.
    pub fn max_debt(&self) -> u64 {
        match self {
            Limit::TokenBucket(b) => TokenBucket::MAX_CAPACITY_UNITS / b.unit,
            _ => MAX_EXACT / 2,
        }
    }

    /// Charges `extra` at `now_us` **whatever the state** (a priced
    /// request's actual cost above its estimate, once its response ended):
    /// the state to store and its time-to-live in microseconds, or `None`
    /// for a limit that does not [settle](Limit::settles). The twin of the
    /// debt functions of `lua/refund.lua`.
    ///
    /// The charge may take the tier below zero: that is **debt**. A token
    /// bucket is then more than its capacity short of full (its TAT further
    /// out), so every request is denied, `remaining` is 0 and `retry_after`
    /// is the exact time until the request fits again; at most 2^52 units
    /// short (the exactness bound of [`TokenBucket::MAX_CAPACITY_UNITS`]),
    /// beyond which the debt is dropped. A fixed window counts above its
    /// limit until the window ends, when the debt is forgiven with the
    /// rest of the count (at most [`MAX_EXACT`] / 2).
    pub fn debt(&self, state: Option<&State>, now_us: u64, extra: u64) -> Option<(State, u64)> {
        match self {
            Limit::TokenBucket(b) => {
                let missing = b
                    .missing(bucket(state), now_us)
                    .saturating_add(extra.min(self.max_debt()).saturating_mul(b.unit))
                    .min(TokenBucket::MAX_CAPACITY_UNITS);
                if missing == 0 {
                    return None;
                }
                Some((
                    State::Bucket(b.state_at(missing, now_us)),
                    div_ceil(missing, b.rate),
                ))
            }
            Limit::FixedWindow(w) => {
                let (mut s, ttl) = w.fixed_charge(fixed(state), now_us, 0);
                s.count = s
                    .count
                    .saturating_add(extra.min(self.max_debt()))
                    .min(MAX_EXACT / 2);
                Some((State::FixedWindow(s), ttl))
            }
            _ => None,
        }
    }
}
