//! A control-key poll's rollout work in one call (`lua/poll.lua`, with
//! `lua/stage.lua`, `lua/guard.lua` and `lua/plan.lua` as its functions):
//! an instance's stage counts, its guard counts and the guard's lease, the
//! plan's steps, and the read of the control hash (`crate::engine::rollout`'s
//! poll).

use super::RedisBackend;
use crate::error::BackendError;

/// One part of a poll's call (see `lua/poll.lua` for the kinds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PollPart {
    /// `stage`, `guard`, `plan` or `gated`.
    pub(crate) kind: &'static str,
    pub(crate) tier: String,
    /// Its keys (in the control hash's slot).
    pub(crate) keys: Vec<String>,
    /// Its arguments (bytes: a stage's map of keys is binary).
    pub(crate) args: Vec<Vec<u8>>,
}

/// The poll's source: the three scripts as local functions, then
/// `lua/poll.lua`.
pub(crate) fn poll_source() -> &'static str {
    static SOURCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SOURCE.get_or_init(|| {
        let part =
            |name: &str, body: &str| format!("local function {name}(KEYS, ARGV)\n{body}\nend\n");
        [
            part("stage_part", include_str!("../../../lua/stage.lua")),
            part("guard_part", include_str!("../../../lua/guard.lua")),
            part("plan_part", include_str!("../../../lua/plan.lua")),
            include_str!("../../../lua/poll.lua").to_owned(),
        ]
        .concat()
    })
}

fn poll_script() -> &'static ::redis::Script {
    static SCRIPT: std::sync::OnceLock<::redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| ::redis::Script::new(poll_source()))
}

/// The poll's answer: each part's answer, in order, and the control hash's
/// fields.
pub(crate) type PollAnswer = (Vec<::redis::Value>, Vec<(String, String)>);

impl RedisBackend {
    /// Runs `parts` and reads the control hash `key` in one call
    /// (`lua/poll.lua`; `log`: the rollout log, in the hash's slot).
    pub(crate) async fn poll(
        &self,
        key: &str,
        log: &str,
        parts: &[PollPart],
    ) -> Result<PollAnswer, BackendError> {
        let script = poll_script();
        let clock = self.script_clock();
        let build = |with_source: bool| {
            let mut cmd = super::peek::script_cmd(with_source, script, poll_source());
            let nkeys: usize = parts.iter().map(|p| p.keys.len()).sum();
            cmd.arg(2 + nkeys).arg(key).arg(log);
            for p in parts {
                for k in &p.keys {
                    cmd.arg(k);
                }
            }
            cmd.arg(&clock).arg(parts.len());
            for p in parts {
                cmd.arg(p.kind)
                    .arg(&p.tier)
                    .arg(p.keys.len())
                    .arg(p.args.len());
                for a in &p.args {
                    cmd.arg(a);
                }
            }
            cmd
        };
        let mut target = self.target().await?;
        let mut answers: Vec<::redis::Value> = self
            .call_on(&mut target, key, script, build)
            .await
            .map_err(|e| self.error(e))?;
        let fields = match answers.pop() {
            Some(v) => ::redis::from_redis_value(v).map_err(|e| self.error(e.into()))?,
            None => Vec::new(),
        };
        Ok((answers, fields))
    }
}
