use super::{KeyError, KeyExtractor, KeyWriter};
use crate::de::{FieldIn, Nets};
use http::header::{HeaderMap, HeaderName};
use http::request::Parts;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::de::{self, Deserialize, Deserializer};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The most entries read from a forwarding header (all its lines together,
/// empty list elements included); past them the walk stops and the key falls
/// back to the last trusted hop.
pub const MAX_FORWARDED_HOPS: usize = 32;

/// The longest `X-Forwarded-For` / `X-Real-IP` entry or `for=` node, in
/// bytes, that is parsed at all (the longest address spelling,
/// `[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:65535`, is 54). Longer
/// entries are unparseable.
const MAX_NODE_LEN: usize = 64;

/// The longest RFC 7239 `forwarded-element` (`for=..;by=..;proto=..;host=..`)
/// that is parsed at all, in bytes. Longer elements are unparseable.
const MAX_ELEMENT_LEN: usize = 512;

/// The misconfiguration warning (see [`ClientIp`]) is logged at most once per
/// this interval per extractor (clones share it).
const MISCONFIG_WARN_INTERVAL: Duration = Duration::from_secs(60);

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// A header that carries the client address through proxies, for
/// [`ClientIp::forwarded_headers`] and `[client_ip] forwarded_headers` in a
/// policy file (where it is spelled by its header name, case-insensitive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`: comma-separated addresses
    /// (`1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`), each hop
    /// appending the address it received the request from.
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=192.0.2.60;proto=http, for="[2001:db8::1]:4711"`:
    /// only the `for=` parameter is read.
    Forwarded,
    /// `X-Real-IP: 1.2.3.4`, a single address that the proxy sets (nginx's
    /// `proxy_set_header X-Real-IP $remote_addr`). Read like
    /// `X-Forwarded-For`, so a proxy that appends instead of replacing is
    /// handled too.
    XRealIp,
}

impl ForwardedHeader {
    /// Every forwarding header this crate knows.
    pub const ALL: [ForwardedHeader; 3] = [
        ForwardedHeader::XForwardedFor,
        ForwardedHeader::Forwarded,
        ForwardedHeader::XRealIp,
    ];

    /// The default of [`ClientIp::forwarded_headers`]: `X-Forwarded-For`
    /// only, the header that load balancers and reverse proxies write by
    /// default (see [`ClientIp`] for why not more).
    pub const DEFAULT: [ForwardedHeader; 1] = [ForwardedHeader::XForwardedFor];

    /// The header's name, lowercase: `x-forwarded-for`, `forwarded` or
    /// `x-real-ip` (also its spelling in a policy file).
    pub const fn as_str(self) -> &'static str {
        match self {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
            ForwardedHeader::XRealIp => "x-real-ip",
        }
    }

    /// The header's name.
    pub const fn header_name(self) -> HeaderName {
        match self {
            ForwardedHeader::XForwardedFor => X_FORWARDED_FOR,
            ForwardedHeader::Forwarded => http::header::FORWARDED,
            ForwardedHeader::XRealIp => X_REAL_IP,
        }
    }
}

impl fmt::Display for ForwardedHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A forwarding header name this crate does not know (see
/// [`ForwardedHeader`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown forwarding header {0:?}: expected \"x-forwarded-for\", \"forwarded\" or \"x-real-ip\""
)]
pub struct UnknownForwardedHeader(pub String);

impl FromStr for ForwardedHeader {
    type Err = UnknownForwardedHeader;

    /// Parses a header name, case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ForwardedHeader::ALL
            .into_iter()
            .find(|h| h.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownForwardedHeader(s.to_owned()))
    }
}

impl<'de> Deserialize<'de> for ForwardedHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(|_| {
            de::Error::unknown_variant(&s, &["x-forwarded-for", "forwarded", "x-real-ip"])
        })
    }
}

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
    misconfig_warning: Arc<WarnThrottle>,
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
            misconfig_warning: Arc::new(WarnThrottle::new(MISCONFIG_WARN_INTERVAL)),
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
    pub(crate) fn check(&self) -> Result<(), crate::ConfigError> {
        if self.ipv6_prefix > 128 {
            return Err(crate::ConfigError::InvalidIpv6Prefix(self.ipv6_prefix));
        }
        Ok(())
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|n| n.contains(&ip))
    }

    /// The client address this extractor resolves for `peer` and the request
    /// headers, normalised (IPv4-mapped and -compatible IPv6 become IPv4) but
    /// before IPv6 grouping. Never panics, whatever the headers hold.
    pub fn resolve(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        if self.trusted.is_empty() {
            self.warn_if_forwarded(peer, headers);
            return peer;
        }
        if !self.is_trusted(peer) {
            return peer;
        }
        for &h in &self.headers {
            let name = h.header_name();
            if headers.contains_key(&name) {
                return self.walk(h, headers.get_all(name).iter(), peer);
            }
        }
        peer
    }

    /// Walks one header's entries from the right (last line first, last
    /// entry first), skipping trusted hops.
    fn walk<'a>(
        &self,
        header: ForwardedHeader,
        lines: impl DoubleEndedIterator<Item = &'a http::HeaderValue>,
        peer: IpAddr,
    ) -> IpAddr {
        let mut last_trusted = peer;
        let mut hops = 0usize;
        for line in lines.rev() {
            for entry in line.as_bytes().rsplit(|&b| b == b',') {
                hops += 1;
                if hops > MAX_FORWARDED_HOPS {
                    return last_trusted;
                }
                if entry.iter().all(|&b| b == b' ' || b == b'\t') {
                    continue; // empty list element
                }
                let parsed = match header {
                    ForwardedHeader::Forwarded => parse_forwarded_element(entry),
                    ForwardedHeader::XForwardedFor | ForwardedHeader::XRealIp => {
                        std::str::from_utf8(trim_ows(entry))
                            .ok()
                            .and_then(|s| parse_node(s, false))
                    }
                };
                match parsed {
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

    fn warn_if_forwarded(&self, peer: IpAddr, headers: &HeaderMap) {
        // Per request: nothing unless the warning could be logged at all (a
        // subscriber wants WARN here); then one pass over the request's few
        // header names rather than three lookups.
        if headers.is_empty() || !tracing::enabled!(tracing::Level::WARN) {
            return;
        }
        let Some(h) = headers.keys().find_map(|name| {
            ForwardedHeader::ALL
                .into_iter()
                .find(|h| h.header_name() == name)
        }) else {
            return;
        };
        if self.misconfig_warning.permit() {
            tracing::warn!(
                header = h.as_str(),
                %peer,
                "rate limiter: forwarding header received but no proxy is trusted, so \
                 every request is keyed by its TCP peer; behind a load balancer or \
                 reverse proxy all clients then share its bucket: list it in \
                 `ClientIp::trusted_proxies` / `[client_ip] trusted_proxies`. If this \
                 service is reached directly, clients sent the header themselves and \
                 it is rightly ignored (logged at most once a minute)"
            );
        }
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

/// Lets one event through per interval, lock-free: the hot path (an event
/// that is not due) is one clock read and one relaxed atomic load.
struct WarnThrottle {
    origin: Instant,
    interval_ms: u64,
    /// Milliseconds since `origin` from which the next event may pass.
    next_ms: AtomicU64,
}

impl WarnThrottle {
    fn new(interval: Duration) -> Self {
        Self {
            origin: Instant::now(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
        }
    }

    fn permit(&self) -> bool {
        let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(self.interval_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }
}

/// IPv4-mapped (`::ffff:a.b.c.d`) and IPv4-compatible (`::a.b.c.d`, first
/// octet non-zero so `::` and `::1` stay IPv6) addresses become IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
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
fn canonical_net(net: IpNet) -> IpNet {
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

fn trim_ows(b: &[u8]) -> &[u8] {
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
fn parse_node(s: &str, obfuscated_port: bool) -> Option<IpAddr> {
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
fn parse_forwarded_element(elem: &[u8]) -> Option<IpAddr> {
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
        Ok(Some(self.key_for(ip)))
    }

    fn extract_into(&self, parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        let peer = peer_addr(parts).ok_or(KeyError::MissingConnectInfo)?;
        // An address's text is already in storage form.
        self.write_key(self.resolve(peer.ip(), &parts.headers), out.trusted());
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
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
    fn header_names_parse_case_insensitively() {
        assert_eq!(
            "X-Forwarded-For".parse::<ForwardedHeader>(),
            Ok(ForwardedHeader::XForwardedFor)
        );
        assert_eq!(
            "x-real-ip".parse::<ForwardedHeader>(),
            Ok(ForwardedHeader::XRealIp)
        );
        let e = "x-forwarded".parse::<ForwardedHeader>().unwrap_err();
        assert!(e.to_string().contains("\"x-forwarded\""), "{e}");
        for h in ForwardedHeader::ALL {
            assert_eq!(h.header_name().as_str(), h.as_str());
        }
    }

    #[test]
    fn warn_throttle_passes_one_per_interval() {
        let t = WarnThrottle::new(Duration::from_secs(3600));
        assert!(t.permit());
        assert!(!t.permit());
        t.next_ms.store(0, Ordering::Relaxed);
        assert!(t.permit());
        assert!(!t.permit());
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
