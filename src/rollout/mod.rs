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
//! # Staged plans
//! A [`RolloutPlan`] on a tier ([`Tier::rollout`](crate::Tier::rollout))
//! walks these steps by itself, fleet-wide through the control key: each
//! stage's mode for its `for`, advanced by one instance when the gates
//! ([`RolloutGates`], an optional guard) pass; [`PlanStatus`] says where it
//! is and [`RolloutEvent`]s what it decided.
//!
//! # Allowlist and denylist
//! An [`AccessList`] matches a request by client IP / CIDR (resolved with the
//! layer's [`ClientIp`](crate::key::ClientIp) rules, so a forged
//! `X-Forwarded-For` from an untrusted peer never matches), API key, user id
//! or a predicate. An **allowlisted** request skips limiting entirely: no
//! backend call, no headers, never rejected in any mode, counted as
//! `allowlisted`. A **denylisted** request is refused before any tier with
//! 403 (default) or 429, counted as `denylisted`; the denylist is checked
//! first, so a client on both lists is refused. The global `Mode::Off` (the
//! kill switch) turns everything off, the denylist included.

mod fallback;
mod lists;
mod plan;
mod status;

pub use fallback::{Fallback, FallbackGuard};
pub use lists::{AccessList, DenyStatus, ListEntries, ListKind};
pub(crate) use lists::{AccessLists, Lists, Standing};
#[cfg_attr(not(feature = "redis"), allow(unused_imports))]
pub(crate) use plan::LEASE_POLLS;
pub use plan::{Guard, GuardVerdict, RolloutGates, RolloutPlan, Stage};
pub(crate) use status::Stored;
pub use status::{PlanAction, PlanStatus, RolloutEvent};

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::fmt;

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
    #[inline]
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
    #[inline]
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
    #[inline]
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
