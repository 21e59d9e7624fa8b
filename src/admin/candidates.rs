//! `GET /api/candidates/{tier}`: what the tier's candidate quotas would
//! have done beside its live quota (see
//! [`RateLimitHandle::candidates`](crate::RateLimitHandle::candidates)).

use super::api::top_param;
use super::form::form_pairs;
use super::reply::{error, json_response, unknown_tier};
use super::Admin;
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use std::sync::Arc;

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
            "n" | "window" => {
                if let Some(e) = top_param(&k, &v, &mut n, &mut window) {
                    return e;
                }
            }
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

/// The page's table of candidate quotas (only when a tier has some): per
/// tier, its live quota then each candidate, over the page's window, in
/// this process: requests, would-be denials and their share, distinct keys
/// denied, and the three heaviest.
pub(super) fn render_candidates(
    s: &mut String,
    admin: &Admin,
    tiers: &[crate::handle::TierStatus],
) {
    use super::html::Esc;
    use std::fmt::Write as _;
    let reports: Vec<_> = tiers
        .iter()
        .filter_map(|t| admin.handle.candidates(&t.name, 3, admin.window))
        .filter(|r| !r.candidates.is_empty())
        .collect();
    let Some(first) = reports.first() else {
        return;
    };
    let _ = write!(
        s,
        r#"<section class="wide"><h2>Candidate quotas, last {} h</h2><table id="candidates"><tr><th>tier</th><th>quota</th><th class="n">requests</th><th class="n">would deny</th><th class="n">rate</th><th class="n">keys denied</th><th>heaviest</th></tr>"#,
        first.window_secs / 3600
    );
    for r in &reports {
        let live = std::iter::once((true, &r.live));
        for (is_live, c) in live.chain(r.candidates.iter().map(|c| (false, c))) {
            #[allow(clippy::cast_precision_loss)]
            let rate = if c.requests == 0 {
                0.0
            } else {
                c.would_deny as f64 * 100.0 / c.requests as f64
            };
            let top: Vec<String> = c
                .top
                .iter()
                .map(|k| format!("<code>{}</code> {}", Esc(&k.key), k.count))
                .collect();
            let _ = write!(
                s,
                r#"<tr{}><td><code>{}</code></td><td>{}{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{rate:.2}%</td><td class="n">{}{}</td><td>{}</td></tr>"#,
                if is_live { r#" class="live""# } else { "" },
                Esc(&r.tier),
                Esc(&c.quota),
                if is_live {
                    " <span class=\"muted\">live</span>"
                } else {
                    ""
                },
                c.requests,
                c.would_deny,
                c.keys_denied,
                if c.keys_capped { "+" } else { "" },
                if top.is_empty() {
                    "<span class=\"muted\">–</span>".to_owned()
                } else {
                    top.join(", ")
                },
            );
        }
    }
    s.push_str("</table></section>");
}
