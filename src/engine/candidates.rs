//! Candidate quotas: up to four quotas beside a tier's live one, checked
//! and charged on keys of their own in the same backend call as the live
//! checks, never changing an answer (`docs/rollout.md`, "Candidate
//! quotas").
//!
//! Planning appends one check per candidate after every live check of the
//! request (overrides' reads and penalty boxes included), so the live
//! checks keep their indices; [`Meta::live_of`] names each candidate's live
//! check. The backends charge a candidate when it allows and every
//! enforced check but its live one allows. When the answer arrives,
//! [`take`] counts the candidates' decisions and cuts them off the
//! verdict and the sent checks: everything after (outcome, decide, the
//! deny cache, top-N, refunds) sees the live checks only.
//!
//! On the memory backend a request's candidates are, when they can be,
//! their tiers' [`UnitCandidates`], built once: nothing is appended, each
//! live check with candidates is noted in [`Meta::packs`], and the backend
//! answers only which candidates denied ([`Meta::denials`]), which
//! [`take`] counts the same way.

use super::meta::Meta;
use super::state::Shared;
use crate::algorithm::kind::Algorithm;
use crate::algorithm::Limit;
use crate::backend::{Denials, TierCheck, Verdict};
use crate::error::{BackendError, ConfigError};
use crate::quota::Quota;
use std::sync::Arc;

/// The most candidates a tier takes.
pub(crate) const MAX_CANDIDATES: usize = 4;

/// One candidate quota of a built tier.
#[derive(Debug)]
pub(crate) struct BuiltCandidate {
    /// Its quota as written (`80/1m`): the metric's label, the report's
    /// `quota`, and part of its key suffix.
    pub(crate) label: Arc<str>,
    /// Its quota (a calendar tier's: of the tier's period): what
    /// `POST /api/quota` promotes.
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    pub(crate) quota: Quota,
    pub(crate) limit: Limit,
    /// `limit`'s capacity + 1, the most a request's cost is charged on it
    /// (computed once: a division for a bucket), for a tier without a
    /// calendar (a calendar's limit is computed per request).
    pub(crate) cost_cap: u64,
    /// `{c:<label>}`, appended to the live key.
    pub(crate) suffix: String,
    /// What names it on the memory backend, which packs a tier key's
    /// candidates in one entry: its suffix's tag there.
    pub(crate) tag: u64,
}

/// A tier's candidates as every request of cost 1 checks them on the
/// memory backend when the tier has no calendar: the same checks each
/// time (their keys empty, each named by its tag), so built once with
/// the tier ([`plan`] notes the request's live check in
/// [`Meta::packs`] instead of appending them).
#[derive(Debug, Default)]
pub(crate) struct UnitCandidates {
    pub(crate) checks: Box<[TierCheck]>,
    pub(crate) tags: Box<[u64]>,
}

impl UnitCandidates {
    /// Of `candidates`; none for a calendar tier (its candidates' limits
    /// follow the clock).
    pub(crate) fn new(candidates: &[BuiltCandidate], calendar: bool) -> Self {
        if calendar {
            return Self::default();
        }
        Self {
            checks: candidates
                .iter()
                .map(|c| TierCheck {
                    key: String::new(),
                    limit: c.limit,
                    cost: 1,
                    home: None,
                })
                .collect(),
            tags: candidates.iter().map(|c| c.tag).collect(),
        }
    }
}

/// A quota as a candidate's label: `<limit>/<period>` (humantime, no
/// spaces: `1m`, `1h30m`), then `,burst=<n>` when it has a burst of its
/// own; a calendar tier's period is its calendar's name.
pub(crate) fn label(q: &Quota, calendar: Option<&str>) -> String {
    let period = match calendar {
        Some(name) => name.to_owned(),
        None => humantime::format_duration(q.period())
            .to_string()
            .replace(' ', ""),
    };
    if q.has_burst() && q.burst_size() != q.limit() {
        format!("{}/{period},burst={}", q.limit(), q.burst_size())
    } else {
        format!("{}/{period}", q.limit())
    }
}

/// The candidates of tier `t`, checked as its own quota would be,
/// errors naming `candidates[i]`; `leased`: a tier of the engine is in
/// lease mode.
pub(crate) fn compile(
    t: &super::spec::TierSpec,
    leased: bool,
) -> Result<Vec<BuiltCandidate>, ConfigError> {
    let (tier, algorithm, cost, quota) = (t.name.as_str(), t.algorithm, t.cost, t.quota);
    let (candidates, calendar, priced) = (&t.candidates, t.calendar.as_ref(), t.priced);
    let refused = |field: String, reason: String| ConfigError::Candidate {
        tier: tier.to_owned(),
        field,
        reason,
    };
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    if candidates.len() > MAX_CANDIDATES {
        return Err(refused(
            "candidates".into(),
            format!(
                "{} candidates; a tier takes at most {MAX_CANDIDATES} (each is one more state read and written per request)",
                candidates.len()
            ),
        ));
    }
    if matches!(algorithm, Algorithm::Concurrency { .. }) {
        return Err(refused(
            "candidates".into(),
            "a concurrency tier takes none: its slots are held until each response ends and released then, which a candidate, charged and never released, cannot mirror".into(),
        ));
    }
    if priced {
        return Err(refused(
            "candidates".into(),
            "a priced tier takes none: its charge is settled to the response's price when the response ends, which a candidate's is not".into(),
        ));
    }
    if leased {
        return Err(refused(
            "candidates".into(),
            "not with lease mode: a leased check is answered without a backend call, which a candidate needs to see every request".into(),
        ));
    }
    let mut built: Vec<BuiltCandidate> = Vec::with_capacity(candidates.len());
    for (i, q) in candidates.iter().enumerate() {
        // A calendar tier's candidates count per its calendar window.
        let q = match calendar {
            Some(_) => {
                let q2 = Quota::new(q.limit(), quota.period());
                if q.has_burst() {
                    q2.burst(q.burst_size())
                } else {
                    q2
                }
            }
            None => *q,
        };
        let limit = super::limits::checked_limit(tier, algorithm, q, cost).map_err(|e| {
            // The tier's own message, its field under candidates[i].
            let text = e.to_string();
            let prefix = format!("tier \"{tier}\": ");
            let rest = text.strip_prefix(&prefix).unwrap_or(&text);
            match rest.split_once(": ") {
                Some((field, reason)) => {
                    refused(format!("candidates[{i}].{field}"), reason.to_owned())
                }
                None => refused(format!("candidates[{i}]"), rest.to_owned()),
            }
        })?;
        let label = label(&q, calendar.map(|c| c.period().name()));
        if built.iter().any(|b| *b.label == *label) || q == quota {
            return Err(refused(
                format!("candidates[{i}]"),
                format!("{label} is listed twice (or is the live quota)"),
            ));
        }
        let suffix = format!("{{c:{label}}}");
        built.push(BuiltCandidate {
            tag: crate::backend::candidate_tag(&suffix),
            suffix,
            label: Arc::from(label),
            quota: q,
            cost_cap: limit.capacity().saturating_add(1),
            limit,
        });
    }
    Ok(built)
}

/// After the live checks of a request are planned: one check per
/// candidate of each live check's tier (`pending`: the live check's index,
/// its tier and the request's cost on it), appended in order, with
/// [`Meta::live_of`] and [`Meta::candidates`] filled in.
///
/// A candidate's key is `<live key>{c:<quota>}` (its suffix), except on
/// the memory backend, which keeps a tier key's candidates in the live
/// key's own entry and tells them apart by their suffixes' tags
/// alone: there the key is left empty (no string built per candidate) and
/// the tag is noted in [`Meta::tags`] for the backend.
///
/// On the memory backend, when every live check of `pending` costs 1 on a
/// tier without a calendar, nothing is appended: each is noted in
/// [`Meta::packs`], and its tier's [`UnitCandidates`] checks are sent beside the
/// live checks.
pub(crate) fn plan(
    shared: &Shared,
    checks: &mut Vec<TierCheck>,
    meta: &mut Meta,
    pending: &[(u8, u8, u64)],
) {
    let keyed = !by_tag(&shared.backend);
    if !keyed && units(shared, checks.len(), pending) {
        for &(live, tier, _) in pending {
            meta.packs.push((live, tier));
        }
        return;
    }
    for &(live, tier, cost) in pending {
        let Some(t) = shared.config.tiers.get(usize::from(tier)) else {
            continue;
        };
        for (j, c) in t.candidates.iter().enumerate() {
            if checks.len() >= crate::engine::MAX_TIERS {
                return;
            }
            let Some(of) = checks.get(usize::from(live)) else {
                return;
            };
            let key = if keyed {
                // A spare key buffer (given back in `take`).
                let mut key = super::spare::key();
                key.reserve(of.key.len() + c.suffix.len());
                key.push_str(&of.key);
                key.push_str(&c.suffix);
                key
            } else {
                meta.tags.push(c.tag);
                String::new()
            };
            let (limit, cost_cap) = match (&t.calendar, c.limit) {
                (Some(cal), l) => {
                    let l = cal.limit(l, shared.local_clock.now_us());
                    (l, l.capacity().saturating_add(1))
                }
                (None, l) => (l, c.cost_cap),
            };
            checks.push(TierCheck {
                key,
                limit,
                cost: cost.min(cost_cap),
                home: None,
            });
            meta.live_of.push(live);
            // At most four candidates: the index fits.
            meta.candidates
                .push((tier, u8::try_from(j).unwrap_or(u8::MAX)));
        }
    }
}

/// Whether each of `pending` (after `live` live checks) is planned as its
/// tier's [`UnitCandidates`]: its live check exists, costs 1 and its tier has one,
/// and every candidate fits in [`MAX_TIERS`](crate::engine::MAX_TIERS)
/// checks (as appended, none would be cut off).
fn units(shared: &Shared, live: usize, pending: &[(u8, u8, u64)]) -> bool {
    let mut n = live;
    pending.iter().all(|&(at, tier, cost)| {
        let Some(t) = shared.config.tiers.get(usize::from(tier)) else {
            return false;
        };
        n += t.candidates.len();
        cost == 1
            && usize::from(at) < live
            && !t.unit_candidates.checks.is_empty()
            && t.unit_candidates.checks.len() == t.candidates.len()
    }) && n <= crate::engine::MAX_TIERS
}

/// Whether `backend` names a candidate by its suffix's tag alone (the
/// memory backend's packs, in their tier key's entry), so [`plan`] leaves
/// its key empty. Redis keeps the keys: a pack is in the live key's value
/// or `<live key>{c}` (`wire::pack_key`), and a candidate it cannot pack
/// (or a cluster's) is on `<live key>{c:<quota>}`.
fn by_tag(backend: &crate::backend::Backend) -> bool {
    matches!(backend, crate::backend::Backend::Memory(_))
}

/// The answer of a request with candidates: counts each candidate's
/// decision, and the live quota's once per live check, then cuts the
/// candidates off the verdict and the sent checks (on an error, off the
/// sent checks only: nothing is counted).
pub(crate) fn take(shared: &Shared, meta: &mut Meta, result: &mut Result<Verdict, BackendError>) {
    if !meta.packs.is_empty() {
        if let Ok(v) = result {
            count_units(shared, meta, v);
        }
        meta.packs.clear();
        meta.denials = Denials::default();
        return;
    }
    if meta.live_of.is_empty() {
        return;
    }
    let k = meta.live_of.len();
    let live = meta.sent.len().saturating_sub(k);
    if let Ok(v) = result {
        // One live check's candidates at a time (consecutive, as planned).
        let mut j = 0;
        while j < k {
            let of = meta.live_of[j];
            let end = j + meta.live_of[j..].iter().take_while(|&&l| l == of).count();
            count(shared, meta, v, live, j..end);
            j = end;
        }
        v.decisions.truncate(live);
        v.charges.truncate(live);
    }
    // The candidates' key buffers go back for the next request's.
    for c in meta.sent.drain(live..) {
        super::spare::give_back_key(c.key);
    }
    meta.live_of.clear();
    meta.candidates.clear();
    meta.tags.clear();
}

/// Counts the candidates `group` (indices among the candidate checks,
/// which follow the `live` live checks) of one live check, and that live
/// check's decision: their stats under one lock, their metric, and the
/// fleet-wide counts. Every candidate's key part is its live check's.
fn count(shared: &Shared, meta: &Meta, v: &Verdict, live: usize, group: std::ops::Range<usize>) {
    let (Some(&(tier, _)), Some(&of)) = (
        meta.candidates.get(group.start),
        meta.live_of.get(group.start),
    ) else {
        return;
    };
    let (Some(t), Some(d), Some(check)) = (
        shared.config.tiers.get(usize::from(tier)),
        v.decisions.get(usize::from(of)),
        meta.sent.get(usize::from(of)),
    ) else {
        return;
    };
    let part = check.key.get(t.key_base.len()..).unwrap_or("");
    let now_s = v.now_us / 1_000_000;
    // (0, the live quota's), then (1 + j, candidate j's) for each.
    let mut decisions: smallvec::SmallVec<[(usize, bool); 5]> =
        smallvec::smallvec![(0, !d.allowed)];
    for i in group {
        let (Some(cd), Some(&(_, j))) = (v.decisions.get(live + i), meta.candidates.get(i)) else {
            continue;
        };
        if t.candidates.get(usize::from(j)).is_some() {
            decisions.push((1 + usize::from(j), !cd.allowed));
        }
    }
    t.candidate_stats.record(part, now_s, &decisions);
    if let Some(f) = &shared.telemetry.fleet_candidates {
        // The first candidate, the live quota, then the others.
        for (n, &(i, denied)) in decisions.iter().skip(1).enumerate() {
            if let Some(c) = t.candidates.get(i - 1) {
                f.record(&shared.backend, &t.name, &c.label, part, denied, v.now_us);
            }
            if n == 0 {
                let live = crate::observe::fleet_candidates::live();
                f.record(&shared.backend, &t.name, &live, part, !d.allowed, v.now_us);
            }
        }
    }
}

/// [`count`] for the live checks of [`Meta::packs`], whose candidates (each
/// tier's [`UnitCandidates`], in order) left only their denials, in
/// [`Meta::denials`].
fn count_units(shared: &Shared, meta: &Meta, v: &Verdict) {
    let now_s = v.now_us / 1_000_000;
    let mut at = 0u32;
    for &(live, tier) in &meta.packs {
        let Some(t) = shared.config.tiers.get(usize::from(tier)) else {
            continue;
        };
        let k = u32::try_from(t.candidates.len()).unwrap_or(u32::MAX);
        let denied = meta.denials.bits.checked_shr(at).unwrap_or(0)
            & 1u64.checked_shl(k).map_or(u64::MAX, |b| b - 1);
        at = at.saturating_add(k);
        let (Some(d), Some(check)) = (
            v.decisions.get(usize::from(live)),
            meta.sent.get(usize::from(live)),
        ) else {
            continue;
        };
        let part = check.key.get(t.key_base.len()..).unwrap_or("");
        t.candidate_stats
            .record_all(part, now_s, !d.allowed, denied);
        if let Some(f) = &shared.telemetry.fleet_candidates {
            // The first candidate, the live quota, then the others.
            for (n, c) in t.candidates.iter().enumerate() {
                let denied = denied >> n & 1 == 1;
                f.record(&shared.backend, &t.name, &c.label, part, denied, v.now_us);
                if n == 0 {
                    let live = crate::observe::fleet_candidates::live();
                    f.record(&shared.backend, &t.name, &live, part, !d.allowed, v.now_us);
                }
            }
        }
    }
}
