//! Limits suggested from real demand: [`RateLimitHandle::suggest`].

use super::RateLimitHandle;
use crate::observe::demand::answer::{self, Ask};
use crate::observe::demand::store::HOUR_US;
use crate::observe::demand::{Demand, SuggestError, Suggestion};
use std::collections::HashSet;
use std::time::Duration;

/// The longest window a suggestion reads: 7 days.
pub(crate) const MAX_SUGGEST_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// Named keys peeked for a penalty-box block, the heaviest first.
const PEEKED: usize = 32;

impl RateLimitHandle {
    /// Turns recording per-key demand on or off on this instance (the
    /// builder's [`demand`](crate::RateLimitLayerBuilder::demand) sets it at
    /// start; default off). Off, a check pays one relaxed load; what was
    /// recorded stays readable until it expires.
    pub fn set_demand(&self, on: bool) {
        self.shared()
            .telemetry
            .demand
            .enabled
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this instance records per-key demand.
    pub fn demand_enabled(&self) -> bool {
        self.shared()
            .telemetry
            .demand
            .enabled
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Takes this instance's per-key demand counts now and stores them
    /// (fleet-wide on Redis), as the background task does once a second; a
    /// replay on a virtual clock calls it as its clock passes each second.
    /// Await it on a graceful shutdown, once the server has stopped taking
    /// requests, so the last second's counts are kept.
    ///
    /// # Errors
    /// [`SuggestError::Backend`]: Redis failed (the counts taken are lost).
    pub async fn flush_demand(&self) -> Result<(), SuggestError> {
        self.shared()
            .telemetry
            .demand
            .flush()
            .await
            .map_err(SuggestError::Backend)
    }

    /// The limit for `tier` (and its `plan`) that would have denied at most
    /// a `target` share of its keys over the last `window` (rounded up to
    /// whole hours, at most 7 days), from the per-key demand
    /// every instance recorded ([`observe::demand`](crate::observe::demand):
    /// fleet-wide on Redis, this process's on the memory backend). This
    /// instance's counts are flushed first. Nothing is applied.
    ///
    /// A key's demand is the most requests (cost units, attempts denied
    /// included) it sent in one period of the quota (aligned to the epoch)
    /// within the window. Left out and named: keys on the denylist (an IP
    /// inside a listed network, a listed API key or user equal to the key
    /// part), keys of a tier with a penalty box that are blocked now (the
    /// 32 heaviest named keys are peeked), then outliers (above
    /// 10 × the
    /// p99.9). For a token or leaky bucket the answer is a rate and a burst
    /// ([`Suggested::Bucket`](crate::observe::demand::Suggested)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// use tiered_ratelimit::observe::demand::SuggestError;
    /// use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
    /// let layer = RateLimitLayer::builder()
    ///     .tier(Tier::new("global", Global, Quota::per_minute(10)))
    ///     .demand(true)
    ///     .build()
    ///     .unwrap();
    /// let hour = Duration::from_secs(3600);
    /// let answer = layer.handle().suggest("global", None, 0.001, hour).await;
    /// // One key (`Global`): no distribution to read.
    /// assert_eq!(answer, Err(SuggestError::NotEnoughData { keys: 0, needed: 50 }));
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`SuggestError::Off`] while this instance does not record demand
    /// ([`set_demand`](Self::set_demand));
    /// [`SuggestError::NotEnoughData`] below 50 distinct keys;
    /// [`SuggestError::UnknownTier`], [`SuggestError::InvalidTarget`]
    /// (not in `0..1`), [`SuggestError::Backend`] (Redis failed).
    pub async fn suggest(
        &self,
        tier: &str,
        plan: Option<&str>,
        target: f64,
        window: Duration,
    ) -> Result<Suggestion, SuggestError> {
        if !(0.0..1.0).contains(&target) {
            return Err(SuggestError::InvalidTarget(target));
        }
        if !self.demand_enabled() {
            return Err(SuggestError::Off);
        }
        let shared = self.shared();
        let unknown = || {
            SuggestError::UnknownTier(match plan {
                Some(p) => format!("{tier} (plan {p})"),
                None => tier.to_owned(),
            })
        };
        let i = shared.config.tier_index(tier).map_err(|_| unknown())?;
        let (quota, bucket, penalty) = {
            let rt = shared.live.runtime.load();
            let r = &rt.tiers[i];
            let quota = match plan {
                Some(p) => {
                    r.plans
                        .iter()
                        .find(|x| &*x.name == p)
                        .ok_or_else(unknown)?
                        .quota
                }
                None => r.quota,
            };
            let t = &shared.config.tiers[i];
            let bucket = matches!(
                t.algorithm,
                crate::algorithm::kind::Algorithm::TokenBucket
                    | crate::algorithm::kind::Algorithm::LeakyBucket(_)
            );
            (quota, bucket, t.penalty.is_some())
        };
        let demand: &Demand = &shared.telemetry.demand;
        let slot = demand.slot(tier, plan).ok_or_else(unknown)?;
        let period_s = Demand::period_s(slot, quota.period().as_secs());
        demand.flush().await.map_err(SuggestError::Backend)?;
        let window = window.clamp(Duration::from_secs(1), MAX_SUGGEST_WINDOW);
        let hours = window.as_secs().div_ceil(3600);
        let now_hour = demand.now_us() / HOUR_US;
        let w = demand
            .store
            .window(tier, plan, (now_hour + 1).saturating_sub(hours)..=now_hour)
            .await
            .map_err(SuggestError::Backend)?;
        let deny = self.denylist_entries();
        let nets: Vec<ipnet::IpNet> = deny.ips.iter().filter_map(|n| n.parse().ok()).collect();
        // An `ApiKey` tier's key part is the value's 128-bit XXH3 in hex
        // (`key::ApiKey`): a denylisted key is found by its hash too.
        let hashed_keys: Vec<String> = deny
            .api_keys
            .iter()
            .map(|k| format!("{:032x}", xxhash_rust::xxh3::xxh3_128(k.as_bytes())))
            .collect();
        let mut penalised = HashSet::new();
        if penalty {
            let mut named: Vec<(u64, &String)> = w
                .names
                .iter()
                .filter_map(|(h, n)| Some((*w.peaks.get(h)?, n)))
                .collect();
            named.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
            for (_, name) in named.into_iter().take(PEEKED) {
                if let Ok(s) = self.peek(tier, name).await {
                    if s.blocked_for.is_some() {
                        penalised.insert(name.clone());
                    }
                }
            }
        }
        let listed = |name: &str| -> Option<&'static str> {
            let ip = name.parse::<std::net::IpAddr>().ok();
            let denied = ip.is_some_and(|ip| nets.iter().any(|n| n.contains(&ip)))
                || deny.api_keys.iter().any(|k| k == name)
                || hashed_keys.iter().any(|k| k == name)
                || deny.users.iter().any(|u| u == name);
            if denied {
                Some("denylisted")
            } else if penalised.contains(name) {
                Some("penalised")
            } else {
                None
            }
        };
        let ask = Ask {
            tier,
            plan,
            period_s,
            bucket,
            target,
            window_s: hours * 3600,
        };
        answer::suggest(&ask, &w, &listed)
    }
}
