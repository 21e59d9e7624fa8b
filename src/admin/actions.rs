//! The admin page's forms: the POST actions of its buttons (a key's peek,
//! reset, lift and override; the kill switch and modes), each answered with
//! a redirect back to the page.

use super::mode::apply_mode;
use super::reply::{base_of, error, page_path, read_form, see_other};
use super::Admin;
use crate::handle::InspectError;
use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;
use std::sync::Arc;

/// A rule as the page's form writes it: `unlimited`, `blocked`, or
/// `<limit>/<period>` (humantime).
fn form_rule(s: &str) -> Option<crate::handle::Override> {
    use crate::handle::Override;
    match s.trim() {
        "unlimited" => Some(Override::Unlimited),
        "blocked" => Some(Override::Blocked),
        r => {
            let (limit, period) = r.split_once('/')?;
            let q = crate::quota::Quota::new(
                limit.trim().parse().ok()?,
                humantime::parse_duration(period.trim()).ok()?,
            );
            Some(Override::Quota(q))
        }
    }
}

/// The page's override form and remove buttons (`action=override`: `tier`,
/// `key`, `rule`, optional `ttl`; `action=remove_override`: `tier`, `key`).
async fn form_override(
    admin: &Admin,
    base: &str,
    action: &str,
    tier: &str,
    key: &str,
    fields: &[(String, String)],
) -> Response {
    use crate::handle::OverrideError;
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let done = if action == "remove_override" {
        admin
            .handle
            .remove_override(tier, key, "admin page")
            .await
            .map(|_| ())
    } else {
        let Some(rule) = field("rule").and_then(form_rule) else {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_rule",
                "rule: unlimited, blocked or <limit>/<period> (1000/1m)",
            );
        };
        let ttl = match field("ttl").map(str::trim).filter(|t| !t.is_empty()) {
            None => None,
            Some(t) => match humantime::parse_duration(t) {
                Ok(d) if !d.is_zero() => Some(d),
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_ttl",
                        "ttl: a humantime duration (30m, 1d)",
                    )
                }
            },
        };
        admin
            .handle
            .set_override(tier, key, rule, ttl, "admin page")
            .await
    };
    match done {
        Ok(()) => see_other(page_path(base)),
        Err(OverrideError::UnknownTier(_)) => super::reply::unknown_tier(tier),
        Err(e @ OverrideError::InvalidKey) => {
            error(StatusCode::BAD_REQUEST, "invalid_key", &e.to_string())
        }
        Err(e @ OverrideError::Quota(_)) => {
            error(StatusCode::BAD_REQUEST, "invalid_quota", &e.to_string())
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_failed",
            &e.to_string(),
        ),
    }
}

/// The page's reset and lift buttons.
pub(super) async fn form_key(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let pairs = match read_form(req).await {
        Ok(p) => p,
        Err(res) => return res,
    };
    let (mut action, mut tier, mut key) = (None, None, None);
    for (k, v) in &pairs {
        match k.as_str() {
            "action" => action = Some(v.clone()),
            "tier" => tier = Some(v.clone()),
            "key" => key = Some(v.clone()),
            _ => {}
        }
    }
    let (Some(action), Some(tier), Some(key)) = (action, tier, key) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            "action, tier and key are required",
        );
    };
    if action == "override" || action == "remove_override" {
        return form_override(&admin, &base, &action, &tier, &key, &pairs).await;
    }
    let done = match action.as_str() {
        "reset" => admin.handle.reset(&tier, &key).await,
        "lift" => admin.handle.lift(&tier, &key).await,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_action",
                "action: reset or lift",
            )
        }
    };
    match done {
        Ok(_) => see_other(page_path(&base)),
        Err(InspectError::UnknownTier(_)) => super::reply::unknown_tier(&tier),
        Err(e @ InspectError::InvalidKey) => {
            error(StatusCode::BAD_REQUEST, "invalid_key", &e.to_string())
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_failed",
            &e.to_string(),
        ),
    }
}

pub(super) async fn form_mode(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let pairs = match read_form(req).await {
        Ok(p) => p,
        Err(res) => return res,
    };
    let (mut mode, mut tier) = (None, None);
    for (k, v) in pairs {
        match k.as_str() {
            "mode" => mode = Some(v),
            "tier" => tier = Some(v),
            _ => {}
        }
    }
    let Some(mode) = mode else {
        return error(StatusCode::BAD_REQUEST, "invalid_body", "mode: missing");
    };
    match apply_mode(&admin.handle, tier.as_deref(), &mode, "page").await {
        Ok(()) => see_other(page_path(&base)),
        Err(e) => e.response(),
    }
}
