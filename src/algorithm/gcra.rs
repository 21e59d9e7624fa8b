//! Leaky bucket as GCRA (the Generic Cell Rate Algorithm, ITU-T I.371): the
//! state is one **theoretical arrival time** (TAT), the instant the bucket
//! would be empty.
//!
//! Time is counted in *ticks* of `1 / rate` µs, with the same `unit`, `rate`
//! and `capacity` as [`TokenBucket`] (so `cost` tokens advance the TAT by
//! `cost × unit` ticks and the tolerance is `capacity` ticks). The TAT is
//! stored exactly as whole microseconds plus a remainder in ticks.
//!
//! * **Police** (a meter): a request passes if `max(TAT, now) + cost × T − now ≤
//!   burst × T`, otherwise it is rejected at once. Its decisions are those
//!   of a token bucket with the same quota, which the tests check.
//! * **Shape** (a queue, like nginx `limit_req` without `nodelay`): the part of
//!   `max(TAT, now) + cost × T − now` beyond the tolerance is a **delay**: the
//!   request is held until its slot and then passed, if that delay is at most
//!   `max_delay`; otherwise it is rejected at once.

use super::{div_ceil, TierDecision, TokenBucket};

/// Stored state: the TAT as `tat_us + frac / rate` microseconds, and the
/// quota it was written under (its rate and unit).
///
/// Read under another quota the backlog carries over in requests (tokens):
/// `(TAT − now) × rate / unit` of the old quota, in the new one's ticks,
/// rounded up (the rule of [`super::BucketState`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TatState {
    /// Whole microseconds of the TAT (epoch).
    pub tat_us: u64,
    /// Remainder in ticks, `0 ≤ frac < rate`.
    pub frac: u64,
    /// Ticks per microsecond when the state was written.
    pub rate: u64,
    /// Ticks per token when the state was written.
    pub unit: u64,
}

/// GCRA parameters: the bucket's integer units and, when shaping, the most a
/// request may be delayed (µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// Capacity, rate and unit, as for the token bucket.
    pub bucket: TokenBucket,
    /// `None` to police; `Some(max delay in µs)` to shape.
    pub max_delay_us: Option<u64>,
}

impl Gcra {
    /// The backlog of `s` at `now_us` in this quota's ticks (0 when the
    /// TAT is past): ticks from now to the TAT under the quota it was
    /// written with, carried into this one's when its unit differs (at
    /// most 2^52 ticks, so the Lua twin's arithmetic stays exact). `None`
    /// for a state without a rate.
    pub(crate) fn backlog_of(&self, s: &TatState, now_us: u64) -> Option<u64> {
        let b = &self.bucket;
        if s.rate == 0 {
            return None;
        }
        if s.tat_us < now_us {
            return Some(0);
        }
        let d = s.tat_us - now_us;
        if s.rate == b.rate && s.unit == b.unit {
            return Some(d * s.rate + s.frac);
        }
        let d = d.min(TokenBucket::MAX_CAPACITY_UNITS / s.rate);
        Some(super::carry_units(d * s.rate + s.frac, s.unit, b.unit))
    }

    /// Ticks from `now_us` to the TAT (0 when the TAT is past or the state
    /// is not read under this rate).
    fn backlog(&self, state: Option<TatState>, now_us: u64) -> u64 {
        state.map_or(0, |s| self.backlog_of(&s, now_us).unwrap_or(0))
    }

    /// GCRA decision for `cost` at `now_us`.
    pub fn check(&self, state: Option<TatState>, now_us: u64, cost: u64) -> TierDecision {
        self.check_backlog(self.backlog(state, now_us), cost)
    }

    /// [`Gcra::check`] of a bucket whose TAT is `backlog` units (of
    /// `1 / rate` µs) ahead of now. The memory backend's cells, which keep
    /// the TAT in those units, decide with it directly (a charge then puts
    /// the TAT at `backlog + cost × unit` units ahead).
    #[inline(always)]
    pub(crate) fn check_backlog(&self, backlog: u64, cost: u64) -> TierDecision {
        let b = &self.bucket;
        let after = backlog + cost * b.unit;
        let over = after.saturating_sub(b.capacity);
        let allowed_ticks = self.max_delay_us.map_or(0, |d| d.saturating_mul(b.rate));
        let limit = b.burst();
        if over <= allowed_ticks && cost * b.unit <= b.capacity {
            TierDecision {
                allowed: true,
                limit,
                remaining: b.capacity.saturating_sub(after) / b.unit,
                reset_after_us: div_ceil(after, b.rate),
                retry_after_us: 0,
                delay_us: div_ceil(over, b.rate),
            }
        } else {
            let reset_after_us = div_ceil(backlog, b.rate);
            let retry_after_us = if cost * b.unit > b.capacity {
                reset_after_us
            } else {
                div_ceil(over - allowed_ticks, b.rate)
            };
            TierDecision {
                allowed: false,
                limit,
                remaining: b.capacity.saturating_sub(backlog) / b.unit,
                reset_after_us,
                retry_after_us,
                delay_us: 0,
            }
        }
    }

    /// The state after admitting `cost` at `now_us`, and its time-to-live (µs).
    pub fn charge(&self, state: Option<TatState>, now_us: u64, cost: u64) -> (TatState, u64) {
        let rate = self.bucket.rate;
        let after = self.backlog(state, now_us) + cost * self.bucket.unit;
        (
            TatState {
                tat_us: now_us + after / rate,
                frac: after % rate,
                rate,
                unit: self.bucket.unit,
            },
            div_ceil(after, rate),
        )
    }
}
