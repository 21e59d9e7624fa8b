use super::{KeyError, KeyExtractor};
use http::request::Parts;

/// Keys by method and route: `GET /users/{id}` for both `/users/1` and
/// `/users/2`.
///
/// The route is axum's `MatchedPath` (the route template) when the layer runs
/// inside a `Router` (`Router::layer` or `route_layer`); a request that matched
/// no route, or a service outside axum, is keyed by its raw path.
#[derive(Debug, Clone, Copy, Default)]
pub struct Endpoint;

impl KeyExtractor for Endpoint {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        #[cfg(feature = "axum")]
        let route = parts
            .extensions
            .get::<axum::extract::MatchedPath>()
            .map(|m| m.as_str());
        #[cfg(not(feature = "axum"))]
        let route: Option<&str> = None;
        let route = route.unwrap_or_else(|| parts.uri.path());
        let method = parts.method.as_str();
        let mut key = String::with_capacity(method.len() + 1 + route.len());
        key.push_str(method);
        key.push(' ');
        key.push_str(route);
        Ok(Some(key))
    }
}
