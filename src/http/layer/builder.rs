//! [`RateLimitLayerBuilder`]: its settings, their defaults and setters
//! (checked and assembled by `build`, in `build.rs`).

use crate::engine::{engine_settings, EngineBuilder};
use crate::http::tier::Tier;
use crate::key::ClientIp;
use crate::response::{JsonRejection, OnRejection};
use crate::rollout::{AccessList, DenyStatus};
use std::fmt;
use std::sync::Arc;

/// Builds a [`RateLimitLayer`](crate::RateLimitLayer); every setting is
/// checked in [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder {
    /// The engine's settings (set by the setters `engine_settings!` forwards).
    pub(super) engine: EngineBuilder,
    pub(super) tiers: Vec<Tier>,
    pub(super) on_rejection: Arc<dyn OnRejection>,
    pub(super) client_ip: ClientIp,
    pub(super) allow: AccessList,
    pub(super) deny: AccessList,
    pub(super) deny_status: DenyStatus,
    #[cfg(feature = "grpc")]
    pub(super) protocol: crate::http::grpc::Protocol,
}

impl Default for RateLimitLayerBuilder {
    fn default() -> Self {
        Self {
            engine: EngineBuilder::default(),
            tiers: Vec::new(),
            on_rejection: Arc::new(JsonRejection),
            client_ip: ClientIp::default(),
            allow: AccessList::new(),
            deny: AccessList::new(),
            deny_status: DenyStatus::Forbidden,
            #[cfg(feature = "grpc")]
            protocol: crate::http::grpc::Protocol::Auto,
        }
    }
}

impl fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("engine", &self.engine)
            .field("tiers", &self.tiers)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayerBuilder {
    /// Adds a tier; tiers are checked in the order added.
    pub fn tier(mut self, tier: Tier) -> Self {
        self.tiers.push(tier);
        self
    }

    /// Replaces the 429 response (see [`OnRejection`]).
    pub fn on_rejection(mut self, on_rejection: impl OnRejection) -> Self {
        self.on_rejection = Arc::new(on_rejection);
        self
    }

    /// How the allowlist and denylist resolve a client's IP (trusted proxies,
    /// IPv6 prefix). Give it the same `ClientIp` as your `ip` tier.
    pub fn client_ip(mut self, client_ip: ClientIp) -> Self {
        self.client_ip = client_ip;
        self
    }

    /// Requests matching `list` skip limiting (see [`crate::rollout`]).
    pub fn allowlist(mut self, list: AccessList) -> Self {
        self.allow = list;
        self
    }

    /// Requests matching `list` are refused with `status` before any tier.
    pub fn denylist(mut self, list: AccessList, status: DenyStatus) -> Self {
        self.deny = list;
        self.deny_status = status;
        self
    }

    /// Which protocol blocked requests are answered in (feature `grpc`;
    /// default [`Protocol::Auto`](crate::http::grpc::Protocol::Auto): gRPC for
    /// `application/grpc` requests, HTTP for the others). See
    /// [`crate::http::grpc`].
    #[cfg(feature = "grpc")]
    #[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
    pub fn protocol(mut self, protocol: crate::http::grpc::Protocol) -> Self {
        self.protocol = protocol;
        self
    }
}

/// Makes each setting of `engine_settings` (the engine's, declared once in
/// `engine/builder.rs` with its docs) a setter of the layer's builder that
/// sets it on the `EngineBuilder` inside, under the same name.
macro_rules! forward_setters {
    ($( $(#[$doc:meta])* fn $name:ident($this:ident $(, $arg:ident: $ty:ty)*) $body:block )*) => {
        $(
            $(#[$doc])*
            ///
            #[doc = concat!(
                "The engine's setting: [`EngineBuilder::", stringify!($name),
                "`](crate::EngineBuilder::", stringify!($name), ")."
            )]
            pub fn $name(mut self $(, $arg: $ty)*) -> Self {
                self.engine = self.engine.$name($($arg),*);
                self
            }
        )*
    };
}

/// The engine's settings (backend, key prefix, failure policy, guards,
/// answers, telemetry), the same setters as [`EngineBuilder`]'s.
impl RateLimitLayerBuilder {
    engine_settings!(forward_setters);
}
