//! Adding the deny cache's 429s to the fleet-wide blocked-keys sets (see
//! `crate::observe::fleet`).

use super::RedisBackend;
use crate::error::BackendError;

/// Members `lua/check.lua` keeps in an hourly set (its heaviest).
pub(crate) const KEEP: i64 = 10_000;
/// The sets' TTL in seconds, as `lua/check.lua` sets it (25 h).
pub(crate) const TTL_S: i64 = 90_000;

impl RedisBackend {
    /// Adds `(set, [(storage key, cost)])` to the hourly sets in **one**
    /// pipelined round trip: `ZINCRBY` per key, then per set the trim to its
    /// [`KEEP`] heaviest members and the `EXPIRE` the script gives it. Not a
    /// transaction: the script's own increments may interleave, and every
    /// command adds, so the sums are exact either way. Single Redis only.
    pub(crate) async fn add_blocked(
        &self,
        sets: &[(String, Vec<(String, u64)>)],
    ) -> Result<(), BackendError> {
        let mut pipe = ::redis::pipe();
        for (set, keys) in sets {
            for (key, cost) in keys {
                pipe.cmd("ZINCRBY").arg(set).arg(*cost).arg(key).ignore();
            }
            // Ranks 0 ..= -(KEEP + 1): everything below the KEEP heaviest.
            pipe.cmd("ZREMRANGEBYRANK")
                .arg(set)
                .arg(0)
                .arg(-(KEEP + 1))
                .ignore();
            pipe.cmd("EXPIRE").arg(set).arg(TTL_S).ignore();
        }
        let r: Result<(), ::redis::RedisError> =
            pipe.query_async(&mut self.connection().await?).await;
        r.map_err(|e| self.error(e))
    }
}
