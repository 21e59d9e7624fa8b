//! The fleet-wide control key: one Redis hash every instance polls, so one
//! `redis-cli` command switches the whole fleet.
//!
//! ```text
//! HSET rl:control mode off               # kill switch: every instance stops limiting
//! HSET rl:control mode shadow            # stop rejecting, keep counting
//! HSET rl:control tier:login canary:10   # one tier's mode
//! HDEL rl:control mode                   # back to the configured mode
//! DEL  rl:control                        # back to everything configured
//! ```
//!
//! Fields: `mode` (the global mode) and `tier:<name>` (a tier's mode), with
//! values `enforce`, `shadow`, `off` or `canary:<0-100>`. A field present
//! overrides the configured mode (and any [`RateLimitHandle`](crate::RateLimitHandle)
//! change) on every instance within one poll interval (default 5 s); a field
//! removed gives the configured mode back. A malformed field (unknown mode,
//! unknown tier) is logged at `error` and ignored — the last good value of
//! that field stays — so a typo can never silently switch limiting off. A
//! failed poll keeps the overrides as they were. Switching any override
//! drops the deny cache.
//!
//! The watcher starts with the first request the layer sees (it needs the
//! tokio runtime) and stops when the layer is dropped.
//!
//! [`RateLimitHandle::set_fleet_mode`](crate::RateLimitHandle::set_fleet_mode)
//! writes the hash (what the admin page's buttons do when a control key is
//! configured), then reads it back and applies it to its own process at
//! once; the other instances follow within one poll interval.

use crate::layer::Shared;
use crate::rollout::Mode;
use std::sync::Arc;
use std::time::Duration;

/// Where the control hash is and how often to read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlKey {
    /// The Redis key of the hash, e.g. `rl:control`.
    pub redis_key: String,
    /// How often every instance reads it (default 5 s).
    pub poll_interval: Duration,
}

impl ControlKey {
    /// The hash at `redis_key`, polled every 5 s.
    pub fn new(redis_key: impl Into<String>) -> Self {
        Self {
            redis_key: redis_key.into(),
            poll_interval: Duration::from_secs(5),
        }
    }

    /// Polls every `interval`.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }
}

/// Overrides from the control hash: global and per tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Overrides {
    pub(crate) mode: Option<Mode>,
    pub(crate) tiers: Vec<Option<Mode>>,
}

/// Applies one read of the hash to `previous`; returns the new overrides.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn apply(
    shared: &Shared,
    previous: &Overrides,
    fields: &[(String, String)],
) -> Overrides {
    let mut next = Overrides {
        mode: None,
        tiers: vec![None; shared.tiers.len()],
    };
    for (field, value) in fields {
        let parsed = value.parse::<Mode>();
        if field == "mode" {
            match parsed {
                Ok(m) => next.mode = Some(m),
                Err(e) => {
                    tracing::error!(field, value, error = %e, "control key: malformed mode ignored");
                    next.mode = previous.mode;
                }
            }
        } else if let Some(tier) = field.strip_prefix("tier:") {
            let Ok(i) = shared.tier_index(tier) else {
                tracing::error!(field, value, "control key: unknown tier ignored");
                continue;
            };
            match parsed {
                Ok(m) => next.tiers[i] = Some(m),
                Err(e) => {
                    tracing::error!(field, value, error = %e, "control key: malformed tier mode ignored");
                    next.tiers[i] = previous.tiers.get(i).copied().flatten();
                }
            }
        } else {
            tracing::error!(field, value, "control key: unknown field ignored");
        }
    }
    next
}

/// Why a write to the control hash failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The layer has no control key, or its backend is not Redis.
    #[error("no fleet control key: the layer has none configured, or its backend is not Redis")]
    NotConfigured,
    /// No tier of that name.
    #[error("unknown tier: {0}")]
    UnknownTier(String),
    /// The Redis call failed; nothing was changed.
    #[error("control key: {0}")]
    Backend(#[from] crate::error::BackendError),
}

/// The control hash's key, when the layer polls one (a control key and a
/// Redis backend).
pub(crate) fn key_of(shared: &Shared) -> Option<&str> {
    let control = shared.control.as_ref()?;
    #[cfg(feature = "redis")]
    if matches!(shared.backend, crate::backend::Backend::Redis(_)) {
        return Some(&control.redis_key);
    }
    let _ = control;
    None
}

/// Sets `field` of the control hash to `mode`, then reads the hash back
/// and applies it here at once (the watcher would within a poll interval).
pub(crate) async fn write(
    shared: &Arc<Shared>,
    field: &str,
    mode: Mode,
) -> Result<(), ControlError> {
    let Some(key) = key_of(shared) else {
        return Err(ControlError::NotConfigured);
    };
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        redis.hset(key, field, &mode.to_string()).await?;
        let fields = redis.hgetall(key).await?;
        store(shared, key, &fields);
        return Ok(());
    }
    let _ = (key, field, mode);
    Err(ControlError::NotConfigured)
}

/// Applies one read of the hash, if it changes anything.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
fn store(shared: &Shared, key: &str, fields: &[(String, String)]) {
    let previous = shared.overrides.load_full();
    let next = apply(shared, &previous, fields);
    if next != *previous {
        tracing::warn!(
            key,
            mode = ?next.mode,
            tiers = ?next.tiers,
            "control key changed the rate limiter's modes"
        );
        // Store first, then drop the cached denials (decided under the
        // old modes).
        shared.overrides.store(Arc::new(next));
        shared.deny_cache.clear();
        crate::handle::refresh_mode_gauges(shared);
    }
}

/// Starts the watcher once (needs a tokio runtime; a no-op without one).
pub(crate) fn start(shared: &Arc<Shared>) {
    let Some(control) = shared.control.as_ref() else {
        return;
    };
    #[cfg(feature = "redis")]
    {
        let crate::backend::Backend::Redis(redis) = &shared.backend else {
            return;
        };
        if shared.control_started.set(()).is_err() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak: std::sync::Weak<Shared> = Arc::downgrade(shared);
        let redis = redis.clone();
        let key = control.redis_key.clone();
        let interval = control.poll_interval;
        rt.spawn(async move {
            loop {
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                let read = tokio::time::timeout(interval.max(Duration::from_millis(100)), redis.hgetall(&key)).await;
                match read {
                    Ok(Ok(fields)) => store(&shared, &key, &fields),
                    Ok(Err(e)) => tracing::warn!(key, error = %e, "control key: poll failed; keeping the current overrides"),
                    Err(_) => tracing::warn!(key, "control key: poll timed out; keeping the current overrides"),
                }
                drop(shared);
                tokio::time::sleep(interval).await;
            }
        });
    }
    #[cfg(not(feature = "redis"))]
    let _ = control;
}
