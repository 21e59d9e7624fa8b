//! The control plane: [`RateLimitHandle`] (change modes, quotas and lists
//! at run time, read the layer's counts and sketches) and everything an
//! operator does through it:
//!
//! * [peek, reset and lift](#peek-reset-and-lift) one key of one tier
//!   ([`KeyStatus`], [`InspectError`]);
//! * [per-key overrides](#per-key-overrides): a quota, unlimited, blocked
//!   ([`Override`], [`OverrideEntry`], [`OverrideError`]);
//! * [the fleet-wide control key](#the-fleet-wide-control-key)
//!   ([`ControlKey`], [`ControlError`]) that switches every instance's modes.
//!
//! [`RateLimitHandle`] is also re-exported at the crate root, beside the
//! layer whose [`handle`](crate::RateLimitLayer::handle) returns it.
//!
//! # Peek, reset and lift
//!
//! One key's numbers in one tier without consuming anything, and a fresh
//! start for one key ([`RateLimitHandle::peek`],
//! [`RateLimitHandle::reset`], and the admin API's `GET /api/peek/{tier}`
//! and `POST /api/reset`).
//!
//! Support teams ask "why is this customer blocked?": peek answers with
//! what the next request of the tier's cost would get, from the same
//! backend state the layer decides on (Redis `TIME`, the key's stored value),
//! and charges nothing. On Redis it is a read-only script call
//! (`EVALSHA_RO` of `lua/peek.lua`); on a cluster it goes to the key's slot.
//!
//! ## Keys
//!
//! `key` is the key part in either form: **as people read it** (what the
//! admin page shows: `GET /users/{id}`, `203.0.113.7`, an API key's hash)
//! or **as stored** (what the top-N API answers and the page's tooltips
//! show: `GET%20/users/%7Bid%7D`). Text that is exactly a stored form (what
//! [`storage_key_part`](crate::key::storage_key_part) writes) is taken as
//! stored; any other text is escaped (or hashed) as the layer escapes
//! request bytes ([`readable_key_part`](crate::key::readable_key_part) is
//! the way back). The storage key is `<key_prefix>:<tier>:<stored key>`.
//!
//! ## Deployment caveat
//!
//! A peek uses the tier's default quota: a key on a plan
//! ([`Tier::plans`](crate::Tier::plans)) has other numbers. A reset clears
//! the backend's state and this process's deny cache for the key. Other
//! instances drop their deny caches within one poll interval of the
//! [control key](crate::handle#the-fleet-wide-control-key) (a reset or lift increments its
//! `generation` field); without a control key, another instance may answer
//! a cached 429 for that key until the retry time it was told (Redis) — at
//! most the wait the last denial announced.
//!
//! # Per-key overrides
//!
//! For one key of one tier, another quota, no limit at all, or a block, optionally until an expiry — fleet-wide on Redis
//! ([`RateLimitHandle::set_override`], [`RateLimitHandle::remove_override`],
//! [`RateLimitHandle::overrides`], and the admin API's `/api/overrides`).
//!
//! A tier takes overrides only when built with
//! [`Tier::overrides(true)`](crate::Tier::overrides): each of its checks is
//! then preceded by a read of the key `<tier key>{ov}` (the same hash slot
//! on a cluster) **inside the same script call** — one more key in the
//! check's `MGET`, no extra command, no extra round trip. A tier without
//! the flag pays nothing.
//!
//! Keys are **exact**: the key part as people read it or as stored (see
//! [`handle`](crate::handle#peek-reset-and-lift)), no prefix patterns.
//!
//! What an override does to its tier's decision:
//! - [`Override::Quota`]: the tier decides on the override's quota (same
//!   algorithm, same stored state); headers show its limit and remaining.
//! - [`Override::Unlimited`]: the tier allows without charging anything;
//!   its headers show the tier's limit as remaining.
//! - [`Override::Blocked`]: the tier denies (429) without charging;
//!   `Retry-After` is the time left until the override expires, or
//!   [`BLOCKED_RETRY`] for a block without expiry.
//!
//! The expiry is an instant of the setting process's clock (Unix epoch µs),
//! compared with the backend's clock (Redis `TIME`) on every request.
//!
//! Caveats:
//! - An overridden key's answers are never deny-cached, but a key denied
//!   (and cached) under the tier's own quota before an override was set
//!   may still be answered 429 by another instance until the retry time it
//!   was told (this process's cache is cleared by the change).
//! - [`RateLimitHandle::peek`] and the local fallback
//!   ([`FailurePolicy::Fallback`](crate::FailurePolicy::Fallback)) use the
//!   tier's own quota.
//! - With IETF headers, `RateLimit-Policy` names the tier's configured
//!   quota; `RateLimit` (limit, remaining) shows the override's.
//! - A `blocked` tier's denial is a strike for the tier's penalty box, if
//!   it has one.
//! - The store of a quota override is the tier's: the key's stored state
//!   is read with the override's parameters (the first request after a
//!   change may show a partly used quota).
//! - On the memory backend a tier taking overrides is decided by the
//!   locked path (not the compare-and-swap fast path of token and leaky
//!   buckets).
//!
//! # The fleet-wide control key
//!
//! One Redis hash every instance polls, so one `redis-cli` command
//! switches the whole fleet.
//!
//! ```text
//! HSET rl:control mode off               # kill switch: every instance stops limiting
//! HSET rl:control mode shadow            # stop rejecting, keep counting
//! HSET rl:control tier:login canary:10   # one tier's mode
//! HDEL rl:control mode                   # back to the configured mode
//! DEL  rl:control                        # back to everything configured
//! ```
//!
//! Fields: `mode` (the global mode) and `tier:<name>` (a tier's mode), with
//! values `enforce`, `shadow`, `off` or `canary:<0-100>`. A field present
//! overrides the configured mode (and any [`RateLimitHandle`]
//! change) on every instance within one poll interval (default 5 s); a field
//! removed gives the configured mode back. A malformed field (unknown mode,
//! unknown tier) is logged at `error` and ignored — the last good value of
//! that field stays — so a typo can never silently switch limiting off. A
//! failed poll keeps the mode overrides as they were. Switching any mode override
//! drops the deny cache.
//!
//! One more field, `generation`, is the crate's own: every operator action
//! on a key ([`RateLimitHandle::reset`](crate::RateLimitHandle::reset),
//! [`lift`](crate::RateLimitHandle::lift),
//! [`set_override`](crate::RateLimitHandle::set_override),
//! [`remove_override`](crate::RateLimitHandle::remove_override), and so the
//! admin API and the CLI) increments it (`HINCRBY`), and an instance that
//! reads a new value drops its deny cache: the action reaches every
//! instance's cached 429s within one poll interval (plus the poll's round
//! trip).
//!
//! The watcher starts when the layer is built inside a Tokio runtime (else
//! with the first request the layer sees) and stops when the layer is
//! dropped.
//!
//! Two more fields carry the **fleet-wide settings**: `settings_version`
//! and `settings`, the quotas, plan quotas and list entries changed at run
//! time (written by
//! [`RateLimitHandle::set_fleet_quota`](crate::RateLimitHandle::set_fleet_quota)
//! and its siblings, the admin API or the command, never by hand), applied
//! by every instance at its next poll; see docs/rollout.md, "Fleet-wide
//! settings".
//!
//! [`RateLimitHandle::set_fleet_mode`](crate::RateLimitHandle::set_fleet_mode)
//! writes the hash (what the admin page's buttons do when a control key is
//! configured), then reads it back and applies it to its own process at
//! once; the other instances follow within one poll interval.

mod candidates;
mod changes;
mod demand;
mod fleet;
mod inspect;
mod overrides;
mod plan;
mod traffic;

pub use crate::engine::{ControlError, ControlKey};
pub use changes::Changes;
pub use inspect::{InspectError, KeyStatus};
pub use overrides::{Override, OverrideEntry, OverrideError, BLOCKED_RETRY};

use crate::engine::Shared;
use crate::rollout::{AccessList, AccessLists, Mode};
use crate::{algorithm::kind::Algorithm, error::ConfigError, quota::Quota};
use std::fmt;
use std::sync::Arc;

/// Changes a running layer without rebuilding the router: the global mode,
/// a tier's mode or quota, a plan's quota, the allowlist and the denylist.
///
/// Changes apply to the next request; requests in flight finish with the
/// settings they started with. Reads on the request path are lock-free (the
/// settings are swapped whole with `arc-swap`), so a request never sees half
/// of a change: group changes that belong together in [`update`](Self::update).
///
/// ```
/// use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier, rollout::Mode};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(100)).mode(Mode::Shadow))
///     .build()
///     .unwrap();
/// let handle = layer.handle();
/// handle.set_tier_mode("global", Mode::Canary { percent: 10 }).unwrap();
/// handle.set_tier_quota("global", Quota::per_second(200)).unwrap();
/// handle.set_mode(Mode::Off); // the kill switch
/// assert_eq!(handle.mode(), Mode::Off);
/// ```
#[derive(Clone)]
pub struct RateLimitHandle {
    shared: Arc<Shared>,
    /// The front door's allow- and denylists (`None`: it has none, as the
    /// descriptor front door).
    lists: Option<Arc<AccessLists>>,
}

impl fmt::Debug for RateLimitHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitHandle")
            .field("mode", &self.mode())
            .finish_non_exhaustive()
    }
}

/// One tier's current settings, as reported by [`RateLimitHandle::tiers`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierStatus {
    /// The tier's name.
    pub name: String,
    /// Its own mode (before the global override).
    pub mode: Mode,
    /// Its mode in force: under the global mode, with control-key mode overrides.
    pub effective_mode: Mode,
    /// Its default quota.
    pub quota: Quota,
    /// Its algorithm.
    pub algorithm: Algorithm,
    /// A calendar quota's period (`None`: a duration).
    pub calendar: Option<crate::algorithm::CalendarPeriod>,
    /// Per-plan quotas.
    pub plans: Vec<(String, Quota)>,
    /// Whether the tier has a penalty box ([`Penalty`](crate::Penalty)).
    pub penalty: bool,
    /// Whether the tier takes per-key overrides
    /// ([`Tier::overrides`](crate::Tier::overrides)).
    pub overrides: bool,
}

impl RateLimitHandle {
    pub(crate) fn new(shared: Arc<Shared>, lists: Option<Arc<AccessLists>>) -> Self {
        Self { shared, lists }
    }

    /// What every request of the layer reads.
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The global mode set in code (builder or [`set_mode`](Self::set_mode)).
    pub fn mode(&self) -> Mode {
        self.shared.live.runtime.load().mode
    }

    /// The global mode in force: the control key's mode override if it sets one
    /// (see [`handle`](crate::handle#the-fleet-wide-control-key)), else [`mode`](Self::mode).
    pub fn effective_mode(&self) -> Mode {
        self.shared
            .live
            .mode_overrides
            .load()
            .mode
            .unwrap_or_else(|| self.mode())
    }

    /// Sets the global mode: `Mode::Off` is the kill switch, `Mode::Shadow`
    /// stops all rejections while still counting them.
    pub fn set_mode(&self, mode: Mode) {
        let _ = self.update(|c| {
            c.mode(mode);
            Ok(())
        });
    }

    /// Sets one tier's mode.
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`].
    pub fn set_tier_mode(&self, tier: &str, mode: Mode) -> Result<(), ConfigError> {
        self.update(|c| c.tier_mode(tier, mode).map(|_| ()))
    }

    /// Sets one tier's default quota, in this process. A token bucket or
    /// leaky bucket whose integer unit changes with the quota starts full
    /// for every key. With a fleet-wide control key use
    /// [`set_fleet_quota`](Self::set_fleet_quota).
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`] or any quota error (checked like at
    /// build); [`ConfigError::FleetWide`] with a fleet-wide control key.
    pub fn set_tier_quota(&self, tier: &str, quota: Quota) -> Result<(), ConfigError> {
        self.update(|c| c.tier_quota(tier, quota).map(|_| ()))
    }

    /// Sets a plan's quota on a tier, in this process; applies to the next
    /// request of every key on that plan. With a fleet-wide control key use
    /// [`set_fleet_quota`](Self::set_fleet_quota).
    ///
    /// # Errors
    /// [`ConfigError::UnknownTier`] or any quota error;
    /// [`ConfigError::FleetWide`] with a fleet-wide control key.
    pub fn set_plan_quota(&self, tier: &str, plan: &str, quota: Quota) -> Result<(), ConfigError> {
        self.update(|c| c.plan_quota(tier, plan, quota).map(|_| ()))
    }

    /// Replaces the allowlist, in this process. With a fleet-wide control
    /// key use [`set_fleet_allowlist`](Self::set_fleet_allowlist).
    ///
    /// # Errors
    /// [`ConfigError::FleetWide`] with a fleet-wide control key.
    pub fn set_allowlist(&self, list: AccessList) -> Result<(), ConfigError> {
        self.update(|c| c.allowlist(list.clone()).map(|_| ()))
    }

    /// Replaces the denylist, in this process. With a fleet-wide control
    /// key use [`set_fleet_denylist`](Self::set_fleet_denylist).
    ///
    /// # Errors
    /// [`ConfigError::FleetWide`] with a fleet-wide control key.
    pub fn set_denylist(&self, list: AccessList) -> Result<(), ConfigError> {
        self.update(|c| c.denylist(list.clone()).map(|_| ()))
    }

    /// Every tier's current settings, in check order.
    pub fn tiers(&self) -> Vec<TierStatus> {
        let rt = self.shared.live.runtime.load();
        let ov = self.shared.live.mode_overrides.load();
        let global = ov.mode.unwrap_or(rt.mode);
        self.shared
            .config
            .tiers
            .iter()
            .zip(rt.tiers.iter())
            .enumerate()
            .map(|(i, (t, r))| TierStatus {
                name: t.name.to_string(),
                mode: r.mode,
                effective_mode: ov
                    .tiers
                    .get(i)
                    .copied()
                    .flatten()
                    .unwrap_or(r.mode)
                    .under(global),
                quota: r.quota,
                algorithm: t.algorithm,
                calendar: t.calendar.as_ref().map(|c| c.calendar.period()),
                penalty: t.penalty.is_some(),
                overrides: t.overrides,
                plans: r
                    .plans
                    .iter()
                    .map(|p| (p.name.to_string(), p.quota))
                    .collect(),
            })
            .collect()
    }

    /// The circuit breaker: `closed`, `open` (the backend is not called) or
    /// `half_open` (the next request probes it).
    pub fn circuit_state(&self) -> &'static str {
        self.shared.guards.breaker.state().label()
    }

    /// The fleet-wide control hash's Redis key, when the layer polls one (a
    /// [`ControlKey`] and a Redis backend): where
    /// [`set_fleet_mode`](Self::set_fleet_mode) writes.
    pub fn fleet_control_key(&self) -> Option<&str> {
        crate::engine::control_hash_key(&self.shared)
    }

    /// Sets the mode of every instance: writes the control hash's `mode`
    /// field (`tier` `None`) or `tier:<name>`, then applies the hash here
    /// at once; the other instances follow within their poll interval (see
    /// [`handle`](crate::handle#the-fleet-wide-control-key)). Undo with `HDEL` (or set `enforce`).
    pub async fn set_fleet_mode(
        &self,
        tier: Option<&str>,
        mode: Mode,
    ) -> Result<(), crate::engine::ControlError> {
        let field = match tier {
            None => "mode".to_owned(),
            Some(t) => {
                self.shared
                    .config
                    .tier_index(t)
                    .map_err(|_| crate::engine::ControlError::UnknownTier(t.to_owned()))?;
                format!("tier:{t}")
            }
        };
        crate::engine::write_mode(&self.shared, &field, mode).await
    }

    /// Lease mode ([`crate::engine::token_lease`]): the keys this instance holds
    /// unspent tokens of, sorted by key (empty without a leased tier, or on
    /// the memory backend).
    pub fn leases(&self) -> Vec<crate::engine::LeaseStatus> {
        self.shared
            .guards
            .leases
            .as_ref()
            .map_or_else(Vec::new, |p| p.status())
    }

    /// Lease mode's counters since the layer was built, in this process
    /// (all 0 without a leased tier).
    pub fn lease_counts(&self) -> crate::engine::LeaseCounts {
        self.shared
            .guards
            .leases
            .as_ref()
            .map_or_else(Default::default, |p| p.counts())
    }

    /// Lease mode, graceful shutdown: waits for the leases being taken
    /// (at most the backend timeout), then hands every unspent leased token
    /// back to its shared bucket, through the refund of its lease's charge
    /// (never lifting a bucket above where it would be had the lease never
    /// been taken). Answers the tokens handed back. The layer keeps working:
    /// later requests lease again. Dropping the layer does the same in a
    /// task.
    ///
    /// A failed return is logged at `debug` and its tokens are lost (an
    /// under-admission, as for a crashed instance).
    pub async fn return_leases(&self) -> u64 {
        match &self.shared.guards.leases {
            Some(p) => p.return_all().await,
            None => 0,
        }
    }

    /// Loses every lease without returning it, as a crashed instance would
    /// (tests of the false-denial bound; the `__testing` feature). Answers the
    /// tokens lost.
    #[cfg(feature = "__testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "__testing")))]
    pub fn abandon_leases(&self) -> u64 {
        self.shared
            .guards
            .leases
            .as_ref()
            .map_or(0, |p| p.abandon())
    }
}
