//! Quotas and lists from the API: `POST /api/quota`, `POST
//! /api/quota/reset`, `GET` and `POST /api/lists`. With a control key on
//! Redis a change is a fleet-wide setting (every instance applies it within
//! one poll interval); without one it changes this process.

use super::api::status_json;
use super::mode::scope;
use super::reply::{error, json_body, json_response};
use super::Admin;
use crate::engine::{ControlError, QuotaSetting};
use crate::handle::ListName;
use crate::rollout::ListEntries;
use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::json;
use std::sync::Arc;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaChange {
    tier: String,
    limit: u64,
    period: String,
    #[serde(default)]
    burst: Option<u64>,
    #[serde(default)]
    plan: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaReset {
    tier: String,
    #[serde(default)]
    plan: Option<String>,
}

/// One list entry as the API writes it: `{"ip":"203.0.113.0/24"}`,
/// `{"user":"ops-bot"}` or `{"api_key":"…"}`.
#[derive(serde::Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Entry {
    Ip(String),
    User(String),
    ApiKey(String),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ListChange {
    list: String,
    #[serde(default)]
    add: Vec<Entry>,
    #[serde(default)]
    remove: Vec<Entry>,
}

fn entries(list: Vec<Entry>) -> ListEntries {
    let mut e = ListEntries::default();
    for entry in list {
        match entry {
            Entry::Ip(s) => e.ips.push(s),
            Entry::User(s) => e.users.push(s),
            Entry::ApiKey(s) => e.api_keys.push(s),
        }
    }
    e
}

/// A refused or failed change: `400 <code>` naming the field, `503` when
/// the control key could not be written.
fn refused(code: &str, e: &ControlError) -> Response {
    match e {
        ControlError::Invalid { field, reason } => json_response(
            StatusCode::BAD_REQUEST,
            &json!({ "error": code, "field": field, "message": format!("{field}: {reason}") }),
        ),
        ControlError::Malformed(_) | ControlError::Contended => {
            error(StatusCode::CONFLICT, "settings_conflict", &e.to_string())
        }
        _ => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "control_key_failed",
            &e.to_string(),
        ),
    }
}

pub(super) async fn api_quota(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let c: QuotaChange = match json_body(
        req,
        r#"{"tier":"user","limit":200,"period":"1m"} (optional "burst", "plan")"#,
    )
    .await
    {
        Ok(c) => c,
        Err(res) => return res,
    };
    let setting = QuotaSetting {
        limit: c.limit,
        period: c.period,
        burst: c.burst,
    };
    match admin
        .handle
        .change_quota("admin", &c.tier, c.plan.as_deref(), Some(setting))
        .await
    {
        Ok(_) => json_response(StatusCode::OK, &status_json(&admin.handle)),
        Err(e) => refused("invalid_quota", &e),
    }
}

pub(super) async fn api_quota_reset(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let c: QuotaReset = match json_body(req, r#"{"tier":"user"} (optional "plan")"#).await {
        Ok(c) => c,
        Err(res) => return res,
    };
    match admin
        .handle
        .change_quota("admin", &c.tier, c.plan.as_deref(), None)
        .await
    {
        Ok(_) => json_response(StatusCode::OK, &status_json(&admin.handle)),
        Err(e) => refused("invalid_quota", &e),
    }
}

pub(super) async fn api_lists(State(admin): State<Arc<Admin>>) -> Response {
    json_response(StatusCode::OK, &lists_json(&admin))
}

fn lists_json(admin: &Admin) -> serde_json::Value {
    let h = &admin.handle;
    json!({
        "allow": h.allowlist_entries(),
        "deny": h.denylist_entries(),
        "settings_version": h.settings_version(),
        "changes_apply_to": scope(h),
    })
}

pub(super) async fn api_lists_change(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let c: ListChange = match json_body(
        req,
        r#"{"list":"allow","add":[{"ip":"203.0.113.0/24"},{"user":"ops-bot"},{"api_key":"k"}],"remove":[...]}"#,
    )
    .await
    {
        Ok(c) => c,
        Err(res) => return res,
    };
    let name = match c.list.as_str() {
        "allow" => ListName::Allow,
        "deny" => ListName::Deny,
        other => {
            return refused(
                "invalid_list",
                &ControlError::Invalid {
                    field: "list".to_owned(),
                    reason: format!("{other:?}: \"allow\" or \"deny\""),
                },
            )
        }
    };
    let (add, remove) = (entries(c.add), entries(c.remove));
    match admin
        .handle
        .change_entries("admin", name, &add, &remove)
        .await
    {
        Ok(_) => json_response(StatusCode::OK, &lists_json(&admin)),
        Err(e) => refused("invalid_list", &e),
    }
}
