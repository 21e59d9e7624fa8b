//! The token check: bearer header, cookie, `?token=`; and the headers every
//! admin answer carries.

use super::form::{cookies, form_pairs, hex_encode};
use super::reply::{base_of, error, page_path, see_other};
use super::{Admin, COOKIE_NAME};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// How long the cookie lives.
const COOKIE_MAX_AGE_S: u64 = 8 * 3600;

impl Admin {
    fn token_matches(&self, candidate: &[u8]) -> bool {
        let token = self.token.as_bytes();
        // Lengths may differ in time; contents never do.
        !token.is_empty() && bool::from(token.ct_eq(candidate))
    }

    fn bearer_ok(&self, headers: &HeaderMap) -> bool {
        headers.get_all(header::AUTHORIZATION).iter().any(|v| {
            let v = v.as_bytes();
            v.len() > 7
                && v[..7].eq_ignore_ascii_case(b"bearer ")
                && self.token_matches(v[7..].trim_ascii())
        })
    }

    fn cookie_ok(&self, headers: &HeaderMap) -> bool {
        use subtle::ConstantTimeEq;
        let want = self.cookie_value();
        cookies(headers, COOKIE_NAME).any(|v| bool::from(v.as_bytes().ct_eq(want.as_bytes())))
    }

    /// The cookie's value: HMAC-SHA256 of a fixed label keyed by the token,
    /// in hex. It proves the token was given without carrying it (a cookie
    /// read off a browser does not reveal the token), every instance with
    /// the same token accepts it, and a new token voids old cookies.
    fn cookie_value(&self) -> String {
        use hmac::{KeyInit, Mac};
        let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(self.token.as_bytes()) else {
            // HMAC takes keys of any length; unreachable, and no cookie
            // matches an empty value.
            return String::new();
        };
        mac.update(b"tiered-ratelimit admin cookie v1");
        hex_encode(&mac.finalize().into_bytes())
    }

    fn query_ok(&self, query: Option<&str>) -> bool {
        query.is_some_and(|q| {
            form_pairs(q)
                .iter()
                .any(|(k, v)| k == "token" && self.token_matches(v.as_bytes()))
        })
    }

    fn cookie(&self, path: &str) -> HeaderValue {
        let mut c = format!(
            "{COOKIE_NAME}={}; Path={path}; Max-Age={COOKIE_MAX_AGE_S}; HttpOnly; SameSite=Strict",
            self.cookie_value()
        );
        if self.secure_cookie {
            c.push_str("; Secure");
        }
        HeaderValue::from_str(&c).unwrap_or_else(|_| HeaderValue::from_static(""))
    }
}

pub(super) async fn authorize(
    State(admin): State<Arc<Admin>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    let page = req.method() == Method::GET && (path == "/" || path.is_empty());
    let form = req.method() == Method::POST && (path == "/mode" || path == "/key");
    let mut res = if admin.bearer_ok(req.headers()) {
        next.run(req).await
    } else if (page || form) && admin.cookie_ok(req.headers()) {
        let cross_site = req
            .headers()
            .get("sec-fetch-site")
            .is_some_and(|v| v.as_bytes() == b"cross-site" || v.as_bytes() == b"same-site");
        if form && cross_site {
            error(StatusCode::FORBIDDEN, "cross_site", "cross-site form post")
        } else {
            next.run(req).await
        }
    } else if page && admin.query_token && admin.query_ok(req.uri().query()) {
        // Trade the token in the URL for the cookie, and leave the URL.
        let base = base_of(&req);
        let mut res = see_other(page_path(&base));
        res.headers_mut()
            .insert(header::SET_COOKIE, admin.cookie(page_path(&base)));
        res
    } else {
        let mut res = error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid admin bearer token is required",
        );
        res.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"tiered-ratelimit admin\""),
        );
        res
    };
    let h = res.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_token_matches_nothing() {
        let layer = crate::http::layer::RateLimitLayer::builder()
            .tier(crate::http::tier::Tier::new(
                "g",
                crate::key::Global,
                crate::quota::Quota::per_second(1),
            ))
            .build()
            .unwrap();
        let a = Admin::new(layer.handle(), "");
        assert!(!a.token_matches(b""));
        let b = Admin::new(layer.handle(), "abc");
        assert!(b.token_matches(b"abc"));
        assert!(!b.token_matches(b"abd"));
        assert!(!b.token_matches(b"ab"));
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer abc"),
        );
        assert!(b.bearer_ok(&h));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert!(!b.bearer_ok(&h));
    }
}
