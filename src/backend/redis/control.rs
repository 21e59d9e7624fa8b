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
