//! Safe rollout: modes (enforce, shadow, canary, off), allow and deny lists,
//! and client plans.
//!
//! A limiter is most dangerous on the day it is switched on. The recipe:
//! **shadow** first (the whole path runs, would-be rejections are counted and
//! logged, nobody is rejected), then **canary** enforcement for 1 % → 10 % →
//! 100 % of keys, with a kill switch ([`RateLimitHandle`](crate::RateLimitHandle)
//! and the fleet-wide control key) and an **allowlist** for critical
//! integrations. `docs/rollout.md` is the runbook.
//!
//! # Modes
//! Each tier has a [`Mode`]; the layer has a global one that overrides them:
//! the effective mode of a tier is the *weaker* of the two, in the order
//! `Off` < `Shadow` < `Canary` (smaller percent is weaker) < `Enforce`.
//!
//! # Allowlist and denylist
//! An [`AccessList`] matches a request by client IP / CIDR (resolved with the
//! layer's [`ClientIp`] rules, so a forged
//! `X-Forwarded-For` from an untrusted peer never matches), API key, user id
//! or a predicate. An **allowlisted** request skips limiting entirely: no
//! backend call, no headers, never rejected in any mode, counted as
//! `allowlisted`. A **denylisted** request is refused before any tier with
//! 403 (default) or 429, counted as `denylisted`; the denylist is checked
//! first, so a client on both lists is refused. The global `Mode::Off` (the
//! kill switch) turns everything off, the denylist included.

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

/// How a tier (or the whole layer) acts on its decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Reject requests over the limit (the default).
    #[default]
    Enforce,
    /// Run the whole path (backend call, counting, metrics, logs) but never
    /// reject: a request that would be denied passes and is counted as
    /// `shadow_limited`. It consumes exactly what an enforced request would
    /// (a would-be denial consumes nothing), so shadow numbers predict
    /// enforcement.
    Shadow,
    /// Enforce for `percent` % of keys, chosen by a stable hash of
    /// (tier, key): a key is always enforced or always shadowed at a given
    /// percent, and raising the percent only adds keys. The rest behave as
    /// [`Mode::Shadow`]. Values above 100 act as 100.
    Canary {
        /// Percent of keys enforced, 0-100.
        percent: u8,
    },
    /// Skip the tier entirely (no backend call).
    Off,
}

impl Mode {
    /// Strength for combining a global and a tier mode: higher is stricter.
    fn strength(self) -> u16 {
        match self {
            Mode::Off => 0,
            Mode::Shadow => 1,
            Mode::Canary { percent } => 2 + u16::from(percent.min(100)),
            Mode::Enforce => 200,
        }
    }

    /// The effective mode of a tier in mode `self` under global mode `global`:
    /// the weaker of the two.
    pub fn under(self, global: Mode) -> Mode {
        if global.strength() < self.strength() {
            global
        } else {
            self
        }
    }

    /// Whether `key` of `tier` is enforced in this mode (`Canary` decides by a
    /// stable hash; `Shadow` and `Off` never enforce).
    ///
    /// ```
    /// use tiered_ratelimit::rollout::Mode;
    /// let one = Mode::Canary { percent: 1 };
    /// let ten = Mode::Canary { percent: 10 };
    /// // Raising the percent only adds keys.
    /// for k in 0..1000 {
    ///     let key = k.to_string();
    ///     assert!(!one.enforces("ip", &key) || ten.enforces("ip", &key));
    /// }
    /// ```
    pub fn enforces(self, tier: &str, key: &str) -> bool {
        match self {
            Mode::Enforce => true,
            Mode::Shadow | Mode::Off => false,
            Mode::Canary { percent } => {
                canary_bucket(tier, key) < u32::from(percent.min(100)) * 100
            }
        }
    }

    /// A bounded metrics label: `enforce`, `shadow`, `canary` or `off`.
    pub const fn label(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
            Mode::Canary { .. } => "canary",
            Mode::Off => "off",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Canary { percent } => write!(f, "canary:{percent}"),
            m => f.write_str(m.label()),
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    /// `enforce`, `shadow`, `off`, or `canary:<percent>` (the
    /// [labels](Mode::label), with the canary's percent).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some(mode) = [Mode::Enforce, Mode::Shadow, Mode::Off]
            .into_iter()
            .find(|m| m.label() == s)
        {
            return Ok(mode);
        }
        s.strip_prefix(Mode::CANARY)
            .and_then(|p| p.strip_prefix(':'))
            .and_then(|p| p.trim().parse::<u8>().ok())
            .filter(|p| *p <= 100)
            .map(|percent| Mode::Canary { percent })
            .ok_or_else(|| format!("unknown mode {s:?} (enforce, shadow, off or canary:<0-100>)"))
    }
}

impl Mode {
    /// The canary's label, without a percent.
    pub(crate) const CANARY: &'static str = Mode::Canary { percent: 0 }.label();
}

/// A policy file's global `mode`, parsed as [`Mode::from_str`](std::str::FromStr)
/// parses the control key's: `"enforce"`, `"shadow"`, `"off"` or
/// `"canary:<percent>"`.
impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

/// The canary bucket of (tier, key): 0-9999, from a stable 64-bit XXH3 hash.
fn canary_bucket(tier: &str, key: &str) -> u32 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(tier.as_bytes());
    h.update(&[0]);
    h.update(key.as_bytes());
    // Modulo bias over 2^64 is below 10^-15: irrelevant.
    (h.digest() % 10_000) as u32
}

/// The client's plan (`free`, `pro`, ...), put into the request extensions by
/// the app's auth layer next to [`UserId`](crate::key::UserId). Read by tiers
/// with [`Tier::plans`](crate::Tier::plans) unless they have their own plan
/// extractor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Plan(pub String);

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
/// the allowlist and the denylist (see the [module docs](self)).
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
