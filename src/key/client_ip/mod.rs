//! `ClientIp`: keys by the client's IP address. The type, its settings and
//! its key format live here; which address is the client's in `resolve.rs`,
//! the forwarding headers in `header.rs`, entry parsing in `parse.rs`, the
//! misconfiguration warning's throttle is `crate::util::throttle::Throttle`.

mod header;
mod parse;
mod resolve;
#[cfg(test)]
mod tests;

pub use header::{ForwardedHeader, UnknownForwardedHeader};

use super::{KeyError, KeyExtractor, KeyWriter};
use crate::util::de::{FieldIn, Nets};
use crate::util::throttle::Throttle;
use http::request::Parts;
use ipnet::{IpNet, Ipv6Net};
use parse::canonical_net;
use serde::de::{self, Deserialize, Deserializer};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// The most entries read from a forwarding header (all its lines together,
/// empty list elements included); past them the walk stops and the key falls
/// back to the last trusted hop.
pub const MAX_FORWARDED_HOPS: usize = 32;

/// The misconfiguration warning (see [`ClientIp`]) is logged at most once per
/// this interval per extractor (clones share it).
const MISCONFIG_WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Keys by the client's IP address.
///
/// # Which address
/// By default the key is the **TCP peer address** from axum's
/// `ConnectInfo<SocketAddr>` (or a plain `SocketAddr` extension), and no
/// forwarding header is trusted: they are written by the client unless a
/// proxy you run overwrites them. Behind a load balancer, list its addresses
/// in [`ClientIp::trusted_proxies`]. Then, **only when the TCP peer is
/// trusted**, the forwarding header is walked from the **right**, skipping
/// trusted hops, and the first untrusted address is the client. Entries to the
/// left of it were written by the client and never matter: a forged leftmost
/// entry never changes the key.
///
/// # Which header
/// [`ClientIp::forwarded_headers`] lists the headers that may be read, in
/// priority order; the **first one present** on the request is walked and the
/// others are ignored (they are never merged). The default is
/// `[XForwardedFor]`. List only headers that **every** trusted proxy writes
/// or strips: a header your proxy passes through untouched is entirely
/// client-written, and reading it lets clients choose their own key. That is
/// why `Forwarded` is not in the default: most proxies append to
/// `X-Forwarded-For` and forward a client's `Forwarded` header as is.
///
/// # Malformed headers
/// Walking from the right, the first entry that cannot be read — garbage,
/// non-UTF-8 bytes, an address with a zone (`fe80::1%eth0`) or leading zeros,
/// an unbracketed IPv6 address with a port, quotes in `X-Forwarded-For`, an
/// RFC 7239 obfuscated identifier (`for=_hidden`, `for=unknown`), a `for=`
/// missing or repeated within one element, an entry over 64 bytes — stops
/// the walk, and the key is the **last trusted hop** (the proxy that wrote
/// the unreadable entry, or the TCP peer). The same happens after
/// [`MAX_FORWARDED_HOPS`] entries. Empty list elements (`a,,b`, a trailing
/// comma) are skipped. Such entries can only be reached when a trusted proxy
/// wrote them (it writes to the right of anything the client sent), so this
/// never lets a client pick a key; at worst, requests with garbage share their
/// proxy's bucket. Accepted spellings: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`,
/// `[2001:db8::1]`, `[2001:db8::1]:80`; in `Forwarded` also quoted values with
/// quoted-pairs, unquoted IPv6 (as nginx's `for=$remote_addr` writes) and
/// obfuscated ports (`"1.2.3.4:_abc"`). `Forwarded` is split at every comma,
/// quoted or not (addresses never contain one), so an unbalanced quote
/// written by a client cannot swallow the entries a proxy appended after it.
///
/// # Normalisation and IPv6 grouping
/// IPv4-mapped (`::ffff:a.b.c.d`) and IPv4-compatible (`::a.b.c.d`, with
/// `a` non-zero, so `::1` stays IPv6 loopback) addresses are keyed as the IPv4
/// address, wherever they come from (the peer, a header, or a trusted CIDR).
/// IPv6 clients are grouped by prefix ([`ClientIp::ipv6_prefix`], default
/// `/64`): one subscriber usually gets a whole /64 (SLAAC needs it), so keying
/// single addresses would let one client rotate through 2^64 keys, while a /64
/// is rarely shared by unrelated users. The key is the network in canonical
/// text (`2001:db8:1:2::/64`: lowercase, zeros compressed), whatever the
/// spelling received.
///
/// # The load balancer warning
/// With no trusted proxy, a request carrying `X-Forwarded-For`, `Forwarded`
/// or `X-Real-IP` logs a `warn` (at most once a minute per extractor; an
/// atomic timestamp, no lock): behind a proxy, that configuration keys every
/// client by the proxy's address, so they all share one bucket. The log
/// names the header and the peer address, never the header's value.
///
/// # Missing peer address
/// Without a peer address (the app was not served with
/// `into_make_service_with_connect_info::<SocketAddr>()`), extraction fails
/// with [`KeyError::MissingConnectInfo`], a configuration error: the layer
/// skips this tier (the others still apply) under `FailurePolicy::Open` and
/// `Fallback`, answers 503 under `Closed`, logs the fix at `ERROR` (once a
/// minute) and counts it (see [`KeyError`]).
///
/// ```
/// use tiered_ratelimit::key::{ClientIp, ForwardedHeader};
/// let ip = ClientIp::default()
///     .trusted_proxies(["10.0.0.0/8".parse().unwrap()])
///     .forwarded_headers([ForwardedHeader::Forwarded])
///     .ipv6_prefix(56);
/// ```
#[derive(Clone)]
#[must_use]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    headers: Vec<ForwardedHeader>,
    ipv6_prefix: u8,
    misconfig_warning: Arc<Throttle>,
}

impl fmt::Debug for ClientIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientIp")
            .field("trusted", &self.trusted)
            .field("headers", &self.headers)
            .field("ipv6_prefix", &self.ipv6_prefix)
            .finish_non_exhaustive()
    }
}

impl Default for ClientIp {
    fn default() -> Self {
        Self {
            trusted: Vec::new(),
            headers: ForwardedHeader::DEFAULT.to_vec(),
            ipv6_prefix: 64,
            misconfig_warning: Arc::new(Throttle::new(MISCONFIG_WARN_INTERVAL)),
        }
    }
}

impl ClientIp {
    /// Trusts the forwarding headers when the TCP peer is inside one of these
    /// networks, and skips hops inside them while walking the header.
    /// IPv4-mapped IPv6 networks (`::ffff:10.0.0.0/104`) are read as IPv4.
    pub fn trusted_proxies(mut self, nets: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted = nets.into_iter().map(canonical_net).collect();
        self
    }

    /// The forwarding headers that may be read from a trusted peer, in
    /// priority order: the first one present on a request is walked, the
    /// others are ignored (default [`ForwardedHeader::DEFAULT`],
    /// `X-Forwarded-For` only). Duplicates are dropped; an empty list reads no
    /// header, so the key is always the TCP peer.
    pub fn forwarded_headers(mut self, headers: impl IntoIterator<Item = ForwardedHeader>) -> Self {
        self.headers.clear();
        for h in headers {
            if !self.headers.contains(&h) {
                self.headers.push(h);
            }
        }
        self
    }

    /// Groups IPv6 clients by this prefix length (0-128, default 64). Values
    /// above 128 are clamped to 128; the policy file rejects them.
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.ipv6_prefix = bits.min(128);
        self
    }

    /// The trusted proxy networks (see [`ClientIp::trusted_proxies`]), as
    /// stored: IPv4-mapped networks as IPv4.
    pub fn trusted(&self) -> &[IpNet] {
        &self.trusted
    }

    /// The forwarding headers read, in priority order (see
    /// [`ClientIp::forwarded_headers`]).
    pub fn headers(&self) -> &[ForwardedHeader] {
        &self.headers
    }

    /// What [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build)
    /// refuses: an `ipv6_prefix` above 128, which only a policy file can
    /// give (the setter clamps).
    pub(crate) fn check(&self) -> Result<(), crate::error::ConfigError> {
        if self.ipv6_prefix > 128 {
            return Err(crate::error::ConfigError::InvalidIpv6Prefix(
                self.ipv6_prefix,
            ));
        }
        Ok(())
    }

    fn key_for(&self, ip: IpAddr) -> String {
        let mut key = String::new();
        self.write_key(ip, &mut key);
        key
    }

    /// Appends `ip`'s key: an IPv4 address in dotted decimal (written digit
    /// by digit, not through `fmt`), an IPv6 address as its prefix network
    /// (`2001:db8:1:2::/64`). Both are plain key characters: no escaping.
    fn write_key(&self, ip: IpAddr, out: &mut String) {
        use std::fmt::Write;
        match ip {
            IpAddr::V4(v4) => {
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        out.push('.');
                    }
                    if octet >= 100 {
                        out.push(char::from(b'0' + octet / 100));
                    }
                    if octet >= 10 {
                        out.push(char::from(b'0' + octet / 10 % 10));
                    }
                    out.push(char::from(b'0' + octet % 10));
                }
            }
            IpAddr::V6(v6) => {
                // Writing into a String cannot fail.
                let _ = match Ipv6Net::new(v6, self.ipv6_prefix.min(128)) {
                    Ok(net) => write!(out, "{}", net.trunc()),
                    Err(_) => write!(out, "{v6}"),
                };
            }
        }
    }
}

impl ClientIp {
    /// The fields of a policy file's `[client_ip]` table.
    const FIELDS: [&'static str; 3] = ["trusted_proxies", "forwarded_headers", "ipv6_prefix"];
}

/// A policy file's `[client_ip]` table, each field optional:
/// `trusted_proxies` (CIDRs or single addresses; default none),
/// `forwarded_headers` (header names, as [`ForwardedHeader`] parses them;
/// default `["x-forwarded-for"]`) and `ipv6_prefix` (default 64; above 128
/// the layer refuses to build, with [`ConfigError::InvalidIpv6Prefix`](crate::ConfigError::InvalidIpv6Prefix)).
/// Unknown fields are an error naming the field.
impl<'de> Deserialize<'de> for ClientIp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = ClientIp;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table of trusted_proxies, forwarded_headers and ipv6_prefix")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<ClientIp, A::Error> {
                let mut ip = ClientIp::default();
                while let Some(field) = map.next_key_seed(FieldIn(&ClientIp::FIELDS))? {
                    ip = match field {
                        "trusted_proxies" => ip.trusted_proxies(map.next_value::<Nets>()?.0),
                        "forwarded_headers" => ip.forwarded_headers(map.next_value::<Vec<_>>()?),
                        // As written, not clamped: `build()` refuses it
                        // above 128, naming the field.
                        "ipv6_prefix" => ClientIp {
                            ipv6_prefix: map.next_value()?,
                            ..ip
                        },
                        other => return Err(de::Error::unknown_field(other, &ClientIp::FIELDS)),
                    };
                }
                Ok(ip)
            }
        }
        d.deserialize_struct("ClientIp", &ClientIp::FIELDS, V)
    }
}

fn peer_addr(parts: &Parts) -> Option<SocketAddr> {
    #[cfg(feature = "axum")]
    if let Some(ci) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(ci.0);
    }
    // tonic's server puts the connection's addresses in every request.
    #[cfg(feature = "grpc")]
    if let Some(addr) = parts
        .extensions
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(|ci| ci.remote_addr())
    {
        return Some(addr);
    }
    parts.extensions.get::<SocketAddr>().copied()
}

impl KeyExtractor for ClientIp {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        let peer = peer_addr(parts).ok_or(KeyError::MissingConnectInfo)?;
        let ip = self.resolve(peer.ip(), &parts.headers);
        Ok(Some(self.key_for(ip)))
    }

    fn extract_into(&self, parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        let peer = peer_addr(parts).ok_or(KeyError::MissingConnectInfo)?;
        // An address's text is already in storage form.
        self.write_key(self.resolve(peer.ip(), &parts.headers), out.trusted());
        Ok(true)
    }
}
