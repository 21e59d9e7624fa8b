//! [`Penalty`]: a tier's penalty box, as configured.

use crate::algorithm::PenaltyBox;
use crate::error::ConfigError;
use std::time::Duration;

/// A tier's penalty box ([`Tier::penalty`](crate::Tier::penalty)): after
/// `violations` denials of one key by the tier within `window`, the key is
/// blocked for `block`; each repeat offence within `memory` after the end
/// of the previous block multiplies the block by `backoff`, up to `max_block`. While
/// blocked, every request of the key is denied (429) without touching the
/// tier's rate state, and `Retry-After` / `X-RateLimit-Reset` say when the
/// block ends. Blocks are fleet-wide on Redis (the same script call as the
/// check); [`RateLimitHandle::peek`](crate::RateLimitHandle::peek) shows
/// one and [`RateLimitHandle::lift`](crate::RateLimitHandle::lift) lifts it.
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::{key::ClientIp, Penalty, Quota, Tier};
/// // 5 failed logins a minute per IP; 3 more 429s within 10 minutes block
/// // the IP for 15 minutes, then 30, 60, ... at most a day.
/// let tier = Tier::new("login_ip", ClientIp::default(), Quota::per_minute(5))
///     .skip_successful_requests(true)
///     .penalty(Penalty::new(3, Duration::from_secs(600), Duration::from_secs(900)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Penalty {
    /// Denials by the tier that start a block (1-1023).
    pub violations: u32,
    /// The span the denials are counted over (humantime in a policy file).
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// The first block.
    #[serde(with = "humantime_serde")]
    pub block: Duration,
    /// The factor a repeat offence multiplies the block by (1-1023;
    /// default 2).
    #[serde(default = "two")]
    pub backoff: u32,
    /// How long after a block a new one counts as a repeat offence (whole
    /// seconds; default 24 h).
    #[serde(default = "day", with = "humantime_serde")]
    pub memory: Duration,
    /// The longest block (default 24 h).
    #[serde(default = "day", with = "humantime_serde")]
    pub max_block: Duration,
}

fn two() -> u32 {
    2
}
fn day() -> Duration {
    Duration::from_secs(86_400)
}

impl Penalty {
    /// A penalty box blocking for `block` after `violations` denials within
    /// `window`; backoff 2, memory and max block 24 h.
    #[must_use]
    pub fn new(violations: u32, window: Duration, block: Duration) -> Self {
        Self {
            violations,
            window,
            block,
            backoff: two(),
            memory: day(),
            max_block: day(),
        }
    }

    /// The factor each repeat offence multiplies the block by.
    #[must_use]
    pub fn backoff(mut self, backoff: u32) -> Self {
        self.backoff = backoff;
        self
    }

    /// How long after a block's **end** a new one is a repeat offence
    /// (whole seconds; a part of a second counts as one).
    #[must_use]
    pub fn memory(mut self, memory: Duration) -> Self {
        self.memory = memory;
        self
    }

    /// The longest block.
    #[must_use]
    pub fn max_block(mut self, max_block: Duration) -> Self {
        self.max_block = max_block;
        self
    }

    /// The integer parameters, checked (each error names the field).
    pub(crate) fn compile(&self, tier: &str) -> Result<PenaltyBox, ConfigError> {
        let bad = |field: &str, why: &str| {
            ConfigError::Policy(format!("tier \"{tier}\": penalty.{field}: {why}"))
        };
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if !(1..1024).contains(&self.violations) {
            return Err(bad("violations", "must be 1-1023"));
        }
        if !(1..1024).contains(&self.backoff) {
            return Err(bad("backoff", "must be 1-1023"));
        }
        let most = crate::algorithm::MAX_PERIOD_US;
        for (field, d) in [
            ("window", self.window),
            ("block", self.block),
            ("max_block", self.max_block),
        ] {
            if us(d) == 0 || us(d) > most {
                return Err(bad(
                    field,
                    "must be between 1 µs and 2^51 µs (about 71 years)",
                ));
            }
        }
        if self.max_block < self.block {
            return Err(bad("max_block", "must be at least block"));
        }
        // Whole seconds, below 2^32 (the script packs it with the others).
        let memory_s = self.memory.as_secs() + u64::from(self.memory.subsec_nanos() > 0);
        if memory_s >= 1 << 32 {
            return Err(bad("memory", "must be below 2^32 s"));
        }
        Ok(PenaltyBox {
            violations: u64::from(self.violations),
            window_us: us(self.window),
            block_us: us(self.block),
            backoff: u64::from(self.backoff),
            memory_us: memory_s * 1_000_000,
            max_block_us: us(self.max_block),
        })
    }
}
