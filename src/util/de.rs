//! Deserialization helpers shared by the configuration types that a policy
//! file's tables deserialize into ([`ClientIp`](crate::key::ClientIp),
//! [`AccessList`](crate::rollout::AccessList), the `policy` module's tables).

use ipnet::IpNet;
use serde::de::{self, DeserializeSeed, Deserializer};
use serde::Deserialize;
use std::net::IpAddr;

/// A table's key that must be one of `self.0`: an unknown key is an error
/// naming it and listing the known ones, at the key's line (like
/// `#[serde(deny_unknown_fields)]`).
pub(crate) struct FieldIn(pub(crate) &'static [&'static str]);

impl<'de> DeserializeSeed<'de> for FieldIn {
    type Value = &'static str;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<&'static str, D::Error> {
        let key = String::deserialize(d)?;
        self.0
            .iter()
            .find(|f| **f == key)
            .copied()
            .ok_or_else(|| de::Error::unknown_field(&key, self.0))
    }
}

/// A list of networks, each a CIDR (`10.0.0.0/8`) or a single address
/// (`192.0.2.1`, a /32; `::1`, a /128).
pub(crate) struct Nets(pub(crate) Vec<IpNet>);

impl<'de> Deserialize<'de> for Nets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|s| {
                s.parse::<IpNet>()
                    .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| {
                        de::Error::invalid_value(
                            de::Unexpected::Str(s),
                            &"a CIDR such as 10.0.0.0/8 or an IP address",
                        )
                    })
            })
            .collect::<Result<_, _>>()
            .map(Nets)
    }
}

/// An HTTP header name (case-insensitive; stored lowercase).
pub(crate) struct Header(pub(crate) http::HeaderName);

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        http::HeaderName::from_bytes(name.as_bytes())
            .map(Header)
            .map_err(|_| de::Error::invalid_value(de::Unexpected::Str(&name), &"a header name"))
    }
}
