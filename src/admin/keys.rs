//! One key's numbers and its reset: `GET /api/peek/{tier}?key=…` and
//! `POST /api/reset` (see [`handle`](crate::handle#peek-reset-and-lift)). A key is typed in either
//! form (as the page shows it, or as stored); answers name its stored form.

use super::form::form_pairs;
use super::reply::{error, json_body, json_response, unknown_tier, TierKey, TIER_KEY};
use super::Admin;
use crate::handle::{InspectError, KeyStatus};
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::json;
use std::sync::Arc;

/// The key of `?key=`.
fn key_param(req: &Request) -> Option<String> {
    form_pairs(req.uri().query().unwrap_or(""))
        .into_iter()
        .find(|(k, _)| k == "key")
        .map(|(_, v)| v)
}

fn failed(tier: &str, e: &InspectError) -> Response {
    match e {
        InspectError::UnknownTier(_) => unknown_tier(tier),
        InspectError::InvalidKey => error(StatusCode::BAD_REQUEST, "invalid_key", &e.to_string()),
        InspectError::Backend(b) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_failed",
            &b.to_string(),
        ),
    }
}

fn status_json(tier: &str, key: &str, s: &KeyStatus) -> serde_json::Value {
    let mut v = json!({
        "tier": tier,
        "key": key,
        "allowed": s.allowed,
        "limit": s.limit,
        "remaining": s.remaining,
        "reset_after_us": u64::try_from(s.reset_after.as_micros()).unwrap_or(u64::MAX),
        "retry_after_us": u64::try_from(s.retry_after.as_micros()).unwrap_or(u64::MAX),
        "now_us": s.now_us,
        "blocked_for_us": s.blocked_for.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
    });
    // A calendar quota's renewal (Unix epoch µs), only for such a tier.
    if let (Some(at), Some(o)) = (s.renews_at_us, v.as_object_mut()) {
        o.insert("renews_at_us".to_owned(), at.into());
    }
    v
}

pub(super) async fn api_peek(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
    req: Request,
) -> Response {
    let Some(key) = key_param(&req) else {
        return error(
            StatusCode::BAD_REQUEST,
            "missing_key",
            "key: as the page shows it, or as stored (?key=...)",
        );
    };
    match admin.handle.peek(&tier, &key).await {
        Ok(s) => json_response(
            StatusCode::OK,
            &status_json(&tier, &crate::key::typed_key_part(&key), &s),
        ),
        Err(e) => failed(&tier, &e),
    }
}

pub(super) async fn api_reset(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    key_action(admin, req, false).await
}

pub(super) async fn api_lift(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    key_action(admin, req, true).await
}

/// A reset, or a lift of the penalty box only.
async fn key_action(admin: Arc<Admin>, req: Request, lift: bool) -> Response {
    let r: TierKey = match json_body(req, TIER_KEY).await {
        Ok(r) => r,
        Err(res) => return res,
    };
    let done = if lift {
        admin.handle.lift(&r.tier, &r.key).await
    } else {
        admin.handle.reset(&r.tier, &r.key).await
    };
    match done {
        Ok(existed) => json_response(
            StatusCode::OK,
            &json!({ "tier": r.tier, "key": crate::key::typed_key_part(&r.key), "existed": existed }),
        ),
        Err(e) => failed(&r.tier, &e),
    }
}
