use super::{KeyError, KeyExtractor, KeyWriter};
use http::request::Parts;

/// The authenticated user's id, put into the request extensions by the app's
/// auth layer (which must run before the rate-limit layer). Read by [`User`]
/// and by `key = "user"` in a policy file.
///
/// Build one from the id your authentication established, as a string:
///
/// ```
/// use tiered_ratelimit::key::UserId;
///
/// let mut req = http::Request::new(());
/// let account_id: u64 = 42; // what your auth verified
/// req.extensions_mut().insert(UserId(account_id.to_string()));
/// assert_eq!(req.extensions().get::<UserId>(), Some(&UserId("42".into())));
/// ```
///
/// An axum middleware that inserts it, applied *outside* the limiter so it
/// runs first (with axum, the layer added last runs first):
///
/// ```
/// use axum::{extract::Request, middleware::{self, Next}, response::Response, routing::get, Router};
/// use tiered_ratelimit::{key::{User, UserId}, Quota, RateLimitLayer, Tier};
/// use tower::ServiceExt; // `oneshot`
///
/// /// A stand-in: the bearer token *is* the user id. Verify a real token or
/// /// session before trusting it.
/// async fn auth(mut req: Request, next: Next) -> Response {
///     let user = req
///         .headers()
///         .get("authorization")
///         .and_then(|v| v.to_str().ok())
///         .and_then(|v| v.strip_prefix("Bearer "))
///         .map(|id| UserId(id.to_owned()));
///     if let Some(user) = user {
///         req.extensions_mut().insert(user);
///     }
///     next.run(req).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(
///         RateLimitLayer::builder()
///             .tier(Tier::new("user", User, Quota::per_minute(1)))
///             .build()
///             .unwrap(),
///     )
///     .layer(middleware::from_fn(auth));
/// let bob = || {
///     Request::get("/")
///         .header("authorization", "Bearer bob")
///         .body(axum::body::Body::empty())
///         .unwrap()
/// };
/// assert_eq!(app.clone().oneshot(bob()).await.unwrap().status(), 200);
/// assert_eq!(app.oneshot(bob()).await.unwrap().status(), 429);
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UserId(pub String);

/// Keys by the [`UserId`] in the request extensions; requests without one
/// (anonymous) skip the tier. An empty id is a key like any other: every
/// request carrying it shares one bucket (skipping would leave them
/// unlimited on this tier).
#[derive(Debug, Clone, Copy, Default)]
pub struct User;

impl KeyExtractor for User {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        Ok(user_id(parts).map(str::to_owned))
    }

    fn extract_into(&self, parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        Ok(match user_id(parts) {
            Some(id) => {
                out.part(id.as_bytes());
                true
            }
            None => false,
        })
    }

    fn no_key_cause(&self) -> Option<String> {
        Some(
            "no request carried a `UserId`: the auth middleware that inserts it must run \
             BEFORE the limiter, so it must wrap it (with axum, add the auth layer after the \
             limiter's: `.layer(limiter).layer(auth)`); placed inside the limiter it runs too late \
             (if the requests so far were all anonymous, this is expected: raise or turn off \
             the warning with `no_key_warning_after`)"
                .to_owned(),
        )
    }
}

/// The request's [`UserId`].
fn user_id(parts: &Parts) -> Option<&str> {
    parts.extensions.get::<UserId>().map(|u| u.0.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_requests_skip_the_tier() {
        let with = |id: Option<&str>| {
            let mut p = http::Request::new(()).into_parts().0;
            if let Some(id) = id {
                p.extensions.insert(UserId(id.to_owned()));
            }
            p
        };
        assert_eq!(User.extract(&with(None)), Ok(None));
        assert_eq!(User.extract(&with(Some(""))), Ok(Some(String::new())));
        assert_eq!(User.extract(&with(Some("42"))), Ok(Some("42".to_owned())));
        let long = "x{".repeat(100);
        crate::key::assert_extract_into_agrees(
            &User,
            &[
                with(None),
                with(Some("")),
                with(Some("a b")),
                with(Some(&long)),
            ],
        );
    }
}
