//! The forwarding-header parser (`ClientIp::resolve` / `extract`).
//!
//! Input: byte 0 picks the configuration, byte 1 (and maybe 4 or 16 more)
//! the TCP peer; the rest is split at `\n` into header lines, whose first byte
//! picks the header (`X-Forwarded-For`, `Forwarded`, `X-Real-IP`) and whose
//! remaining bytes are the value (lines that are not valid header values are
//! dropped, as hyper would refuse them).
//!
//! Checked: no panic; the key is an IPv4 address or an IPv6 network in
//! canonical text, at most 43 bytes, unchanged by `storage_key_part`; an
//! untrusted peer is always its own key, whatever the headers; and when a
//! trusted proxy appends the client it saw as a new header line, that client
//! is the key, whatever the client had sent before.
#![no_main]

use http::{request::Parts, HeaderMap, HeaderValue, Request};
use libfuzzer_sys::fuzz_target;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use tiered_ratelimit::key::{storage_key_part, ClientIp, ForwardedHeader, KeyExtractor};

const HEADERS: [&str; 3] = ["x-forwarded-for", "forwarded", "x-real-ip"];

fn config(b: u8) -> (ClientIp, &'static [ForwardedHeader], bool) {
    use ForwardedHeader::*;
    const LISTS: [&[ForwardedHeader]; 6] = [
        &[XForwardedFor],
        &[Forwarded],
        &[XRealIp],
        &[XForwardedFor, Forwarded],
        &[Forwarded, XRealIp, XForwardedFor],
        &[],
    ];
    let list = LISTS[usize::from(b % 6)];
    let trusting = b & 0x40 == 0;
    let mut c = ClientIp::default()
        .forwarded_headers(list.iter().copied())
        .ipv6_prefix((b >> 1) & 0x7f);
    if trusting {
        c = c.trusted_proxies([
            "10.0.0.0/8".parse().unwrap(),
            "2001:db8:ffff::/48".parse().unwrap(),
            "::ffff:192.168.0.0/112".parse().unwrap(),
        ]);
    }
    (c, list, trusting)
}

const PEERS: [&str; 8] = [
    "10.0.0.1",
    "::ffff:10.0.0.1",
    "2001:db8:ffff::1",
    "192.168.3.4",
    "203.0.113.9",
    "2001:db8:1::1",
    "::1",
    "::10.0.0.1",
];

fn is_trusted(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let o = v6.octets();
                if o[..12].iter().all(|&b| b == 0) && o[12] != 0 {
                    IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
                } else {
                    IpAddr::V6(v6)
                }
            }
        },
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => v4.octets()[0] == 10 || v4.octets()[..2] == [192, 168],
        IpAddr::V6(v6) => v6.segments()[..3] == [0x2001, 0xdb8, 0xffff],
    }
}

fn parts(peer: IpAddr, headers: HeaderMap) -> Parts {
    let (mut p, _) = Request::new(()).into_parts();
    p.headers = headers;
    p.extensions.insert(SocketAddr::new(peer, 1));
    p
}

fn check_key(key: &str) {
    assert!(key.len() <= 43, "key {key:?}");
    assert!(
        key.parse::<Ipv4Addr>().is_ok()
            || key
                .split_once('/')
                .is_some_and(|(a, p)| a.parse::<Ipv6Addr>().is_ok()
                    && p.parse::<u8>().is_ok_and(|p| p <= 128)),
        "key {key:?}"
    );
    assert_eq!(storage_key_part(key.as_bytes()), key);
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let (c, list, trusting) = config(data[0]);
    let mut rest = &data[2..];
    let peer: IpAddr = match data[1] % 10 {
        8 if rest.len() >= 4 => {
            let (a, r) = rest.split_at(4);
            rest = r;
            IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
        }
        9 if rest.len() >= 16 => {
            let (a, r) = rest.split_at(16);
            rest = r;
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(a).unwrap()))
        }
        n => PEERS[usize::from(n % 8)].parse().unwrap(),
    };
    let mut headers = HeaderMap::new();
    for line in rest.split(|&b| b == b'\n') {
        let Some((&sel, value)) = line.split_first() else {
            continue;
        };
        if let Ok(v) = HeaderValue::from_bytes(value) {
            headers.append(HEADERS[usize::from(sel % 3)], v);
        }
    }

    let resolved = c.resolve(peer, &headers);
    assert_eq!(c.resolve(peer, &headers), resolved, "deterministic");
    let key = c.extract(&parts(peer, headers.clone())).unwrap().unwrap();
    check_key(&key);
    let peer_key = c.extract(&parts(peer, HeaderMap::new())).unwrap().unwrap();
    if !trusting || !is_trusted(peer) {
        assert_eq!(key, peer_key, "untrusted peer {peer}");
    }

    // A trusted proxy appends the client it saw: that client wins.
    if trusting && is_trusted(peer) {
        if let Some(&first) = list.first() {
            let mut headers = headers;
            let v = match first {
                ForwardedHeader::Forwarded => "for=198.51.100.200",
                _ => "198.51.100.200",
            };
            headers.append(first.header_name(), HeaderValue::from_static(v));
            let key = c.extract(&parts(peer, headers)).unwrap().unwrap();
            assert_eq!(key, "198.51.100.200");
        }
    }
});
