//! Reading one forwarding-header entry: address spellings, ports, RFC 7239
//! elements; and the canonical (IPv4 where possible) form of addresses and
//! networks. Whatever the bytes, these return `None`, never panic.

use ipnet::{IpNet, Ipv4Net};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The longest `X-Forwarded-For` / `X-Real-IP` entry or `for=` node, in
/// bytes, that is parsed at all (the longest address spelling,
/// `[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:65535`, is 54). Longer
/// entries are unparseable.
const MAX_NODE_LEN: usize = 64;

/// The longest RFC 7239 `forwarded-element` (`for=..;by=..;proto=..;host=..`)
/// that is parsed at all, in bytes. Longer elements are unparseable.
const MAX_ELEMENT_LEN: usize = 512;

/// IPv4-mapped (`::ffff:a.b.c.d`) and IPv4-compatible (`::a.b.c.d`, first
/// octet non-zero so `::` and `::1` stay IPv6) addresses become IPv4.
pub(super) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return IpAddr::V4(v4);
            }
            let o = v6.octets();
            if o[..12].iter().all(|&b| b == 0) && o[12] != 0 {
                return IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
            }
            IpAddr::V6(v6)
        }
        v4 => v4,
    }
}

/// A trusted network, truncated, with IPv4-mapped/-compatible IPv6 networks
/// of at least /96 turned into the IPv4 network they cover.
pub(super) fn canonical_net(net: IpNet) -> IpNet {
    let net = net.trunc();
    if let IpNet::V6(v6) = net {
        if v6.prefix_len() >= 96 {
            if let IpAddr::V4(v4) = canonical(IpAddr::V6(v6.network())) {
                if let Ok(n) = Ipv4Net::new(v4, v6.prefix_len() - 96) {
                    return IpNet::V4(n);
                }
            }
        }
    }
    net
}

pub(super) fn trim_ows(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|&c| c != b' ' && c != b'\t');
    let Some(start) = start else {
        return &[];
    };
    let end = b
        .iter()
        .rposition(|&c| c != b' ' && c != b'\t')
        .unwrap_or(start);
    &b[start..=end]
}

/// Parses one node: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]`
/// or `[2001:db8::1]:80` (and, when `obfuscated_port`, `_abc` as the port).
pub(super) fn parse_node(s: &str, obfuscated_port: bool) -> Option<IpAddr> {
    if s.is_empty() || s.len() > MAX_NODE_LEN {
        return None;
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (inner, after) = rest.split_once(']')?;
        let ip: Ipv6Addr = inner.parse().ok()?;
        if !after.is_empty() && !valid_port(after.strip_prefix(':')?, obfuscated_port) {
            return None;
        }
        return Some(canonical(IpAddr::V6(ip)));
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    let (host, port) = s.rsplit_once(':')?;
    let v4: Ipv4Addr = host.parse().ok()?;
    valid_port(port, obfuscated_port).then_some(IpAddr::V4(v4))
}

fn valid_port(p: &str, obfuscated_ok: bool) -> bool {
    if let Some(obf) = p.strip_prefix('_') {
        return obfuscated_ok
            && !obf.is_empty()
            && obf
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    }
    !p.is_empty()
        && p.len() <= 5
        && p.bytes().all(|b| b.is_ascii_digit())
        && p.parse::<u16>().is_ok()
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Parses one RFC 7239 `forwarded-element`
/// (`for=192.0.2.60;proto=http;by=203.0.113.43`) and returns its `for=`
/// address. `None` when the element is malformed, has no `for=` or more than
/// one, or its `for=` is not an address (`unknown`, `_hidden`).
pub(super) fn parse_forwarded_element(elem: &[u8]) -> Option<IpAddr> {
    if elem.len() > MAX_ELEMENT_LEN {
        return None;
    }
    let mut i = 0;
    let n = elem.len();
    let mut node: Option<String> = None;
    loop {
        while i < n && matches!(elem[i], b' ' | b'\t') {
            i += 1;
        }
        if i == n {
            break;
        }
        // pair name
        let name_start = i;
        while i < n && is_tchar(elem[i]) {
            i += 1;
        }
        let name = &elem[name_start..i];
        while i < n && matches!(elem[i], b' ' | b'\t') {
            i += 1;
        }
        if name.is_empty() || i == n || elem[i] != b'=' {
            return None;
        }
        i += 1;
        while i < n && matches!(elem[i], b' ' | b'\t') {
            i += 1;
        }
        // value: quoted-string or token (leniently with `:[]` for IPv6)
        let mut value = Vec::new();
        if i < n && elem[i] == b'"' {
            i += 1;
            loop {
                let &b = elem.get(i)?; // unterminated quote
                i += 1;
                match b {
                    b'"' => break,
                    b'\\' => {
                        value.push(*elem.get(i)?);
                        i += 1;
                    }
                    _ => value.push(b),
                }
            }
        } else {
            while i < n && (is_tchar(elem[i]) || matches!(elem[i], b':' | b'[' | b']')) {
                value.push(elem[i]);
                i += 1;
            }
            if value.is_empty() {
                return None;
            }
        }
        if name.eq_ignore_ascii_case(b"for") {
            if node.is_some() {
                return None; // a parameter must not repeat within an element
            }
            node = Some(String::from_utf8(value).ok()?);
        }
        while i < n && matches!(elem[i], b' ' | b'\t') {
            i += 1;
        }
        if i < n {
            if elem[i] != b';' {
                return None;
            }
            i += 1;
        }
    }
    parse_node(&node?, true)
}
