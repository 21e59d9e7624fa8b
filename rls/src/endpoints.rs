//! The reference service's HTTP endpoints (its `HOST`:`PORT`, 8080 by
//! default): `GET /healthcheck` and `POST /json`, a `ShouldRateLimit` in
//! protobuf's canonical JSON mapping (field names in lowerCamelCase, the
//! proto names accepted too; enums by name; `Duration` as `"1.5s"`; fields
//! at their default value left out), as the reference answers it: 200 for
//! `OK`, 429 for `OVER_LIMIT`, 400 for a body that is not a request or a
//! request the service refuses, with the body `Bad Request: ` and what is
//! wrong (the reference's body is `Bad Request` alone).

use crate::Rls;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The largest `/json` body read (bytes); a larger one is answered 413.
pub const MAX_JSON_BODY: usize = 64 * 1024;

/// `/healthcheck` and `/json` over `rls`. `/healthcheck` answers 200 `OK`
/// while `serving` is true and 500 with an empty body once it is false
/// (the reference's answers; [`crate::serve_http`] turns it false when
/// shutdown starts).
pub fn router(rls: Rls, serving: Arc<AtomicBool>) -> axum::Router {
    axum::Router::new()
        .route(
            "/healthcheck",
            axum::routing::get(move || {
                let up = serving.load(Ordering::Acquire);
                async move {
                    if up {
                        (StatusCode::OK, "OK").into_response()
                    } else {
                        StatusCode::INTERNAL_SERVER_ERROR.into_response()
                    }
                }
            }),
        )
        .route(
            "/json",
            axum::routing::post(move |body: axum::body::Bytes| {
                let rls = rls.clone();
                async move { json_call(&rls, &body).await }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON_BODY))
}

/// The reference's `400 Bad Request`, with what is wrong after it (the
/// reference's body stops at `Bad Request`; its reason is only in its log).
fn bad_request(why: &str) -> Response {
    (StatusCode::BAD_REQUEST, format!("Bad Request: {why}\n")).into_response()
}

async fn json_call(rls: &Rls, body: &[u8]) -> Response {
    let req: JsonRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "/json: not a RateLimitRequest");
            return bad_request(&format!("not a RateLimitRequest in JSON: {e}"));
        }
    };
    let req = req.into_proto();
    match rls.decide(&req).await {
        Ok(resp) => {
            let status = match Code::try_from(resp.overall_code) {
                Ok(Code::Ok) => StatusCode::OK,
                Ok(Code::OverLimit) => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                response_json(&resp).to_string(),
            )
                .into_response()
        }
        Err(e) => {
            tracing::debug!(error = %e.message(), "/json: refused");
            bad_request(e.message())
        }
    }
}

/// A uint64 in protobuf JSON: a number or a decimal string; anything else
/// (a negative or fractional number, another string) is refused saying so.
struct U64(u64);

impl<'de> Deserialize<'de> for U64 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = U64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a count: a non-negative integer, or one as a decimal string")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<U64, E> {
                Ok(U64(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<U64, E> {
                u64::try_from(n)
                    .map(U64)
                    .map_err(|_| E::custom(format!("{n}: a count is never negative")))
            }
            fn visit_str<E: serde::de::Error>(self, t: &str) -> Result<U64, E> {
                t.parse()
                    .map(U64)
                    .map_err(|_| E::custom(format!("\"{t}\": a count is a non-negative integer")))
            }
        }
        d.deserialize_any(Visitor)
    }
}

fn u64_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(Option::<U64>::deserialize(d)?.map(|n| n.0))
}

fn u32_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = Option::<U64>::deserialize(d)?.map_or(0, |n| n.0);
    u32::try_from(n)
        .map_err(|_| serde::de::Error::custom(format!("{n}: at most {} (a uint32)", u32::MAX)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    #[serde(deserialize_with = "u32_field")]
    hits_addend: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    /// The per-descriptor limit override: read, and not applied (as on
    /// gRPC).
    #[serde(default)]
    #[allow(dead_code)]
    limit: Option<Value>,
    #[serde(default, rename = "hitsAddend", alias = "hits_addend")]
    #[serde(deserialize_with = "u64_opt")]
    hits_addend: Option<u64>,
    #[serde(default, rename = "isNegativeHits", alias = "is_negative_hits")]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

impl JsonRequest {
    fn into_proto(self) -> RateLimitRequest {
        RateLimitRequest {
            domain: self.domain,
            descriptors: self
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| Entry {
                            key: e.key,
                            value: e.value,
                        })
                        .collect(),
                    limit: None,
                    hits_addend: d
                        .hits_addend
                        .map(|value| envoy_types::pb::google::protobuf::UInt64Value { value }),
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: self.hits_addend,
        }
    }
}

/// `google.protobuf.Duration` in JSON: seconds with 0, 3, 6 or 9
/// fractional digits and an `s`.
fn duration_json(seconds: i64, nanos: i32) -> String {
    let nanos = nanos.unsigned_abs();
    if nanos == 0 {
        format!("{seconds}s")
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{seconds}.{:03}s", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{seconds}.{:06}s", nanos / 1_000)
    } else {
        format!("{seconds}.{nanos:09}s")
    }
}

fn code_json(code: i32) -> Option<&'static str> {
    match Code::try_from(code) {
        Ok(Code::Unknown) | Err(_) => None,
        Ok(c) => Some(c.as_str_name()),
    }
}

fn status_json(s: &DescriptorStatus) -> Value {
    let mut m = Map::new();
    if let Some(c) = code_json(s.code) {
        m.insert("code".into(), json!(c));
    }
    if let Some(l) = &s.current_limit {
        let mut limit = Map::new();
        if !l.name.is_empty() {
            limit.insert("name".into(), json!(l.name));
        }
        if l.requests_per_unit != 0 {
            limit.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
        }
        if l.unit != 0 {
            limit.insert("unit".into(), json!(l.unit().as_str_name()));
        }
        m.insert("currentLimit".into(), Value::Object(limit));
    }
    if s.limit_remaining != 0 {
        m.insert("limitRemaining".into(), json!(s.limit_remaining));
    }
    if let Some(d) = &s.duration_until_reset {
        m.insert(
            "durationUntilReset".into(),
            json!(duration_json(d.seconds, d.nanos)),
        );
    }
    Value::Object(m)
}

/// The response in protobuf's JSON mapping (what the reference's `/json`
/// answers).
pub fn response_json(r: &RateLimitResponse) -> Value {
    let mut m = Map::new();
    if let Some(c) = code_json(r.overall_code) {
        m.insert("overallCode".into(), json!(c));
    }
    if !r.statuses.is_empty() {
        m.insert(
            "statuses".into(),
            Value::Array(r.statuses.iter().map(status_json).collect()),
        );
    }
    if !r.response_headers_to_add.is_empty() {
        let headers = r
            .response_headers_to_add
            .iter()
            .map(|h| json!({"key": h.key, "value": h.value}))
            .collect();
        m.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    if !r.raw_body.is_empty() {
        use base64::Engine as _;
        m.insert(
            "rawBody".into(),
            json!(base64::engine::general_purpose::STANDARD.encode(&r.raw_body)),
        );
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::duration_json;

    #[test]
    fn durations_as_protobuf_json_writes_them() {
        assert_eq!(duration_json(60, 0), "60s");
        assert_eq!(duration_json(1, 500_000_000), "1.500s");
        assert_eq!(duration_json(0, 250_000), "0.000250s");
        assert_eq!(duration_json(2, 1), "2.000000001s");
    }
}
