//! The fleet-wide control key's watcher: polls the control hash and stores
//! its modes as the engine's mode overrides; and the hash's `generation` field,
//! which every operator action on keys (lift, reset, an override set or
//! removed) increments, so every instance drops its deny cache within one
//! poll interval ([`announce_change`]).

use super::runtime::ModeOverrides;
use super::state::Shared;
use crate::rollout::Mode;
use std::sync::Arc;
use std::time::Duration;

/// Applies one read of the hash to `previous`; returns the new mode overrides.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn apply(
    shared: &Shared,
    previous: &ModeOverrides,
    fields: &[(String, String)],
) -> ModeOverrides {
    let mut next = ModeOverrides {
        mode: None,
        tiers: vec![None; shared.config.tiers.len()],
    };
    for (field, value) in fields {
        let parsed = value.parse::<Mode>();
        if field == "mode" {
            match parsed {
                Ok(m) => next.mode = Some(m),
                Err(e) => {
                    tracing::error!(target: super::CONTROL_LOG_TARGET, field, value, error = %e, "control key: malformed mode ignored");
                    next.mode = previous.mode;
                }
            }
        } else if field == GENERATION
            || field == super::settings::SETTINGS
            || field == super::settings::SETTINGS_VERSION
            || field.starts_with("plan:")
        {
            // Not a mode: the generation is read by the watcher (`store`),
            // the settings by `settings::apply_read`, the rollout plans by
            // `rollout::after`.
        } else if let Some(tier) = field.strip_prefix("tier:") {
            let Ok(i) = shared.config.tier_index(tier) else {
                tracing::error!(target: super::CONTROL_LOG_TARGET, field, value, "control key: unknown tier ignored");
                continue;
            };
            match parsed {
                Ok(m) => next.tiers[i] = Some(m),
                Err(e) => {
                    tracing::error!(target: super::CONTROL_LOG_TARGET, field, value, error = %e, "control key: malformed tier mode ignored");
                    next.tiers[i] = previous.tiers.get(i).copied().flatten();
                }
            }
        } else {
            tracing::error!(target: super::CONTROL_LOG_TARGET, field, value, "control key: unknown field ignored");
        }
    }
    next
}

/// The control hash's field that operator actions on keys increment
/// (`HINCRBY <key> generation 1`): an instance that reads a new value drops
/// its deny cache.
pub(crate) const GENERATION: &str = "generation";

/// The `generation` field's value in one read of the hash (`None`: absent).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
fn generation_of(fields: &[(String, String)]) -> Option<&str> {
    fields
        .iter()
        .find(|(f, _)| f == GENERATION)
        .map(|(_, v)| v.as_str())
}

/// Tells the other instances that `what` (an operator action on `key`)
/// changed a key's state: increments the control hash's `generation`, so
/// each one drops its deny cache at its next poll. Without a control key
/// (or on the memory backend) there is nobody to tell. A failed write is
/// logged at `warn` and otherwise ignored: the action itself is done, and
/// the other instances' cached denials lapse at their retry time.
pub(crate) async fn announce_change(shared: &Shared, what: &str, key: &str) {
    let Some(control) = control_hash_key(shared) else {
        return;
    };
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        let timeout = shared.config.backend_timeout;
        let bumped = tokio::time::timeout(timeout, redis.hincrby(control, GENERATION, 1)).await;
        let error = match bumped {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("timed out after {timeout:?}"),
        };
        tracing::warn!(target: super::CONTROL_LOG_TARGET, control, action = what, key, error,
            "control key: could not tell the other instances; their cached denials of the key last until their retry time");
    }
    #[cfg(not(feature = "redis"))]
    let _ = (control, what, key);
}

/// The control hash's key, when the layer polls one (a control key and a
/// Redis backend).
pub(crate) fn control_hash_key(shared: &Shared) -> Option<&str> {
    let control = shared.config.control.as_ref()?;
    #[cfg(feature = "redis")]
    if matches!(shared.backend, crate::backend::Backend::Redis(_)) {
        return Some(&control.redis_key);
    }
    let _ = control;
    None
}

/// Sets `field` of the control hash to `mode`, then reads the hash back
/// and applies it here at once (the watcher would within a poll interval).
pub(crate) async fn write_mode(
    shared: &Arc<Shared>,
    field: &str,
    mode: Mode,
) -> Result<(), ControlError> {
    let Some(key) = control_hash_key(shared) else {
        return Err(ControlError::NotConfigured);
    };
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        redis.hset(key, field, &mode.to_string()).await?;
        let fields = redis.hgetall(key).await?;
        store(shared, key, &fields, None);
        return Ok(());
    }
    let _ = (key, field, mode);
    Err(ControlError::NotConfigured)
}

/// Reads the control hash and applies it here at once (after a write this
/// instance made; the watcher would within a poll interval).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) async fn refresh(shared: &Arc<Shared>, key: &str) -> Result<(), ControlError> {
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        let fields = redis.hgetall(key).await?;
        store(shared, key, &fields, None);
        let states = super::rollout::read_states(shared, &fields, &shared.live.plans.read.load());
        super::rollout::store_states(shared, states);
        return Ok(());
    }
    let _ = (shared, key);
    Err(ControlError::NotConfigured)
}

/// Applies one read of the hash, if it changes anything. `seen`: the
/// watcher's last `generation` (`None` for a read outside the watcher): a
/// new one drops the deny cache, since an operator action somewhere in the
/// fleet changed a key's state; the first read only records it.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
fn store(
    shared: &Shared,
    key: &str,
    fields: &[(String, String)],
    seen: Option<&mut Option<Option<String>>>,
) {
    if let Some(seen) = seen {
        let now = generation_of(fields);
        match seen {
            Some(before) if before.as_deref() != now => {
                tracing::info!(target: super::CONTROL_LOG_TARGET, key, generation = now.unwrap_or("none"),
                    "control key: an operator action changed a key's state; dropping the deny cache");
                shared.guards.deny_cache.clear();
                *seen = Some(now.map(str::to_owned));
            }
            Some(_) => {}
            None => *seen = Some(now.map(str::to_owned)),
        }
    }
    super::settings::apply_read(shared, key, fields);
    let previous = shared.live.mode_overrides.load_full();
    let next = apply(shared, &previous, fields);
    if next != *previous {
        let changed = changed_tiers(shared, &previous, &next);
        tracing::warn!(target: super::CONTROL_LOG_TARGET,
            key,
            mode = %ModeText(next.mode),
            tiers = %changed,
            "control key changed the rate limiter's modes"
        );
        // Store first, then drop the cached denials (decided under the
        // old modes).
        shared.live.mode_overrides.store(Arc::new(next));
        shared.guards.deny_cache.clear();
        shared.refresh_mode_gauges();
    }
}

/// A control-key mode as an operator writes it (`off`, `canary:10`), or
/// `none` when the hash sets none (the page's or the policy's mode
/// applies).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
struct ModeText(Option<Mode>);

impl std::fmt::Display for ModeText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(m) => write!(f, "{m}"),
            None => f.write_str("none"),
        }
    }
}

/// The tiers whose control-key mode changed, as `name=mode` (`none`: no
/// longer set) joined by `,`; `none` when no tier's did.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
fn changed_tiers(shared: &Shared, previous: &ModeOverrides, next: &ModeOverrides) -> String {
    let mut out = String::new();
    for (i, t) in shared.config.tiers.iter().enumerate() {
        let (a, b) = (
            previous.tiers.get(i).copied().flatten(),
            next.tiers.get(i).copied().flatten(),
        );
        if a != b {
            if !out.is_empty() {
                out.push(',');
            }
            out.push_str(&t.name);
            out.push('=');
            out.push_str(&ModeText(b).to_string());
        }
    }
    if out.is_empty() {
        out.push_str("none");
    }
    out
}

/// Starts the watcher once (needs a tokio runtime; a no-op without one).
pub(crate) fn start(shared: &Arc<Shared>) {
    let Some(control) = shared.config.control.as_ref() else {
        return;
    };
    #[cfg(feature = "redis")]
    {
        let crate::backend::Backend::Redis(redis) = &shared.backend else {
            return;
        };
        if shared.live.control_started.set(()).is_err() {
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
            // The `generation` last read (`None`: no read yet).
            let mut seen: Option<Option<String>> = None;
            loop {
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                // One call a poll: the rollout's work (if any) and the read.
                let parts = super::rollout::gather(&shared, &key, interval).await;
                let read = tokio::time::timeout(interval.max(Duration::from_millis(100)),
                    super::rollout::call(&redis, &key, &parts)).await;
                match read {
                    Ok(Ok((fields, answers))) => {
                        store(&shared, &key, &fields, Some(&mut seen));
                        super::rollout::after(&shared, &redis, &key, &fields, &parts, answers).await;
                    }
                    Ok(Err(e)) => tracing::warn!(target: super::CONTROL_LOG_TARGET, key, error = %e, "control key: poll failed; keeping the current mode overrides"),
                    Err(_) => tracing::warn!(target: super::CONTROL_LOG_TARGET, key, "control key: poll timed out; keeping the current mode overrides"),
                }
                shared.live.fleet.mark_read();
                drop(shared);
                tokio::time::sleep(interval).await;
            }
        });
    }
    #[cfg(not(feature = "redis"))]
    let _ = control;
}

/// Where the control hash is and how often to read it.
///
/// In a policy file, the `[control]` table: `redis_key` (required) and
/// `poll_interval` (humantime, default `"5s"`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlKey {
    /// The Redis key of the hash, e.g. `rl:control`.
    pub redis_key: String,
    /// How often every instance reads it (default 5 s).
    #[serde(default = "default_poll_interval", with = "humantime_serde")]
    pub poll_interval: Duration,
}

/// How often the control hash is read unless told otherwise.
fn default_poll_interval() -> Duration {
    Duration::from_secs(5)
}

impl ControlKey {
    /// The hash at `redis_key`, polled every 5 s.
    pub fn new(redis_key: impl Into<String>) -> Self {
        Self {
            redis_key: redis_key.into(),
            poll_interval: default_poll_interval(),
        }
    }

    /// Polls every `interval`.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }
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
    /// A settings change `build()` would refuse (limit 0, burst below the
    /// cost, an unknown tier or plan, a calendar tier given a duration, an
    /// entry that is not a network…); nothing was written. `field` names it
    /// (`limit`, `period`, `burst`, `tier`, `plan`, `ips[2]`).
    #[error("{field}: {reason}")]
    Invalid {
        /// The field refused.
        field: String,
        /// Why.
        reason: String,
    },
    /// The stored settings are malformed (written by hand): every instance
    /// ignores them, and no change is written over them until they are
    /// fixed or deleted (`HDEL <control key> settings settings_version`
    /// goes back to the configured settings).
    #[error("the stored fleet-wide settings are malformed ({0}); fix or delete them")]
    Malformed(String),
    /// Other writes of the settings kept coming first (8 attempts); nothing
    /// was written.
    #[error("the fleet-wide settings kept changing while this change was written; try again")]
    Contended,
}
