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
//! With [`HeaderStyle::IetfDraft11`] (or [`HeaderStyle::IetfDraft09`]) the
//! same binding tier is described by the IETF `RateLimit` field instead,
//! beside `RateLimit-Policy`, which lists every tier of the request;
//! [`HeaderStyle`] gives their exact values. A 429 no wait can lift (a cost
//! above the tier's capacity) has no `Retry-After` and says
//! `x-should-retry: false`.
//!
//! A denied request gets `429 Too Many Requests`, `Content-Type:
//! application/json` and the body
//! `{"error":"rate_limit_exceeded","retry_after":<seconds>,"docs":"<docs_url>"}`
//! (`docs` omitted when no docs URL is configured). Replace the body with
//! [`OnRejection`]; the headers are added after your body is built, so they
//! are never lost. The [`Rejection`] is also put in the response extensions
//! for outer layers.

mod headers;
mod meters;
mod rejection;

pub(crate) use headers::effective_window_us;
pub(crate) use headers::SF_INTEGER_MAX;
pub use headers::{HeaderStyle, PolicyItem, QuotaUnit, RateLimitHeaders, X_SHOULD_RETRY};
pub use meters::{go_duration, Meter, Meters};
pub(crate) use rejection::{json_response, unavailable};
pub use rejection::{
    JsonRejection, OnRejection, ProblemRejection, Rejection, RejectionBody, RejectionReason,
};
