//! A tier's fall back guard in Redis (`lua/guard.lua`): an instance's
//! flush of its counts, the guard's lease and the read of the bucket being
//! judged, in one call (`crate::engine::rollout`'s guard).

use super::RedisBackend;
use crate::error::BackendError;

/// `lua/guard.lua`.
fn guard_script() -> &'static ::redis::Script {
    static SCRIPT: std::sync::OnceLock<::redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| ::redis::Script::new(include_str!("../../../lua/guard.lua")))
}

impl RedisBackend {
    /// Runs `lua/guard.lua` on `keys` (the bucket added to, the bucket
    /// read, the lease: one hash slot) with `args` (its ARGV). Answers
    /// whether this instance holds the lease, and the read bucket's fields.
    pub(crate) async fn guard_flush(
        &self,
        keys: [&str; 3],
        args: &[String],
    ) -> Result<(bool, Vec<(String, String)>), BackendError> {
        let script = guard_script();
        let build = |with_source: bool| {
            let mut cmd = if with_source {
                let mut c = ::redis::cmd("EVAL");
                c.arg(include_str!("../../../lua/guard.lua"));
                c
            } else {
                let mut c = ::redis::cmd("EVALSHA");
                c.arg(script.get_hash());
                c
            };
            cmd.arg(3).arg(keys[0]).arg(keys[1]).arg(keys[2]);
            for a in args {
                cmd.arg(a);
            }
            cmd
        };
        let mut target = self.target().await?;
        let (lead, fields): (i64, Vec<(String, String)>) = self
            .call_on(&mut target, keys[0], script, build)
            .await
            .map_err(|e| self.error(e))?;
        Ok((lead == 1, fields))
    }
}

/// `lua/stage.lua`.
fn stage_script() -> &'static ::redis::Script {
    static SCRIPT: std::sync::OnceLock<::redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| ::redis::Script::new(include_str!("../../../lua/stage.lua")))
}

impl RedisBackend {
    /// Runs `lua/stage.lua` on `keys` (the stage's totals, its map of
    /// keys, this instance's scratch key: one hash slot): adds `requests`
    /// and `enforced`, ORs `map` (empty: unchanged) in. Answers the stage's
    /// fleet-wide checks, enforced checks and bits set in its map.
    pub(crate) async fn stage_flush(
        &self,
        keys: [&str; 3],
        requests: u64,
        enforced: u64,
        map: &[u8],
        ttl_s: u64,
    ) -> Result<(u64, u64, u64), BackendError> {
        let script = stage_script();
        let build = |with_source: bool| {
            let mut cmd = if with_source {
                let mut c = ::redis::cmd("EVAL");
                c.arg(include_str!("../../../lua/stage.lua"));
                c
            } else {
                let mut c = ::redis::cmd("EVALSHA");
                c.arg(script.get_hash());
                c
            };
            cmd.arg(3)
                .arg(keys[0])
                .arg(keys[1])
                .arg(keys[2])
                .arg(requests)
                .arg(enforced)
                .arg(map)
                .arg(ttl_s);
            cmd
        };
        let mut target = self.target().await?;
        self.call_on(&mut target, keys[0], script, build)
            .await
            .map_err(|e| self.error(e))
    }
}
