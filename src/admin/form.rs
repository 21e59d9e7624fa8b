//! Parsing what browsers send: form bodies and query strings, cookies; and
//! the hex of the cookie value.

use http::{header, HeaderMap};
use std::fmt::Write as _;

/// `application/x-www-form-urlencoded` pairs (also query strings), decoded
/// as the WHATWG URL standard says (the `form_urlencoded` crate: `+` is a
/// space, a malformed `%` escape is kept as written, invalid UTF-8 becomes
/// U+FFFD).
pub(super) fn form_pairs(s: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(s.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// A form field's value (`pairs` from [`form_pairs`]), trimmed; `None`
/// when it is missing or blank.
pub(super) fn form_field<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

pub(super) fn hex_encode(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// Values of cookie `name` in the request's `Cookie` headers.
pub(super) fn cookies<'a>(
    headers: &'a HeaderMap,
    name: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(move |c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_forms_and_hex() {
        assert_eq!(
            form_pairs("mode=canary%3A10&tier=ip&x=a+b&bad=%zz&t=%4"),
            [
                ("mode".into(), "canary:10".into()),
                ("tier".into(), "ip".into()),
                ("x".into(), "a b".into()),
                ("bad".into(), "%zz".into()),
                ("t".into(), "%4".into()),
            ]
        );
        assert_eq!(hex_encode(b"t0k;en ="), "74306b3b656e203d");
    }
}
