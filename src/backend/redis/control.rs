//! Reading and writing the fleet-wide control hash (see `crate::handle`).

use super::RedisBackend;
use crate::error::BackendError;

impl RedisBackend {
    /// `HGETALL key` on the node that holds it.
    pub(crate) async fn hgetall(&self, key: &str) -> Result<Vec<(String, String)>, BackendError> {
        let mut cmd = ::redis::cmd("HGETALL");
        cmd.arg(key);
        let err = BackendError::connection;
        if self.is_cluster() {
            let via = self.cluster_via().await?;
            return super::cluster::command(&via, key, &cmd).await.map_err(err);
        }
        cmd.query_async(&mut self.connection().await?)
            .await
            .map_err(|e| self.error(e))
    }

    /// `HSET key field value` on the node that holds it.
    pub(crate) async fn hset(
        &self,
        key: &str,
        field: &str,
        value: &str,
    ) -> Result<(), BackendError> {
        let mut cmd = ::redis::cmd("HSET");
        cmd.arg(key).arg(field).arg(value);
        let err = BackendError::connection;
        if self.is_cluster() {
            let via = self.cluster_via().await?;
            return super::cluster::command::<i64>(&via, key, &cmd)
                .await
                .map(drop)
                .map_err(err);
        }
        cmd.query_async::<i64>(&mut self.connection().await?)
            .await
            .map(drop)
            .map_err(|e| self.error(e))
    }

    /// `HINCRBY key field by` on the node that holds it; the new value.
    pub(crate) async fn hincrby(
        &self,
        key: &str,
        field: &str,
        by: i64,
    ) -> Result<i64, BackendError> {
        let mut cmd = ::redis::cmd("HINCRBY");
        cmd.arg(key).arg(field).arg(by);
        if self.is_cluster() {
            let via = self.cluster_via().await?;
            return super::cluster::command::<i64>(&via, key, &cmd)
                .await
                .map_err(BackendError::connection);
        }
        cmd.query_async(&mut self.connection().await?)
            .await
            .map_err(|e| self.error(e))
    }
}

/// The settings' compare-and-set (`lua/settings.lua`).
fn settings_script() -> &'static ::redis::Script {
    static SCRIPT: std::sync::OnceLock<::redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| ::redis::Script::new(include_str!("../../../lua/settings.lua")))
}

impl RedisBackend {
    /// Writes the fleet-wide settings `document` (`""`: none) to the control
    /// hash `key` if its `settings_version` is still `read`: `Ok(Ok(new
    /// version))`, or `Ok(Err(found))` when another write came first
    /// (`found` is `None` when the stored version is not a number).
    pub(crate) async fn write_settings(
        &self,
        key: &str,
        read: u64,
        document: &str,
    ) -> Result<Result<u64, Option<u64>>, BackendError> {
        let script = settings_script();
        let build = |with_source: bool| {
            let mut cmd = super::peek::script_cmd(
                with_source,
                script,
                include_str!("../../../lua/settings.lua"),
            );
            cmd.arg(1).arg(key).arg(read).arg(document);
            cmd
        };
        let mut target = self.target().await?;
        let answer: i64 = self
            .call_on(&mut target, key, script, build)
            .await
            .map_err(|e| self.error(e))?;
        Ok(match answer {
            v if v > 0 => Ok(v.unsigned_abs()),
            -1 => Err(None),
            v => Err(Some((-1 - v).unsigned_abs())),
        })
    }
}
