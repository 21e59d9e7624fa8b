//! Peek, reset and lift: one key's numbers in one tier without consuming
//! anything, a fresh start, a lifted block (the rules are in the
//! [`handle`](crate::handle#peek-reset-and-lift) module's docs).

use crate::algorithm::{Limit, TierDecision};
use crate::backend::TierCheck;
use crate::error::BackendError;
use crate::handle::RateLimitHandle;
use std::time::Duration;

/// One key's numbers in one tier, as [`RateLimitHandle::peek`] reads them:
/// what a request of the tier's cost would be answered with now (its
/// headers' numbers), nothing charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyStatus {
    /// Whether a request of the tier's cost would pass now.
    pub allowed: bool,
    /// The tier's capacity in whole requests (`X-RateLimit-Limit`).
    pub limit: u64,
    /// Whole requests the next request would leave (after its charge,
    /// when it would pass; what is left now, when it would not):
    /// `X-RateLimit-Remaining`.
    pub remaining: u64,
    /// Until the key would be back to its full capacity after the next
    /// request (`X-RateLimit-Reset`, relative).
    pub reset_after: Duration,
    /// Until a request of the tier's cost would pass (zero when it would
    /// pass now).
    pub retry_after: Duration,
    /// The backend's clock when it was read (Redis `TIME`), Unix epoch µs.
    pub now_us: u64,
    /// With a penalty box on the tier ([`Penalty`](crate::Penalty)): how
    /// long the key is still blocked (`None`: not blocked). A blocked key is
    /// denied whatever the numbers above say.
    pub blocked_for: Option<Duration>,
    /// For a calendar quota ([`Tier::calendar`](crate::Tier::calendar)):
    /// when the key's quota renews, the end of the current calendar window
    /// by the backend's clock, Unix epoch µs.
    pub renews_at_us: Option<u64>,
}

impl KeyStatus {
    fn from_decision(d: &TierDecision, now_us: u64) -> Self {
        Self {
            allowed: d.allowed,
            limit: d.limit,
            remaining: d.remaining,
            reset_after: Duration::from_micros(d.reset_after_us),
            retry_after: Duration::from_micros(d.retry_after_us),
            now_us,
            blocked_for: None,
            renews_at_us: None,
        }
    }
}

/// Why a peek or reset could not run.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum InspectError {
    /// The layer has no tier of this name.
    #[error("tier \"{0}\": no such tier")]
    UnknownTier(String),
    /// The key is empty (any other text is a key, as read or as stored:
    /// see the module docs).
    #[error("key: empty (give the key as the admin page shows it, or as stored)")]
    InvalidKey,
    /// The backend could not answer (or did not within `backend_timeout`).
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Whether `key` can be a stored key part (what
/// [`storage_key_part`](crate::key::storage_key_part) and the built-in
/// extractors write).
pub(crate) fn valid_key(key: &str) -> bool {
    (1..=crate::key::MAX_KEY_PART).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
}

impl RateLimitHandle {
    /// The storage key and the check of `key` in `tier` (its default
    /// quota, its fixed cost).
    fn key_check(&self, tier: &str, key: &str) -> Result<TierCheck, InspectError> {
        let shared = self.shared();
        let i = shared
            .config
            .tier_index(tier)
            .map_err(|_| InspectError::UnknownTier(tier.to_owned()))?;
        let key = crate::key::typed_key_part(key);
        if !valid_key(&key) {
            return Err(InspectError::InvalidKey);
        }
        let t = &shared.config.tiers[i];
        let runtime = shared.live.runtime.load();
        let (limit, home) = (runtime.tiers[i].limit, runtime.tiers[i].home);
        let now = shared.local_clock.now_us();
        Ok(TierCheck {
            key: format!("{}{key}", t.key_base),
            // A calendar tier's windows around this instance's clock.
            limit: match &t.calendar {
                Some(c) => c.limit(limit, now),
                None => limit,
            },
            cost: t.cost,
            home: home.map(|h| match &t.calendar {
                Some(c) => c.limit(h, now),
                None => h,
            }),
        })
    }

    /// `key`'s numbers in `tier` now, **without consuming** anything: what a
    /// request of the tier's cost would get (see the [module docs](crate::handle#peek-reset-and-lift)
    /// for the key's form), under the key's per-key override when it has
    /// one ([`set_override`](Self::set_override): another quota's numbers,
    /// unlimited shown full, blocked denied with the time left). Each
    /// backend call bounded by the layer's `backend_timeout`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
    /// let layer = RateLimitLayer::builder()
    ///     .tier(Tier::new("global", Global, Quota::per_minute(10)))
    ///     .build()
    ///     .unwrap();
    /// let status = layer.handle().peek("global", "all").await.unwrap();
    /// // The next request would pass and leave 9 (nothing is charged).
    /// assert_eq!((status.allowed, status.limit, status.remaining), (true, 10, 9));
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`InspectError::UnknownTier`], [`InspectError::InvalidKey`], or the
    /// backend's error.
    pub async fn peek(&self, tier: &str, key: &str) -> Result<KeyStatus, InspectError> {
        let check = self.key_check(tier, key)?;
        let calendar = match check.limit {
            Limit::Calendar(c) => Some(c),
            _ => None,
        };
        let timeout = self.shared().config.backend_timeout;
        let peek = |check: TierCheck| async move {
            let v = tokio::time::timeout(timeout, self.shared().backend.peek(&check))
                .await
                .map_err(|_| BackendError::Timeout(timeout))??;
            match v.decisions.first() {
                Some(d) => Ok((*d, v.now_us)),
                None => Err(BackendError::Reply("a peek without a decision".to_owned())),
            }
        };
        let penalty = self.penalty_check(tier, &check);
        // Under an override, what the next request would see: its quota's
        // numbers on the key's state, or unlimited, or blocked.
        let i = self
            .shared()
            .config
            .tier_index(tier)
            .map_err(|_| InspectError::UnknownTier(tier.to_owned()))?;
        let active = self.key_override(i, key).await?;
        let overridden = match active.map(|a| a.effect) {
            Some(crate::backend::override_rule::Effect::Limit(l)) => TierCheck {
                // On a calendar tier the override gives the limit only.
                limit: match (l, check.limit) {
                    (Limit::FixedWindow(w), Limit::Calendar(c)) => {
                        Limit::Calendar(crate::algorithm::CalendarWindow {
                            limit: w.limit,
                            ..c
                        })
                    }
                    (l, _) => l,
                },
                ..check.clone()
            },
            _ => check.clone(),
        };
        let (mut d, now_us) = peek(overridden).await?;
        match active.filter(|a| a.live(now_us)) {
            Some(a) if !matches!(a.effect, crate::backend::override_rule::Effect::Limit(_)) => {
                d = a.check(&check, None, now_us).0;
            }
            // Expired meanwhile: the tier's own quota.
            None if active.is_some() => d = peek(check).await?.0,
            _ => {}
        }
        let mut status = KeyStatus::from_decision(&d, now_us);
        status.renews_at_us = calendar.map(|c| c.window(now_us).1);
        if let Some(p) = penalty {
            let (d, _) = peek(p).await?;
            if !d.allowed {
                status.allowed = false;
                status.blocked_for = Some(Duration::from_micros(d.retry_after_us));
                status.retry_after = status
                    .retry_after
                    .max(Duration::from_micros(d.retry_after_us));
            }
        }
        Ok(status)
    }

    /// The penalty box's check of `check`'s key, when `tier` has one.
    fn penalty_check(&self, tier: &str, check: &TierCheck) -> Option<TierCheck> {
        let i = self.shared().config.tier_index(tier).ok()?;
        let p = self.shared().config.tiers[i].penalty?;
        Some(TierCheck {
            key: format!("{}{}", check.key, crate::algorithm::PENALTY_KEY_SUFFIX),
            limit: crate::algorithm::Limit::Penalty(p),
            cost: 1,
            home: None,
        })
    }

    /// Lifts `key`'s block in `tier`'s penalty box (and forgets its strikes
    /// and offences), fleet-wide, leaving its rate state alone; this
    /// process forgets its cached denial. Returns whether there was any
    /// penalty state. Logged at `info`. The other instances' deny caches
    /// follow within one [control key](crate::handle#the-fleet-wide-control-key) poll interval.
    ///
    /// # Errors
    /// [`InspectError::UnknownTier`] (also for a tier without a penalty
    /// box), [`InspectError::InvalidKey`], or the backend's error.
    pub async fn lift(&self, tier: &str, key: &str) -> Result<bool, InspectError> {
        let check = self.key_check(tier, key)?;
        let p = self
            .penalty_check(tier, &check)
            .ok_or_else(|| InspectError::UnknownTier(tier.to_owned()))?;
        let shared = self.shared();
        let timeout = shared.config.backend_timeout;
        let existed = tokio::time::timeout(timeout, shared.backend.reset(&p.key))
            .await
            .map_err(|_| BackendError::Timeout(timeout))??;
        shared.guards.deny_cache.forget(&p.key, || 0);
        if let Some(fallback) = &shared.guards.fallback {
            fallback.reset(&p.key);
        }
        crate::engine::announce_change(shared, "lift", &p.key).await;
        tracing::info!(tier, key, existed, "rate limiter: penalty box lifted");
        Ok(existed)
    }

    /// Makes `key` start fresh in `tier`: its stored state is deleted (on
    /// Redis for the whole fleet), its penalty box too (see
    /// [`lift`](Self::lift)), and this process forgets any cached
    /// denial of it (see the [module docs](crate::handle#peek-reset-and-lift) for other
    /// instances). Returns whether the key held any state. Logged at `info`.
    ///
    /// # Errors
    /// [`InspectError::UnknownTier`], [`InspectError::InvalidKey`], or the
    /// backend's error.
    pub async fn reset(&self, tier: &str, key: &str) -> Result<bool, InspectError> {
        let check = self.key_check(tier, key)?;
        let shared = self.shared();
        let timeout = shared.config.backend_timeout;
        let mut existed = tokio::time::timeout(timeout, shared.backend.reset(&check.key))
            .await
            .map_err(|_| BackendError::Timeout(timeout))??;
        shared.guards.deny_cache.forget(&check.key, || 0);
        if let Some(fallback) = &shared.guards.fallback {
            fallback.reset(&check.key);
        }
        if shared.config.tiers[shared
            .config
            .tier_index(tier)
            .map_err(|_| InspectError::UnknownTier(tier.to_owned()))?]
        .penalty
        .is_some()
        {
            existed |= self.lift(tier, key).await?;
        }
        crate::engine::announce_change(shared, "reset", &check.key).await;
        tracing::info!(tier, key, existed, "rate limiter: key reset");
        Ok(existed)
    }
}

#[cfg(test)]
mod tests {
    use super::valid_key;

    #[test]
    fn stored_key_parts_only() {
        for k in ["203.0.113.7", "2001:db8::/64", "%7Bx%7D", "GET%20/users"] {
            assert!(valid_key(k), "{k}");
        }
        let long = "a".repeat(129);
        for k in ["", "a b", "{x}", "x}", "é", long.as_str()] {
            assert!(!valid_key(k), "{k:?}");
        }
    }
}
