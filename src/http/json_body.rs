//! The estimate of a priced tier from a field of the request's JSON body
//! ([`Estimate::json`](crate::priced::Estimate::json), OpenAI-style
//! `max_tokens`): [`JsonBodyLayer`], the companion layer that reads the body
//! before the rate-limit layer decides, and the tier's cost function, which
//! reads what it found.
//!
//! The rate-limit layer takes any request body type and hands the inner
//! service that same type, so it cannot buffer a body itself. The companion
//! layer can: it asks of the body type that it be rebuilt from bytes
//! (`From<Bytes>`: axum's `Body`, `http_body_util::Full`), reads the body up
//! to the bound (`max_body_bytes`, the largest of the layer's JSON
//! estimates), picks the named top-level fields out of it (one pass, the
//! rest of the document skipped unparsed into values), puts them in the
//! request's extensions and hands the request on with a body of exactly the
//! bytes read. A body above the bound is answered `413 Payload Too Large`
//! (and reaches neither the rate-limit layer nor the handler): a client
//! cannot dodge its estimate by padding its body, and a handler never gets a
//! body cut short. A body that fails while being read is answered `400 Bad
//! Request`.
//!
//! # Deployment caveat
//! Every request through the companion layer is read to its end before it
//! is decided, whatever its route: mount the pair on the routes that need
//! it. Request trailers (rare; no HTTP/1.1 client sends them) are not
//! handed on.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;

/// The body fields a layer's priced tiers estimate from, and the largest
/// body read to find them (bytes).
#[derive(Debug, Default)]
pub(crate) struct JsonSpec {
    fields: Vec<Box<str>>,
    max_body_bytes: usize,
}

impl JsonSpec {
    /// A tier estimating from `field`, reading at most `limit` bytes.
    pub(crate) fn add(&mut self, field: Box<str>, limit: usize) {
        if !self.fields.contains(&field) {
            self.fields.push(field);
        }
        self.max_body_bytes = self.max_body_bytes.max(limit);
    }

    /// The spec, if any tier reads the body.
    pub(crate) fn finish(self) -> Option<Arc<Self>> {
        (!self.fields.is_empty()).then(|| Arc::new(self))
    }
}

/// What the companion layer found in a request's body (in its extensions).
#[derive(Debug, Clone)]
struct BodyFields {
    spec: Arc<JsonSpec>,
    /// Per field of `spec`: its whole-number value, if it had one.
    values: Vec<Option<u64>>,
}

impl BodyFields {
    /// `None`: the companion layer did not read `field`.
    fn get(&self, field: &str) -> Option<Option<u64>> {
        let at = self.spec.fields.iter().position(|f| &**f == field)?;
        self.values.get(at).copied()
    }
}

/// The cost function of a tier estimating from body field `field`.
pub(crate) fn cost_fn(field: Box<str>, default: u64, max: u64) -> crate::http::tier::CostFn {
    Arc::new(move |p: &http::request::Parts| {
        match p.extensions.get::<BodyFields>().and_then(|b| b.get(&field)) {
            Some(value) => value.map_or(default, |n| n.min(max)),
            None => {
                layer_missing(&field);
                max
            }
        }
    })
}

/// A JSON estimate without its companion layer in front: logged at most
/// once a second.
fn layer_missing(field: &str) {
    static LOG: std::sync::OnceLock<crate::util::throttle::LogThrottle> =
        std::sync::OnceLock::new();
    let log = LOG
        .get_or_init(|| crate::util::throttle::LogThrottle::new(std::time::Duration::from_secs(1)));
    if let Some(suppressed) = log.permit() {
        tracing::warn!(target: "tiered_ratelimit::priced",
            field,
            suppressed,
            "rate limiter: a priced tier estimates from the JSON body field {field:?}, but \
             the request did not come through RateLimitLayer::json_body(); it reserves \
             the estimate's max"
        );
    }
}

/// The whole-number values of `fields` at the top level of the JSON object
/// `body` (all `None` when it is not one).
fn pick(body: &[u8], fields: &[Box<str>]) -> Vec<Option<u64>> {
    let mut values = vec![None; fields.len()];
    let mut de = serde_json::Deserializer::from_slice(body);
    let picked = Pick {
        fields,
        values: &mut values,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end());
    if picked.is_err() {
        values.fill(None);
    }
    values
}

/// Reads a JSON object's top-level entries, keeping the named ones.
struct Pick<'a> {
    fields: &'a [Box<str>],
    values: &'a mut [Option<u64>],
}

impl<'de> DeserializeSeed<'de> for Pick<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Pick<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            match self.fields.iter().position(|f| **f == *key) {
                // The last of duplicate keys wins, as in most JSON parsers.
                Some(at) => {
                    self.values[at] = map.next_value::<serde_json::Value>()?.as_u64();
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// The companion layer of a [`RateLimitLayer`](crate::RateLimitLayer) whose
/// priced tiers estimate from a JSON body field: made by
/// [`RateLimitLayer::json_body`](crate::RateLimitLayer::json_body), stacked
/// outside it. See [`Estimate::json`](crate::priced::Estimate::json).
#[derive(Debug, Clone)]
#[must_use]
pub struct JsonBodyLayer {
    spec: Option<Arc<JsonSpec>>,
}

impl JsonBodyLayer {
    pub(crate) fn new(spec: Option<Arc<JsonSpec>>) -> Self {
        Self { spec }
    }
}

impl<S> tower_layer::Layer<S> for JsonBodyLayer {
    type Service = JsonBody<S>;

    fn layer(&self, inner: S) -> Self::Service {
        JsonBody {
            inner,
            spec: self.spec.clone(),
        }
    }
}

/// The service of [`JsonBodyLayer`]: reads a request's JSON body (at most
/// `max_body_bytes`) for the priced tiers' estimates, then calls `S` with
/// the same bytes.
#[derive(Debug, Clone)]
#[must_use]
pub struct JsonBody<S> {
    inner: S,
    spec: Option<Arc<JsonSpec>>,
}

type Boxed<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

pin_project! {
    /// The response future of [`JsonBody`].
    #[project = FutureProj]
    #[allow(missing_docs)]
    pub enum JsonBodyFuture<F, R, E> {
        /// No tier reads the body: the inner service's future.
        Inner {
            #[pin]
            future: F,
        },
        /// The body read, then the inner service.
        Reading {
            future: Boxed<R, E>,
        },
    }
}

impl<F, R, E> Future for JsonBodyFuture<F, R, E>
where
    F: Future<Output = Result<R, E>>,
{
    type Output = Result<R, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            FutureProj::Inner { future } => future.poll(cx),
            FutureProj::Reading { future } => future.as_mut().poll(cx),
        }
    }
}

impl<S, B, ResBody> Service<Request<B>> for JsonBody<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: http_body::Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: From<Bytes> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = JsonBodyFuture<S::Future, Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let Some(spec) = self.spec.clone() else {
            return JsonBodyFuture::Inner {
                future: self.inner.call(req),
            };
        };
        // The readied service goes into the future; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        JsonBodyFuture::Reading {
            future: Box::pin(async move {
                let (mut parts, body) = req.into_parts();
                let limit = spec.max_body_bytes;
                if body.size_hint().lower() > limit as u64 {
                    return Ok(too_large(limit));
                }
                let bytes = match Limited::new(body, limit).collect().await {
                    Ok(collected) => collected.to_bytes(),
                    Err(e) if e.is::<LengthLimitError>() => return Ok(too_large(limit)),
                    Err(_) => {
                        return Ok(plain(
                            StatusCode::BAD_REQUEST,
                            "the request body could not be read".to_owned(),
                        ))
                    }
                };
                let values = pick(&bytes, &spec.fields);
                parts.extensions.insert(BodyFields { spec, values });
                inner.call(Request::from_parts(parts, B::from(bytes))).await
            }),
        }
    }
}

/// `413 Payload Too Large`, saying the bound.
fn too_large<R: From<Bytes>>(limit: usize) -> Response<R> {
    plain(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body above {limit} bytes (the rate limiter reads at most this much)"),
    )
}

fn plain<R: From<Bytes>>(status: StatusCode, text: String) -> Response<R> {
    let mut res = Response::new(R::from(Bytes::from(text)));
    *res.status_mut() = status;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn picks_top_level_whole_numbers_only() {
        let fields: Vec<Box<str>> = vec!["max_tokens".into(), "n".into()];
        let at = |body: &str| pick(body.as_bytes(), &fields);
        assert_eq!(
            at(r#"{"model":"m","messages":[{"max_tokens":9}],"max_tokens":300}"#),
            [Some(300), None]
        );
        assert_eq!(at(r#"{"max_tokens":300.0,"n":2}"#), [None, Some(2)]);
        assert_eq!(at(r#"{"max_tokens":-1,"n":"2"}"#), [None, None]);
        assert_eq!(at(r#"{"max_tokens":1,"max_tokens":7}"#), [Some(7), None]);
        assert_eq!(at(r#"[{"max_tokens":1}]"#), [None, None]);
        assert_eq!(at(r#"{"max_tokens":1} trailing"#), [None, None]);
        assert_eq!(at("not json"), [None, None]);
        assert_eq!(at(""), [None, None]);
    }
}
