//! [`Changes`]: a set of changes to a running layer, applied together by
//! [`RateLimitHandle::update`] (a request sees all of them or none).

use super::RateLimitHandle;
use crate::engine::{Runtime, Shared, UPDATES};
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::rollout::{AccessList, Lists, Mode};
use std::fmt;
use std::sync::Arc;

/// A set of changes applied together by [`RateLimitHandle::update`].
pub struct Changes<'a> {
    runtime: &'a mut Runtime,
    lists: Option<&'a mut Lists>,
    shared: &'a Shared,
}

impl fmt::Debug for Changes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Changes")
            .field("mode", &self.runtime.mode)
            .finish_non_exhaustive()
    }
}

impl Changes<'_> {
    /// Sets the global mode.
    pub fn mode(&mut self, mode: Mode) -> &mut Self {
        self.runtime.mode = mode;
        self
    }

    /// Sets a tier's mode.
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`].
    pub fn tier_mode(&mut self, tier: &str, mode: Mode) -> Result<&mut Self, ConfigError> {
        let i = self.shared.config.tier_index(tier)?;
        self.runtime.tiers[i].mode = mode;
        Ok(self)
    }

    /// Sets a tier's default quota (checked like at build time).
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`] or any quota error.
    pub fn tier_quota(&mut self, tier: &str, quota: Quota) -> Result<&mut Self, ConfigError> {
        self.local("tier_quota", "set_fleet_quota")?;
        let i = self.shared.config.tier_index(tier)?;
        crate::engine::set_tier_quota(self.shared, self.runtime, i, quota)?;
        Ok(self)
    }

    /// Sets (or adds) a plan's quota on a tier.
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`] or any quota error.
    pub fn plan_quota(
        &mut self,
        tier: &str,
        plan: &str,
        quota: Quota,
    ) -> Result<&mut Self, ConfigError> {
        self.local("plan_quota", "set_fleet_quota")?;
        let i = self.shared.config.tier_index(tier)?;
        crate::engine::set_plan_quota(self.shared, self.runtime, i, plan, quota)?;
        Ok(self)
    }

    /// Replaces the allowlist (a no-op on a front door without lists).
    ///
    /// # Errors
    /// [`ConfigError::FleetWide`] with a fleet-wide control key.
    pub fn allowlist(&mut self, list: AccessList) -> Result<&mut Self, ConfigError> {
        self.local("allowlist", "set_fleet_allowlist")?;
        if let Some(lists) = self.lists.as_deref_mut() {
            lists.allow = Arc::new(list);
        }
        Ok(self)
    }

    /// Replaces the denylist (its status stays as built; a no-op on a
    /// front door without lists).
    ///
    /// # Errors
    /// [`ConfigError::FleetWide`] with a fleet-wide control key.
    pub fn denylist(&mut self, list: AccessList) -> Result<&mut Self, ConfigError> {
        self.local("denylist", "set_fleet_denylist")?;
        if let Some(lists) = self.lists.as_deref_mut() {
            lists.deny = Arc::new(list);
        }
        Ok(self)
    }

    /// Refuses a change of a quota or a list where they are fleet-wide
    /// settings (a control key on a Redis backend).
    fn local(&self, setter: &'static str, instead: &'static str) -> Result<(), ConfigError> {
        if crate::engine::control_hash_key(self.shared).is_some() {
            return Err(ConfigError::FleetWide { setter, instead });
        }
        Ok(())
    }
}

impl RateLimitHandle {
    /// Applies several changes at once: a request sees all of them or none.
    /// If `f` returns an error nothing is applied.
    ///
    /// # Errors
    /// Whatever `f` returns.
    pub fn update<F>(&self, f: F) -> Result<(), ConfigError>
    where
        F: Fn(&mut Changes<'_>) -> Result<(), ConfigError>,
    {
        // A poisoned lock only means another update panicked in `f`; the
        // cells it guards were not written then.
        let _serial = UPDATES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut runtime = Runtime::clone(&self.shared.live.runtime.load());
        let mut lists = self.lists.as_ref().map(|l| Lists::clone(&l.load()));
        f(&mut Changes {
            runtime: &mut runtime,
            lists: lists.as_mut(),
            shared: &self.shared,
        })?;
        if let (Some(cell), Some(lists)) = (&self.lists, lists) {
            cell.store(lists);
        }
        let runtime = runtime.with_homes(&self.shared.config.configured);
        self.shared.live.runtime.store(Arc::new(runtime));
        // Cached denials were decided under the old settings.
        self.shared.guards.deny_cache.clear();
        self.shared.refresh_mode_gauges();
        Ok(())
    }
}
