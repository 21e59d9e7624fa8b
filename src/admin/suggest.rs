//! `GET /api/suggest/{tier}?target=0.001&window=24h&plan=…`: the limit
//! that would have denied at most `target` of the tier's keys over the
//! window, from the per-key demand every instance recorded
//! ([`RateLimitHandle::suggest`](crate::RateLimitHandle::suggest)). Read
//! only: nothing is applied.

use super::form::form_pairs;
use super::reply::{error, json_response, unknown_tier};
use super::Admin;
use crate::observe::demand::SuggestError;
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// The default target: one key in a thousand denied.
const TARGET: f64 = 0.001;
/// The default window.
const WINDOW: Duration = Duration::from_secs(24 * 3600);

pub(super) async fn api_suggest(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
    req: Request,
) -> Response {
    let mut target = TARGET;
    let mut window = WINDOW;
    let mut plan = None;
    for (k, v) in form_pairs(req.uri().query().unwrap_or("")) {
        match k.as_str() {
            "target" => match v.parse::<f64>() {
                Ok(t) if (0.0..1.0).contains(&t) => target = t,
                _ => return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_target",
                    "target: the share of keys a limit may deny, at least 0 and below 1 (0.001)",
                ),
            },
            "window" => match humantime::parse_duration(&v) {
                Ok(d) => window = d,
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_window",
                        &format!("window: {e} (humantime: 1h, 24h, 7d)"),
                    )
                }
            },
            "plan" => plan = Some(v),
            _ => {}
        }
    }
    match admin
        .handle
        .suggest(&tier, plan.as_deref(), target, window)
        .await
    {
        Ok(s) => json_response(StatusCode::OK, &s.to_json()),
        Err(SuggestError::NotEnoughData { keys, needed }) => json_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            &json!({ "error": "not_enough_data", "keys": keys, "needed": needed }),
        ),
        Err(SuggestError::UnknownTier(_)) => unknown_tier(&tier),
        Err(e @ SuggestError::Off) => json_response(StatusCode::CONFLICT, &e.to_json()),
        Err(e @ SuggestError::InvalidTarget(_)) => {
            error(StatusCode::BAD_REQUEST, "invalid_target", &e.to_string())
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_failed",
            &e.to_string(),
        ),
    }
}
