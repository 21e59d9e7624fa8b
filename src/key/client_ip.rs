use super::{KeyError, KeyExtractor};
use http::request::Parts;
use ipnet::{IpNet, Ipv6Net};
use std::net::{IpAddr, SocketAddr};

/// The most forwarding hops read from `X-Forwarded-For`; entries beyond are
/// ignored (the key falls back to the last trusted hop).
pub const MAX_FORWARDED_HOPS: usize = 32;

/// Keys by the client's IP address.
///
/// By default the key is the **TCP peer address** from axum's
/// `ConnectInfo<SocketAddr>` (or a plain `SocketAddr` extension), and no
/// forwarding header is trusted: `X-Forwarded-For` is written by the client
/// unless a proxy you run overwrites it. Behind a load balancer, list its
/// addresses in [`ClientIp::trusted_proxies`]; the header is then walked from
/// the right, skipping trusted hops, and the first untrusted address is the
/// client. A forged leftmost entry therefore never changes the key.
///
/// IPv6 clients are grouped by prefix ([`ClientIp::ipv6_prefix`], default
/// `/64`: one subscriber usually gets a whole /64, so keying single addresses
/// would let one client rotate through 2^64 keys). IPv4-mapped IPv6 addresses
/// (`::ffff:a.b.c.d`) are keyed as the IPv4 address.
///
/// Without a peer address (the app was not served with
/// `into_make_service_with_connect_info::<SocketAddr>()`), extraction fails
/// with [`KeyError::MissingConnectInfo`]; the layer logs it and applies the
/// failure policy instead of answering 500.
///
/// ```
/// use tiered_ratelimit::key::ClientIp;
/// let ip = ClientIp::default()
///     .trusted_proxies(["10.0.0.0/8".parse().unwrap()])
///     .ipv6_prefix(56);
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    ipv6_prefix: u8,
}

impl Default for ClientIp {
    fn default() -> Self {
        Self {
            trusted: Vec::new(),
            ipv6_prefix: 64,
        }
    }
}

impl ClientIp {
    /// Trusts `X-Forwarded-For` when the TCP peer is inside one of these
    /// networks, and skips hops inside them while walking the header.
    pub fn trusted_proxies(mut self, nets: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted = nets.into_iter().map(|n| n.trunc()).collect();
        self
    }

    /// Groups IPv6 clients by this prefix length (0-128, default 64). Values
    /// above 128 are clamped to 128; the policy file rejects them.
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.ipv6_prefix = bits.min(128);
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|n| n.contains(&ip))
    }

    /// The client address this extractor resolves for `peer` and the request
    /// headers, before IPv6 grouping.
    pub fn resolve(&self, peer: IpAddr, headers: &http::HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        if self.trusted.is_empty() || !self.is_trusted(peer) {
            return peer;
        }
        let mut last_trusted = peer;
        let mut hops = 0usize;
        // Header lines in order; within a line, comma-separated entries. We
        // walk every entry from the right.
        let lines: Vec<&[u8]> = headers
            .get_all(http::header::HeaderName::from_static("x-forwarded-for"))
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        for line in lines.iter().rev() {
            for entry in line.rsplit(|&b| b == b',') {
                hops += 1;
                if hops > MAX_FORWARDED_HOPS {
                    return last_trusted;
                }
                match parse_forwarded_ip(entry) {
                    Some(ip) if self.is_trusted(ip) => last_trusted = ip,
                    Some(ip) => return ip,
                    // Garbage where a trusted proxy should have written an
                    // address: key by the last hop we can vouch for.
                    None => return last_trusted,
                }
            }
        }
        last_trusted
    }

    fn key_for(&self, ip: IpAddr) -> String {
        match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => match Ipv6Net::new(v6, self.ipv6_prefix) {
                Ok(net) => net.trunc().to_string(),
                Err(_) => v6.to_string(),
            },
        }
    }
}

/// IPv4-mapped IPv6 becomes IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// Parses one `X-Forwarded-For` entry: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`,
/// `[2001:db8::1]` or `[2001:db8::1]:80`, with surrounding whitespace.
fn parse_forwarded_ip(entry: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(entry).ok()?.trim();
    if s.len() > 64 {
        return None;
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Some(canonical(sa.ip()));
    }
    let inner = s.strip_prefix('[')?.strip_suffix(']')?;
    inner.parse::<IpAddr>().ok().map(canonical)
}

fn peer_addr(parts: &Parts) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(ci) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(ci.0);
    }
    parts.extensions.get::<SocketAddr>().copied()
}

impl KeyExtractor for ClientIp {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        let peer = peer_addr(parts).ok_or(KeyError::MissingConnectInfo)?;
        let ip = self.resolve(peer.ip(), &parts.headers);
        Ok(Some(self.key_for(canonical(ip))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(peer: &str, xff: &[&str]) -> Parts {
        let mut b = http::Request::builder();
        for v in xff {
            b = b.header("x-forwarded-for", *v);
        }
        let (mut p, _) = b.body(()).unwrap().into_parts();
        p.extensions.insert(peer.parse::<SocketAddr>().unwrap());
        p
    }

    fn key(c: &ClientIp, peer: &str, xff: &[&str]) -> String {
        c.extract(&parts(peer, xff)).unwrap().unwrap()
    }

    #[test]
    fn untrusted_peer_ignores_forwarding_headers() {
        let c = ClientIp::default();
        assert_eq!(key(&c, "203.0.113.9:5000", &["1.1.1.1"]), "203.0.113.9");
    }

    #[test]
    fn walks_from_the_right_skipping_trusted_hops() {
        let c = ClientIp::default().trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
        // client forged 6.6.6.6; LB saw 198.51.100.7; inner proxy 10.0.0.2
        assert_eq!(
            key(&c, "10.0.0.1:1", &["6.6.6.6, 198.51.100.7, 10.0.0.2"]),
            "198.51.100.7"
        );
        assert_eq!(
            key(&c, "10.0.0.1:1", &["6.6.6.6", "198.51.100.7:443"]),
            "198.51.100.7"
        );
        assert_eq!(key(&c, "10.0.0.1:1", &["garbage"]), "10.0.0.1");
        assert_eq!(key(&c, "10.0.0.1:1", &[]), "10.0.0.1");
    }

    #[test]
    fn ipv6_grouped_and_mapped() {
        let c = ClientIp::default();
        assert_eq!(
            key(&c, "[2001:db8:1:2:3:4:5:6]:1", &[]),
            "2001:db8:1:2::/64"
        );
        assert_eq!(key(&c, "[::ffff:192.0.2.1]:1", &[]), "192.0.2.1");
        let c = c.ipv6_prefix(128);
        assert_eq!(key(&c, "[2001:DB8::1]:1", &[]), "2001:db8::1/128");
    }

    #[test]
    fn missing_peer_is_an_error() {
        let (p, _) = http::Request::new(()).into_parts();
        assert_eq!(
            ClientIp::default().extract(&p),
            Err(KeyError::MissingConnectInfo)
        );
    }
}
