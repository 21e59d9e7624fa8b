//! [`Meta`]: the per-request context the engine keeps beside a request's
//! checks, from planning to the decision (which tiers the checks belong to,
//! which only observe, what the breaker allowed, what was sent, the probe
//! and flight guards, lease mode's local spend).

use super::runtime::BuiltTier;
use super::state::Shared;
use crate::backend::{Shadow, TierCheck};
use crate::engine::breaker::Permit;
use crate::engine::deny_cache::ProbeGuard;
use std::sync::Arc;

/// What a request's check is about, kept for the decision: which tiers the
/// checks belong to, which of them only observe (shadow, or canary keys not
/// enforced), and what to log about those.
#[derive(Debug, Default)]
pub(crate) struct Meta {
    /// Tier index of each check (inline up to 8 checks).
    pub(crate) tiers: smallvec::SmallVec<[u8; 8]>,
    /// Checks whose denial does not reject.
    pub(crate) shadow: Shadow,
    /// For shadow checks: the endpoint label and a hash of each key, for the
    /// would-be-rejected log line (computed only when some tier observes).
    pub(crate) observed: Option<Observed>,
    /// What the circuit breaker allowed.
    pub(crate) permit: Permit,
    /// The local clock when the check was sent, and each check's key and
    /// cost (for the deny cache and the top-N sketches).
    pub(crate) sent_us: u64,
    pub(crate) sent: Vec<TierCheck>,
    /// The request's endpoint series (for the anomaly baseline).
    pub(crate) endpoint: Option<Arc<crate::observe::recorder::Endpoint>>,
    /// When the request reached the layer, and when the backend call started.
    pub(crate) started: Option<std::time::Instant>,
    pub(crate) backend_started: Option<std::time::Instant>,
    /// Decided by the local fallback limiter.
    pub(crate) fallback: bool,
    /// Not observed ([`Facts::OBSERVED`](super::facts::Facts::OBSERVED)): no endpoint series, sketches or
    /// latency.
    pub(crate) quiet: bool,
    /// No headers on an allowed decision ([`Facts::HEADERS`](super::facts::Facts::HEADERS) false).
    pub(crate) headless: bool,
    /// With IETF headers: each check's quota (requests), period in
    /// microseconds (0 for a concurrency tier), and whether its algorithm
    /// refills continuously.
    pub(crate) quotas: Vec<(u64, u64, bool)>,
    /// Held while this request probes a lapsed deny-cache key: dropped with
    /// the meta, after the answer was fed to the cache (or on an error),
    /// which wakes the requests waiting for it.
    pub(crate) probe: Option<ProbeGuard>,
    /// Held while the backend check is in flight, until the answer has
    /// been fed to the deny cache (for its room facts: see
    /// [`crate::engine::deny_cache`]).
    pub(crate) flight: Option<crate::engine::deny_cache::Flight>,
    /// For tiers with plans: each check's plan (`None` = the tier's
    /// default), with its position among the tier's plans.
    pub(crate) plans: Vec<Option<(usize, Arc<str>)>>,
    /// The decision carries every check's result ([`Facts::DETAILS`](super::facts::Facts::DETAILS)).
    pub(crate) details: bool,
    /// What lease mode spent locally for this request (`engine/leased.rs`).
    pub(crate) leased: Option<Box<super::token_lease::taken::Taken>>,
    /// The candidate checks (the last `live_of.len()` of the checks, see
    /// `engine/candidates.rs`): each one's live check, by index.
    pub(crate) live_of: smallvec::SmallVec<[u8; 4]>,
    /// Each candidate check's tier and its place among the tier's
    /// candidates.
    pub(crate) candidates: smallvec::SmallVec<[(u8, u8); 4]>,
    /// On the memory backend, each candidate check's tag (its key is left
    /// empty: `engine/candidates.rs`); empty on Redis.
    pub(crate) tags: smallvec::SmallVec<[u64; 4]>,
    /// On the memory backend, instead of the three above when planned so
    /// (`engine/candidates.rs`, [`UnitCandidates`](super::candidates::UnitCandidates)): each
    /// live check whose tier's candidates are sent beside the checks (its
    /// index, its tier), in order.
    pub(crate) packs: smallvec::SmallVec<[(u8, u8); 2]>,
    /// Which of those candidates denied (bit `k`: the `k`-th over
    /// `packs`' tiers, in order).
    pub(crate) denials: crate::backend::Denials,
}

impl Drop for Meta {
    /// The checks' key buffers go back for the next request's.
    fn drop(&mut self) {
        super::spare::give_back(&mut self.sent);
    }
}

#[derive(Debug)]
pub(crate) struct Observed {
    pub(crate) endpoint: String,
    pub(crate) key_hashes: Vec<u64>,
}

impl Meta {
    /// The tier check `i` belongs to.
    pub(crate) fn tier<'s>(&self, shared: &'s Shared, i: usize) -> Option<&'s BuiltTier> {
        self.tiers
            .get(i)
            .and_then(|&t| shared.config.tiers.get(usize::from(t)))
    }

    /// The per-key override's read sent just before check `i`, of the same
    /// tier, if its tier takes overrides: a refund or settle of check `i`
    /// carries it so the backend runs it under the override, as the check.
    pub(crate) fn override_read(&self, i: usize) -> Option<&TierCheck> {
        let j = i.checked_sub(1)?;
        self.sent
            .get(j)
            .filter(|o| o.limit.is_override() && self.tiers.get(j) == self.tiers.get(i))
    }

    /// The name of the tier check `i` belongs to.
    pub(crate) fn tier_name(&self, shared: &Shared, i: usize) -> Arc<str> {
        self.tier(shared, i)
            .map_or_else(|| Arc::from("unknown"), |t| t.name.clone())
    }

    /// Check `i`'s plan slot for the tier-decision counter (0: the default
    /// plan, else 1 + its position) and name.
    pub(crate) fn plan_slot(&self, i: usize) -> (usize, &str) {
        match self.plans.get(i) {
            Some(Some((pos, name))) => (pos.saturating_add(1), name),
            _ => (0, "default"),
        }
    }
}
