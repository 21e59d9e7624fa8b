//! Per-key demand on Redis (`lua/demand.lua`; see `crate::observe::demand`).

use super::RedisBackend;
use crate::error::BackendError;
use crate::observe::demand::store::RedisAdd;
use crate::observe::demand::{score, MAX_HOUR_KEYS, MAX_NAMES};

fn script() -> &'static ::redis::Script {
    static SCRIPT: std::sync::OnceLock<::redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| ::redis::Script::new(include_str!("../../../lua/demand.lua")))
}

/// One hour as read: peaks, names, requests, unsampled requests, whether
/// its sample was full.
pub(crate) type DemandHour = (Vec<(u64, u64)>, Vec<(u64, String)>, u64, u64, bool);

impl RedisBackend {
    /// Adds one instance's counts of every group taken in a flush (one
    /// script call whatever their number; none for none).
    pub(crate) async fn demand_add(&self, adds: &[RedisAdd]) -> Result<(), BackendError> {
        let Some(first) = adds.first() else {
            return Ok(());
        };
        let script = script();
        let build = |with_source: bool| {
            let mut cmd = super::peek::script_cmd(
                with_source,
                script,
                include_str!("../../../lua/demand.lua"),
            );
            cmd.arg(5 * adds.len());
            for a in adds {
                cmd.arg(&a.period_key);
                for part in ["h", "m", "n", "z"] {
                    cmd.arg(format!("{}:{part}", a.hour_base));
                }
            }
            cmd.arg(first.hour_ttl_s).arg(MAX_HOUR_KEYS).arg(MAX_NAMES);
            for a in adds {
                cmd.arg(a.period_ttl_ms)
                    .arg(a.unsampled)
                    .arg(a.counts.len())
                    .arg(a.names.len());
                for (h, c) in &a.counts {
                    cmd.arg(format!("{h:016x}")).arg(*c).arg(score(*h));
                }
                for (h, n) in &a.names {
                    cmd.arg(format!("{h:016x}")).arg(n);
                }
            }
            cmd
        };
        let mut target = self.target().await?;
        let _: i64 = self
            .call_on(&mut target, &first.period_key, script, build)
            .await
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// One hour of one tier (and plan): `<hour_base>:h`, `:n` and `:m`.
    pub(crate) async fn demand_hour(&self, hour_base: &str) -> Result<DemandHour, BackendError> {
        let hex = |f: &str| u64::from_str_radix(f, 16).ok();
        let read = |key: String| async move {
            let mut cmd = ::redis::cmd("HGETALL");
            cmd.arg(&key);
            self.command_on::<Vec<(String, String)>>(&key, &cmd).await
        };
        let peaks = read(format!("{hour_base}:h"))
            .await?
            .into_iter()
            .filter_map(|(f, v)| Some((hex(&f)?, v.parse().ok()?)))
            .collect();
        let names = read(format!("{hour_base}:n"))
            .await?
            .into_iter()
            .filter_map(|(f, v)| Some((hex(&f)?, v)))
            .collect();
        let mut requests = 0;
        let mut unsampled = 0;
        let mut full = false;
        for (f, v) in read(format!("{hour_base}:m")).await? {
            let v = v.parse().unwrap_or(0);
            match f.as_str() {
                "requests" => requests = v,
                "unsampled" => unsampled = v,
                "full" => full = v > 0,
                _ => {}
            }
        }
        Ok((peaks, names, requests, unsampled, full))
    }
}
