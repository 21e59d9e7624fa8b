//! Mode changes from the page and the API: where they apply (the fleet
//! control key or this process), and the log line each leaves.

use super::reply::{error, unknown_tier};
use crate::{handle::RateLimitHandle, rollout::Mode};
use axum::response::Response;
use http::StatusCode;

/// Why a mode change was refused.
pub(super) enum ModeError {
    Invalid(String),
    UnknownTier(String),
    /// The control key could not be written: nothing changed.
    Control(crate::engine::ControlError),
}

impl ModeError {
    pub(super) fn response(&self) -> Response {
        match self {
            ModeError::Invalid(e) => error(StatusCode::BAD_REQUEST, "invalid_mode", e),
            ModeError::UnknownTier(t) => unknown_tier(t),
            ModeError::Control(e) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "control_key_failed",
                &e.to_string(),
            ),
        }
    }
}

/// Where the router's mode changes apply: `all instances` (the control
/// key is written) or `this instance (host:pid)`.
pub(super) fn scope(handle: &RateLimitHandle) -> String {
    if handle.fleet_control_key().is_some() {
        "all instances".to_owned()
    } else {
        static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let host = HOST.get_or_init(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "unknown-host".to_owned())
        });
        format!("this instance ({host}:{})", std::process::id())
    }
}

/// Sets the global mode (`tier` absent or empty) or a tier's, and logs it:
/// with a control key, on every instance through it; else in this process.
pub(super) async fn apply_mode(
    handle: &RateLimitHandle,
    tier: Option<&str>,
    mode: &str,
    via: &'static str,
) -> Result<(), ModeError> {
    let mode: Mode = mode.parse().map_err(ModeError::Invalid)?;
    let tier = tier.filter(|t| !t.is_empty());
    if let Some(key) = handle.fleet_control_key().map(str::to_owned) {
        let from = match tier {
            None => handle.effective_mode(),
            Some(t) => {
                handle
                    .tiers()
                    .into_iter()
                    .find(|s| s.name == t)
                    .ok_or_else(|| ModeError::UnknownTier(t.to_owned()))?
                    .effective_mode
            }
        };
        handle
            .set_fleet_mode(tier, mode)
            .await
            .map_err(ModeError::Control)?;
        let tier = tier.unwrap_or("");
        if mode == Mode::Off && tier.is_empty() {
            tracing::warn!(%from, to = %mode, via, key, "rate limiter admin: kill switch, global mode off on all instances (control key)");
        } else {
            tracing::info!(tier, %from, to = %mode, via, key, "rate limiter admin: mode changed on all instances (control key)");
        }
        return Ok(());
    }
    match tier {
        None => {
            let from = handle.mode();
            handle.set_mode(mode);
            if mode == Mode::Off {
                tracing::warn!(%from, to = %mode, via, "rate limiter admin: kill switch, global mode off");
            } else {
                tracing::info!(%from, to = %mode, via, "rate limiter admin: global mode changed");
            }
            Ok(())
        }
        Some(t) => {
            let unknown = || ModeError::UnknownTier(t.to_owned());
            let from = handle
                .tiers()
                .into_iter()
                .find(|s| s.name == t)
                .ok_or_else(unknown)?;
            handle.set_tier_mode(t, mode).map_err(|_| unknown())?;
            tracing::info!(tier = t, from = %from.mode, to = %mode, via, "rate limiter admin: tier mode changed");
            Ok(())
        }
    }
}
