//! The allowlist and the denylist: [`AccessList`] (a set of clients),
//! [`DenyStatus`] (what a denylisted request gets), and one HTTP front
//! door's pair of them ([`AccessLists`]), which answers a request's
//! [`Standing`].

use crate::key::ClientIp;
use crate::util::de::{FieldIn, Header, Nets};
use http::request::Parts;
use http::StatusCode;
use ipnet::IpNet;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

/// What a denylisted request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenyStatus {
    /// `403 Forbidden` (the default): the client is not welcome, and should
    /// not retry.
    #[default]
    Forbidden,
    /// `429 Too Many Requests` (with `Retry-After: 3600`), for clients that
    /// should believe they are merely limited.
    TooManyRequests,
}

impl DenyStatus {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            DenyStatus::Forbidden => StatusCode::FORBIDDEN,
            DenyStatus::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
        }
    }
}

/// A policy file's `[denylist] status`: `403` or `429`.
impl<'de> Deserialize<'de> for DenyStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let code = u16::deserialize(d)?;
        [DenyStatus::Forbidden, DenyStatus::TooManyRequests]
            .into_iter()
            .find(|s| s.status() == code)
            .ok_or_else(|| de::Error::custom(format!("denylist.status: {code} is not 403 or 429")))
    }
}

type Predicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// A set of clients: by IP / CIDR, API key, user id, or a predicate. Used as
/// the allowlist and the denylist (see the [module docs](crate::rollout)).
///
/// ```
/// use tiered_ratelimit::rollout::AccessList;
/// let partners = AccessList::new()
///     .ip("192.0.2.0/24".parse().unwrap())
///     .api_key("sk_partner_1")
///     .user("ops-bot")
///     .predicate(|p| p.uri.path() == "/health");
/// ```
#[derive(Clone, Default)]
#[must_use]
pub struct AccessList {
    ips: Vec<IpNet>,
    api_key_header: Option<http::HeaderName>,
    api_keys: HashSet<Vec<u8>>,
    users: HashSet<String>,
    predicates: Vec<Predicate>,
}

impl fmt::Debug for AccessList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessList")
            .field("ips", &self.ips)
            .field("api_key_header", &self.api_key_header)
            .field("api_keys", &self.api_keys.len())
            .field("users", &self.users)
            .field("predicates", &self.predicates.len())
            .finish()
    }
}

impl AccessList {
    /// An empty list (matches nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a network (IPv4 or IPv6; a single address is a /32 or /128).
    /// IPv4-mapped IPv6 networks (`::ffff:192.0.2.0/120`) are stored as the
    /// IPv4 network they denote, since client addresses are normalised the
    /// same way.
    pub fn ip(mut self, net: IpNet) -> Self {
        self.ips.push(normalize_net(net));
        self
    }

    /// Adds an API key, matched against the `api_key_header` (default
    /// `x-api-key`).
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_keys.insert(key.into().into_bytes());
        self
    }

    /// The header API keys are read from (default `x-api-key`).
    pub fn api_key_header(mut self, header: http::HeaderName) -> Self {
        self.api_key_header = Some(header);
        self
    }

    /// Adds a user id ([`UserId`](crate::key::UserId) in the request extensions).
    pub fn user(mut self, id: impl Into<String>) -> Self {
        self.users.insert(id.into());
        self
    }

    /// Adds a predicate on the request head.
    pub fn predicate(mut self, f: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.predicates.push(Arc::new(f));
        self
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
            && self.api_keys.is_empty()
            && self.users.is_empty()
            && self.predicates.is_empty()
    }

    /// Whether the request matches. `client_ip` resolves the client address
    /// (trusted-proxy rules included); without a peer address, IP entries
    /// cannot match.
    pub fn matches(&self, parts: &Parts, client_ip: &ClientIp) -> bool {
        if self.is_empty() {
            return false;
        }
        if !self.ips.is_empty() {
            match client_addr(client_ip, parts) {
                Some(ip) if self.ips.iter().any(|n| n.contains(&ip)) => return true,
                Some(_) => {}
                // A misconfiguration must not look like "not listed" in silence.
                None => no_peer_address(),
            }
        }
        if !self.api_keys.is_empty() {
            let header = self
                .api_key_header
                .clone()
                .unwrap_or(http::HeaderName::from_static("x-api-key"));
            if parts
                .headers
                .get_all(header)
                .iter()
                .any(|v| self.api_keys.contains(v.as_bytes()))
            {
                return true;
            }
        }
        if !self.users.is_empty() {
            if let Some(u) = parts.extensions.get::<crate::key::UserId>() {
                if self.users.contains(&u.0) {
                    return true;
                }
            }
        }
        self.predicates.iter().any(|p| p(parts))
    }
}

/// The entries of an [`AccessList`] that can be written down: its networks,
/// API keys and user ids (not its predicates, which are code, nor its API
/// key header). What the fleet-wide settings store for a list
/// ([`RateLimitHandle::set_fleet_allowlist`](crate::RateLimitHandle::set_fleet_allowlist))
/// and what `GET /api/lists` answers, in the policy file's notation: `ips`
/// (CIDRs; a single address is a /32 or /128), `api_keys`, `users`, each
/// sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ListEntries {
    /// Networks, as CIDRs (`203.0.113.0/24`, `2001:db8::/32`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    /// API keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_keys: Vec<String>,
    /// User ids.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub users: Vec<String>,
}

/// Which of a front door's two lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListKind {
    /// The allowlist.
    Allow,
    /// The denylist.
    Deny,
}

impl ListEntries {
    /// Sorted, without duplicates (the form stored and compared).
    pub(crate) fn normalized(mut self) -> Self {
        for v in [&mut self.ips, &mut self.api_keys, &mut self.users] {
            v.sort();
            v.dedup();
        }
        self
    }
}

impl AccessList {
    /// Its entries that can be written down ([`ListEntries`]), sorted.
    pub fn entries(&self) -> ListEntries {
        ListEntries {
            ips: self.ips.iter().map(ToString::to_string).collect(),
            api_keys: self
                .api_keys
                .iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect(),
            users: self.users.iter().cloned().collect(),
        }
        .normalized()
    }

    /// Whether it has predicates (code, which no setting can carry).
    pub(crate) fn has_predicates(&self) -> bool {
        !self.predicates.is_empty()
    }

    /// This list with its networks, API keys and users replaced by
    /// `entries` (its API key header and predicates kept). The error names
    /// the entry: `ips[2]: "10.0.0.0/33" is not a CIDR or an IP address`.
    pub(crate) fn with_entries(&self, entries: &ListEntries) -> Result<Self, (String, String)> {
        let mut list = Self {
            ips: Vec::new(),
            api_key_header: self.api_key_header.clone(),
            api_keys: HashSet::new(),
            users: HashSet::new(),
            predicates: self.predicates.clone(),
        };
        for (i, s) in entries.ips.iter().enumerate() {
            let net = s
                .parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    (
                        format!("ips[{i}]"),
                        format!("{s:?} is not a CIDR or an IP address"),
                    )
                })?;
            list = list.ip(net);
        }
        for k in &entries.api_keys {
            list = list.api_key(k.clone());
        }
        for u in &entries.users {
            list = list.user(u.clone());
        }
        Ok(list)
    }
}

impl AccessList {
    /// The fields of a list table in a policy file (`[allowlist]`;
    /// `[denylist]` has `status` too).
    pub(crate) const FIELDS: [&'static str; 4] = ["ips", "api_keys", "api_key_header", "users"];

    /// Adds the entries of list field `field` (one of [`AccessList::FIELDS`]),
    /// read from `map`: `ips` (CIDRs or addresses), `api_keys`,
    /// `api_key_header`, `users`.
    pub(crate) fn read_field<'de, A: MapAccess<'de>>(
        self,
        field: &str,
        map: &mut A,
    ) -> Result<Self, A::Error> {
        Ok(match field {
            "ips" => map.next_value::<Nets>()?.0.into_iter().fold(self, Self::ip),
            "api_keys" => map
                .next_value::<Vec<String>>()?
                .into_iter()
                .fold(self, Self::api_key),
            "api_key_header" => self.api_key_header(map.next_value::<Header>()?.0),
            "users" => map
                .next_value::<Vec<String>>()?
                .into_iter()
                .fold(self, Self::user),
            other => return Err(de::Error::unknown_field(other, &Self::FIELDS)),
        })
    }
}

/// A policy file's `[allowlist]` table: `ips` (CIDRs or addresses),
/// `api_keys`, `api_key_header` (default `x-api-key`) and `users`, each
/// optional. Unknown fields are an error naming the field.
impl<'de> Deserialize<'de> for AccessList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = AccessList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table of ips, api_keys, api_key_header and users")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<AccessList, A::Error> {
                let mut list = AccessList::new();
                while let Some(field) = map.next_key_seed(FieldIn(&AccessList::FIELDS))? {
                    list = list.read_field(field, &mut map)?;
                }
                Ok(list)
            }
        }
        d.deserialize_struct("AccessList", &AccessList::FIELDS, V)
    }
}

/// An allow- or denylist with IP entries met a request without a peer
/// address (the app is served without connect info): its IP entries cannot
/// match. Counted in `tiered_ratelimit_key_errors_total{tier="access_list",
/// reason="missing_connect_info"}` and logged at `ERROR` with the fix, at
/// most once a minute.
#[cold]
fn no_peer_address() {
    metrics::counter!(
        "tiered_ratelimit_key_errors_total",
        "tier" => "access_list",
        "reason" => "missing_connect_info"
    )
    .increment(1);
    static LOG: std::sync::OnceLock<crate::util::throttle::LogThrottle> =
        std::sync::OnceLock::new();
    let log = LOG.get_or_init(|| {
        crate::util::throttle::LogThrottle::new(std::time::Duration::from_secs(60))
    });
    if let Some(suppressed) = log.permit() {
        tracing::error!(
            reason = "missing_connect_info",
            suppressed,
            "rate limiter misconfigured: an allow- or denylist has IP entries but the request has \
             no peer address, so they cannot match; serve the app with \
             into_make_service_with_connect_info::<SocketAddr>()"
        );
    }
}

/// The resolved client address: the peer, or with trusted proxies the first
/// untrusted forwarding hop (the same rules as the `ClientIp` key).
pub(crate) fn client_addr(client_ip: &ClientIp, parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    let peer = parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0);
    #[cfg(not(feature = "axum"))]
    let peer: Option<std::net::SocketAddr> = None;
    let peer = peer.or_else(|| parts.extensions.get::<std::net::SocketAddr>().copied())?;
    let ip = client_ip.resolve(peer.ip(), &parts.headers);
    Some(match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    })
}

fn normalize_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) => {
            let addr = v6.network();
            match addr.to_ipv4_mapped() {
                Some(v4) if v6.prefix_len() >= 96 => {
                    IpNet::new(IpAddr::V4(v4), v6.prefix_len() - 96).unwrap_or(net)
                }
                _ => IpNet::V6(v6.trunc()),
            }
        }
        IpNet::V4(v4) => IpNet::V4(v4.trunc()),
    }
}

/// The allowlist and the denylist of one HTTP front door, with the
/// denylist's status: the front door answers the engine's "is this request
/// listed?" from them, and a [`RateLimitHandle`](crate::RateLimitHandle)
/// replaces them at run time (swapped whole, so a request reads one
/// version).
pub(crate) struct AccessLists {
    current: arc_swap::ArcSwap<Lists>,
    /// Whether either list has an entry: a request of a layer without lists
    /// (the common case) reads this flag only.
    any: std::sync::atomic::AtomicBool,
}

/// One version of [`AccessLists`].
#[derive(Debug, Clone)]
pub(crate) struct Lists {
    pub(crate) allow: Arc<AccessList>,
    pub(crate) deny: Arc<AccessList>,
    pub(crate) deny_status: DenyStatus,
}

impl AccessLists {
    pub(crate) fn new(lists: Lists) -> Self {
        let any = !lists.allow.is_empty() || !lists.deny.is_empty();
        Self {
            current: arc_swap::ArcSwap::from_pointee(lists),
            any: std::sync::atomic::AtomicBool::new(any),
        }
    }

    /// The lists in force.
    pub(crate) fn load(&self) -> Arc<Lists> {
        self.current.load_full()
    }

    /// Replaces both lists.
    pub(crate) fn store(&self, lists: Lists) {
        let any = !lists.allow.is_empty() || !lists.deny.is_empty();
        self.current.store(Arc::new(lists));
        self.any.store(any, std::sync::atomic::Ordering::Release);
    }

    /// The request's standing: the denylist first, then the allowlist.
    #[inline]
    pub(crate) fn standing(&self, parts: &Parts, client_ip: &ClientIp) -> Standing {
        if !self.any.load(std::sync::atomic::Ordering::Acquire) {
            return Standing::Unlisted;
        }
        let lists = self.current.load();
        if lists.deny.matches(parts, client_ip) {
            Standing::Denied(lists.deny_status)
        } else if lists.allow.matches(parts, client_ip) {
            Standing::Allowed
        } else {
            Standing::Unlisted
        }
    }
}

impl fmt::Debug for AccessLists {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessLists")
            .field("current", &self.current.load())
            .finish()
    }
}

/// A request's standing on the lists, as the engine's gate asks it
/// (see [`crate::rollout`]): the denylist is checked first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// On neither list: the tiers decide.
    Unlisted,
    /// On the allowlist: not limited.
    Allowed,
    /// On the denylist: refused with this status before any tier.
    Denied(DenyStatus),
}
