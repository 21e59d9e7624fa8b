use super::{KeyError, KeyExtractor};
use http::request::Parts;

/// The authenticated user's id, put into the request extensions by the app's
/// auth layer (which must run before the rate-limit layer). Read by [`User`]
/// and by `key = "user"` in a policy file.
///
/// ```
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(tiered_ratelimit::UserId("42".into()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UserId(pub String);

/// Keys by the [`UserId`] in the request extensions; requests without one
/// (anonymous), or with an empty id, skip the tier.
#[derive(Debug, Clone, Copy, Default)]
pub struct User;

impl KeyExtractor for User {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        Ok(parts.extensions.get::<UserId>().map(|u| u.0.clone()))
    }
}
