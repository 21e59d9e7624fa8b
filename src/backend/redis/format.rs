//! [`StateFormat`]: which format the scripts write each key's state in.

use super::{wire, RedisBackend};

/// The format the Redis scripts write each key's state in. Every script
/// **reads both**, whatever this says; this only chooses what it writes
/// (see `docs/redis.md`, "Stored values" and "Upgrading").
///
/// * [`StateFormat::Legacy`] (the default, for now): the colon-separated
///   strings every earlier release writes and reads, e.g.
///   `"58200000:1700000000000000:600000"` for a token bucket. 104–120 B per
///   idle `rl:ip:<IPv4>` key (`MEMORY USAGE`).
/// * [`StateFormat::Compact`]: one integer per key wherever the quota allows
///   (a bucket's theoretical arrival time in µs where its rate is 1 (the
///   period in µs a multiple of the limit), a window's start plus its
///   count), which Redis stores in the object itself: **72 B** per idle
///   `rl:ip:<IPv4>` key, for example a token bucket of 60 or 300 per
///   minute. Other quotas (a token bucket of 7 per minute: rate 7) keep a
///   string. An integer TAT is read under any quota: a quota change carries
///   the time until full over (`docs/redis.md`, "Whose value is it").
///
/// An earlier release reads a compact value as **no state** (a full bucket,
/// an empty window) and overwrites it. So a fleet that still runs one must
/// not write compact values: deploy this release with `Legacy` first, and
/// switch to `Compact` once no earlier instance is left (a mix of `Legacy`
/// and `Compact` instances of this release is fine: each reads what the
/// other writes, exactly). To roll back to an earlier release, switch to
/// `Legacy` first and wait for the longest TTL of any tier (a compact key
/// is rewritten as legacy by its next charge, or expires).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StateFormat {
    /// The strings of earlier releases (readable by them).
    #[default]
    Legacy,
    /// Integers where the quota allows (not readable by earlier releases).
    Compact,
}

impl RedisBackend {
    /// Makes the scripts write every key's state in `format` (default
    /// [`StateFormat::Legacy`]); they read both formats whatever it is. See
    /// [`StateFormat`] for when a fleet can switch.
    #[must_use]
    pub fn with_state_format(mut self, format: StateFormat) -> Self {
        self.format = format;
        self
    }

    /// The format the scripts write in (see [`RedisBackend::with_state_format`]).
    pub fn state_format(&self) -> StateFormat {
        self.format
    }

    /// The tier flag that asks the scripts for this backend's format.
    pub(super) fn format_flag(&self) -> u8 {
        match self.format {
            StateFormat::Compact => wire::COMPACT,
            StateFormat::Legacy => 0,
        }
    }
}
