//! Every built-in key extractor on an arbitrary request head, then the key
//! as the layer stores it (`storage_key_part`).
//!
//! Input: byte 0 picks lengths; the rest is cut into a method, a request
//! target, an `x-api-key` value, a user id and a forwarding header value.
//! Parts the `http` crate refuses (an invalid method or URI) fall back to
//! `GET /`, as a server would never pass them on.
//!
//! Checked: no panic; every stored key part is at most 128 printable ASCII
//! bytes without `{`/`}`; `Endpoint` (built without axum, so no matched
//! route) is one of ten `<METHOD> <unmatched>` keys; an API key is 32 hex
//! digits and never contains the secret; `User` keys by the id verbatim.
#![no_main]

use http::{HeaderValue, Method, Request, Uri};
use libfuzzer_sys::fuzz_target;
use std::net::SocketAddr;
use tiered_ratelimit::key::{
    storage_key_part, ApiKey, ClientIp, Endpoint, Global, KeyExtractor, User, UNMATCHED_ROUTE,
};
use tiered_ratelimit::UserId;

const METHODS: [&str; 10] = [
    "GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "CONNECT", "PATCH", "TRACE", "OTHER",
];

fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
    let n = n.min(data.len());
    let (a, b) = data.split_at(n);
    *data = b;
    a
}

fn check_stored(key: &str) -> String {
    let part = storage_key_part(key.as_bytes());
    assert!(part.len() <= 128);
    assert!(part
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}'));
    part
}

fuzz_target!(|data: &[u8]| {
    let Some((&lens, mut rest)) = data.split_first() else {
        return;
    };
    let method = take(&mut rest, usize::from(lens & 0x0f));
    let target = take(&mut rest, usize::from(lens >> 4) * 8);
    let api_len = rest.first().map_or(0, |&b| usize::from(b));
    let api = take(&mut rest, api_len);
    let user_len = rest.first().map_or(0, |&b| usize::from(b));
    let user = take(&mut rest, user_len);
    let forwarded = rest;

    let mut req = Request::new(());
    *req.method_mut() = Method::from_bytes(method).unwrap_or(Method::GET);
    *req.uri_mut() = Uri::try_from(target).unwrap_or_else(|_| Uri::from_static("/"));
    let api_value = HeaderValue::from_bytes(api).ok();
    if let Some(v) = &api_value {
        req.headers_mut().insert("x-api-key", v.clone());
    }
    if let Ok(v) = HeaderValue::from_bytes(forwarded) {
        req.headers_mut().insert("x-forwarded-for", v.clone());
        req.headers_mut().insert("forwarded", v);
    }
    let user_id = String::from_utf8_lossy(user).into_owned();
    req.extensions_mut().insert(UserId(user_id.clone()));
    req.extensions_mut()
        .insert("10.0.0.1:443".parse::<SocketAddr>().unwrap());
    let (parts, _) = req.into_parts();

    let endpoint = Endpoint.extract(&parts).unwrap().unwrap();
    let (m, route) = endpoint.split_once(' ').unwrap();
    assert!(
        METHODS.contains(&m) && route == UNMATCHED_ROUTE,
        "{endpoint:?}"
    );
    check_stored(&endpoint);

    let api_key = ApiKey::header("x-api-key").extract(&parts).unwrap();
    match (&api_value, &api_key) {
        (Some(v), Some(k)) => {
            assert!(!v.is_empty());
            assert_eq!(k.len(), 32);
            assert!(k.bytes().all(|b| b.is_ascii_hexdigit()));
            assert_eq!(check_stored(k), *k);
        }
        (Some(v), None) => assert!(v.is_empty()),
        (None, k) => assert!(k.is_none()),
    }

    let u = User.extract(&parts).unwrap().unwrap();
    assert_eq!(u, user_id);
    check_stored(&u);

    assert_eq!(Global.extract(&parts).unwrap().as_deref(), Some("all"));

    let ip = ClientIp::default()
        .trusted_proxies(["10.0.0.0/8".parse().unwrap()])
        .forwarded_headers(tiered_ratelimit::key::ForwardedHeader::ALL)
        .extract(&parts)
        .unwrap()
        .unwrap();
    assert_eq!(check_stored(&ip), ip);
});
