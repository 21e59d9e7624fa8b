//! Fleet-wide settings: the quotas, plan quotas and lists an operator
//! changes at run time, kept beside the control hash's modes so that every
//! instance applies the same ones (see [`crate::handle`], "The fleet-wide control key").
//!
//! Two fields of the control hash, always written together by one script
//! (`lua/settings.lua`, a compare-and-set on the version):
//!
//! - `settings_version`: a whole number, incremented by every change
//!   (absent: 0, the configured settings);
//! - `settings`: a JSON document ([`Settings`]) of what differs from the
//!   configured settings: per tier its quota and plan quotas, and the
//!   allow- and denylist's entries.
//!
//! ```text
//! {"tiers":{"user":{"quota":{"limit":200,"period":"1m"},
//!                   "plans":{"pro":{"limit":2000,"period":"1m","burst":3000}}}},
//!  "allow":{"ips":["203.0.113.0/24"],"users":["ops-bot"]},
//!  "by":"admin"}
//! ```
//!
//! The watcher reads both with the modes (the same `HGETALL`, no extra
//! command) and, when they changed, checks the whole document as
//! `build()` would and swaps it in at once (a request sees all of a change
//! or none of it); a document it refuses is logged at `error` and ignored,
//! and the instance keeps its last good settings. What the document does
//! not name is the configured value, so removing an entry (or the fields)
//! goes back to it.

use super::limits::{checked_limit, fallback_limit};
use super::runtime::{PlanRuntime, Runtime};
use super::state::Shared;
use super::watch::ControlError;
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::rollout::{AccessLists, ListEntries, Lists};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod write;

pub(crate) use write::write;

/// The control hash's field holding the settings document.
pub(crate) const SETTINGS: &str = "settings";
/// The control hash's field holding the settings' version.
pub(crate) const SETTINGS_VERSION: &str = "settings_version";

/// Serializes every change of the engine's live settings (a handle's
/// update, an applied settings document): they copy the settings, change
/// the copy and store it, so two at once would lose one. Changes are rare
/// operator actions; requests never take it.
pub(crate) static UPDATES: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The settings document (field `settings`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Settings {
    /// Per tier name: what differs from its configured quotas.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) tiers: BTreeMap<String, TierSettings>,
    /// The allowlist's entries (absent: the configured ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) allow: Option<ListEntries>,
    /// The denylist's entries (absent: the configured ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) deny: Option<ListEntries>,
    /// Who made the last change (`admin`, `handle`, `cli`, or a name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) by: Option<String>,
}

impl Settings {
    /// Whether it changes nothing (stored as no document).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(super) fn is_empty(&self) -> bool {
        self.tiers.is_empty() && self.allow.is_none() && self.deny.is_none()
    }
}

/// One tier's entry of the document.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TierSettings {
    /// Its default quota (absent: the configured one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) quota: Option<QuotaSetting>,
    /// Plan quotas that differ from the configured ones, by plan name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) plans: BTreeMap<String, QuotaSetting>,
}

/// A quota as the policy file writes it: `limit`, `period` (a duration,
/// `"1m"`, or for a calendar tier its calendar period, `"month"`) and an
/// optional `burst`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QuotaSetting {
    pub(crate) limit: u64,
    pub(crate) period: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) burst: Option<u64>,
}

/// A change refused: the field (`limit`, `period`, `burst`, `tier`,
/// `plan`, `ips[2]`…) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Invalid {
    pub(crate) field: String,
    pub(crate) reason: String,
}

impl Invalid {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The same, under `prefix` (`tiers.user.plans.pro.` + `burst`).
    fn under(mut self, prefix: &str) -> Self {
        self.field = format!("{prefix}{}", self.field);
        self
    }

    /// A quota error of `build()`, under the field it names.
    pub(crate) fn of(e: &ConfigError) -> Self {
        let field = match e {
            ConfigError::UnknownTier(_) => "tier",
            ConfigError::ZeroLimit { .. } => "limit",
            ConfigError::ZeroPeriod { .. } => "period",
            ConfigError::BurstBelowCost { .. } | ConfigError::BurstNotSupported { .. } => "burst",
            ConfigError::QuotaTooLarge { field, .. } => field,
            _ => "quota",
        };
        Self::new(field, e.to_string())
    }
}

impl From<Invalid> for ControlError {
    fn from(i: Invalid) -> Self {
        ControlError::Invalid {
            field: i.field,
            reason: i.reason,
        }
    }
}

/// The settings an instance applies: their version (0: the configured
/// ones) and the fields they were read from (to skip an unchanged read).
#[derive(Debug, Default)]
pub(crate) struct Applied {
    pub(crate) version: u64,
    /// The `settings` field as read (`None`: absent).
    raw: Option<String>,
}

/// The engine's fleet-wide settings state (in [`Live`](super::state::Live)).
#[derive(Default)]
pub(crate) struct FleetSettings {
    pub(crate) applied: arc_swap::ArcSwap<Applied>,
    /// The front door's lists and their configured value, registered by a
    /// front door that has lists (the HTTP layer).
    pub(crate) lists: std::sync::OnceLock<(Arc<AccessLists>, Lists)>,
    /// Set once the first read of the control hash was tried.
    first_read: AtomicBool,
    first_read_done: tokio::sync::Notify,
}

impl FleetSettings {
    /// Marks the first read tried and wakes [`ready`](Self::ready)'s waiters.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn mark_read(&self) {
        if !self.first_read.swap(true, Ordering::AcqRel) {
            self.first_read_done.notify_waiters();
        }
    }

    /// Whether the first read of the control hash was tried.
    pub(crate) fn is_read(&self) -> bool {
        self.first_read.load(Ordering::Acquire)
    }

    /// Waits until the first read of the control hash was tried.
    pub(crate) async fn ready(&self) {
        loop {
            let notified = self.first_read_done.notified();
            if self.first_read.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }
}

/// The quota `q` means for tier `i`: its period parsed (a calendar tier
/// takes its own calendar period and counts over its calendar window).
pub(crate) fn quota_of(shared: &Shared, i: usize, q: &QuotaSetting) -> Result<Quota, Invalid> {
    let t = &shared.config.tiers[i];
    let configured = shared.config.configured.tiers[i].quota;
    let calendar = t.calendar.as_ref().map(|c| c.calendar.period().name());
    let period = match (calendar, crate::algorithm::CalendarPeriod::from_name(&q.period)) {
        (Some(own), Some(p)) if p.name() == own => configured.period(),
        (Some(own), _) => {
            return Err(Invalid::new(
                "period",
                format!(
                    "tier \"{}\" is a calendar quota: its period is \"{own}\" (only the limit and burst change at run time)",
                    t.name
                ),
            ))
        }
        (None, Some(p)) => {
            return Err(Invalid::new(
                "period",
                format!(
                    "\"{}\" is a calendar period, and tier \"{}\" is not a calendar quota: give a duration (\"1m\")",
                    p.name(),
                    t.name
                ),
            ))
        }
        (None, None) => humantime::parse_duration(&q.period).map_err(|e| {
            Invalid::new(
                "period",
                format!("invalid period {:?}: {e}; expected a duration such as \"1m\"", q.period),
            )
        })?,
    };
    let quota = Quota::new(q.limit, period);
    Ok(match q.burst {
        Some(b) => quota.burst(b),
        None => quota,
    })
}

/// `quota` as the document writes it for tier `i`.
pub(crate) fn setting_of(shared: &Shared, i: usize, quota: Quota) -> QuotaSetting {
    let t = &shared.config.tiers[i];
    let period = match &t.calendar {
        Some(c) => c.calendar.period().name().to_owned(),
        None => humantime::format_duration(quota.period()).to_string(),
    };
    QuotaSetting {
        limit: quota.limit(),
        period,
        burst: (quota.burst_size() != quota.limit()).then_some(quota.burst_size()),
    }
}

/// `runtime` with tier `i`'s default quota set to `quota`, checked as
/// `build()` checks it.
pub(crate) fn set_tier_quota(
    shared: &Shared,
    runtime: &mut Runtime,
    i: usize,
    quota: Quota,
) -> Result<(), ConfigError> {
    let t = &shared.config.tiers[i];
    let limit = checked_limit(&t.name, t.algorithm, quota, t.cost)?;
    let fallback = fallback_limit(
        &t.name,
        t.algorithm,
        quota,
        t.cost,
        shared.config.fallback_instances,
    )?;
    let rt = &mut runtime.tiers[i];
    rt.quota = quota;
    rt.limit = limit;
    rt.fallback = fallback;
    Ok(())
}

/// `runtime` with plan `plan`'s quota on tier `i` set (or added) to
/// `quota`, checked as `build()` checks it.
pub(crate) fn set_plan_quota(
    shared: &Shared,
    runtime: &mut Runtime,
    i: usize,
    plan: &str,
    quota: Quota,
) -> Result<(), ConfigError> {
    let t = &shared.config.tiers[i];
    let entry = PlanRuntime {
        name: Arc::from(plan),
        quota,
        limit: checked_limit(&t.name, t.algorithm, quota, t.cost)?,
        fallback: fallback_limit(
            &t.name,
            t.algorithm,
            quota,
            t.cost,
            shared.config.fallback_instances,
        )?,
        home: None,
    };
    let plans = &mut runtime.tiers[i].plans;
    match plans.iter_mut().find(|p| &*p.name == plan) {
        Some(existing) => *existing = entry,
        None => plans.push(entry),
    }
    Ok(())
}

/// The runtime `doc` makes of `current`: every tier's quotas the configured
/// ones, then the document's; modes as in `current`. The error names the
/// field by its path in the document (`tiers.user.quota.burst`).
pub(crate) fn runtime_of(
    shared: &Shared,
    current: &Runtime,
    doc: &Settings,
) -> Result<Runtime, Invalid> {
    let configured = &shared.config.configured;
    let mut next = current.clone();
    for (rt, c) in next.tiers.iter_mut().zip(configured.tiers.iter()) {
        rt.quota = c.quota;
        rt.limit = c.limit;
        rt.fallback = c.fallback;
        rt.plans.clone_from(&c.plans);
    }
    for (name, tier) in &doc.tiers {
        let at = format!("tiers.{name}.");
        let i = shared
            .config
            .tier_index(name)
            .map_err(|e| Invalid::of(&e).under(&at))?;
        if let Some(q) = &tier.quota {
            let at = format!("{at}quota.");
            let quota = quota_of(shared, i, q).map_err(|e| e.under(&at))?;
            set_tier_quota(shared, &mut next, i, quota).map_err(|e| Invalid::of(&e).under(&at))?;
        }
        for (plan, q) in &tier.plans {
            let at = format!("{at}plans.{plan}.");
            if !configured.tiers[i].plans.iter().any(|p| &*p.name == plan) {
                return Err(Invalid::new(
                    "plan",
                    format!("tier \"{name}\" has no plan \"{plan}\""),
                )
                .under(&at));
            }
            let quota = quota_of(shared, i, q).map_err(|e| e.under(&at))?;
            set_plan_quota(shared, &mut next, i, plan, quota)
                .map_err(|e| Invalid::of(&e).under(&at))?;
        }
    }
    Ok(next)
}

/// The lists `doc` makes of the configured ones (`None`: the front door
/// has no lists). The error names the entry (`allow.ips[2]`).
pub(super) fn lists_of(shared: &Shared, doc: &Settings) -> Result<Option<Lists>, Invalid> {
    let Some((_, configured)) = shared.live.fleet.lists.get() else {
        return Ok(None);
    };
    let mut lists = configured.clone();
    if let Some(e) = &doc.allow {
        lists.allow = Arc::new(
            configured
                .allow
                .with_entries(e)
                .map_err(|(f, r)| Invalid::new(format!("allow.{f}"), r))?,
        );
    }
    if let Some(e) = &doc.deny {
        lists.deny = Arc::new(
            configured
                .deny
                .with_entries(e)
                .map_err(|(f, r)| Invalid::new(format!("deny.{f}"), r))?,
        );
    }
    Ok(Some(lists))
}

/// The version and document of one read of the control hash (`(0, None)`
/// when it has no settings). The error says what is malformed.
pub(super) fn stored(fields: &[(String, String)]) -> Result<(u64, Option<&str>), String> {
    let field = |name: &str| {
        fields
            .iter()
            .find(|(f, _)| f == name)
            .map(|(_, v)| v.as_str())
    };
    let version = match field(SETTINGS_VERSION) {
        None => 0,
        Some(v) => v
            .parse::<u64>()
            .map_err(|_| format!("{SETTINGS_VERSION} {v:?} is not a whole number"))?,
    };
    let raw = field(SETTINGS);
    if version == 0 && raw.is_some() {
        return Err(format!(
            "{SETTINGS} is set without a {SETTINGS_VERSION}: write settings through the handle, the admin API or the command"
        ));
    }
    Ok((version, raw))
}

/// Parses a stored document (`None`: none, the configured settings).
pub(super) fn parse(raw: Option<&str>) -> Result<Settings, String> {
    match raw {
        None | Some("") => Ok(Settings::default()),
        Some(text) => serde_json::from_str(text).map_err(|e| format!("{SETTINGS}: {e}")),
    }
}

/// Applies one read of the control hash's settings fields, if they
/// changed: checks the whole document, then swaps quotas and lists in
/// together. A document refused is logged at `error` and ignored (the last
/// good settings stay).
pub(crate) fn apply_read(shared: &Shared, key: &str, fields: &[(String, String)]) {
    let fleet = &shared.live.fleet;
    let applied = fleet.applied.load_full();
    let (version, raw) = match stored(fields) {
        Ok(v) => v,
        Err(error) => {
            tracing::error!(target: super::CONTROL_LOG_TARGET, key, error,
                kept = applied.version, "control key: malformed settings ignored; keeping the last good ones");
            return;
        }
    };
    if version == applied.version && raw == applied.raw.as_deref() {
        return;
    }
    let doc = match parse(raw) {
        Ok(d) => d,
        Err(error) => {
            tracing::error!(target: super::CONTROL_LOG_TARGET, key, version, error,
                kept = applied.version, "control key: malformed settings ignored; keeping the last good ones");
            return;
        }
    };
    let _serial = UPDATES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let current = shared.live.runtime.load_full();
    let checked =
        runtime_of(shared, &current, &doc).and_then(|rt| lists_of(shared, &doc).map(|l| (rt, l)));
    let (runtime, lists) = match checked {
        Ok(v) => v,
        Err(e) => {
            tracing::error!(target: super::CONTROL_LOG_TARGET, key, version, field = e.field, error = e.reason,
                kept = applied.version, "control key: settings refused (checked as at build) and ignored; keeping the last good ones");
            return;
        }
    };
    if let (Some((cell, _)), Some(lists)) = (fleet.lists.get(), lists) {
        cell.store(lists);
    }
    shared
        .live
        .runtime
        .store(Arc::new(runtime.with_homes(&shared.config.configured)));
    let by = doc.by.clone().unwrap_or_else(|| "unknown".to_owned());
    fleet.applied.store(Arc::new(Applied {
        version,
        raw: raw.map(str::to_owned),
    }));
    // Cached denials were decided under the old quotas and lists.
    shared.guards.deny_cache.clear();
    set_version_gauge(version);
    tracing::info!(target: super::CONTROL_LOG_TARGET, key, version, by, previous = applied.version,
        "control key: fleet-wide settings applied");
}

/// `tiered_ratelimit_settings_version`: the settings version this instance
/// applies.
pub(crate) fn set_version_gauge(version: u64) {
    #[allow(clippy::cast_precision_loss)] // versions stay far below 2^53
    metrics::gauge!(crate::observe::SETTINGS_VERSION).set(version as f64);
}
