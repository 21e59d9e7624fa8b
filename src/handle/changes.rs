//! [`Changes`]: a set of changes to a running layer, applied together by
//! [`RateLimitHandle::update`] (a request sees all of them or none).

use super::RateLimitHandle;
use crate::engine::{checked_limit, fallback_limit, PlanRuntime, Runtime, Shared};
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::rollout::{AccessList, Lists, Mode};
use std::fmt;
use std::sync::Arc;

/// Serializes [`RateLimitHandle::update`]s: the engine's settings and the
/// front door's lists are two cells, written together under it. Updates are
/// rare operator actions; requests never take it.
static UPDATES: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
        let i = self.shared.config.tier_index(tier)?;
        let t = &self.shared.config.tiers[i];
        let limit = checked_limit(tier, t.algorithm, quota, t.cost)?;
        let fallback = fallback_limit(
            tier,
            t.algorithm,
            quota,
            t.cost,
            self.shared.config.fallback_instances,
        )?;
        let rt = &mut self.runtime.tiers[i];
        rt.quota = quota;
        rt.limit = limit;
        rt.fallback = fallback;
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
        let i = self.shared.config.tier_index(tier)?;
        let t = &self.shared.config.tiers[i];
        let entry = PlanRuntime {
            name: Arc::from(plan),
            quota,
            limit: checked_limit(tier, t.algorithm, quota, t.cost)?,
            fallback: fallback_limit(
                tier,
                t.algorithm,
                quota,
                t.cost,
                self.shared.config.fallback_instances,
            )?,
        };
        let plans = &mut self.runtime.tiers[i].plans;
        match plans.iter_mut().find(|p| &*p.name == plan) {
            Some(existing) => *existing = entry,
            None => plans.push(entry),
        }
        Ok(self)
    }

    /// Replaces the allowlist (a no-op on a front door without lists).
    pub fn allowlist(&mut self, list: AccessList) -> &mut Self {
        if let Some(lists) = self.lists.as_deref_mut() {
            lists.allow = Arc::new(list);
        }
        self
    }

    /// Replaces the denylist (its status stays as built; a no-op on a
    /// front door without lists).
    pub fn denylist(&mut self, list: AccessList) -> &mut Self {
        if let Some(lists) = self.lists.as_deref_mut() {
            lists.deny = Arc::new(list);
        }
        self
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
        self.shared.live.runtime.store(Arc::new(runtime));
        // Cached denials were decided under the old settings.
        self.shared.guards.deny_cache.clear();
        self.shared.refresh_mode_gauges();
        Ok(())
    }
}
