//! What a handle reads of a tier's candidate quotas (see
//! [`Tier::candidates`](crate::Tier::candidates)).

use super::RateLimitHandle;
use crate::observe::CandidatesReport;

impl RateLimitHandle {
    /// What `tier`'s candidate quotas would have done over the last
    /// `window` (rounded up to whole clock hours, at most 24), in this
    /// process, with each one's `n` heaviest would-be-denied keys, beside
    /// the live quota's counts on the same requests. `None` for an unknown
    /// tier; an empty `candidates` for a tier without any.
    pub fn candidates(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Option<CandidatesReport> {
        let i = self.shared.config.tier_index(tier).ok()?;
        let t = self.shared.config.tiers.get(i)?;
        let hours = window.as_secs().div_ceil(3600).clamp(1, 24);
        let now_s = self.shared.local_clock.now_us() / 1_000_000;
        let live_label = self.live_label(i);
        let stats = &t.candidate_stats;
        Some(CandidatesReport {
            tier: tier.to_owned(),
            window_secs: hours * 3600,
            live: stats.report(0, &live_label, hours, n, now_s),
            candidates: t
                .candidates
                .iter()
                .enumerate()
                .map(|(j, c)| stats.report(1 + j, &c.label, hours, n, now_s))
                .collect(),
        })
    }
}

impl RateLimitHandle {
    /// [`candidates`](Self::candidates) since the layer was built, in this
    /// process (`window_secs` 0): what `tiered-ratelimit replay` reports of
    /// a policy's candidates. Each candidate's heaviest keys are those of
    /// the last 24 clock hours. `None` for an unknown tier.
    pub fn candidates_total(&self, tier: &str, n: usize) -> Option<CandidatesReport> {
        let i = self.shared.config.tier_index(tier).ok()?;
        let t = self.shared.config.tiers.get(i)?;
        let now_s = self.shared.local_clock.now_us() / 1_000_000;
        let live_label = self.live_label(i);
        let stats = &t.candidate_stats;
        Some(CandidatesReport {
            tier: tier.to_owned(),
            window_secs: 0,
            live: stats.report(0, &live_label, u64::MAX, n, now_s),
            candidates: t
                .candidates
                .iter()
                .enumerate()
                .map(|(j, c)| stats.report(1 + j, &c.label, u64::MAX, n, now_s))
                .collect(),
        })
    }

    /// Tier `tier`'s candidate named `label` (`80/1m`) as a quota setting
    /// (what `POST /api/quota` with `"candidate"` promotes), or `None`.
    #[cfg(feature = "admin")]
    pub(crate) fn candidate_setting(
        &self,
        tier: &str,
        label: &str,
    ) -> Option<crate::engine::QuotaSetting> {
        let i = self.shared.config.tier_index(tier).ok()?;
        let t = self.shared.config.tiers.get(i)?;
        let c = t.candidates.iter().find(|c| *c.label == *label)?;
        let period = match &t.calendar {
            Some(cal) => cal.calendar.period().name().to_owned(),
            None => humantime::format_duration(c.quota.period()).to_string(),
        };
        Some(crate::engine::QuotaSetting {
            limit: c.quota.limit(),
            period,
            burst: c.quota.has_burst().then(|| c.quota.burst_size()),
        })
    }

    /// Tier `i`'s live quota as a candidate's label.
    fn live_label(&self, i: usize) -> String {
        let t = &self.shared.config.tiers[i];
        self.shared
            .live
            .runtime
            .load()
            .tiers
            .get(i)
            .map(|r| {
                let calendar = t.calendar.as_ref().map(|c| c.calendar.period().name());
                crate::engine::candidates::label(&r.quota, calendar)
            })
            .unwrap_or_default()
    }

    /// [`candidates`](Self::candidates) across the whole fleet: every
    /// instance's counts, from the hourly hashes and sets each one flushes
    /// to Redis once per
    /// [`fleet_top_n_flush`](crate::RateLimitLayerBuilder::fleet_top_n_flush)
    /// interval (docs/rollout.md, "Candidate quotas"), so they lag by one
    /// interval. The distinct keys and heaviest keys count up to the
    /// 10 000 heaviest keys an hour (`keys_capped` past that).
    ///
    /// # Errors
    /// [`BackendError`](crate::BackendError) when Redis cannot answer, or
    /// `Unsupported` without fleet-wide counts (memory backend, cluster,
    /// `fleet_top_n` off, no tier with candidates) or for an unknown tier.
    pub async fn candidates_fleet(
        &self,
        tier: &str,
        n: usize,
        window: std::time::Duration,
    ) -> Result<CandidatesReport, crate::error::BackendError> {
        let no = |why: &str| crate::error::BackendError::Unsupported(why.to_owned());
        let i = self
            .shared
            .config
            .tier_index(tier)
            .map_err(|e| no(&e.to_string()))?;
        if self.shared.telemetry.fleet_candidates.is_none() {
            return Err(no(
                "fleet-wide candidate counts need a single Redis backend with fleet_top_n on and a tier with candidates",
            ));
        }
        let Some(local) = self.candidates(tier, n, window) else {
            return Err(no("unknown tier"));
        };
        #[cfg(feature = "redis")]
        if let crate::backend::Backend::Redis(r) = &self.shared.backend {
            use crate::observe::fleet_candidates::{hash_key, set_key, LIVE};
            let prefix = &self.shared.config.key_prefix;
            let name = &self.shared.config.tiers[i].name;
            let hour = self.shared.local_clock.now_us() / 3_600_000_000;
            let hours: Vec<u64> = (0..local.window_secs / 3600)
                .map(|h| hour.saturating_sub(h))
                .collect();
            let labels: Vec<String> = std::iter::once(LIVE.to_owned())
                .chain(local.candidates.iter().map(|c| c.quota.clone()))
                .collect();
            let hashes: Vec<String> = hours.iter().map(|&h| hash_key(prefix, name, h)).collect();
            let sets: Vec<String> = labels
                .iter()
                .flat_map(|l| hours.iter().map(move |&h| set_key(prefix, name, l, h)))
                .collect();
            let (fields, members) = r.read_candidates(&hashes, &sets).await?;
            let count = |label: &str, what: &str| -> u64 {
                let field = format!("{label}|{what}");
                fields
                    .iter()
                    .flatten()
                    .filter(|(f, _)| *f == field)
                    .map(|(_, v)| *v)
                    .sum()
            };
            let report = |at: usize, mut c: crate::observe::CandidateReport| {
                let label = &labels[at];
                let mut keys: std::collections::HashMap<&str, u64> =
                    std::collections::HashMap::new();
                for set in members.iter().skip(at * hours.len()).take(hours.len()) {
                    for (k, v) in set {
                        *keys.entry(k.as_str()).or_default() += v;
                    }
                }
                let mut top: Vec<(&str, u64)> = keys.iter().map(|(k, v)| (*k, *v)).collect();
                top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
                c.requests = count(label, "requests");
                c.would_deny = count(label, "would_deny");
                c.keys_denied = keys.len() as u64;
                c.keys_capped = members
                    .iter()
                    .skip(at * hours.len())
                    .take(hours.len())
                    .any(|s| s.len() >= 10_000);
                c.top = top
                    .into_iter()
                    .take(n)
                    .map(|(key, count)| crate::observe::CandidateKey {
                        key: key.to_owned(),
                        count,
                    })
                    .collect();
                c
            };
            let live = report(0, local.live);
            let candidates = local
                .candidates
                .into_iter()
                .enumerate()
                .map(|(j, c)| report(j + 1, c))
                .collect();
            return Ok(CandidatesReport {
                tier: local.tier,
                window_secs: local.window_secs,
                live,
                candidates,
            });
        }
        #[cfg(not(feature = "redis"))]
        let _ = (i, local);
        Err(no("not a Redis backend"))
    }
}
