//! Which address a request is keyed by: the TCP peer, or the first untrusted
//! hop of a forwarding header walked from the right.

use super::parse::{canonical, parse_forwarded_element, parse_node, trim_ows};
use super::{ClientIp, ForwardedHeader, MAX_FORWARDED_HOPS};
use http::header::HeaderMap;
use std::net::IpAddr;

impl ClientIp {
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
}
