//! The body of a `429` ([`OnRejection`] and the two built in) and of the
//! `503` of a closed failure policy.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use std::sync::Arc;

/// Why a request was denied: the binding tier and the numbers the headers
/// carry. Given to [`OnRejection`] and put in the response extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// The denying tier with the longest wait.
    pub tier: Arc<str>,
    /// Every enforced tier that denied the request, in tier order (the
    /// draft's `violated-policies`; `tier` is one of them).
    pub violated_policies: Vec<Arc<str>>,
    /// The tier's capacity in requests.
    pub limit: u64,
    /// Requests left on that tier (a denied request of cost 3 with 2 left shows 2).
    pub remaining: u64,
    /// Unix epoch seconds, rounded up, at which the request would pass
    /// (`now` + the exact wait; at most `now + retry_after`).
    pub reset: u64,
    /// Seconds until the request would pass, rounded up, at least 1; 0
    /// when it never will ([`RejectionReason::CostExceedsCapacity`]: no
    /// `Retry-After` header is sent).
    pub retry_after: u64,
    /// The configured documentation URL.
    pub docs_url: Option<Arc<str>>,
    /// Why: over the quota for now, or a cost no wait can satisfy.
    pub reason: RejectionReason,
    /// The HTTP status to answer: 429, or 403 for a calendar quota whose
    /// tier sets [`Tier::exhausted_status`](crate::Tier::exhausted_status)
    /// ("come back next month" is not a rate problem). The built-in bodies
    /// use it, and the layer sets it on any [`OnRejection`]'s response.
    pub status: u16,
}

/// Why a request was denied ([`Rejection::reason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RejectionReason {
    /// The tier's quota is spent for now: the request passes after
    /// `Retry-After`.
    #[default]
    QuotaExceeded,
    /// The request costs more than the binding tier's capacity (its burst,
    /// or its limit per window): it can **never** pass, however long the
    /// client waits. Answered 429 without `Retry-After`, with
    /// `"error":"cost_exceeds_capacity"` in the JSON body (`"reason"` in a
    /// problem body), counted in
    /// `tiered_ratelimit_cost_exceeds_capacity_total{tier}` and logged once
    /// per tier as a likely misconfiguration.
    CostExceedsCapacity,
    /// The key is in its tier's **penalty box**
    /// ([`Tier::penalty`](crate::Tier::penalty)): blocked after repeated
    /// denials, whatever its numbers, until `Retry-After`. A problem body
    /// uses the draft's `abnormal-usage-detected` problem type
    /// (`draft-ietf-httpapi-ratelimit-headers-11` §5.3); the JSON body
    /// says `rate_limit_exceeded`, as for any wait.
    AbnormalUsage,
}

impl Rejection {
    /// [`status`](Self::status) as a status code (429 for any value that is
    /// not one).
    pub fn http_status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
    }
}

impl RejectionReason {
    /// Its word: `rate_limit_exceeded`, `cost_exceeds_capacity` or
    /// `abnormal_usage_detected` (the JSON body's `error` says
    /// `rate_limit_exceeded` for the last too).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::QuotaExceeded => "rate_limit_exceeded",
            Self::CostExceedsCapacity => "cost_exceeds_capacity",
            Self::AbnormalUsage => "abnormal_usage_detected",
        }
    }
}

/// Builds the response for a denied request. The layer then adds the
/// `X-RateLimit-*` and `Retry-After` headers to whatever you return.
///
/// Closures `Fn(&Rejection) -> http::Response<Bytes>` implement it:
///
/// ```
/// use bytes::Bytes;
/// use tiered_ratelimit::{RateLimitLayer, Tier, Quota, key::Global, response::Rejection};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(10)))
///     .on_rejection(|r: &Rejection| {
///         http::Response::builder()
///             .status(429)
///             .header("content-type", "text/plain")
///             .body(Bytes::from(format!("slow down: {} s", r.retry_after)))
///             .unwrap_or_default()
///     })
///     .build()
///     .unwrap();
/// ```
pub trait OnRejection: Send + Sync + 'static {
    /// The response (status, headers, body) for `rejection`.
    fn response(&self, rejection: &Rejection) -> Response<Bytes>;

    /// Whether the response reads [`Rejection::violated_policies`]. `true`
    /// (the default, and for closures) keeps it exact from the deny cache
    /// too: a 429 is then answered locally only when every enforced tier of
    /// the request has a cached denial, since only then is the full list
    /// known without asking the backend. Return `false` when the response
    /// does not show the list, so that a cached denial of the binding tier
    /// is enough ([`JsonRejection`] does).
    fn uses_violated_policies(&self) -> bool {
        true
    }
}

impl<F> OnRejection for F
where
    F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
{
    fn response(&self, rejection: &Rejection) -> Response<Bytes> {
        self(rejection)
    }
}

/// The default rejection: `429` with
/// `{"error":"rate_limit_exceeded","retry_after":N,"docs":"URL"}`; for a
/// request whose cost exceeds the tier's capacity (it can never pass),
/// `{"error":"cost_exceeds_capacity","limit":N,"docs":"URL"}` (no
/// `retry_after`, and no `Retry-After` header).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonRejection;

#[derive(serde::Serialize)]
struct JsonBody<'a> {
    error: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    docs: Option<&'a str>,
}

impl OnRejection for JsonRejection {
    fn uses_violated_policies(&self) -> bool {
        false
    }

    fn response(&self, r: &Rejection) -> Response<Bytes> {
        json_response(
            r.http_status(),
            &match r.reason {
                RejectionReason::CostExceedsCapacity => JsonBody {
                    error: r.reason.as_str(),
                    retry_after: None,
                    limit: Some(r.limit),
                    docs: r.docs_url.as_deref(),
                },
                // A penalty box's block is a wait like any other to a
                // client that reads this body.
                _ => JsonBody {
                    error: RejectionReason::QuotaExceeded.as_str(),
                    retry_after: Some(r.retry_after),
                    limit: None,
                    docs: r.docs_url.as_deref(),
                },
            },
        )
    }
}

/// An RFC 9457 problem details rejection (`application/problem+json`) with
/// the `quota-exceeded` problem type (a key in a penalty box:
/// `abnormal-usage-detected`, §5.3, title "Request not satisfied due to
/// detection of abnormal request pattern") of
/// `draft-ietf-httpapi-ratelimit-headers-11` §5.1 (type URI
/// `https://iana.org/assignments/http-problem-types#quota-exceeded`, title as
/// in the draft's §5.1 example, status 429 as its §10.2.1 registration
/// recommends) and its `violated-policies` member: the names of every
/// enforced tier that denied the request, in tier order. `retry_after`
/// (seconds, equal to the `Retry-After` header) and `docs` are this crate's
/// extension members; `docs` is left out when no docs URL is configured.
///
/// ```json
/// {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded",
///  "title":"Request cannot be satisfied as assigned quota has been exceeded",
///  "status":429,"detail":"Retry in 20 seconds.","violated-policies":["ip","user"],
///  "retry_after":20,"docs":"https://example.com/docs/rate-limits"}
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ProblemRejection;

/// The draft's `quota-exceeded` problem type (§5.1).
const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";
/// The draft's `abnormal-usage-detected` problem type (§5.3), for a key in
/// a penalty box.
const ABNORMAL_USAGE_DETECTED: &str =
    "https://iana.org/assignments/http-problem-types#abnormal-usage-detected";

#[derive(serde::Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    title: &'static str,
    status: u16,
    detail: String,
    #[serde(rename = "violated-policies")]
    violated_policies: Vec<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    docs: Option<&'a str>,
}

impl OnRejection for ProblemRejection {
    fn response(&self, r: &Rejection) -> Response<Bytes> {
        let mut res = json_response(
            r.http_status(),
            &ProblemBody {
                kind: match r.reason {
                    RejectionReason::AbnormalUsage => ABNORMAL_USAGE_DETECTED,
                    _ => QUOTA_EXCEEDED,
                },
                title: match r.reason {
                    // §5.3's example title (its typo "satisifed" corrected).
                    RejectionReason::AbnormalUsage => {
                        "Request not satisfied due to detection of abnormal request pattern"
                    }
                    _ => "Request cannot be satisfied as assigned quota has been exceeded",
                },
                status: r.http_status().as_u16(),
                detail: match r.reason {
                    RejectionReason::CostExceedsCapacity => format!(
                        "This request costs more than the capacity of {} of \"{}\": it can never \
                         pass. Send a smaller request.",
                        r.limit, r.tier
                    ),
                    RejectionReason::AbnormalUsage => format!(
                        "Blocked after repeated rate-limited requests. Retry in {} seconds.",
                        r.retry_after
                    ),
                    RejectionReason::QuotaExceeded => {
                        format!("Retry in {} seconds.", r.retry_after)
                    }
                },
                violated_policies: if r.violated_policies.is_empty() {
                    vec![&*r.tier]
                } else {
                    r.violated_policies.iter().map(|p| &**p).collect()
                },
                reason: (r.reason == RejectionReason::CostExceedsCapacity)
                    .then_some(r.reason.as_str()),
                retry_after: (r.reason != RejectionReason::CostExceedsCapacity)
                    .then_some(r.retry_after),
                docs: r.docs_url.as_deref(),
            },
        );
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    }
}

/// The built-in rejections by name: a policy file's `body`, `"json"`
/// ([`JsonRejection`], the default) or `"problem"` ([`ProblemRejection`]).
/// Answers exactly as the one it names.
///
/// ```
/// use tiered_ratelimit::{key::Global, response::RejectionBody, Quota, RateLimitLayer, Tier};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(100)))
///     .on_rejection(RejectionBody::Problem)
///     .build()
///     .unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RejectionBody {
    /// [`JsonRejection`].
    #[default]
    Json,
    /// [`ProblemRejection`].
    Problem,
}

impl OnRejection for RejectionBody {
    fn response(&self, rejection: &Rejection) -> Response<Bytes> {
        match self {
            RejectionBody::Json => JsonRejection.response(rejection),
            RejectionBody::Problem => ProblemRejection.response(rejection),
        }
    }

    fn uses_violated_policies(&self) -> bool {
        match self {
            RejectionBody::Json => JsonRejection.uses_violated_policies(),
            RejectionBody::Problem => ProblemRejection.uses_violated_policies(),
        }
    }
}

pub(crate) fn json_response(status: StatusCode, body: &impl serde::Serialize) -> Response<Bytes> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut res = Response::new(Bytes::from(bytes));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

/// `503` JSON answered under [`FailurePolicy::Closed`](crate::FailurePolicy::Closed)
/// when the backend cannot decide: `{"error":"rate_limiter_unavailable"}`.
pub(crate) fn unavailable() -> Response<Bytes> {
    #[derive(serde::Serialize)]
    struct Body {
        error: &'static str,
    }
    json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        &Body {
            error: "rate_limiter_unavailable",
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use http::HeaderMap;

    fn get<'m>(m: &'m HeaderMap, name: &str) -> Option<&'m str> {
        m.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn problem_body_lists_every_violated_policy() {
        let r = Rejection {
            status: 429,
            tier: Arc::from("b"),
            violated_policies: vec![Arc::from("a"), Arc::from("b")],
            limit: 1,
            remaining: 0,
            reset: 1_700_000_060,
            retry_after: 60,
            docs_url: None,
            reason: RejectionReason::QuotaExceeded,
        };
        let res = ProblemRejection.response(&r);
        assert_eq!(res.status(), 429);
        assert_eq!(
            get(res.headers(), "content-type"),
            Some("application/problem+json")
        );
        assert_eq!(
            res.body().as_ref(),
            br#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"Retry in 60 seconds.","violated-policies":["a","b"],"retry_after":60}"#
        );
    }
}
