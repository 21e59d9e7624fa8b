//! Per-key overrides in Redis ([`handle`](crate::handle#per-key-overrides)): the override's value
//! under `<tier key>{ov}` (read by the check script of a tier that takes
//! overrides, in its `MGET`), and the tier's listing, a hash
//! `<prefix>:<tier>:{ov}` of key part → `<until µs> <rule>`. Plain commands;
//! on a cluster each to its key's slot.

use super::RedisBackend;
use crate::backend::override_rule::Active;
use crate::error::BackendError;

impl RedisBackend {
    /// Stores `active` under `key` (expiring `ttl_ms` after now when set,
    /// for garbage collection: the value's own expiry decides), and its
    /// listing `field` → `listing` in the hash `index`.
    pub(crate) async fn set_override(
        &self,
        key: &str,
        active: Active,
        ttl_ms: Option<u64>,
        index: &str,
        field: &str,
        listing: &str,
    ) -> Result<(), BackendError> {
        let key = self.storage_key(key);
        let mut set = ::redis::cmd("SET");
        set.arg(&key).arg(active.redis_value());
        if let Some(ms) = ttl_ms {
            set.arg("PX").arg(ms);
        }
        let () = self.command_on(&key, &set).await?;
        let index = self.storage_key(index);
        let _: i64 = self
            .command_on(
                &index,
                ::redis::cmd("HSET").arg(&index).arg(field).arg(listing),
            )
            .await?;
        Ok(())
    }

    /// Deletes the override under `key` (`GETDEL`, Redis ≥ 6.2) and its
    /// listing: its expiry (Unix epoch µs, 0 for none), if there was one.
    pub(crate) async fn remove_override(
        &self,
        key: &str,
        index: &str,
        field: &str,
    ) -> Result<Option<u64>, BackendError> {
        let key = self.storage_key(key);
        let old: Option<String> = self
            .command_on(&key, ::redis::cmd("GETDEL").arg(&key))
            .await?;
        let index = self.storage_key(index);
        let _: i64 = self
            .command_on(&index, ::redis::cmd("HDEL").arg(&index).arg(field))
            .await?;
        // The value's first number is its expiry.
        Ok(old.and_then(|v| v.split(' ').next().and_then(|u| u.parse().ok())))
    }

    /// The listing hash `index`: key part → `<until µs> <rule>`.
    pub(crate) async fn list_overrides(
        &self,
        index: &str,
    ) -> Result<Vec<(String, String)>, BackendError> {
        let index = self.storage_key(index);
        self.command_on(&index, ::redis::cmd("HGETALL").arg(&index))
            .await
    }
}
