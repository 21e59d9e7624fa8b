//! Fleet-wide settings through the handle: quotas, plan quotas and lists
//! written to the control hash, applied by every instance within one poll
//! interval (see [`crate::handle`], "The fleet-wide control key").

use super::RateLimitHandle;
use crate::engine::{control_hash_key, ControlError, QuotaSetting, Settings};
use crate::quota::Quota;
use crate::rollout::{AccessList, ListEntries, ListKind};

impl RateLimitHandle {
    /// Sets a tier's quota (`plan` `None`) or one of its plans' quota for
    /// the whole fleet: written to the control hash with a new settings
    /// version, applied here at once and by every other instance within one
    /// poll interval (plus the poll's round trip); kept across restarts.
    /// Checked as `build()` checks a quota, against the configured tier
    /// (an unknown tier or plan, a limit of 0, a burst below the cost:
    /// nothing is written). A calendar tier keeps its calendar: only the
    /// limit (and burst) of `quota` count. `by` (who makes the change) is
    /// stored with it and logged at `info` with the new version. Answers
    /// the new settings version.
    ///
    /// # Errors
    /// [`ControlError::NotConfigured`] without a control key on Redis (use
    /// [`set_tier_quota`](Self::set_tier_quota)), [`ControlError::Invalid`]
    /// naming the field, [`ControlError::Malformed`],
    /// [`ControlError::Contended`] or [`ControlError::Backend`].
    pub async fn set_fleet_quota(
        &self,
        tier: &str,
        plan: Option<&str>,
        quota: Quota,
        by: &str,
    ) -> Result<u64, ControlError> {
        let i = self.tier_index(tier)?;
        if control_hash_key(self.shared()).is_none() {
            return Err(ControlError::NotConfigured);
        }
        let setting = crate::engine::setting_of(self.shared(), i, quota);
        self.change_quota(by, tier, plan, Some(setting)).await
    }

    /// Gives a tier (`plan` `None`) or one of its plans its configured quota
    /// back, for the whole fleet (as [`set_fleet_quota`](Self::set_fleet_quota)).
    ///
    /// # Errors
    /// As [`set_fleet_quota`](Self::set_fleet_quota).
    pub async fn reset_fleet_quota(
        &self,
        tier: &str,
        plan: Option<&str>,
        by: &str,
    ) -> Result<u64, ControlError> {
        self.tier_index(tier)?;
        if control_hash_key(self.shared()).is_none() {
            return Err(ControlError::NotConfigured);
        }
        self.change_quota(by, tier, plan, None).await
    }

    /// Replaces the allowlist's networks, API keys and users for the whole
    /// fleet (its API key header and predicates stay as built). Answers the
    /// new settings version.
    ///
    /// # Errors
    /// [`ControlError::Invalid`] for a list with predicates (code cannot be
    /// stored), else as [`set_fleet_quota`](Self::set_fleet_quota).
    pub async fn set_fleet_allowlist(
        &self,
        list: AccessList,
        by: &str,
    ) -> Result<u64, ControlError> {
        self.write_list(by, ListKind::Allow, &list).await
    }

    /// Like [`set_fleet_allowlist`](Self::set_fleet_allowlist), for the
    /// denylist (its status stays as built).
    ///
    /// # Errors
    /// As [`set_fleet_allowlist`](Self::set_fleet_allowlist).
    pub async fn set_fleet_denylist(
        &self,
        list: AccessList,
        by: &str,
    ) -> Result<u64, ControlError> {
        self.write_list(by, ListKind::Deny, &list).await
    }

    /// Adds `add` to and removes `remove` from a list's networks, API keys
    /// and users, for the whole fleet, in one change (IPs as the list
    /// stores them: `203.0.113.7` is `203.0.113.7/32`; removing an absent
    /// entry is no error). Answers the new settings version.
    ///
    /// # Errors
    /// [`ControlError::NotConfigured`] without a control key on Redis,
    /// [`ControlError::Invalid`] naming the entry (`add.ips[0]`), else as
    /// [`set_fleet_quota`](Self::set_fleet_quota).
    pub async fn change_fleet_list(
        &self,
        list: ListKind,
        add: &ListEntries,
        remove: &ListEntries,
        by: &str,
    ) -> Result<u64, ControlError> {
        if control_hash_key(self.shared()).is_none() {
            return Err(ControlError::NotConfigured);
        }
        self.change_entries(by, list, add, remove).await
    }

    /// The fleet-wide settings version this instance applies: 0 for the
    /// configured settings (also without a control key), else the version
    /// the control hash had when this instance last read it. Also the gauge
    /// `tiered_ratelimit_settings_version`.
    pub fn settings_version(&self) -> u64 {
        self.shared().live.fleet.applied.load().version
    }

    /// Waits until this instance has read the fleet-wide settings once
    /// (its first poll of the control hash, bounded by the poll's timeout),
    /// then answers [`settings_version`](Self::settings_version). Await it
    /// before serving, so that a starting instance never answers with the
    /// configured quotas what the fleet has changed. Answers at once
    /// without a control key on Redis. Needs the layer to be built inside
    /// a Tokio runtime (where its watcher starts).
    pub async fn ready(&self) -> u64 {
        let shared = self.shared();
        if control_hash_key(shared).is_some() && shared.live.control_started.get().is_some() {
            shared.live.fleet.ready().await;
        }
        self.settings_version()
    }

    /// The allowlist's entries in force (configured, or the fleet-wide
    /// settings'); empty on a front door without lists.
    pub fn allowlist_entries(&self) -> ListEntries {
        self.lists
            .as_ref()
            .map_or_else(ListEntries::default, |l| l.load().allow.entries())
    }

    /// The denylist's entries in force, as [`allowlist_entries`](Self::allowlist_entries).
    pub fn denylist_entries(&self) -> ListEntries {
        self.lists
            .as_ref()
            .map_or_else(ListEntries::default, |l| l.load().deny.entries())
    }

    fn tier_index(&self, tier: &str) -> Result<usize, ControlError> {
        self.shared()
            .config
            .tier_index(tier)
            .map_err(|e| ControlError::Invalid {
                field: "tier".to_owned(),
                reason: e.to_string(),
            })
    }

    /// Sets a tier's or plan's quota written as the policy file writes it
    /// (`None`: back to the configured one), checked as `build()` would:
    /// with a control key on Redis for the whole fleet (answers the new
    /// version), else in this process (answers 0). An unknown plan is
    /// refused either way.
    pub(crate) async fn change_quota(
        &self,
        by: &str,
        tier: &str,
        plan: Option<&str>,
        setting: Option<QuotaSetting>,
    ) -> Result<u64, ControlError> {
        let i = self.tier_index(tier)?;
        let shared = self.shared();
        let configured = &shared.config.configured.tiers[i];
        let configured_plan =
            match plan {
                None => None,
                Some(p) => Some(configured.plans.iter().find(|c| &*c.name == p).ok_or_else(
                    || ControlError::Invalid {
                        field: "plan".to_owned(),
                        reason: format!("tier \"{tier}\" has no plan \"{p}\""),
                    },
                )?),
            };
        let quota = setting
            .as_ref()
            .map(|s| crate::engine::quota_of(shared, i, s))
            .transpose()?;
        let quota = quota.unwrap_or_else(|| configured_plan.map_or(configured.quota, |p| p.quota));
        let set = |runtime: &mut crate::engine::Runtime| {
            match plan {
                None => crate::engine::set_tier_quota(shared, runtime, i, quota),
                Some(p) => crate::engine::set_plan_quota(shared, runtime, i, p, quota),
            }
            .map_err(|e| ControlError::from(crate::engine::Invalid::of(&e)))
        };
        // Checked here first, so that a refusal names the request's field.
        set(&mut crate::engine::Runtime::clone(
            &shared.live.runtime.load(),
        ))?;
        if control_hash_key(shared).is_some() {
            return self.write_quota(by, tier, plan, setting).await;
        }
        // In this process: the handle's own update (its lock, the swap, the
        // deny cache dropped).
        self.update(|c| {
            match plan {
                None => c.tier_quota(tier, quota),
                Some(p) => c.plan_quota(tier, p, quota),
            }
            .map(|_| ())
        })
        .map_err(|e| ControlError::from(crate::engine::Invalid::of(&e)))?;
        tracing::info!(target: crate::engine::CONTROL_LOG_TARGET, tier, plan, by, "quota changed in this process (no fleet-wide control key)");
        Ok(0)
    }

    /// Writes a tier's or plan's quota (`None`: back to the configured one).
    async fn write_quota(
        &self,
        by: &str,
        tier: &str,
        plan: Option<&str>,
        setting: Option<QuotaSetting>,
    ) -> Result<u64, ControlError> {
        self.tier_index(tier)?;
        crate::engine::write_settings(self.shared(), by, |doc: &mut Settings| {
            let entry = doc.tiers.entry(tier.to_owned()).or_default();
            match (plan, &setting) {
                (None, s) => entry.quota.clone_from(s),
                (Some(p), Some(s)) => {
                    entry.plans.insert(p.to_owned(), s.clone());
                }
                (Some(p), None) => {
                    entry.plans.remove(p);
                }
            }
            if entry.quota.is_none() && entry.plans.is_empty() {
                doc.tiers.remove(tier);
            }
            Ok(())
        })
        .await
    }

    /// Writes a list's entries.
    async fn write_list(
        &self,
        by: &str,
        name: ListKind,
        list: &AccessList,
    ) -> Result<u64, ControlError> {
        if list.has_predicates() {
            return Err(ControlError::Invalid {
                field: "predicate".to_owned(),
                reason: "a list with predicates cannot be stored: predicates are code".to_owned(),
            });
        }
        self.write_entries(by, name, list.entries()).await
    }

    /// Writes a list's entries (sorted, duplicates dropped).
    async fn write_entries(
        &self,
        by: &str,
        name: ListKind,
        entries: ListEntries,
    ) -> Result<u64, ControlError> {
        let entries = entries.normalized();
        crate::engine::write_settings(self.shared(), by, |doc: &mut Settings| {
            match name {
                ListKind::Allow => doc.allow = Some(entries.clone()),
                ListKind::Deny => doc.deny = Some(entries.clone()),
            }
            Ok(())
        })
        .await
    }

    /// Adds `add` to and removes `remove` from a list's entries (IPs
    /// normalised as the list stores them; removing an absent entry is not
    /// an error): with a control key on Redis for the whole fleet (answers
    /// the new version), else in this process (answers 0).
    pub(crate) async fn change_entries(
        &self,
        by: &str,
        name: ListKind,
        add: &ListEntries,
        remove: &ListEntries,
    ) -> Result<u64, ControlError> {
        let add = normalized_ips(add, "add")?;
        let remove = normalized_ips(remove, "remove")?;
        let edit = |base: ListEntries| -> ListEntries {
            let mut e = base;
            e.ips.extend(add.ips.iter().cloned());
            e.api_keys.extend(add.api_keys.iter().cloned());
            e.users.extend(add.users.iter().cloned());
            e.ips.retain(|x| !remove.ips.contains(x));
            e.api_keys.retain(|x| !remove.api_keys.contains(x));
            e.users.retain(|x| !remove.users.contains(x));
            e.normalized()
        };
        let shared = self.shared();
        let Some((_, configured)) = shared.live.fleet.lists.get() else {
            return Err(ControlError::Invalid {
                field: "list".to_owned(),
                reason: "this front door has no allow- or denylist".to_owned(),
            });
        };
        if control_hash_key(shared).is_none() {
            let current = match name {
                ListKind::Allow => self.allowlist_entries(),
                ListKind::Deny => self.denylist_entries(),
            };
            let base = match name {
                ListKind::Allow => &configured.allow,
                ListKind::Deny => &configured.deny,
            };
            let list = base
                .with_entries(&edit(current))
                .map_err(|(field, reason)| ControlError::Invalid { field, reason })?;
            self.update(|c| {
                match name {
                    ListKind::Allow => c.allowlist(list.clone()),
                    ListKind::Deny => c.denylist(list.clone()),
                }
                .map(|_| ())
            })
            .map_err(|e| ControlError::from(crate::engine::Invalid::of(&e)))?;
            return Ok(0);
        }
        let (allow, deny) = (configured.allow.entries(), configured.deny.entries());
        crate::engine::write_settings(shared, by, |doc: &mut Settings| {
            match name {
                ListKind::Allow => {
                    doc.allow = Some(edit(doc.allow.clone().unwrap_or_else(|| allow.clone())))
                }
                ListKind::Deny => {
                    doc.deny = Some(edit(doc.deny.clone().unwrap_or_else(|| deny.clone())))
                }
            }
            Ok(())
        })
        .await
    }
}

/// `entries` with each IP written as the list stores it (`203.0.113.7` is
/// `203.0.113.7/32`); the error names the entry (`add.ips[2]`).
fn normalized_ips(entries: &ListEntries, what: &str) -> Result<ListEntries, ControlError> {
    let parsed = AccessList::new()
        .with_entries(&ListEntries {
            ips: entries.ips.clone(),
            ..ListEntries::default()
        })
        .map_err(|(field, reason)| ControlError::Invalid {
            field: format!("{what}.{field}"),
            reason,
        })?;
    let mut out = entries.clone();
    out.ips = parsed.entries().ips;
    Ok(out)
}
