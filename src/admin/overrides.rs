//! Per-key overrides (see [`handle`](crate::handle#per-key-overrides)): `GET /api/overrides/{tier}`,
//! `POST /api/overrides` (set) and `POST /api/overrides/remove`.

use super::reply::{error, json_body, json_response, unknown_tier, TierKey, TIER_KEY};
use super::Admin;
use crate::handle::{Override, OverrideEntry, OverrideError};
use crate::quota::Quota;
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Who the log lines name: the router has one token, no user names.
const BY: &str = "admin API";

fn failed(tier: &str, e: &OverrideError) -> Response {
    match e {
        OverrideError::UnknownTier(_) => unknown_tier(tier),
        OverrideError::InvalidKey => error(StatusCode::BAD_REQUEST, "invalid_key", &e.to_string()),
        OverrideError::Quota(_) => error(StatusCode::BAD_REQUEST, "invalid_quota", &e.to_string()),
        OverrideError::Backend(b) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_failed",
            &b.to_string(),
        ),
    }
}

fn entry_json(e: &OverrideEntry) -> serde_json::Value {
    let rule = match e.rule {
        Override::Quota(q) => json!({
            "limit": q.limit(),
            "period_ms": u64::try_from(q.period().as_millis()).unwrap_or(u64::MAX),
            "burst": q.burst_size(),
        }),
        Override::Unlimited => json!("unlimited"),
        Override::Blocked => json!("blocked"),
    };
    json!({ "key": e.key, "rule": rule, "expires_at_us": e.expires_at_us })
}

pub(super) async fn api_list(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
) -> Response {
    match admin.handle.overrides(&tier).await {
        Ok(list) => json_response(
            StatusCode::OK,
            &json!({
                "tier": tier,
                "overrides": list.iter().map(entry_json).collect::<Vec<_>>(),
            }),
        ),
        Err(e) => failed(&tier, &e),
    }
}

/// A rule as the API takes it: `"unlimited"`, `"blocked"`, or a quota.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Rule {
    Word(String),
    Quota {
        limit: u64,
        /// humantime: `1m`, `1h`.
        period: String,
        #[serde(default)]
        burst: Option<u64>,
    },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Set {
    tier: String,
    key: String,
    rule: Rule,
    /// humantime; none: until removed.
    #[serde(default)]
    ttl: Option<String>,
}

const EXAMPLE: &str = r#"{"tier":"ip","key":"203.0.113.7","rule":{"limit":1000,"period":"1m"},"ttl":"7d"} (rule: "unlimited", "blocked" or a quota; ttl optional)"#;

fn bad(what: &str) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_body",
        &format!("{what}; expected {EXAMPLE}"),
    )
}

pub(super) async fn api_set(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let s: Set = match json_body(req, EXAMPLE).await {
        Ok(s) => s,
        Err(res) => return res,
    };
    let rule = match s.rule {
        Rule::Word(w) if w == "unlimited" => Override::Unlimited,
        Rule::Word(w) if w == "blocked" => Override::Blocked,
        Rule::Word(w) => return bad(&format!("rule: {w:?} is not unlimited, blocked or a quota")),
        Rule::Quota {
            limit,
            period,
            burst,
        } => {
            let Ok(period) = humantime::parse_duration(&period) else {
                return bad("rule.period: a humantime duration (1s, 1m, 1h)");
            };
            let q = Quota::new(limit, period);
            Override::Quota(burst.map_or(q, |b| q.burst(b)))
        }
    };
    let ttl: Option<Duration> = match s.ttl.as_deref().map(humantime::parse_duration) {
        None => None,
        Some(Ok(d)) if !d.is_zero() => Some(d),
        Some(_) => return bad("ttl: a humantime duration above zero (30m, 7d)"),
    };
    match admin
        .handle
        .set_override(&s.tier, &s.key, rule, ttl, BY)
        .await
    {
        Ok(()) => match admin.handle.overrides(&s.tier).await {
            Ok(list) => json_response(
                StatusCode::OK,
                &json!({
                    "tier": s.tier,
                    "overrides": list.iter().map(entry_json).collect::<Vec<_>>(),
                }),
            ),
            Err(e) => failed(&s.tier, &e),
        },
        Err(e) => failed(&s.tier, &e),
    }
}

pub(super) async fn api_remove(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let r: TierKey = match json_body(req, TIER_KEY).await {
        Ok(r) => r,
        Err(res) => return res,
    };
    match admin.handle.remove_override(&r.tier, &r.key, BY).await {
        Ok(existed) => json_response(
            StatusCode::OK,
            &json!({ "tier": r.tier, "key": crate::key::typed_key_part(&r.key), "existed": existed }),
        ),
        Err(e) => failed(&r.tier, &e),
    }
}
