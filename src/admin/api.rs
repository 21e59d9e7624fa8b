//! The JSON API: status, top-N keys, history, anomalies, mode changes.

use super::form::form_pairs;
use super::mode::{apply_mode, scope};
use super::reply::{error, json_body, json_response, unknown_tier};
use super::{Admin, MAX_TOP_N};
use crate::observe::recorder::{AnomalyStatus, BucketCounts};
use crate::observe::topn::BlockedKey;
use crate::{
    algorithm::kind::Algorithm, algorithm::kind::LeakyBucket, handle::RateLimitHandle,
    handle::TierStatus, observe::DecisionCounts,
};
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::StatusCode;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

pub(super) async fn api_status(State(admin): State<Arc<Admin>>) -> Response {
    json_response(StatusCode::OK, &status_json(&admin.handle))
}

pub(super) async fn api_anomalies(State(admin): State<Arc<Admin>>) -> Response {
    let guards = admin.handle.guard_views();
    let mut anomalies = anomalies_json(&admin.handle.anomalies());
    for a in &mut anomalies {
        let cause = guards
            .iter()
            .find(|g| a["tier"] == g.tier.as_str())
            .and_then(|g| g.last.and_then(|j| j.cause))
            .map(|c| c.name());
        a["cause"] = json!(cause);
    }
    json_response(
        StatusCode::OK,
        &json!({
            "anomalies": anomalies,
            "guards": guards.iter().map(guard_json).collect::<Vec<_>>(),
        }),
    )
}

/// A guarded tier's last judged bucket: its `cause` (`limiter`, `abuse`,
/// `surge`, `unknown`; `null` inside the band) and the numbers it was
/// decided on.
fn guard_json(g: &crate::engine::rollout::GuardView) -> Value {
    let mut v =
        json!({ "tier": g.tier, "leader": g.leader, "cause": Value::Null, "judged": false });
    if let Some(j) = &g.last {
        v["judged"] = json!(true);
        v["cause"] = json!(j.cause.map(|c| c.name()));
        v["alerting"] = json!(j.cause.is_some());
        v["rate"] = json!(j.rate);
        v["mean"] = json!(j.mean);
        v["sigma"] = json!(j.sigma);
        v["checked"] = json!(j.checked);
        v["request_rate"] = json!(j.request_rate);
        v["request_mean"] = json!(j.request_mean);
        v["denied_keys"] = json!(j.denied_keys);
        v["top5_share"] = json!(j.top_share);
        v["rest_rate"] = json!(j.rest.0);
        v["rest_mean"] = json!(j.rest.1);
        v["streak"] = json!(j.streak);
        if let Some((e, s)) = j.cohorts {
            v["enforced_rate"] = json!(e);
            v["shadowed_rate"] = json!(s);
        }
    }
    v
}

pub(super) async fn api_history(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
) -> Response {
    match admin.handle.history(&tier) {
        Some(buckets) => json_response(
            StatusCode::OK,
            &json!({
                "tier": tier,
                "buckets": buckets.iter().map(bucket_json).collect::<Vec<_>>(),
                "current": admin.handle.open_bucket(&tier).map(|b| {
                    let mut v = bucket_json(&b);
                    v["partial"] = json!(true);
                    v
                }),
            }),
        ),
        None => unknown_tier(&tier),
    }
}

pub(super) async fn api_top(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
    req: Request,
) -> Response {
    let mut n = admin.top_n;
    let mut window = admin.window;
    let mut kind = "blocked";
    for (k, v) in form_pairs(req.uri().query().unwrap_or("")) {
        match k.as_str() {
            "n" | "window" => {
                if let Some(e) = top_param(&k, &v, &mut n, &mut window) {
                    return e;
                }
            }
            "kind" => match v.as_str() {
                "blocked" => kind = "blocked",
                "shadow_limited" => kind = "shadow_limited",
                "near_limit" => kind = "near_limit",
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_kind",
                        "kind: blocked, shadow_limited or near_limit",
                    )
                }
            },
            _ => {}
        }
    }
    let top = match kind {
        "near_limit" => admin.handle.top_near_limit(&tier, n, window),
        "shadow_limited" => admin.handle.top_shadow_limited(&tier, n, window),
        _ => admin.handle.top_blocked(&tier, n, window),
    };
    match top {
        Some(keys) => json_response(
            StatusCode::OK,
            &json!({
                "tier": tier,
                "kind": kind,
                "window_secs": window_hours(window) * 3600,
                "keys": keys.iter().map(key_json).collect::<Vec<_>>(),
            }),
        ),
        None => unknown_tier(&tier),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ModeChange {
    mode: String,
    #[serde(default)]
    tier: Option<String>,
}

pub(super) async fn api_mode(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let change: ModeChange = match json_body(
        req,
        r#"{"mode":"shadow"} or {"tier":"ip","mode":"canary:10"}"#,
    )
    .await
    {
        Ok(c) => c,
        Err(res) => return res,
    };
    match apply_mode(&admin.handle, change.tier.as_deref(), &change.mode, "api").await {
        Ok(()) => json_response(StatusCode::OK, &status_json(&admin.handle)),
        Err(e) => e.response(),
    }
}

pub(super) fn status_json(h: &RateLimitHandle) -> Value {
    json!({
        "mode": h.mode().to_string(),
        "effective_mode": h.effective_mode().to_string(),
        "circuit_state": h.circuit_state(),
        "mode_changes_apply_to": scope(h),
        "control_key": h.fleet_control_key(),
        "settings_version": h.settings_version(),
        "counts": counts_json(&h.counts()),
        "tiers": h.tiers().iter().map(tier_json).collect::<Vec<_>>(),
        "anomalies": anomalies_json(&h.anomalies()),
    })
}

fn counts_json(c: &DecisionCounts) -> Value {
    json!({
        "allowed": c.allowed,
        "limited": c.limited,
        "shadow_limited": c.shadow_limited,
        "allowlisted": c.allowlisted,
        "denylisted": c.denylisted,
        "fail_open": c.fail_open,
        "fail_closed": c.fail_closed,
        "skipped": c.skipped,
        "cache_blocked": c.cache_blocked,
        "fallback": c.fallback,
    })
}

fn quota_json(q: &crate::quota::Quota) -> Value {
    json!({
        "limit": q.limit(),
        "period": humantime::format_duration(q.period()).to_string(),
        "period_secs": q.period().as_secs_f64(),
        "burst": q.burst_size(),
    })
}

fn tier_json(t: &TierStatus) -> Value {
    let mut v = json!({
        "name": t.name,
        "mode": t.mode.to_string(),
        "effective_mode": t.effective_mode.to_string(),
        "algorithm": t.algorithm.name(),
        "quota": quota_json(&t.quota),
        "plans": t.plans.iter().map(|(p, q)| json!({ "plan": p, "quota": quota_json(q) })).collect::<Vec<_>>(),
    });
    if let Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) = t.algorithm {
        v["max_delay"] = json!(humantime::format_duration(max_delay).to_string());
    }
    if let Algorithm::Concurrency { slot_ttl } = t.algorithm {
        v["lease"] = json!(humantime::format_duration(slot_ttl).to_string());
    }
    v
}

fn anomalies_json(a: &[AnomalyStatus]) -> Vec<Value> {
    a.iter()
        .map(|a| {
            json!({
                "tier": a.tier,
                "endpoint": a.endpoint,
                "alerting": a.alerting,
                "rate": a.rate,
                "mean": a.mean,
                "sigma": a.sigma,
            })
        })
        .collect()
}

fn bucket_json(b: &BucketCounts) -> Value {
    json!({
        "start": b.start,
        "requests": b.requests,
        "limited": b.limited,
        "shadow_limited": b.shadow_limited,
        "fail_open": b.fail_open,
    })
}

fn key_json(k: &BlockedKey) -> Value {
    json!({ "key": k.key, "count": k.count, "error": k.error })
}

/// Whole hours a top-N window covers, as the handle rounds it.
pub(super) fn window_hours(window: Duration) -> u64 {
    window.as_secs().div_ceil(3600).clamp(1, 24)
}

/// A top-N query's `n` (clamped to `1..=MAX_TOP_N`) or `window` (humantime,
/// at most 24 h) into its variable; a malformed value: the 400 to answer.
pub(super) fn top_param(
    k: &str,
    v: &str,
    n: &mut usize,
    window: &mut Duration,
) -> Option<Response> {
    if k == "n" {
        match v.parse::<usize>() {
            Ok(x) => *n = x.clamp(1, MAX_TOP_N),
            Err(_) => return Some(error(StatusCode::BAD_REQUEST, "invalid_n", "n: an integer")),
        }
    } else {
        match humantime::parse_duration(v) {
            Ok(d) => *window = d.min(Duration::from_secs(24 * 3600)),
            Err(e) => {
                return Some(error(
                    StatusCode::BAD_REQUEST,
                    "invalid_window",
                    &format!("window: {e} (humantime: 30m, 1h, 24h)"),
                ))
            }
        }
    }
    None
}
