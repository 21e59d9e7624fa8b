//! The forwarding headers a [`ClientIp`](super::ClientIp) may read.

use http::header::HeaderName;
use serde::de::{self, Deserialize, Deserializer};
use std::fmt;
use std::str::FromStr;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// A header that carries the client address through proxies, for
/// [`ClientIp::forwarded_headers`] and `[client_ip] forwarded_headers` in a
/// policy file (where it is spelled by its header name, case-insensitive).
///
/// [`ClientIp::forwarded_headers`]: super::ClientIp::forwarded_headers
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
    ///
    /// [`ClientIp::forwarded_headers`]: super::ClientIp::forwarded_headers
    /// [`ClientIp`]: super::ClientIp
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
