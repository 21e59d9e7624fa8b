//! `GET /api/candidates/{tier}`: what the tier's candidate quotas would
//! have done beside its live quota (see
//! [`RateLimitHandle::candidates`](crate::RateLimitHandle::candidates)).

use super::form::form_pairs;
use super::reply::{error, json_response, unknown_tier};
use super::{Admin, MAX_TOP_N};
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use std::sync::Arc;
use std::time::Duration;

/// `?window=1h` (humantime, rounded up to whole hours, at most 24 h),
/// `?n=10` (each candidate's top keys) and `?scope=fleet` (every
/// instance's counts, from Redis; default `process`).
pub(super) async fn api_candidates(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
    req: Request,
) -> Response {
    let mut n = admin.top_n;
    let mut window = admin.window;
    let mut fleet = false;
    for (k, v) in form_pairs(req.uri().query().unwrap_or("")) {
        match k.as_str() {
            "n" => match v.parse::<usize>() {
                Ok(x) => n = x.clamp(1, MAX_TOP_N),
                Err(_) => return error(StatusCode::BAD_REQUEST, "invalid_n", "n: an integer"),
            },
            "window" => match humantime::parse_duration(&v) {
                Ok(d) => window = d.min(Duration::from_secs(24 * 3600)),
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_window",
                        &format!("window: {e} (humantime: 30m, 1h, 24h)"),
                    )
                }
            },
            "scope" => match v.as_str() {
                "process" => fleet = false,
                "fleet" => fleet = true,
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_scope",
                        "scope: process or fleet",
                    )
                }
            },
            _ => {}
        }
    }
    let report = if fleet && admin.handle.candidates(&tier, 1, window).is_some() {
        match admin.handle.candidates_fleet(&tier, n, window).await {
            Ok(r) => Some(r),
            Err(e @ crate::BackendError::Unsupported(_)) => {
                return error(StatusCode::BAD_REQUEST, "no_fleet_counts", &e.to_string())
            }
            Err(e) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "backend_failed",
                    &e.to_string(),
                )
            }
        }
    } else {
        admin.handle.candidates(&tier, n, window)
    };
    match report {
        Some(report) => match serde_json::to_value(&report) {
            Ok(body) => json_response(StatusCode::OK, &body),
            Err(e) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                &e.to_string(),
            ),
        },
        None => unknown_tier(&tier),
    }
}
