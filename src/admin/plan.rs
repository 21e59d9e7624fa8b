//! Rollout plans from the API and the page: `POST /api/plan`
//! (`{"tier","action"}`), `GET /api/plan/{tier}`, `GET /api/rollout/log`,
//! the page's `/plan` form and its "Rollout plans" section.

use super::form::form_pairs;
use super::html::Esc;
use super::reply::{
    base_of, error, json_body, json_response, page_path, read_form, see_other, unknown_tier,
};
use super::Admin;
use crate::engine::ControlError;
use crate::handle::RateLimitHandle;
use crate::rollout::{PlanAction, RolloutEvent};
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::json;
use std::fmt::Write as _;
use std::sync::Arc;

/// Log entries on the page.
pub(super) const PAGE_LOG_ENTRIES: usize = 10;
/// The most log entries one API call answers.
const MAX_LOG_ENTRIES: usize = 1000;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanChange {
    tier: String,
    action: String,
}

/// A refused action: 404 for an unknown tier, 400 naming the field, 409
/// when the stored state is malformed or kept moving, 503 when the
/// control key could not be written or there is none.
fn refused(e: &ControlError) -> Response {
    match e {
        ControlError::UnknownTier(t) => unknown_tier(t),
        ControlError::Invalid { field, reason } => json_response(
            StatusCode::BAD_REQUEST,
            &json!({ "error": "invalid_plan_action", "field": field, "message": format!("{field}: {reason}") }),
        ),
        ControlError::Malformed(_) | ControlError::Contended => {
            error(StatusCode::CONFLICT, "plan_conflict", &e.to_string())
        }
        _ => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "control_key_failed",
            &e.to_string(),
        ),
    }
}

async fn run(
    handle: &RateLimitHandle,
    tier: &str,
    action: &str,
    by: &str,
) -> Result<serde_json::Value, Response> {
    let action: PlanAction = action.parse().map_err(|e: String| {
        json_response(
            StatusCode::BAD_REQUEST,
            &json!({ "error": "invalid_plan_action", "field": "action", "message": format!("action: {e}") }),
        )
    })?;
    let status = handle
        .plan(tier, action, by)
        .await
        .map_err(|e| refused(&e))?;
    Ok(json!(status))
}

pub(super) async fn api_plan(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let c: PlanChange = match json_body(
        req,
        r#"{"tier":"user","action":"start"} (start, pause, resume or abort)"#,
    )
    .await
    {
        Ok(c) => c,
        Err(res) => return res,
    };
    match run(&admin.handle, &c.tier, &c.action, "admin").await {
        Ok(body) => json_response(StatusCode::OK, &body),
        Err(res) => res,
    }
}

pub(super) async fn api_plan_status(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
) -> Response {
    match admin.handle.plan_status(&tier) {
        Ok(s) => json_response(StatusCode::OK, &json!(s)),
        Err(e) => refused(&e),
    }
}

/// `?count=N` (default 100, at most 1000).
pub(super) async fn api_rollout_log(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let mut count = 100;
    for (k, v) in form_pairs(req.uri().query().unwrap_or("")) {
        if k == "count" {
            match v.parse::<usize>() {
                Ok(n) => count = n,
                Err(_) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_count",
                        "count: a whole number",
                    )
                }
            }
        }
    }
    let count = count.min(MAX_LOG_ENTRIES);
    match admin.handle.rollout_log(count).await {
        Ok(entries) => json_response(StatusCode::OK, &json!({ "entries": entries })),
        Err(e) => refused(&e),
    }
}

/// The page's plan form (`tier`, `action` = `start`, `pause`, `resume` or
/// `abort`), answered with a redirect back to the page, or the API's error.
pub(super) async fn form_plan(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let pairs = match read_form(req).await {
        Ok(p) => p,
        Err(res) => return res,
    };
    let field = |name: &str| super::form::form_field(&pairs, name).unwrap_or("");
    match run(&admin.handle, field("tier"), field("action"), "admin page").await {
        Ok(_) => see_other(page_path(&base)),
        Err(res) => res,
    }
}

/// The "Rollout plans" section: each planned tier's stage, mode, status and
/// what holds it, its actions, and the log's last entries (or why it could
/// not be read). Nothing when no tier has a plan.
pub(super) fn render_plans(
    s: &mut String,
    base: &str,
    h: &RateLimitHandle,
    log: Option<&Result<Vec<RolloutEvent>, ControlError>>,
) {
    let tiers = h.planned_tiers();
    if tiers.is_empty() {
        return;
    }
    let action = format!("{base}/plan");
    s.push_str(r#"<section class="wide"><h2>Rollout plans</h2><table id="plans"><tr><th>tier</th><th>stage</th><th>mode</th><th>status</th><th>next stage at</th><th>holding</th><th class="n">version</th><th></th></tr>"#);
    for t in &tiers {
        let Ok(p) = h.plan_status(t) else { continue };
        let next = p.next_at_us.map_or_else(
            || "–".to_owned(),
            |us| {
                humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_micros(us),
                )
                .to_string()
            },
        );
        let _ = write!(
            s,
            r#"<tr><td><code>{name}</code></td><td class="n">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class="n">{}</td><td><form method="post" action="{action}"><input type="hidden" name="tier" value="{name}"><button name="action" value="start">start</button> <button name="action" value="pause">pause</button> <button name="action" value="resume">resume</button> <button name="action" value="abort">abort</button></form></td></tr>"#,
            p.stage,
            Esc(&p.mode),
            Esc(&p.status),
            next,
            p.holding
                .as_deref()
                .map_or_else(|| "–".to_owned(), |w| Esc(w).to_string()),
            p.version,
            name = Esc(t),
            action = Esc(&action),
        );
    }
    s.push_str("</table>");
    match log {
        Some(Ok(entries)) => {
            s.push_str(r#"<table id="rollout-log"><tr><th>at</th><th>tier</th><th>event</th><th>stage</th><th>mode</th><th>by</th><th>instance</th><th>why</th><th>evidence</th></tr>"#);
            for e in entries {
                let _ = write!(
                    s,
                    r#"<tr><td>{}</td><td>{}</td><td>{}</td><td class="n">{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>"#,
                    humantime::format_rfc3339_seconds(
                        std::time::UNIX_EPOCH + std::time::Duration::from_micros(e.at_us)
                    ),
                    Esc(&e.tier),
                    Esc(&e.event),
                    e.stage,
                    Esc(&e.mode),
                    Esc(&e.by),
                    Esc(&e.instance),
                    Esc(&e.reason),
                    Esc(&e.evidence),
                );
            }
            s.push_str("</table>");
        }
        Some(Err(e)) => {
            let _ = write!(
                s,
                r#"<p class="muted">rollout log: {}</p>"#,
                Esc(&e.to_string())
            );
        }
        None => {}
    }
    s.push_str("</section>");
}
