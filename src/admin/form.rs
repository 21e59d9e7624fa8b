//! Parsing what browsers send: form bodies and query strings, cookies; and
//! the hex of the cookie value.

use http::{header, HeaderMap};
use std::fmt::Write as _;

/// `application/x-www-form-urlencoded` pairs (also query strings).
pub(super) fn form_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex_val(b[i + 1]), hex_val(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
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
