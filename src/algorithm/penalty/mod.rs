//! The penalty box of a tier: after `violations` denials of one key by the
//! tier within `window`, the key is **blocked** for `block`; each repeat
//! offence within `memory` after the END of the previous block multiplies the block by
//! `backoff` (capped at `max_block`). While blocked, every request of the
//! key is denied, whatever the tier's rate state (which is not touched:
//! nothing is charged), and `Retry-After` is the block's end.
//!
//! It runs as a check of its own right after its tier's check, in the same
//! all-or-nothing call, on a key of its own in the same hash slot
//! (`<tier key>{pb}`). Unlike a rate check it **writes when the request is
//! denied**: a denial by its tier is a violation (a strike), and the strike
//! that completes `violations` starts the block. A request it denies while
//! blocked counts no strike.
//!
//! State: the times of the strikes still within `window` (at most
//! `violations − 1` are kept), the end of the current block, the number of
//! consecutive offences and when the last block started.

mod config;

use super::TierDecision;
pub use config::Penalty;

/// What a tier's key becomes for its penalty box: `<tier key>{pb}`. Key
/// parts never hold `{` or `}`, so no tier's key can end so; on a cluster
/// the hash tag stays the tier key's (`{<tier key>}{pb}`).
pub const PENALTY_KEY_SUFFIX: &str = "{pb}";

/// Penalty-box parameters, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PenaltyBox {
    /// Denials within `window_us` that start a block (at least 1, below 1024).
    pub violations: u64,
    /// The span strikes are counted over, µs.
    pub window_us: u64,
    /// The first block, µs.
    pub block_us: u64,
    /// The factor a repeat offence multiplies the block by (1..1024).
    pub backoff: u64,
    /// How long after a block's end a new one counts as a repeat offence, µs.
    pub memory_us: u64,
    /// The longest block, µs.
    pub max_block_us: u64,
}

/// A key's penalty state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PenaltyState {
    /// Strikes within the window (epoch µs), oldest first.
    pub strikes: Vec<u64>,
    /// The current (or last) block ends here (epoch µs; 0: never blocked).
    pub blocked_until_us: u64,
    /// Offences so far (blocks, each within `memory` of the one before).
    pub offences: u64,
    /// When the last block started (epoch µs).
    pub last_block_us: u64,
}

/// What a penalty check decided: its decision, and the state to store now
/// (even when the request is denied: a strike), with its time-to-live (µs).
pub type PenaltyOutcome = (TierDecision, Option<(PenaltyState, u64)>);

impl PenaltyBox {
    /// What `X-RateLimit-Limit` shows for the penalty box (never binding
    /// when it allows; its denial shows the block).
    pub const fn capacity(&self) -> u64 {
        self.violations
    }

    /// The length of the block an offence starts: `block × backoff^(n − 1)`
    /// for the `n`th offence, at most `max_block`.
    pub fn block_for(&self, offence: u64) -> u64 {
        let mut len = self.block_us;
        for _ in 1..offence {
            len = len.saturating_mul(self.backoff);
            if len >= self.max_block_us {
                break;
            }
        }
        len.min(self.max_block_us)
    }

    /// The check at `now_us`, given the key's state and whether the tier it
    /// guards allowed the request (`tier_allowed`, decided just before).
    pub fn check(
        &self,
        state: Option<&PenaltyState>,
        now_us: u64,
        tier_allowed: bool,
    ) -> PenaltyOutcome {
        let blocked = state.map_or(0, |s| s.blocked_until_us);
        if blocked > now_us {
            let wait = blocked - now_us;
            return (denied(self, wait), None);
        }
        if tier_allowed {
            return (allowed(self), None);
        }
        // A strike.
        let mut s = state.cloned().unwrap_or_default();
        s.strikes.retain(|&t| t + self.window_us > now_us);
        s.strikes.push(now_us);
        if (s.strikes.len() as u64) < self.violations {
            let ttl = s.strikes[0] + self.window_us - now_us;
            let ttl = ttl.max(self.memory_left(&s, now_us));
            return (allowed(self), Some((s, ttl)));
        }
        // The block: a repeat offence when within `memory` of the END of
        // the previous block.
        let repeat = s.offences > 0 && s.blocked_until_us + self.memory_us > now_us;
        s.offences = if repeat { s.offences + 1 } else { 1 };
        let len = self.block_for(s.offences);
        s.strikes.clear();
        s.blocked_until_us = now_us + len;
        s.last_block_us = now_us;
        let ttl = len.saturating_add(self.memory_us);
        (denied(self, len), Some((s, ttl)))
    }

    /// How long `s` still means something at `now_us` (µs): the block, the
    /// strikes in the window, the memory of the last block.
    pub fn ttl(&self, s: &PenaltyState, now_us: u64) -> u64 {
        let strikes = s
            .strikes
            .first()
            .map_or(0, |t| (t + self.window_us).saturating_sub(now_us));
        s.blocked_until_us
            .saturating_sub(now_us)
            .max(strikes)
            .max(self.memory_left(s, now_us))
    }

    /// Until the last block is forgotten, `memory` after its end (0 when
    /// none).
    fn memory_left(&self, s: &PenaltyState, now_us: u64) -> u64 {
        if s.offences == 0 {
            return 0;
        }
        (s.blocked_until_us.saturating_add(self.memory_us)).saturating_sub(now_us)
    }
}

fn allowed(p: &PenaltyBox) -> TierDecision {
    TierDecision {
        allowed: true,
        limit: p.capacity(),
        // Never the binding tier of an allowed request.
        remaining: p.capacity(),
        reset_after_us: 0,
        retry_after_us: 0,
        delay_us: 0,
    }
}

fn denied(p: &PenaltyBox, wait_us: u64) -> TierDecision {
    TierDecision {
        allowed: false,
        limit: p.capacity(),
        remaining: 0,
        reset_after_us: wait_us,
        retry_after_us: wait_us,
        delay_us: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;
    const P: PenaltyBox = PenaltyBox {
        violations: 3,
        window_us: 60 * S,
        block_us: 900 * S,
        backoff: 2,
        memory_us: 86_400 * S,
        max_block_us: 3_000 * S,
    };

    #[test]
    fn strikes_block_and_repeat_offences_back_off_up_to_the_cap() {
        let mut state: Option<PenaltyState> = None;
        fn hit(state: &mut Option<PenaltyState>, now: u64) -> TierDecision {
            let (d, s) = P.check(state.as_ref(), now, false);
            if let Some((s, _)) = s {
                *state = Some(s);
            }
            d
        }
        let strike = |state: &mut Option<PenaltyState>, now: u64| hit(state, now);
        assert!(strike(&mut state, 0).allowed);
        assert!(strike(&mut state, 10 * S).allowed);
        // The third within a minute: blocked 15 min.
        let d = strike(&mut state, 20 * S);
        assert_eq!((d.allowed, d.retry_after_us), (false, 900 * S));
        // While blocked: denied, no strike, the same end.
        let (d, s) = P.check(state.as_ref(), 30 * S, true);
        assert_eq!((d.allowed, d.retry_after_us, s), (false, 890 * S, None));
        // After it: allowed requests pass untouched.
        let (d, s) = P.check(state.as_ref(), 920 * S, true);
        assert!(d.allowed && s.is_none());
        // Strikes older than the window do not count.
        assert!(strike(&mut state, 1_000 * S).allowed);
        assert!(strike(&mut state, 1_100 * S).allowed);
        assert!(strike(&mut state, 1_110 * S).allowed);
        // A repeat offence within a day: 30 min; then 50 min (the cap).
        let d = strike(&mut state, 1_120 * S);
        assert_eq!(d.retry_after_us, 1_800 * S);
        for t in [3_000, 3_001] {
            assert!(strike(&mut state, t * S).allowed);
        }
        assert_eq!(strike(&mut state, 3_002 * S).retry_after_us, 3_000 * S);
        assert_eq!(P.block_for(10), 3_000 * S);
    }

    /// `memory` counts from the END of the previous block: with a block as
    /// long as `memory`, an offence right after the block ends is a repeat
    /// (counted from the block's start, as before, it never was).
    #[test]
    fn memory_counts_from_the_end_of_the_previous_block() {
        let p = PenaltyBox {
            violations: 1,
            window_us: 60 * S,
            block_us: 600 * S,
            backoff: 2,
            memory_us: 600 * S,
            max_block_us: 86_400 * S,
        };
        let (d, s) = p.check(None, 0, false);
        assert_eq!(d.retry_after_us, 600 * S);
        let (s, ttl) = s.unwrap();
        // Kept until the memory after the block's end is over.
        assert_eq!(ttl, 1_200 * S);
        assert_eq!(p.ttl(&s, 0), 1_200 * S);
        // 1 s after the block ended: a repeat offence, 20 minutes.
        let (d, s2) = p.check(Some(&s), 601 * S, false);
        assert_eq!(d.retry_after_us, 1_200 * S);
        let (s2, ttl) = s2.unwrap();
        assert_eq!((s2.offences, ttl), (2, 1_800 * S));
        // `memory` after the block's end (1 200 s from its start): forgotten.
        let (d, s3) = p.check(Some(&s), 1_200 * S, false);
        assert_eq!(d.retry_after_us, 600 * S);
        assert_eq!(s3.unwrap().0.offences, 1);
        // Within it, one microsecond earlier: still a repeat.
        let (d, _) = p.check(Some(&s), 1_200 * S - 1, false);
        assert_eq!(d.retry_after_us, 1_200 * S);
    }
}
