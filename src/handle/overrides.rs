//! Per-key overrides: another quota, no limit or a block for one key of one
//! tier (the rules are in the [`handle`](crate::handle#per-key-overrides)
//! module's docs).

use crate::backend::override_rule::{Active, Effect};
use crate::error::BackendError;
use crate::handle::RateLimitHandle;
use crate::quota::Quota;
use std::time::Duration;

use crate::backend::override_rule::KEY_SUFFIX;

pub use crate::backend::override_rule::BLOCKED_RETRY;

/// What an override does to one key of one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Override {
    /// Another quota (same algorithm as the tier; checked as the tier's
    /// own quota is, against the tier's fixed cost).
    Quota(Quota),
    /// No limit: allowed, nothing charged.
    Unlimited,
    /// Always denied, nothing charged.
    Blocked,
}

impl std::fmt::Display for Override {
    /// `unlimited`, `blocked`, or `<limit>/<period ms>ms burst <burst>`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Override::Quota(q) => write!(
                f,
                "{}/{}ms burst {}",
                q.limit(),
                q.period().as_millis(),
                q.burst_size()
            ),
            Override::Unlimited => f.write_str("unlimited"),
            Override::Blocked => f.write_str("blocked"),
        }
    }
}

impl Override {
    /// Parses what [`Display`](std::fmt::Display) writes.
    fn parse(s: &str) -> Option<Self> {
        match s {
            "unlimited" => return Some(Override::Unlimited),
            "blocked" => return Some(Override::Blocked),
            _ => {}
        }
        let (limit, rest) = s.split_once('/')?;
        let (period, burst) = rest.split_once("ms burst ")?;
        let q = Quota::new(
            limit.parse().ok()?,
            Duration::from_millis(period.parse().ok()?),
        );
        let burst: u64 = burst.parse().ok()?;
        Some(Override::Quota(if burst == q.limit() {
            q
        } else {
            q.burst(burst)
        }))
    }
}

/// One override as listed by [`RateLimitHandle::overrides`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OverrideEntry {
    /// The key part as stored ([`readable_key_part`](crate::key::readable_key_part)
    /// shows it as people read it).
    pub key: String,
    /// What it does.
    pub rule: Override,
    /// When it ends, Unix epoch µs (`None`: never).
    pub expires_at_us: Option<u64>,
}

impl OverrideEntry {
    /// An entry (for comparisons in tests and tools).
    pub fn new(key: impl Into<String>, rule: Override, expires_at_us: Option<u64>) -> Self {
        Self {
            key: key.into(),
            rule,
            expires_at_us,
        }
    }
}

/// Why an override could not be set, removed or listed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverrideError {
    /// The layer has no tier of this name, or the tier was not built with
    /// [`Tier::overrides(true)`](crate::Tier::overrides).
    #[error("tier \"{0}\": no such tier taking overrides (Tier::overrides(true))")]
    UnknownTier(String),
    /// The key is empty (any other text is a key: see [`handle`](crate::handle#peek-reset-and-lift)).
    #[error("key: empty (give the key as the admin page shows it, or as stored)")]
    InvalidKey,
    /// The quota is not valid for the tier (the message names the field).
    #[error(transparent)]
    Quota(#[from] crate::error::ConfigError),
    /// The backend could not answer (or not within `backend_timeout`).
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The listing entry stored next to an override (the index hash's value):
/// `<until µs> <rule>`.
fn entry_value(until_us: u64, rule: Override) -> String {
    format!("{until_us} {rule}")
}

/// Parses an index entry; `None` when malformed.
pub(crate) fn parse_entry(key: String, v: &str) -> Option<OverrideEntry> {
    let (until, rule) = v.split_once(' ')?;
    let until: u64 = until.parse().ok()?;
    Some(OverrideEntry {
        key,
        rule: Override::parse(rule)?,
        expires_at_us: (until != 0).then_some(until),
    })
}

impl RateLimitHandle {
    /// The tier index and storage key of `key`'s override in `tier`.
    fn override_key(&self, tier: &str, key: &str) -> Result<(usize, String), OverrideError> {
        let shared = self.shared();
        let i = shared
            .config
            .tier_index(tier)
            .ok()
            .filter(|&i| shared.config.tiers[i].overrides)
            .ok_or_else(|| OverrideError::UnknownTier(tier.to_owned()))?;
        let key = crate::key::typed_key_part(key);
        if !crate::handle::inspect::valid_key(&key) {
            return Err(OverrideError::InvalidKey);
        }
        Ok((
            i,
            format!("{}{key}{KEY_SUFFIX}", shared.config.tiers[i].key_base),
        ))
    }

    /// Sets (or replaces) the override of `key` (as read or as stored: see [`handle`](crate::handle#peek-reset-and-lift)) in
    /// `tier`, until `ttl` from now (`None`: until removed). On Redis every
    /// instance applies it from its next request of the key. Logged at
    /// `info` with `by` (who made the change, e.g. the admin token's name).
    ///
    /// # Errors
    /// [`OverrideError::UnknownTier`] (also for a tier without
    /// [`Tier::overrides`](crate::Tier::overrides)),
    /// [`OverrideError::InvalidKey`], [`OverrideError::Quota`] for a quota
    /// the tier's algorithm cannot take, or the backend's error.
    pub async fn set_override(
        &self,
        tier: &str,
        key: &str,
        rule: Override,
        ttl: Option<Duration>,
        by: &str,
    ) -> Result<(), OverrideError> {
        let (i, ov_key) = self.override_key(tier, key)?;
        let shared = self.shared();
        let t = &shared.config.tiers[i];
        let effect = match rule {
            Override::Quota(q) => {
                Effect::Limit(crate::engine::checked_limit(tier, t.algorithm, q, t.cost)?)
            }
            Override::Unlimited => Effect::Unlimited,
            Override::Blocked => Effect::Blocked,
        };
        let now_us = shared.local_clock.now_us();
        let until_us = ttl.map_or(0, |d| {
            now_us
                .saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
                .max(1)
        });
        let active = Active { effect, until_us };
        let index = format!("{}{KEY_SUFFIX}", t.key_base);
        let listing = entry_value(until_us, rule);
        let timeout = shared.config.backend_timeout;
        let ttl_ms = ttl.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
        tokio::time::timeout(
            timeout,
            shared
                .backend
                .set_override(&ov_key, active, ttl_ms, &index, key, &listing),
        )
        .await
        .map_err(|_| BackendError::Timeout(timeout))??;
        let stored = format!("{}{key}", t.key_base);
        shared.guards.deny_cache.forget(&stored, || 0);
        crate::engine::announce_change(shared, "override set", &stored).await;
        tracing::info!(tier, key, rule = %rule, expires_at_us = until_us, by, at_us = now_us,
            "rate limiter: override set");
        Ok(())
    }

    /// Removes the override of `key` in `tier`; whether there was one in
    /// force (not expired).
    /// Logged at `info` with `by`.
    ///
    /// # Errors
    /// As [`set_override`](Self::set_override).
    pub async fn remove_override(
        &self,
        tier: &str,
        key: &str,
        by: &str,
    ) -> Result<bool, OverrideError> {
        let (i, ov_key) = self.override_key(tier, key)?;
        let shared = self.shared();
        let index = format!("{}{KEY_SUFFIX}", shared.config.tiers[i].key_base);
        let timeout = shared.config.backend_timeout;
        let removed = tokio::time::timeout(
            timeout,
            shared.backend.remove_override(&ov_key, &index, key),
        )
        .await
        .map_err(|_| BackendError::Timeout(timeout))??;
        let stored = format!("{}{key}", shared.config.tiers[i].key_base);
        shared.guards.deny_cache.forget(&stored, || 0);
        crate::engine::announce_change(shared, "override removed", &stored).await;
        let at_us = shared.local_clock.now_us();
        // One that had expired does not count.
        let existed = removed.is_some_and(|u| u == 0 || u > at_us);
        tracing::info!(
            tier,
            key,
            existed,
            by,
            at_us,
            "rate limiter: override removed"
        );
        Ok(existed)
    }

    /// The override of `key` in tier `i` as a check applies it (the
    /// effect, compiled for the tier's algorithm, and its expiry), expired
    /// or not; `None` when it has none (or does not take overrides). For
    /// [`peek`](Self::peek): one read of the tier's listing.
    pub(crate) async fn key_override(
        &self,
        i: usize,
        key: &str,
    ) -> Result<Option<Active>, BackendError> {
        let shared = self.shared();
        let Some(t) = shared.config.tiers.get(i).filter(|t| t.overrides) else {
            return Ok(None);
        };
        let index = format!("{}{KEY_SUFFIX}", t.key_base);
        let timeout = shared.config.backend_timeout;
        let raw = tokio::time::timeout(timeout, shared.backend.list_overrides(&index))
            .await
            .map_err(|_| BackendError::Timeout(timeout))??;
        let Some(e) = raw
            .into_iter()
            .find(|(k, _)| k == key)
            .and_then(|(k, v)| parse_entry(k, &v))
        else {
            return Ok(None);
        };
        let effect = match e.rule {
            Override::Quota(q) => {
                match crate::engine::checked_limit(&t.name, t.algorithm, q, t.cost) {
                    Ok(l) => Effect::Limit(l),
                    // Set through set_override, so it compiled then.
                    Err(_) => return Ok(None),
                }
            }
            Override::Unlimited => Effect::Unlimited,
            Override::Blocked => Effect::Blocked,
        };
        Ok(Some(Active {
            effect,
            until_us: e.expires_at_us.unwrap_or(0),
        }))
    }

    /// The overrides of `tier` that have not expired, by key.
    ///
    /// # Errors
    /// [`OverrideError::UnknownTier`] or the backend's error.
    pub async fn overrides(&self, tier: &str) -> Result<Vec<OverrideEntry>, OverrideError> {
        let shared = self.shared();
        let i = shared
            .config
            .tier_index(tier)
            .ok()
            .filter(|&i| shared.config.tiers[i].overrides)
            .ok_or_else(|| OverrideError::UnknownTier(tier.to_owned()))?;
        let index = format!("{}{KEY_SUFFIX}", shared.config.tiers[i].key_base);
        let timeout = shared.config.backend_timeout;
        let raw = tokio::time::timeout(timeout, shared.backend.list_overrides(&index))
            .await
            .map_err(|_| BackendError::Timeout(timeout))??;
        let now_us = shared.local_clock.now_us();
        let mut list: Vec<OverrideEntry> = raw
            .into_iter()
            .filter_map(|(k, v)| parse_entry(k, &v))
            .filter(|e| e.expires_at_us.is_none_or(|u| u > now_us))
            .collect();
        list.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_round_trip_through_their_listing() {
        for r in [
            Override::Unlimited,
            Override::Blocked,
            Override::Quota(Quota::per_minute(1000).burst(50)),
        ] {
            let e = parse_entry("k".into(), &entry_value(7, r)).unwrap();
            assert_eq!(e.rule, r);
            assert_eq!(e.expires_at_us, Some(7));
        }
        assert_eq!(
            parse_entry("k".into(), "0 blocked").unwrap().expires_at_us,
            None
        );
        assert!(parse_entry("k".into(), "x blocked").is_none());
    }
}
