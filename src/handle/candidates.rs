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
        let live_label = self
            .shared
            .live
            .runtime
            .load()
            .tiers
            .get(i)
            .map(|r| {
                let calendar = t.calendar.as_ref().map(|c| c.calendar.period().name());
                crate::engine::candidates::label(&r.quota, calendar)
            })
            .unwrap_or_default();
        Some(CandidatesReport {
            tier: tier.to_owned(),
            window_secs: hours * 3600,
            live: t.candidates_live.report(&live_label, hours, n, now_s),
            candidates: t
                .candidates
                .iter()
                .map(|c| c.stats.report(&c.label, hours, n, now_s))
                .collect(),
        })
    }
}
