//! Quotas and lists from the API: `POST /api/quota`, `POST
//! /api/quota/reset`, `GET` and `POST /api/lists`. With a control key on
//! Redis a change is a fleet-wide setting (every instance applies it within
//! one poll interval); without one it changes this process.

use super::api::status_json;
use super::html::Esc;
use super::mode::scope;
use super::reply::{base_of, error, json_body, json_response, page_path, read_form, see_other};
use super::Admin;
use crate::engine::{ControlError, QuotaSetting};
use crate::rollout::{ListEntries, ListKind};
use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::json;
use std::fmt::Write as _;
use std::sync::Arc;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaChange {
    tier: String,
    #[serde(default)]
    limit: Option<u64>,
    #[serde(default)]
    period: Option<String>,
    #[serde(default)]
    burst: Option<u64>,
    #[serde(default)]
    plan: Option<String>,
    /// A candidate quota of the tier to promote (`"80/1m"`), instead of
    /// `limit`, `period` and `burst`.
    #[serde(default)]
    candidate: Option<String>,
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
        r#"{"tier":"user","limit":200,"period":"1m"} (optional "burst", "plan"), or {"tier":"user","candidate":"80/1m"}"#,
    )
    .await
    {
        Ok(c) => c,
        Err(res) => return res,
    };
    let invalid = |field: &str, reason: &str| {
        refused(
            "invalid_quota",
            &ControlError::Invalid {
                field: field.to_owned(),
                reason: reason.to_owned(),
            },
        )
    };
    let setting = match (&c.candidate, c.limit, c.period) {
        // A candidate promoted: its quota becomes the tier's (each key's
        // used capacity carried over, as for any quota change).
        (Some(label), None, None) if c.burst.is_none() && c.plan.is_none() => {
            match admin.handle.candidate_setting(&c.tier, label) {
                Some(s) => s,
                None => return invalid(
                    "candidate",
                    "not a candidate quota of this tier (GET /api/candidates/{tier} lists them)",
                ),
            }
        }
        (Some(_), _, _) => {
            return invalid(
                "candidate",
                "promotes a candidate alone: without limit, period, burst or plan",
            )
        }
        (None, Some(limit), Some(period)) => QuotaSetting {
            limit,
            period,
            burst: c.burst,
        },
        (None, None, _) => return invalid("limit", "required"),
        (None, Some(_), None) => return invalid("period", "required"),
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
        "allow" => ListKind::Allow,
        "deny" => ListKind::Deny,
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

/// The page's quota and list forms (`action=quota`: `tier`, `plan`,
/// `limit`, `period`, `burst`, `op` = `set` or `reset`; `action=list`:
/// `list`, `kind` = `ip`, `user` or `api_key`, `value`, `op` = `add` or
/// `remove`), answered with a redirect back to the page, or the API's
/// error.
pub(super) async fn form_settings(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let pairs = match read_form(req).await {
        Ok(p) => p,
        Err(res) => return res,
    };
    let field = |name: &str| super::form::form_field(&pairs, name);
    let by = "admin page";
    let done = match (field("action"), field("op")) {
        (Some("quota"), Some(op @ ("set" | "reset"))) => {
            let Some(tier) = field("tier") else {
                return error(StatusCode::BAD_REQUEST, "invalid_body", "tier: missing");
            };
            let setting = if op == "set" {
                let limit = match field("limit").map(str::parse::<u64>) {
                    Some(Ok(l)) => l,
                    _ => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "invalid_quota",
                            "limit: a whole number",
                        )
                    }
                };
                let burst = match field("burst").map(str::parse::<u64>) {
                    None => None,
                    Some(Ok(b)) => Some(b),
                    Some(Err(_)) => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "invalid_quota",
                            "burst: a whole number",
                        )
                    }
                };
                Some(QuotaSetting {
                    limit,
                    period: field("period").unwrap_or("").to_owned(),
                    burst,
                })
            } else {
                None
            };
            admin
                .handle
                .change_quota(by, tier, field("plan"), setting)
                .await
                .map_err(|e| refused("invalid_quota", &e))
        }
        (Some("list"), Some(op @ ("add" | "remove"))) => {
            let kind = match field("list") {
                Some("allow") => ListKind::Allow,
                Some("deny") => ListKind::Deny,
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_list",
                        "list: allow or deny",
                    )
                }
            };
            let Some(value) = field("value") else {
                return error(StatusCode::BAD_REQUEST, "invalid_list", "value: missing");
            };
            let entry = match field("kind") {
                Some("ip") => Entry::Ip(value.to_owned()),
                Some("user") => Entry::User(value.to_owned()),
                Some("api_key") => Entry::ApiKey(value.to_owned()),
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_list",
                        "kind: ip, user or api_key",
                    )
                }
            };
            let (one, none) = (entries(vec![entry]), ListEntries::default());
            let (add, remove) = if op == "add" {
                (&one, &none)
            } else {
                (&none, &one)
            };
            admin
                .handle
                .change_entries(by, kind, add, remove)
                .await
                .map_err(|e| refused("invalid_list", &e))
        }
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_action",
                "action=quota with op=set|reset, or action=list with op=add|remove",
            )
        }
    };
    match done {
        Ok(_) => see_other(page_path(&base)),
        Err(res) => res,
    }
}

/// The fleet-wide settings' forms: a tier's or plan's quota (set or back
/// to the configured one) and the lists' entries, with the version this
/// instance applies and where a change applies.
pub(super) fn render_settings(
    s: &mut String,
    base: &str,
    h: &crate::handle::RateLimitHandle,
    tiers: &[crate::handle::TierStatus],
    scope: &str,
) {
    let action = format!("{base}/settings");
    let _ = write!(
        s,
        r#"<section class="wide"><h2>Quotas and lists</h2><p class="muted" id="settings-version">settings version {}</p><form method="post" action="{}"><input type="hidden" name="action" value="quota"><select name="tier">"#,
        h.settings_version(),
        Esc(&action)
    );
    for t in tiers {
        let _ = write!(s, r#"<option>{}</option>"#, Esc(&t.name));
    }
    let _ = write!(
        s,
        r#"</select> <input name="plan" placeholder="plan (empty: the tier's own)"> <input name="limit" placeholder="limit"> <input name="period" placeholder="period (1m, or month)"> <input name="burst" placeholder="burst (optional)"> <button name="op" value="set">set quota</button> <button name="op" value="reset">configured quota</button>{scope}</form>"#
    );
    for (name, entries) in [
        ("allow", h.allowlist_entries()),
        ("deny", h.denylist_entries()),
    ] {
        let all: Vec<String> = entries
            .ips
            .iter()
            .map(|e| format!("ip {}", Esc(e)))
            .chain(entries.users.iter().map(|e| format!("user {}", Esc(e))))
            .chain(
                entries
                    .api_keys
                    .iter()
                    .map(|e| format!("api_key {}", Esc(e))),
            )
            .collect();
        let _ = write!(
            s,
            r#"<p><strong>{name}list</strong>: {}</p>"#,
            if all.is_empty() {
                "<span class=\"muted\">empty</span>".to_owned()
            } else {
                all.join(", ")
            }
        );
    }
    let _ = write!(
        s,
        r#"<form method="post" action="{}"><input type="hidden" name="action" value="list"><select name="list"><option>deny</option><option>allow</option></select> <select name="kind"><option>ip</option><option>user</option><option>api_key</option></select> <input name="value" placeholder="203.0.113.0/24, a user id or an API key"> <button name="op" value="add">add</button> <button name="op" value="remove">remove</button>{scope}</form></section>"#,
        Esc(&action)
    );
}
