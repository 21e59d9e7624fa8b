use super::parse::canonical_net;
use super::*;

fn parts(peer: &str, headers: &[(&str, &str)]) -> Parts {
    let mut b = http::Request::builder();
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let (mut p, _) = b.body(()).unwrap().into_parts();
    p.extensions.insert(peer.parse::<SocketAddr>().unwrap());
    p
}

fn xff<'a>(v: &[&'a str]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|v| ("x-forwarded-for", *v)).collect()
}

fn key(c: &ClientIp, peer: &str, headers: &[(&str, &str)]) -> String {
    c.extract(&parts(peer, headers)).unwrap().unwrap()
}

#[test]
fn extract_into_agrees() {
    let mut requests = Vec::new();
    for peer in [
        "0.0.0.0:1",
        "9.10.99.100:1",
        "255.255.255.255:1",
        "10.1.2.3:1",
        "[2001:db8:1:2:3:4:5:6]:1",
        "[::ffff:1.2.3.4]:1",
    ] {
        requests.push(parts(peer, &xff(&["203.0.113.7, 10.9.9.9"])));
        requests.push(parts(peer, &[]));
    }
    crate::key::assert_extract_into_agrees(&trusted(), &requests);
    crate::key::assert_extract_into_agrees(&ClientIp::default().ipv6_prefix(128), &requests);
    let v4 = |s: &str| ClientIp::default().key_for(s.parse().unwrap());
    for ip in ["0.0.0.0", "9.10.99.100", "255.255.255.255", "1.20.120.201"] {
        assert_eq!(v4(ip), ip);
    }
}

fn trusted() -> ClientIp {
    ClientIp::default().trusted_proxies(["10.0.0.0/8".parse().unwrap()])
}

#[test]
fn untrusted_peer_ignores_forwarding_headers() {
    let c = ClientIp::default();
    assert_eq!(
        key(&c, "203.0.113.9:5000", &xff(&["1.1.1.1"])),
        "203.0.113.9"
    );
    let c = trusted().forwarded_headers(ForwardedHeader::ALL);
    for h in ["x-forwarded-for", "forwarded", "x-real-ip"] {
        assert_eq!(
            key(&c, "203.0.113.9:5000", &[(h, "for=1.1.1.1")]),
            "203.0.113.9"
        );
    }
}

#[test]
fn walks_from_the_right_skipping_trusted_hops() {
    let c = trusted();
    // client forged 6.6.6.6; LB saw 198.51.100.7; inner proxy 10.0.0.2
    assert_eq!(
        key(&c, "10.0.0.1:1", &xff(&["6.6.6.6, 198.51.100.7, 10.0.0.2"])),
        "198.51.100.7"
    );
    assert_eq!(
        key(&c, "10.0.0.1:1", &xff(&["6.6.6.6", "198.51.100.7:443"])),
        "198.51.100.7"
    );
    assert_eq!(key(&c, "10.0.0.1:1", &xff(&["garbage"])), "10.0.0.1");
    assert_eq!(
        key(&c, "10.0.0.1:1", &xff(&["garbage, 10.0.0.2"])),
        "10.0.0.2"
    );
    assert_eq!(key(&c, "10.0.0.1:1", &[]), "10.0.0.1");
    assert_eq!(
        key(&c, "10.0.0.1:1", &xff(&["198.51.100.7,, ,"])),
        "198.51.100.7"
    );
}

#[test]
fn hop_limit() {
    let c = trusted();
    let mut v = vec!["198.51.100.7"];
    v.extend(std::iter::repeat_n("10.0.0.9", MAX_FORWARDED_HOPS - 1));
    let line = v.join(",");
    assert_eq!(key(&c, "10.0.0.1:1", &xff(&[&line])), "198.51.100.7");
    v.push("10.0.0.9");
    let line = v.join(",");
    assert_eq!(key(&c, "10.0.0.1:1", &xff(&[&line])), "10.0.0.9");
}

#[test]
fn forwarded_header_rfc7239() {
    let c = trusted().forwarded_headers([ForwardedHeader::Forwarded]);
    let k = |v: &str| key(&c, "10.0.0.1:1", &[("forwarded", v)]);
    assert_eq!(k("for=198.51.100.7"), "198.51.100.7");
    assert_eq!(k("For=\"[2001:db8:cafe::17]:4711\""), "2001:db8:cafe::/64");
    assert_eq!(k("for=192.0.2.60;proto=http;by=203.0.113.43"), "192.0.2.60");
    assert_eq!(k("proto=http; for=192.0.2.60 ;by=10.0.0.2"), "192.0.2.60");
    assert_eq!(k("for=6.6.6.6, for=198.51.100.7"), "198.51.100.7");
    assert_eq!(k("for=\"6.6.6.6, for=198.51.100.7"), "198.51.100.7");
    assert_eq!(k("for=198.51.100.7, for=10.0.0.2"), "198.51.100.7");
    assert_eq!(k("for=\"198.51.100\\.7:_x1\""), "198.51.100.7");
    assert_eq!(k("for=2001:db8::1"), "2001:db8::/64");
    assert_eq!(k("for=[2001:db8::1]:80"), "2001:db8::/64");
    assert_eq!(k("for=\"[::ffff:198.51.100.7]\""), "198.51.100.7");
    for bad in [
        "for=_hidden",
        "for=unknown",
        "for=\"_gazonk\"",
        "proto=https;by=10.0.0.2",
        "for=1.2.3.4;for=5.6.7.8",
        "for=\"198.51.100.7",
        "for=198.51.100.7 junk",
        "for",
        "=1.2.3.4",
        "for=\"[2001:db8::1]:_\"",
        "for=1.2.3.4:99999",
        "for=\"[1.2.3.4]\"",
        "for=2001:db8::1:80:", // not an address
    ] {
        assert_eq!(k(bad), "10.0.0.1", "{bad}");
    }
}

#[test]
fn first_configured_header_present_wins() {
    let c = trusted().forwarded_headers([ForwardedHeader::XRealIp, ForwardedHeader::Forwarded]);
    assert_eq!(
        key(
            &c,
            "10.0.0.1:1",
            &[("x-real-ip", "198.51.100.7"), ("forwarded", "for=6.6.6.6")]
        ),
        "198.51.100.7"
    );
    assert_eq!(
        key(&c, "10.0.0.1:1", &[("forwarded", "for=198.51.100.8")]),
        "198.51.100.8"
    );
    // not configured: ignored
    assert_eq!(key(&c, "10.0.0.1:1", &xff(&["198.51.100.9"])), "10.0.0.1");
    let none = trusted().forwarded_headers([]);
    assert_eq!(
        key(&none, "10.0.0.1:1", &xff(&["198.51.100.9"])),
        "10.0.0.1"
    );
}

#[test]
fn ipv6_grouped_and_mapped() {
    let c = ClientIp::default();
    assert_eq!(
        key(&c, "[2001:db8:1:2:3:4:5:6]:1", &[]),
        "2001:db8:1:2::/64"
    );
    assert_eq!(key(&c, "[::ffff:192.0.2.1]:1", &[]), "192.0.2.1");
    assert_eq!(key(&c, "[::192.0.2.1]:1", &[]), "192.0.2.1");
    assert_eq!(key(&c, "[::1]:1", &[]), "::/64");
    let c = c.ipv6_prefix(128);
    assert_eq!(key(&c, "[2001:DB8::1]:1", &[]), "2001:db8::1/128");
    assert_eq!(key(&c, "[::1]:1", &[]), "::1/128");
    let c = trusted();
    assert_eq!(
        key(&c, "[::ffff:10.0.0.1]:1", &xff(&["::ffff:198.51.100.7"])),
        "198.51.100.7"
    );
    assert_eq!(
        key(&c, "10.0.0.1:1", &xff(&["[::198.51.100.7]:80"])),
        "198.51.100.7"
    );
}

#[test]
fn mapped_trusted_networks_are_ipv4() {
    let c = ClientIp::default().trusted_proxies(["::ffff:10.0.0.0/104".parse().unwrap()]);
    assert_eq!(
        key(&c, "10.1.2.3:1", &xff(&["198.51.100.7"])),
        "198.51.100.7"
    );
    assert_eq!(
        canonical_net("::ffff:0:0/96".parse().unwrap()),
        "0.0.0.0/0".parse::<IpNet>().unwrap()
    );
    assert_eq!(
        canonical_net("2001:db8::/32".parse().unwrap()),
        "2001:db8::/32".parse::<IpNet>().unwrap()
    );
}

#[test]
fn missing_peer_is_an_error() {
    let (p, _) = http::Request::new(()).into_parts();
    assert_eq!(
        ClientIp::default().extract(&p),
        Err(KeyError::MissingConnectInfo)
    );
}
