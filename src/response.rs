//! What the client sees: `X-RateLimit-*` headers, the `429` rejection and
//! the `503` of a closed failure policy.
//!
//! # The contract
//! Every response that went through at least one tier carries, for the
//! **binding tier** (the tier with the least remaining when the request is
//! allowed; the denying tier with the longest wait when it is not):
//!
//! | header | value |
//! |---|---|
//! | `X-RateLimit-Limit` | the tier's capacity (its burst) in requests |
//! | `X-RateLimit-Remaining` | requests left now (never negative) |
//! | `X-RateLimit-Reset` | Unix epoch **seconds**, rounded up: when allowed, the instant the tier is back to its full capacity; when denied, the instant the request would pass (`now` + the exact wait, rounded up) |
//! | `Retry-After` | only on `429`: whole **seconds**, rounded up, at least 1 — the time until the request would pass on every tier |
//!
//! A denied request gets `429 Too Many Requests`, `Content-Type:
//! application/json` and the body
//! `{"error":"rate_limit_exceeded","retry_after":<seconds>,"docs":"<docs_url>"}`
//! (`docs` omitted when no docs URL is configured). Replace the body with
//! [`OnRejection`]; the headers are added after your body is built, so they
//! are never lost. The [`Rejection`] is also put in the response extensions
//! for outer layers.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use pin_project_lite::pin_project;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// `RateLimit-Policy` (IETF draft).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF draft).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Which rate-limit headers responses carry. `Retry-After` is sent on every
/// 429 whatever the style.
///
/// * `Legacy` (default): `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
///   `X-RateLimit-Reset` (epoch seconds) — what most clients parse today.
/// * `Ietf`: the structured fields of the IETF HTTPAPI draft
///   *RateLimit header fields for HTTP*, `draft-ietf-httpapi-ratelimit-headers-09`
///   (March 2025): `RateLimit-Policy: "<tier>";q=<quota>;w=<window s>` and
///   `RateLimit: "<tier>";r=<remaining>;t=<seconds until reset>`, for the
///   binding tier. On a 429, `t` equals `Retry-After`.
/// * `Both`, or `None` (no rate-limit headers; `Retry-After` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderStyle {
    /// `X-RateLimit-*`.
    #[default]
    Legacy,
    /// `RateLimit-Policy` and `RateLimit`.
    Ietf,
    /// Both sets.
    Both,
    /// Neither.
    None,
}

/// The header values for one response (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitHeaders {
    /// `X-RateLimit-Limit`: the binding tier's capacity, in requests.
    pub limit: u64,
    /// `X-RateLimit-Remaining`: requests left, in requests.
    pub remaining: u64,
    /// `X-RateLimit-Reset`: Unix epoch seconds.
    pub reset: u64,
    /// `Retry-After` in seconds, on denied requests only.
    pub retry_after: Option<u64>,
    /// Seconds from now until `reset` (the IETF `t` parameter).
    pub reset_in: u64,
    /// The binding tier (the IETF policy name).
    pub policy: Arc<str>,
    /// The tier's quota (IETF `q`) and window in seconds (IETF `w`).
    pub quota: (u64, u64),
    /// Which headers to write.
    pub style: HeaderStyle,
}

impl HeaderStyle {
    pub(crate) fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }
}

impl RateLimitHeaders {
    /// Writes the headers into `headers`, replacing any of the same name.
    pub fn write(&self, headers: &mut HeaderMap) {
        let legacy = matches!(self.style, HeaderStyle::Legacy | HeaderStyle::Both);
        let ietf = matches!(self.style, HeaderStyle::Ietf | HeaderStyle::Both);
        // Grow the map once, not header by header.
        headers.reserve(
            3 * usize::from(legacy)
                + 2 * usize::from(ietf)
                + usize::from(self.retry_after.is_some()),
        );
        if legacy {
            headers.insert(X_RATELIMIT_LIMIT, int_value(self.limit));
            headers.insert(X_RATELIMIT_REMAINING, int_value(self.remaining));
            headers.insert(X_RATELIMIT_RESET, int_value(self.reset));
        }
        if ietf {
            // Tier names are [A-Za-z0-9_-], so they need no sf-string escaping.
            // A String becomes a HeaderValue without a copy.
            let policy = format!("\"{}\";q={};w={}", self.policy, self.quota.0, self.quota.1);
            let current = format!(
                "\"{}\";r={};t={}",
                self.policy, self.remaining, self.reset_in
            );
            if let Ok(v) = HeaderValue::try_from(policy) {
                headers.insert(RATELIMIT_POLICY, v);
            }
            if let Ok(v) = HeaderValue::try_from(current) {
                headers.insert(RATELIMIT, v);
            }
        }
        if let Some(s) = self.retry_after {
            headers.insert(RETRY_AFTER, int_value(s));
        }
    }
}

/// A number as a header value: its digits formatted on the stack, then one
/// copy (`HeaderValue::from(u64)` makes two allocations).
fn int_value(n: u64) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    HeaderValue::from_bytes(digits.format(n).as_bytes())
        .unwrap_or_else(|_| HeaderValue::from_static("0"))
}

/// Why a request was denied: the binding tier and the numbers the headers
/// carry. Given to [`OnRejection`] and put in the response extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// The denying tier with the longest wait.
    pub tier: Arc<str>,
    /// The tier's capacity in requests.
    pub limit: u64,
    /// Requests left on that tier (a denied request of cost 3 with 2 left shows 2).
    pub remaining: u64,
    /// Unix epoch seconds, rounded up, at which the request would pass
    /// (`now` + the exact wait; at most `now + retry_after`).
    pub reset: u64,
    /// Seconds until the request would pass, rounded up, at least 1.
    pub retry_after: u64,
    /// The configured documentation URL.
    pub docs_url: Option<Arc<str>>,
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
/// `{"error":"rate_limit_exceeded","retry_after":N,"docs":"URL"}`.
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonRejection;

#[derive(serde::Serialize)]
struct JsonBody<'a> {
    error: &'static str,
    retry_after: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    docs: Option<&'a str>,
}

impl OnRejection for JsonRejection {
    fn response(&self, r: &Rejection) -> Response<Bytes> {
        json_response(
            StatusCode::TOO_MANY_REQUESTS,
            &JsonBody {
                error: "rate_limit_exceeded",
                retry_after: r.retry_after,
                docs: r.docs_url.as_deref(),
            },
        )
    }
}

/// An RFC 9457 problem details rejection (`application/problem+json`), with
/// the IETF draft's `quota-exceeded` problem type and the violated policy:
///
/// ```json
/// {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded",
///  "title":"Request cannot be satisfied as assigned quota has been exceeded",
///  "status":429,"detail":"Retry in 20 seconds.","violated-policies":["ip"],
///  "retry_after":20,"docs":"https://example.com/docs/rate-limits"}
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ProblemRejection;

#[derive(serde::Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    title: &'static str,
    status: u16,
    detail: String,
    #[serde(rename = "violated-policies")]
    violated_policies: [&'a str; 1],
    retry_after: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    docs: Option<&'a str>,
}

impl OnRejection for ProblemRejection {
    fn response(&self, r: &Rejection) -> Response<Bytes> {
        let mut res = json_response(
            StatusCode::TOO_MANY_REQUESTS,
            &ProblemBody {
                kind: "https://iana.org/assignments/http-problem-types#quota-exceeded",
                title: "Request cannot be satisfied as assigned quota has been exceeded",
                status: 429,
                detail: format!("Retry in {} seconds.", r.retry_after),
                violated_policies: [&r.tier],
                retry_after: r.retry_after,
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

pin_project! {
    /// The body of a response from the layer: the inner service's body, or
    /// a complete body the layer produced (429 or 503). `Inner.body` is the
    /// inner body; `Full.data` holds the bytes until they are sent.
    #[project = BodyProj]
    #[allow(missing_docs)]
    pub enum ResponseBody<B> {
        /// The inner service's body, untouched.
        Inner {
            #[pin]
            body: B,
        },
        /// A body built by the layer.
        Full {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody::Full {
            data: (!data.is_empty()).then_some(data),
        }
    }
}

impl<B> http_body::Body for ResponseBody<B>
where
    B: http_body::Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        match self.project() {
            BodyProj::Inner { body } => body.poll_frame(cx),
            BodyProj::Full { data } => {
                Poll::Ready(data.take().map(|d| Ok(http_body::Frame::data(d))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Inner { body } => body.is_end_stream(),
            ResponseBody::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ResponseBody::Inner { body } => body.size_hint(),
            ResponseBody::Full { data } => {
                http_body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
