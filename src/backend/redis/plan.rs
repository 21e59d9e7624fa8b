//! A tier's rollout plan in the control hash (`lua/plan.lua`, the plan's
//! one compare-and-set) and its log, a capped stream (`crate::engine::rollout`).

use super::RedisBackend;
use crate::error::BackendError;

/// The plan's compare-and-set (`lua/plan.lua`).
fn plan_script() -> &'static ::redis::Script {
    static SCRIPT: std::sync::OnceLock<::redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| ::redis::Script::new(include_str!("../../../lua/plan.lua")))
}

/// One stream entry: its id and its fields.
pub(crate) type StreamEntry = (String, Vec<(String, String)>);

impl RedisBackend {
    /// Runs `lua/plan.lua` on the control hash `key` with the rollout log
    /// `log` (in the hash's slot) and `args` (its ARGV from ARGV[2] on; the
    /// clock, ARGV[1], is added here). Answers the script's code and the
    /// plan's field as stored.
    pub(crate) async fn plan_step(
        &self,
        key: &str,
        log: &str,
        args: &[String],
    ) -> Result<(i64, String), BackendError> {
        let script = plan_script();
        let clock = self.script_clock();
        let build = |with_source: bool| {
            let mut cmd =
                super::peek::script_cmd(with_source, script, include_str!("../../../lua/plan.lua"));
            cmd.arg(2).arg(key).arg(log).arg(&clock);
            for a in args {
                cmd.arg(a);
            }
            cmd
        };
        let mut target = self.target().await?;
        let (code, field): (i64, Option<String>) = self
            .call_on(&mut target, key, script, build)
            .await
            .map_err(|e| self.error(e))?;
        Ok((code, field.unwrap_or_default()))
    }

    /// The newest `count` entries of the stream `log`, newest first.
    pub(crate) async fn stream_newest(
        &self,
        log: &str,
        count: usize,
    ) -> Result<Vec<StreamEntry>, BackendError> {
        let mut cmd = ::redis::cmd("XREVRANGE");
        cmd.arg(log).arg("+").arg("-").arg("COUNT").arg(count);
        self.command_on(log, &cmd).await
    }
}
