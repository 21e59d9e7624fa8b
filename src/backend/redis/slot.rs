//! Concurrency slots on Redis: a request's release (`ZREM`) and the
//! renewal of a long request's slot (`lua/slot.lua`).

use super::wire::SLOT_LUA;
use super::RedisBackend;
use crate::algorithm::Concurrency;
use crate::error::BackendError;
use ::redis::{Cmd, Script};
use std::sync::OnceLock;

fn script() -> &'static Script {
    static SCRIPT: OnceLock<Script> = OnceLock::new();
    SCRIPT.get_or_init(|| Script::new(SLOT_LUA))
}

impl RedisBackend {
    /// Takes slot `id` out of `key`'s sorted set.
    pub(crate) async fn release(&self, key: &str, id: u64) -> Result<(), BackendError> {
        let key = self.storage_key(key);
        let mut cmd = ::redis::cmd("ZREM");
        cmd.arg(&key).arg(id);
        self.command_on::<i64>(&key, &cmd).await.map(|_| ())
    }

    /// Renews slot `c.slot` of `key` for `c.ttl_us` from now (Redis's
    /// clock, or the test clock); false when it is no longer held.
    pub(crate) async fn renew(&self, key: &str, c: &Concurrency) -> Result<bool, BackendError> {
        let key = self.storage_key(key);
        let clock = self.clock_arg();
        let build = |eval: bool| -> Cmd {
            let mut cmd = super::peek::script_cmd(eval, script(), SLOT_LUA);
            cmd.arg(1)
                .arg(key.as_str())
                .arg(clock.as_bytes())
                .arg(c.slot)
                .arg(c.ttl_us);
            cmd
        };
        let mut target = self.target().await?;
        let r: i64 = self
            .call_on(&mut target, &key, script(), build)
            .await
            .map_err(|e| self.error(e))?;
        Ok(r == 1)
    }
}
