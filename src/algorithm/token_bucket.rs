//! Token bucket, in exact integer arithmetic.
//!
//! A bucket holds up to `burst` tokens and refills at `limit / period`. To keep
//! the refill exact for any quota (say 7 per minute, where a token takes
//! 8 571 428.57… µs), tokens are counted in **units** of `1 / unit` token, chosen
//! so that the refill rate is a whole number of units per microsecond:
//!
//! ```text
//! g        = gcd(limit, period_us)
//! unit     = period_us / g          units per token
//! rate     = limit / g              units per microsecond
//! capacity = burst * unit           units
//! ```
//!
//! A refill is then `elapsed_us * rate` units: an integer, with no rounding
//! at all, so slow refills keep their fractional progress forever. The Redis
//! twin (`lua/token_bucket.lua`) does the same arithmetic in Lua doubles, which
//! is exact because every value stays below 2^53 (checked when the quota is
//! built: [`TokenBucket::MAX_CAPACITY_UNITS`]).
//!
//! The state is one instant, the bucket's **theoretical arrival time** (TAT)
//! as GCRA keeps it ([`super::gcra`]): when the bucket is full again. The
//! tokens follow from it, `capacity − (TAT − now) × rate` (at least 0), and
//! so do `reset_after` and `retry_after`; every decision is the one a bucket
//! holding that many tokens makes (the police leaky bucket's, see
//! `tests/algorithms/algorithms.rs`). Stored as whole microseconds plus a remainder in
//! units (a unit is `1 / rate` µs of refill), the TAT is exact.

use super::{div_ceil, TierDecision};

/// The stored state of one bucket: its TAT, `tat_us + frac / rate` µs, the
/// instant it is full again, and the quota it was written under (its rate
/// and unit).
///
/// Read under another quota (a quota changed at run time, a plan, an
/// override set or removed), the bucket keeps its **used capacity**: the
/// tokens it is short of full, `(TAT − now) × rate / unit`, carried into the
/// new quota's units ([`Limit::carry`](super::Limit::carry)): a key that had used 80 of
/// 100 has 120 left under 200 and is 30 tokens in debt under 50, refilled at
/// the new rate. The Redis backend stores exactly that state (as one
/// integer under the tier's configured quota, `docs/redis.md`, "Stored
/// values").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    /// Whole microseconds of the TAT (Unix epoch in both backends).
    pub tat_us: u64,
    /// The rest of the TAT in units (`1 / rate` µs each), `0 ≤ frac < rate`.
    pub frac: u64,
    /// Units per token when the state was written.
    pub unit: u64,
    /// Units per microsecond when the state was written.
    pub rate: u64,
}

/// The integer parameters of one token bucket, derived from a quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// Capacity in units (`burst * unit`).
    pub capacity: u64,
    /// Refill rate in units per microsecond.
    pub rate: u64,
    /// Units per token.
    pub unit: u64,
}

const fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    a
}

impl TokenBucket {
    /// The largest capacity in units a bucket may have (2^52), so that every
    /// value the Lua twin handles is an exact integer in a double.
    /// (With a capacity of at most 2^52, a cost of up to the capacity + 1
    /// token is at most 2^53 units, and so is twice the capacity, which a
    /// refund may add up to.)
    pub const MAX_CAPACITY_UNITS: u64 = 1 << 52;

    /// The largest refill rate in units per microsecond (2^51): the Lua
    /// twin's rounded-up divisions by the rate compute up to
    /// `capacity + 2 × rate`, which must stay at or below 2^53.
    pub const MAX_RATE: u64 = 1 << 51;

    /// Parameters for a bucket of `burst` tokens refilling `limit` tokens per
    /// `period_us` microseconds. Returns `None` when an argument is zero, the
    /// capacity in units would exceed [`Self::MAX_CAPACITY_UNITS`] or the
    /// rate [`Self::MAX_RATE`].
    pub fn new(limit: u64, period_us: u64, burst: u64) -> Option<Self> {
        if limit == 0 || period_us == 0 || burst == 0 {
            return None;
        }
        let (unit, rate) = Self::unit_and_rate(limit, period_us);
        let capacity = burst.checked_mul(unit)?;
        if capacity > Self::MAX_CAPACITY_UNITS || rate > Self::MAX_RATE {
            return None;
        }
        Some(Self {
            capacity,
            rate,
            unit,
        })
    }

    /// `(unit, rate)` for `limit` tokens per `period_us` (both above 0):
    /// units per token and units per microsecond.
    pub fn unit_and_rate(limit: u64, period_us: u64) -> (u64, u64) {
        let g = gcd(limit, period_us);
        (period_us / g, limit / g)
    }

    /// The bucket's capacity in whole tokens (the burst).
    pub fn burst(&self) -> u64 {
        self.capacity / self.unit
    }

    /// Whether `s` was written under this quota (its rate and unit): a
    /// refund gives back only on such a state.
    pub fn reads(&self, s: &BucketState) -> bool {
        s.rate == self.rate && s.unit == self.unit
    }

    /// The units the bucket in `state` is short of full at `now_us`
    /// (`(TAT − now) × rate`; 0 for `None`), in this quota's units: a state
    /// written under another unit carries its tokens over ([`BucketState`],
    /// rounded up to a whole unit). Above the capacity only if the clock
    /// went back (a bucket is as far from full as the clock is behind) or
    /// the state was written under a quota with more tokens missing (at
    /// most 2^52 units, so the Lua twin's arithmetic stays exact).
    pub(crate) fn missing(&self, state: Option<BucketState>, now_us: u64) -> u64 {
        match state {
            Some(s) if s.tat_us >= now_us && s.rate > 0 => {
                let d = (s.tat_us - now_us).min(Self::MAX_CAPACITY_UNITS / s.rate);
                super::carry_units(d * s.rate + s.frac, s.unit, self.unit)
            }
            _ => 0,
        }
    }

    /// The state of a bucket `missing` units short of full at `now_us`.
    pub(crate) fn state_at(&self, missing: u64, now_us: u64) -> BucketState {
        BucketState {
            tat_us: now_us + missing / self.rate,
            frac: missing % self.rate,
            unit: self.unit,
            rate: self.rate,
        }
    }

    /// Checks a request of `cost` tokens at `now_us` against `state` (`None`
    /// for a bucket never seen or expired, which is a full bucket).
    ///
    /// Returns the decision and, when the request is allowed, the state to
    /// store with its time-to-live in microseconds (the time until the bucket
    /// is full again, at which point a missing key means the same thing).
    /// A denied request changes nothing.
    pub fn check(
        &self,
        state: Option<BucketState>,
        now_us: u64,
        cost: u64,
    ) -> (TierDecision, Option<(BucketState, u64)>) {
        let missing = self.missing(state, now_us);
        match self.check_missing(missing, cost) {
            (d, Some(used)) => {
                let reset_after_us = d.reset_after_us;
                (d, Some((self.state_at(used, now_us), reset_after_us)))
            }
            (d, None) => (d, None),
        }
    }

    /// [`TokenBucket::check`] of a bucket `missing` units short of full:
    /// the decision and, when allowed, the units it is short after the
    /// charge (its TAT is `now + used / rate`; its time-to-live the
    /// decision's `reset_after_us`). The memory backend's cells, which keep
    /// the TAT in units, decide with it directly.
    #[inline(always)]
    pub(crate) fn check_missing(&self, missing: u64, cost: u64) -> (TierDecision, Option<u64>) {
        let tokens = self.capacity.saturating_sub(missing);
        let cost_units = cost.saturating_mul(self.unit);
        let limit = self.burst();
        if cost_units <= tokens {
            let left = tokens - cost_units;
            let reset_after_us = div_ceil(self.capacity - left, self.rate);
            let decision = TierDecision {
                allowed: true,
                limit,
                remaining: left / self.unit,
                reset_after_us,
                retry_after_us: 0,
                delay_us: 0,
            };
            (decision, Some(self.capacity - left))
        } else {
            let reset_after_us = div_ceil(missing, self.rate);
            // A cost above the capacity can never pass; the honest wait we can
            // give is the time until the bucket is full.
            let retry_after_us = if cost_units > self.capacity {
                reset_after_us
            } else {
                div_ceil(cost_units + missing - self.capacity, self.rate)
            };
            let decision = TierDecision {
                allowed: false,
                limit,
                remaining: tokens / self.unit,
                reset_after_us,
                retry_after_us,
                delay_us: 0,
            };
            (decision, None)
        }
    }

    /// Whether [`TokenBucket::check_missing`] allows, and if so the units
    /// it leaves the bucket short (its second value), without the rest of
    /// its decision: for a caller that counts decisions and reads no
    /// remaining or reset times (no division).
    #[inline(always)]
    pub(crate) fn admits_missing(&self, missing: u64, cost: u64) -> Option<u64> {
        let tokens = self.capacity.saturating_sub(missing);
        let cost_units = cost.saturating_mul(self.unit);
        (cost_units <= tokens).then(|| self.capacity - (tokens - cost_units))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    /// `admits_missing` (the candidates' decision in a replay) is
    /// `check_missing`'s `allowed` and units short after the charge, for
    /// every bucket, units missing (full to past empty) and cost of a grid.
    #[test]
    fn admits_missing_is_check_missings_allowed_and_units() {
        let buckets = [
            TokenBucket::new(7, 60 * S, 7).unwrap(),
            TokenBucket::new(3, S, 5).unwrap(),
            TokenBucket::new(100, 60 * S, 10).unwrap(),
        ];
        for tb in buckets {
            let step = (tb.capacity / 97).max(1);
            let mut missing = 0;
            while missing <= tb.capacity + 3 * step {
                for cost in [0, 1, 2, 7, 11] {
                    let (decision, used) = tb.check_missing(missing, cost);
                    assert_eq!(tb.admits_missing(missing, cost), used);
                    assert_eq!(used.is_some(), decision.allowed);
                }
                missing += step;
            }
        }
    }

    #[test]
    fn units_make_odd_rates_exact() {
        // 7 per minute: a token every 8 571 428.57 µs.
        let tb = TokenBucket::new(7, 60 * S, 7).unwrap();
        assert_eq!(tb.rate * 60 * S, 7 * tb.unit);
        let mut state = None;
        let mut now = 1_700_000_000 * S;
        for _ in 0..7 {
            let (d, s) = tb.check(state, now, 1);
            assert!(d.allowed);
            state = s.map(|(s, _)| s);
        }
        let (d, _) = tb.check(state, now, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_us, 8_571_429);
        // One microsecond short of a token: still denied, progress kept.
        now += 8_571_428;
        assert!(!tb.check(state, now, 1).0.allowed);
        now += 1;
        assert!(tb.check(state, now, 1).0.allowed);
    }

    #[test]
    fn no_drift_over_a_million_checks() {
        // 3 per 7 s with a burst of 1000, asked 10 times a second for 1e6
        // checks (~27.8 h): admitted must be exactly burst + floor(span * 3/7).
        let tb = TokenBucket::new(3, 7 * S, 1000).unwrap();
        let t0 = 1_700_000_000 * S;
        let mut state = None;
        let mut admitted = 0u64;
        let n = 1_000_000u64;
        for k in 0..n {
            let (d, s) = tb.check(state, t0 + k * 100_000, 1);
            if d.allowed {
                admitted += 1;
                state = s.map(|(s, _)| s);
            }
        }
        let span_us = (n - 1) * 100_000;
        assert_eq!(admitted, 1000 + span_us * 3 / (7 * S));
    }

    #[test]
    fn the_state_is_the_tat() {
        // 7 per minute, burst 3: one request leaves the bucket a token
        // (8 571 428.57… µs) short of full: the TAT.
        let tb = TokenBucket::new(7, 60 * S, 3).unwrap();
        let now = 1_700_000_000 * S;
        let (_, s) = tb.check(None, now, 1);
        let (s, ttl) = s.unwrap();
        assert_eq!(
            s,
            BucketState {
                tat_us: now + 8_571_428,
                frac: 4,
                unit: 60_000_000,
                rate: 7,
            }
        );
        assert_eq!(ttl, 8_571_429);
        assert_eq!(tb.missing(Some(s), now), tb.unit);
        assert_eq!(tb.missing(Some(s), now + 8_571_429), 0);
        // Another quota: the one token used carries over (11/min: unit
        // 60 000 000 as well, so the same units).
        let other = TokenBucket::new(11, 60 * S, 3).unwrap();
        assert_eq!(other.missing(Some(s), now), other.unit);
        // 7 per 2 minutes: another unit, still one token short.
        let slower = TokenBucket::new(7, 120 * S, 3).unwrap();
        assert_eq!(slower.unit, 2 * tb.unit);
        assert_eq!(slower.missing(Some(s), now), slower.unit);
    }

    #[test]
    fn a_clock_that_steps_back_never_fills_the_bucket() {
        // 1 per second, burst 2, drained at t: 2 s to full.
        let tb = TokenBucket::new(1, S, 2).unwrap();
        let t = 1_700_000_000 * S;
        let (_, s) = tb.check(None, t, 2);
        let s = s.map(|(s, _)| s);
        // Half a second earlier (a clock behind by 0.5 s): still empty, and
        // the wait is as long as the bucket is behind.
        let (d, _) = tb.check(s, t - S / 2, 1);
        assert!(!d.allowed);
        assert_eq!((d.remaining, d.retry_after_us), (0, 3 * S / 2));
        // 10 s behind: full 12 s later.
        let (d, _) = tb.check(s, t - 10 * S, 1);
        assert_eq!((d.remaining, d.reset_after_us), (0, 12 * S));
    }

    #[test]
    fn huge_quotas_are_rejected_not_wrapped() {
        assert!(TokenBucket::new(1, u64::MAX, u64::MAX).is_none());
        assert!(TokenBucket::new(0, S, 1).is_none());
    }
}
