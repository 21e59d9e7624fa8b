use super::{KeyError, KeyExtractor, KeyWriter};
use http::request::Parts;

/// The route part of [`Endpoint`]'s key for a request that matched no route
/// (and for every request outside an axum `Router`).
pub const UNMATCHED_ROUTE: &str = "<unmatched>";

/// Keys by method and route **template**: `GET /users/{id}` for both
/// `/users/1` and `/users/2`.
///
/// The route is axum's `MatchedPath` (the route template), which exists when
/// the layer runs inside a `Router` (`Router::layer` or `route_layer`). The key
/// never contains the raw request path, so clients cannot create keys at will:
///
/// * A request that matched **no** route (axum's fallback, a 404) is keyed
///   `<METHOD> <unmatched>`: all of them share one bucket per method, so
///   random paths cannot create unbounded keys. With `route_layer`, unmatched
///   requests never reach the layer at all.
/// * Methods other than the nine standard ones (`GET`, `POST`, `PUT`,
///   `DELETE`, `HEAD`, `OPTIONS`, `CONNECT`, `PATCH`, `TRACE`; case-sensitive,
///   as HTTP methods are) are keyed `OTHER`, so invented methods cannot create
///   keys either. The endpoint tier therefore holds at most
///   10 × (routes + 1) keys.
/// * Spelling variants share a bucket exactly when axum routes them to the same
///   route: `/users/1` and `/users/%31` (both match `/users/{id}`), query
///   strings ignored. axum 0.8 matches paths exactly: `/users/1/` (trailing
///   slash), `/USERS/1` (case) and `//users/1` (duplicate slash) match no
///   route and answer 404, so they share the `<unmatched>` key, not
///   `/users/{id}`. To make them count as the route, normalise paths before
///   the router (for example tower-http's `NormalizePath` around it).
/// * Outside axum (the `axum` feature off, or the layer wrapped around the
///   `Router` instead of added with `Router::layer`) there is no
///   `MatchedPath`, so every request is `<METHOD> <unmatched>`: the tier is
///   then per method only. Key by route with your own extractor (a closure
///   that maps the path to a bounded set of names) in that case.
#[derive(Debug, Clone, Copy, Default)]
pub struct Endpoint;

/// Entries of the per-thread cache of escaped endpoint keys.
const CACHED: usize = 256;

type EscapedKey = Option<(&'static str, Box<str>, Box<str>)>;

thread_local! {
    /// (method label, route template, escaped key part), direct-mapped by
    /// the route string's address.
    static ESCAPED: std::cell::RefCell<[EscapedKey; CACHED]> =
        const { std::cell::RefCell::new([const { None }; CACHED]) };
}

/// The method's name for standard methods, `OTHER` for extension methods.
fn method_label(method: &http::Method) -> &'static str {
    match method.as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "HEAD" => "HEAD",
        "OPTIONS" => "OPTIONS",
        "CONNECT" => "CONNECT",
        "PATCH" => "PATCH",
        "TRACE" => "TRACE",
        _ => "OTHER",
    }
}

/// The bounded `(method, route)` of a request: a standard method or `OTHER`,
/// and the route template or [`UNMATCHED_ROUTE`]. Also the endpoint label of
/// metrics and logs.
pub(crate) fn route_of(parts: &Parts) -> (&'static str, &str) {
    (
        method_label(&parts.method),
        route(parts).unwrap_or(UNMATCHED_ROUTE),
    )
}

/// The route: the template axum matched, else (feature `grpc`) a gRPC
/// request's method path.
fn route(parts: &Parts) -> Option<&str> {
    let route = matched_route(parts);
    #[cfg(feature = "grpc")]
    let route = route.or_else(|| method_path(parts));
    route
}

/// The route template axum matched (`MatchedPath`), if any.
#[cfg(feature = "axum")]
fn matched_route(parts: &Parts) -> Option<&str> {
    parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str())
}

/// Without axum no router records a route template.
#[cfg(not(feature = "axum"))]
fn matched_route(_parts: &Parts) -> Option<&str> {
    None
}

impl KeyExtractor for Endpoint {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        let (method, route) = route_of(parts);
        let mut key = String::with_capacity(method.len() + 1 + route.len());
        key.push_str(method);
        key.push(' ');
        key.push_str(route);
        Ok(Some(key))
    }

    fn extract_into(&self, parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        let (method, route) = route_of(parts);
        // The cache below holds routes' escaped forms.
        let out = out.trusted();
        ESCAPED.with(|cache| {
            // Route templates are few and their strings live as long as the
            // router, so the escaped key of each is cached per thread (a
            // route template always needs escaping: the space, `{`, `}`).
            let mut cache = cache.borrow_mut();
            let addresses = (route.as_ptr() as u64) ^ (method.as_ptr() as u64).rotate_left(29);
            // Fibonacci hashing of the two addresses: the slot's top bits.
            let slot = (addresses.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % CACHED;
            // Two ways: the slot and its neighbour.
            for way in [slot, slot ^ 1] {
                if let Some((m, r, escaped)) = &cache[way] {
                    if std::ptr::eq(*m, method) && **r == *route {
                        out.push_str(escaped);
                        return;
                    }
                }
            }
            let start = out.len();
            super::storage_key_parts_into(out, &[method.as_bytes(), b" ", route.as_bytes()]);
            // The new entry takes the slot; what it held moves to the
            // neighbour (the two most recent of the pair stay).
            let previous = cache[slot].replace((method, route.into(), out[start..].into()));
            if previous.is_some() {
                cache[slot ^ 1] = previous;
            }
        });
        Ok(true)
    }
}

/// Whether the request says it is gRPC: `content-type: application/grpc`,
/// alone or followed by `+`, `-` or `;` (`application/grpc+proto`,
/// `application/grpc-web`).
#[cfg(feature = "grpc")]
pub(crate) fn is_grpc(parts: &Parts) -> bool {
    let Some(ct) = parts.headers.get(http::header::CONTENT_TYPE) else {
        return false;
    };
    let ct = ct.as_bytes();
    let prefix = b"application/grpc";
    ct.len() >= prefix.len()
        && ct[..prefix.len()].eq_ignore_ascii_case(prefix)
        && matches!(ct.get(prefix.len()), None | Some(b'+' | b'-' | b';'))
}

/// The longest gRPC method path, in bytes, that is an endpoint of its own.
#[cfg(feature = "grpc")]
pub(crate) const MAX_METHOD_PATH: usize = 256;

/// The request's gRPC method path (`/package.Service/Method`) when it is a
/// gRPC request with a well-formed one (see [`crate::grpc`]).
#[cfg(feature = "grpc")]
pub(crate) fn method_path(parts: &Parts) -> Option<&str> {
    if parts.method != http::Method::POST || !is_grpc(parts) {
        return None;
    }
    let path = parts.uri.path();
    let rest = path.strip_prefix('/')?;
    let (service, method) = rest.split_once('/')?;
    let name = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
    };
    (path.len() <= MAX_METHOD_PATH && name(service) && name(method)).then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(method: &str, path: &str) -> String {
        let (p, _) = http::Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap()
            .into_parts();
        Endpoint.extract(&p).unwrap().unwrap()
    }

    #[test]
    fn without_a_matched_route_one_key_per_method() {
        assert_eq!(key("GET", "/a/random/path"), "GET <unmatched>");
        assert_eq!(key("GET", "/another"), "GET <unmatched>");
        assert_eq!(key("POST", "/x"), "POST <unmatched>");
        assert_eq!(key("PROPFIND", "/x"), "OTHER <unmatched>");
        assert_eq!(key("get", "/x"), "OTHER <unmatched>");
        assert_eq!(key("OTHER", "/x"), "OTHER <unmatched>");
    }

    #[test]
    fn extract_into_agrees() {
        let req = |method: &str| {
            let (p, _) = http::Request::builder()
                .method(method)
                .uri("/x")
                .body(())
                .unwrap()
                .into_parts();
            p
        };
        // Twice over: the second time from the per-thread cache.
        let requests = [
            req("GET"),
            req("PROPFIND"),
            req("POST"),
            req("GET"),
            req("PROPFIND"),
        ];
        crate::key::assert_extract_into_agrees(&Endpoint, &requests);
        crate::key::assert_extract_into_agrees(&Endpoint, &requests);
    }
}
