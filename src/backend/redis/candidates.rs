//! The fleet-wide counts of candidate quotas in Redis (see
//! `crate::observe::fleet_candidates`): one pipelined flush, and their read.

use super::blocked::{KEEP, TTL_S};
use super::RedisBackend;
use crate::error::BackendError;
use crate::observe::fleet_candidates::Flush;

impl RedisBackend {
    /// Adds one flush in **one** pipelined round trip: `HINCRBY` per field,
    /// `ZINCRBY` per key, each set trimmed to its [`KEEP`] heaviest, and
    /// `EXPIRE` 25 h on each. Every command adds, so instances' flushes
    /// interleave exactly. Single Redis only.
    pub(crate) async fn add_candidates(&self, flush: &Flush) -> Result<(), BackendError> {
        let mut pipe = ::redis::pipe();
        for (hash, fields) in &flush.hashes {
            for (field, n) in fields {
                pipe.cmd("HINCRBY").arg(hash).arg(field).arg(*n).ignore();
            }
            pipe.cmd("EXPIRE").arg(hash).arg(TTL_S).ignore();
        }
        for (set, keys) in &flush.sets {
            for (key, n) in keys {
                pipe.cmd("ZINCRBY").arg(set).arg(*n).arg(key).ignore();
            }
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

    /// The hashes' fields (`HGETALL` of each) and every member of each set
    /// with its score (`ZRANGE 0 -1 WITHSCORES`), in one pipelined call.
    pub(crate) async fn read_candidates(
        &self,
        hashes: &[String],
        sets: &[String],
    ) -> Result<(Vec<Vec<(String, u64)>>, Vec<Vec<(String, u64)>>), BackendError> {
        let mut pipe = ::redis::pipe();
        for h in hashes {
            pipe.cmd("HGETALL").arg(h);
        }
        for s in sets {
            pipe.cmd("ZRANGE").arg(s).arg(0).arg(-1).arg("WITHSCORES");
        }
        let r: Result<Vec<Vec<(String, u64)>>, ::redis::RedisError> =
            pipe.query_async(&mut self.connection().await?).await;
        let mut all = r.map_err(|e| self.error(e))?;
        let sets = all.split_off(hashes.len().min(all.len()));
        Ok((all, sets))
    }
}
