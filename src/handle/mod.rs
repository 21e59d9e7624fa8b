//! The control plane: [`RateLimitHandle`] (change modes, quotas and lists
//! at run time, read the layer's counts and sketches) and everything an
//! operator does through it, one concept a module:
//!
//! * [`inspect`]: peek, reset and lift one key of one tier;
//! * [`overrides`]: per-key quotas (a quota, unlimited, blocked);
//! * [`control`]: the fleet-wide control key ([`ControlKey`](control::ControlKey))
//!   that switches every instance's modes.
//!
//! [`RateLimitHandle`] is also re-exported at the crate root, beside the
//! layer whose [`handle`](crate::RateLimitLayer::handle) returns it.

mod changes;
mod fleet;

pub mod control;
pub mod inspect;
pub mod overrides;

pub use changes::Changes;

use crate::engine::Shared;
use crate::observe::recorder::{AnomalyStatus, BucketCounts};
use crate::observe::topn::{BlockedKey, Kind};
use crate::observe::DecisionCounts;
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
    /// (see [`crate::handle::control`]), else [`mode`](Self::mode).
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

    /// The `n` keys of `tier` most blocked (refused: a 429 by that tier,
    /// enforced for the key) over the last `window` (rounded up to whole
    /// hours, at most 24), in this process. `None` for an unknown tier.
    /// Would-be denials of a tier not enforced for the key are not here:
    /// see [`top_shadow_limited`](Self::top_shadow_limited).
    pub fn top_blocked(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Option<Vec<BlockedKey>> {
        self.top(tier, Kind::Blocked, n, window)
    }

    /// Like [`top_blocked`](Self::top_blocked), for the keys `tier` would
    /// have refused but let through: the tier was in shadow mode, or a
    /// canary not enforced for the key (the `shadow_limited` decision).
    pub fn top_shadow_limited(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Option<Vec<BlockedKey>> {
        self.top(tier, Kind::ShadowLimited, n, window)
    }

    /// Like [`top_blocked`](Self::top_blocked), for keys allowed with less
    /// than 20 % of their tier's capacity left.
    pub fn top_near_limit(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Option<Vec<BlockedKey>> {
        self.top(tier, Kind::NearLimit, n, window)
    }

    fn top(
        &self,
        tier: &str,
        kind: Kind,
        n: usize,
        window: std::time::Duration,
    ) -> Option<Vec<BlockedKey>> {
        let i = self.shared.config.tier_index(tier).ok()?;
        let hours = window.as_secs().div_ceil(3600).max(1);
        let now_s = self.shared.local_clock.now_us() / 1_000_000;
        Some(self.shared.telemetry.observer.top(i, kind, n, hours, now_s))
    }

    /// The `n` keys of `tier` most refused (429) across the whole fleet over
    /// the last `window` (whole hours, at most 24), from the hourly sets in
    /// Redis (see [`RateLimitLayerBuilder::fleet_top_n`](crate::RateLimitLayerBuilder::fleet_top_n)).
    /// Counts are exact (per key, up to the 10 000 heaviest keys an hour):
    /// the rejections the script made, plus the 429s each instance's deny
    /// cache answered, added by a pipelined flush once per
    /// [`fleet_top_n_flush`](crate::RateLimitLayerBuilder::fleet_top_n_flush)
    /// interval (default 1 s) — so they can lag by one interval, and a crash
    /// or a failed flush loses at most one interval of one instance (counted
    /// in `tiered_ratelimit_fleet_blocked_dropped_total`). Would-be denials
    /// of a tier not enforced for the key are counted apart:
    /// [`top_shadow_limited_fleet`](Self::top_shadow_limited_fleet).
    ///
    /// # Errors
    /// [`BackendError`](crate::BackendError) when Redis cannot answer, or
    /// `Script` when the layer has no fleet-wide top-N (memory backend,
    /// cluster, or turned off) or the tier is unknown.
    pub async fn top_blocked_fleet(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Result<Vec<BlockedKey>, crate::error::BackendError> {
        self.top_fleet(tier, crate::engine::BLOCKED_SET, n, window)
            .await
    }

    /// Like [`top_blocked_fleet`](Self::top_blocked_fleet), for the keys
    /// `tier` would have refused but let through, fleet-wide (a shadow
    /// tier, or a canary not enforced for the key): the script adds those
    /// to the hourly sets `<prefix>:shadow_limited:<hour>`, apart from the
    /// refused keys' `<prefix>:blocked:<hour>`.
    ///
    /// # Errors
    /// As [`top_blocked_fleet`](Self::top_blocked_fleet).
    pub async fn top_shadow_limited_fleet(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Result<Vec<BlockedKey>, crate::error::BackendError> {
        self.top_fleet(tier, crate::engine::SHADOW_LIMITED_SET, n, window)
            .await
    }

    /// The `n` heaviest keys of `tier` in the hourly sets
    /// `<prefix>:<set>:<hour>` of the last `window`.
    async fn top_fleet(
        &self,
        tier: &str,
        set: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Result<Vec<BlockedKey>, crate::error::BackendError> {
        let no = |why: &str| crate::error::BackendError::Unsupported(why.to_owned());
        let i = self
            .shared
            .config
            .tier_index(tier)
            .map_err(|e| no(&e.to_string()))?;
        if self.shared.telemetry.blocked_set.is_none() {
            return Err(no(
                "fleet-wide top-N needs a single Redis backend with fleet_top_n on",
            ));
        }
        #[cfg(feature = "redis")]
        if let crate::backend::Backend::Redis(r) = &self.shared.backend {
            let hour = self.shared.local_clock.now_us() / 3_600_000_000;
            let hours = window.as_secs().div_ceil(3600).clamp(1, 24);
            let sets: Vec<String> = (0..hours)
                .map(|h| {
                    format!(
                        "{}:{set}:{}",
                        self.shared.config.key_prefix,
                        hour.saturating_sub(h)
                    )
                })
                .collect();
            let base = &self.shared.config.tiers[i].key_base;
            let top = r.top_blocked(&sets, base, n).await?;
            return Ok(top
                .into_iter()
                .map(|(key, count)| BlockedKey {
                    key,
                    count,
                    error: 0,
                })
                .collect());
        }
        #[cfg(not(feature = "redis"))]
        let _ = (n, window, i, set);
        Err(no("not a Redis backend"))
    }

    /// Every (tier, endpoint) series of the 429-rate baseline, with its alert.
    pub fn anomalies(&self) -> Vec<AnomalyStatus> {
        self.shared.telemetry.observer.anomalies()
    }

    /// The last hour of a tier's counts, one bucket per anomaly bucket (a
    /// minute by default), oldest first. `None` for an unknown tier.
    pub fn history(&self, tier: &str) -> Option<Vec<BucketCounts>> {
        let i = self.shared.config.tier_index(tier).ok()?;
        Some(self.shared.telemetry.observer.history(i))
    }

    /// The fleet-wide control hash's Redis key, when the layer polls one (a
    /// [`ControlKey`](crate::handle::control::ControlKey) and a Redis backend): where
    /// [`set_fleet_mode`](Self::set_fleet_mode) writes.
    pub fn fleet_control_key(&self) -> Option<&str> {
        crate::engine::control_hash_key(&self.shared)
    }

    /// Sets the mode of every instance: writes the control hash's `mode`
    /// field (`tier` `None`) or `tier:<name>`, then applies the hash here
    /// at once; the other instances follow within their poll interval (see
    /// [`crate::handle::control`]). Undo with `HDEL` (or set `enforce`).
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

    /// A tier's counts so far in the bucket not closed yet (partial: the
    /// current bucket, or the last one with traffic until the first request
    /// after its end closes it into [`history`](Self::history)). `None` for
    /// an unknown tier, and before the layer's first checked request.
    pub fn open_bucket(&self, tier: &str) -> Option<BucketCounts> {
        let i = self.shared.config.tier_index(tier).ok()?;
        self.shared.telemetry.observer.open_bucket(i)
    }

    /// The layer's clock (the one its buckets use), Unix epoch seconds
    /// (the admin page's render time).
    #[cfg(feature = "admin")]
    pub(crate) fn now_s(&self) -> u64 {
        self.shared.local_clock.now_us() / 1_000_000
    }

    /// Requests by decision since the layer was built, in this process.
    pub fn counts(&self) -> DecisionCounts {
        self.shared.telemetry.counts.snapshot()
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
