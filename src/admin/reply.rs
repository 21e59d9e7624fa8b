//! The admin's answers: JSON bodies and errors, redirects back to the
//! page, bounded request bodies, and where the router is mounted.

use axum::body::{Body, Bytes};
use axum::extract::{NestedPath, Request};
use axum::response::Response;
use http::{header, HeaderValue, StatusCode};
use serde_json::{json, Value};

/// Request bodies larger than this are refused (`413`).
const BODY_LIMIT: usize = 16 * 1024;

/// Where the router is mounted, without a trailing slash (`""` at the root).
pub(super) fn base_of(req: &Request) -> String {
    req.extensions()
        .get::<NestedPath>()
        .map(|p| p.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default()
}

/// The page's own path.
pub(super) fn page_path(base: &str) -> &str {
    if base.is_empty() {
        "/"
    } else {
        base
    }
}

pub(super) async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "not_found", "no such admin route")
}

pub(super) fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut res = Response::new(Body::from(body.to_string()));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

pub(super) fn error(status: StatusCode, code: &str, message: &str) -> Response {
    json_response(status, &json!({ "error": code, "message": message }))
}

pub(super) fn unknown_tier(tier: &str) -> Response {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({ "error": "unknown_tier", "tier": tier }),
    )
}

pub(super) fn see_other(location: &str) -> Response {
    let mut res = Response::new(Body::empty());
    *res.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(v) = HeaderValue::from_str(location) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    res
}

/// A JSON request body as `T`: `413` past 16 KiB, `400 invalid_body` with
/// serde's message and `expected` (an example body) when it does not parse.
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    req: Request,
    expected: &str,
) -> Result<T, Response> {
    let body = read_body(req).await?;
    serde_json::from_slice(&body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            &format!("{e}; expected {expected}"),
        )
    })
}

/// The body of the admin API's actions on one key (reset, lift, remove an
/// override).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TierKey {
    pub(super) tier: String,
    pub(super) key: String,
}

/// An example [`TierKey`] body.
pub(super) const TIER_KEY: &str = r#"{"tier":"ip","key":"203.0.113.7"}"#;

/// A form body's pairs (`application/x-www-form-urlencoded`, at most
/// 16 KiB, UTF-8), or the error to answer.
pub(super) async fn read_form(req: Request) -> Result<Vec<(String, String)>, Response> {
    let body = read_body(req).await?;
    let Ok(body) = std::str::from_utf8(&body) else {
        return Err(error(StatusCode::BAD_REQUEST, "invalid_body", "not UTF-8"));
    };
    Ok(super::form::form_pairs(body))
}

pub(super) async fn read_body(req: Request) -> Result<Bytes, Response> {
    axum::body::to_bytes(req.into_body(), BODY_LIMIT)
        .await
        .map_err(|_| {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "at most 16 KiB",
            )
        })
}
