//! What a handle reads of the layer's traffic: the top-N keys (in this
//! process and fleet-wide), the anomaly baseline, the history and the
//! counts by decision.

use super::RateLimitHandle;
use crate::observe::topn::Kind;
use crate::observe::{AnomalyStatus, BlockedKey, BucketCounts, DecisionCounts};

impl RateLimitHandle {
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

    /// Every guarded tier's fall back guard as this instance judged it
    /// (`GET /api/anomalies`' `guards`).
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    pub(crate) fn guard_views(&self) -> Vec<crate::engine::rollout::GuardView> {
        let shared = &self.shared;
        shared
            .live
            .plans
            .guards
            .iter()
            .zip(shared.config.tiers.iter())
            .filter_map(|(g, t)| g.as_ref().map(|g| g.view(&t.name)))
            .collect()
    }

    /// The last hour of a tier's counts, one bucket per anomaly bucket (a
    /// minute by default), oldest first. `None` for an unknown tier.
    pub fn history(&self, tier: &str) -> Option<Vec<BucketCounts>> {
        let i = self.shared.config.tier_index(tier).ok()?;
        Some(self.shared.telemetry.observer.history(i))
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
}
