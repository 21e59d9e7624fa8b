//! Planning: the gate (global mode, deny- and allowlists), then one check per
//! applicable tier (mode, method, cost, key, plan, limit).

use super::facts::Facts;
pub(crate) use super::meta::{Meta, Observed};
use super::runtime::{BuiltTier, FailurePolicy, ModeOverrides, PlanRuntime, Runtime, TierRuntime};
use super::state::Shared;
use crate::algorithm::Limit;
use crate::backend::TierCheck;
use crate::error::BackendError;
use crate::key::KeyError;
use crate::observe::RequestDecision;
use crate::rollout::{DenyStatus, Mode, Standing};

/// What the service does with a request before any backend call.
// Returned and matched at once: never stored, so never worth a box.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Planned {
    /// No tier applies (or the request is allowlisted): pass, counted as this.
    Pass(RequestDecision),
    /// Denylisted: refuse with this status.
    Refuse(DenyStatus),
    /// Check these (their [`Meta`] is the one `plan` was given).
    Check(Vec<TierCheck>),
    /// An extractor could not run.
    Failed(BackendError),
}

/// The steps before any tier: the denylist, then the global mode (with the
/// control key's override), then the allowlist.
pub(crate) enum Gate {
    /// The global mode is off.
    Off,
    Denylisted(DenyStatus),
    Allowlisted,
    /// Plan the tiers under this global mode.
    Tiers(Mode),
}

///
/// The global `off` (the kill switch) stops the limiter, not the denylist:
/// a denylisted client is still refused (a kill switch is for a limiter
/// that misbehaves; a denylist is an operator's explicit abuse control, and
/// a wrong entry is removed on its own, fleet-wide with a control key).
pub(crate) fn gate(rt: &Runtime, ov: &ModeOverrides, facts: &impl Facts) -> Gate {
    let global = ov.mode.unwrap_or(rt.mode);
    match facts.standing() {
        Standing::Denied(status) => Gate::Denylisted(status),
        _ if global == Mode::Off => Gate::Off,
        Standing::Allowed => Gate::Allowlisted,
        Standing::Unlisted => Gate::Tiers(global),
    }
}

/// One tier's check of a request, as planned.
pub(crate) struct TierPlan<'r> {
    pub(crate) limit: Limit,
    /// The configured limit when `limit` is another (`TierCheck::home`).
    pub(crate) home: Option<Limit>,
    /// Clamped to the capacity + 1: a cost above the capacity is denied
    /// anyway, and clamping keeps every algorithm's integer arithmetic far
    /// from overflow whatever a cost function returns (a client-declared
    /// batch size, say).
    pub(crate) cost: u64,
    /// False in shadow mode, or for a canary's keys outside its share.
    pub(crate) enforced: bool,
    /// The request's plan on this tier, when the tier has plans and the
    /// request names one of them.
    pub(crate) plan: Option<&'r PlanRuntime>,
    /// The cost before clamping (a candidate quota clamps it to its own
    /// capacity).
    pub(crate) raw_cost: u64,
}

/// What [`plan_tier`] found for one tier.
pub(crate) enum TierStep<'r> {
    /// Check it so.
    Check(TierPlan<'r>),
    /// It does not apply to this request (mode, method, cost).
    Skip,
    /// It would, but its extractor found no key.
    NoKey,
}

/// Whether tier `i` (`t`, `r`) checks the request of `facts`, and how. `key` is set to the
/// storage key (`<prefix>:<tier>:<part>`). [`TierStep::Skip`]: the tier does
/// not apply (its mode is off, it does not count the method, the cost is
/// 0); [`TierStep::NoKey`]: the extractor found no key. `fallback`: the
/// local fallback's limits.
///
/// # Errors
/// The extractor could not run.
#[inline]
pub(crate) fn plan_tier<'r>(
    (i, t, r): (usize, &BuiltTier, &'r TierRuntime),
    n: usize,
    ov: &ModeOverrides,
    global: Mode,
    facts: &impl Facts,
    fallback: bool,
    key: &mut String,
) -> Result<TierStep<'r>, KeyError> {
    let tier_mode = ov.tiers.get(i).copied().flatten().unwrap_or(r.mode);
    let mode = tier_mode.under(global);
    if mode == Mode::Off {
        return Ok(TierStep::Skip);
    }
    let cost = match facts.cost_at(i, n) {
        None | Some(0) => return Ok(TierStep::Skip),
        Some(cost) => cost,
    };
    key.clear();
    // Room for the prefix and a typical key part (an IPv4 address, a user
    // id, a 32-digit API key hash) without growing.
    key.reserve(t.key_base.len() + 40);
    key.push_str(&t.key_base);
    if !facts.key_at(i, n, &mut crate::key::KeyWriter::new(key))? {
        return Ok(TierStep::NoKey);
    }
    let plan = if r.plans.is_empty() {
        None
    } else {
        // The plan's name is read once per tier.
        let name = facts.plan(i);
        name.and_then(|p| r.plans.iter().find(|pr| *pr.name == *p))
    };
    let (limit, home) = match (plan, fallback) {
        (Some(p), false) => (p.limit, p.home),
        (Some(p), true) => (p.fallback, None),
        (None, false) => (r.limit, r.home),
        (None, true) => (r.fallback, None),
    };
    Ok(TierStep::Check(TierPlan {
        limit,
        home,
        cost: cost.min(limit.capacity().saturating_add(1)),
        enforced: mode.enforces(&t.name, &key[t.key_base.len()..]),
        plan,
        raw_cost: cost,
    }))
}

/// The penalty box of the check just planned, as a check of its own right
/// after it: the key `<key>{pb}` (the same hash slot on a cluster), the
/// tier's mode, plan slot and quota.
#[cold]
fn penalty_check(
    checks: &mut Vec<TierCheck>,
    meta: &mut Meta,
    p: crate::algorithm::PenaltyBox,
    plans: bool,
) {
    let Some(tier) = checks.last() else {
        return;
    };
    let n = checks.len();
    let key = format!("{}{}", tier.key, crate::algorithm::PENALTY_KEY_SUFFIX);
    duplicate_meta(n, meta, plans);
    checks.push(TierCheck {
        key,
        limit: Limit::Penalty(p),
        cost: 1,
        home: None,
    });
}

/// The override read of the check just planned, as a check of its own
/// right BEFORE it (the script applies what it reads to the check after
/// it): the key `<key>{ov}` (the same hash slot on a cluster), the tier's
/// meta.
#[cold]
fn override_check(checks: &mut Vec<TierCheck>, meta: &mut Meta, plans: bool) {
    let Some(tier) = checks.last() else {
        return;
    };
    let key = format!("{}{}", tier.key, crate::backend::override_rule::KEY_SUFFIX);
    // Same meta as its tier: pushed after it, then the two checks swapped.
    duplicate_meta(checks.len(), meta, plans);
    checks.push(TierCheck {
        key,
        limit: Limit::Override,
        cost: 1,
        home: None,
    });
    let n = checks.len();
    checks.swap(n - 2, n - 1);
}

/// Meta for check `n` (about to be pushed), copied from check `n - 1`'s.
fn duplicate_meta(n: usize, meta: &mut Meta, plans: bool) {
    if meta.shadow.contains(n - 1) {
        meta.shadow.0 |= 1 << n;
        if let Some(o) = &mut meta.observed {
            let h = o.key_hashes.get(n - 1).copied().unwrap_or(0);
            o.key_hashes.push(h);
        }
    }
    if plans {
        let last = meta.plans.last().cloned().flatten();
        meta.plans.push(last);
    }
    if let Some(&q) = meta.quotas.last() {
        meta.quotas.push(q);
    }
    let t = meta.tiers.last().copied().unwrap_or(u8::MAX);
    meta.tiers.push(t);
}

/// Why a request is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// To be checked: counted, extractor failures logged.
    Check,
    /// Again, for the local fallback: its limits; nothing counted twice.
    Fallback,
    /// Only to see which tiers apply under which keys (replay's report next
    /// to a real router): nothing counted, logged or registered.
    Inspect,
}

/// The checks for a request, after the global mode and the lists: one per
/// tier whose mode is not off, whose methods include the request's, whose
/// cost is not 0 and whose extractor returns a key. `meta` (a fresh
/// `Meta::default()`) is filled in for them: the caller owns it, so the
/// request's `Meta` is written in place, never moved out of a return value.
pub(crate) fn plan<F: Facts>(
    shared: &Shared,
    facts: &F,
    purpose: Purpose,
    meta: &mut Meta,
) -> Planned {
    let rt = shared.live.runtime.load();
    let ov = shared.live.mode_overrides.load();
    let fallback = purpose == Purpose::Fallback;
    let global = match gate(&rt, &ov, facts) {
        Gate::Off => return Planned::Pass(RequestDecision::Skipped),
        Gate::Denylisted(status) => {
            if purpose == Purpose::Check {
                shared.count(RequestDecision::Denylisted);
            }
            return Planned::Refuse(status);
        }
        Gate::Allowlisted => return Planned::Pass(RequestDecision::Allowlisted),
        Gate::Tiers(global) => global,
    };
    let mut checks = super::spare::checks(shared.config.tiers.len());
    // A tier that does not apply leaves the buffer to the next.
    let mut key = super::spare::key();
    let tiers = shared.config.tiers.iter().zip(rt.tiers.iter()).enumerate();
    // One check per tier (the HTTP layer), or per occurrence (a front door
    // whose request names a tier more than once); never more than MAX_TIERS
    // checks (the shadow bitmask's width).
    let planned = tiers.flat_map(|(i, tr)| (0..facts.occurrences(i)).map(move |n| (i, tr, n)));
    // The live checks with candidates: (check index, tier, cost).
    let mut pending: smallvec::SmallVec<[(u8, u8, u64); 2]> = smallvec::SmallVec::new();
    // The clock for per-key demand, read once a request.
    let mut demand_now = None;
    for (i, (t, r), n) in planned {
        if checks.len() == crate::engine::MAX_TIERS {
            break;
        }
        let tp = match plan_tier((i, t, r), n, &ov, global, facts, fallback, &mut key) {
            Ok(TierStep::Check(tp)) => {
                if purpose == Purpose::Check {
                    t.no_key.keyed();
                    // A rollout plan's gates (engine/rollout/gates.rs).
                    if let Some(stats) = shared.live.plans.counting(i) {
                        stats.record(&key[t.key_base.len()..], tp.enforced);
                    }
                    // Per-key demand, denied attempts included (observe/demand/).
                    crate::observe::demand::record(
                        &shared.telemetry.demand,
                        i,
                        &r.plans,
                        tp.plan,
                        r.quota,
                        tp.plan.map(|p| p.quota),
                        &key[t.key_base.len()..],
                        tp.cost,
                        || *demand_now.get_or_insert_with(|| shared.local_clock.now_us()),
                    );
                }
                tp
            }
            Ok(TierStep::Skip) => continue,
            Ok(TierStep::NoKey) => {
                if purpose == Purpose::Check {
                    t.no_key
                        .record(&shared.telemetry.metrics, i, &t.name, t.key_type);
                }
                continue;
            }
            Err(e) => {
                // The tier cannot be computed for this request: the failure
                // policy decides it alone (see `KeyError`). The fallback's
                // second plan of the same request is not counted again.
                if purpose == Purpose::Check {
                    key_failed(shared, t, &e);
                }
                if shared.config.failure_policy == FailurePolicy::Closed {
                    // As if nothing was planned (the tiers before it).
                    *meta = Meta::default();
                    return Planned::Failed(e.into());
                }
                continue;
            }
        };
        if !r.plans.is_empty() {
            // The plan label of this check's metrics (configured names only).
            meta.plans.resize(checks.len(), None);
            meta.plans.push(tp.plan.map(|p| {
                let pos = r.plans.iter().position(|x| std::ptr::eq(x, p));
                (pos.unwrap_or(usize::MAX - 1), p.name.clone())
            }));
        }
        if !tp.enforced {
            let n = checks.len();
            meta.shadow.0 |= 1 << n;
            let observed = meta.observed.get_or_insert_with(|| Observed {
                endpoint: {
                    let (m, r) = facts.endpoint();
                    format!("{m} {r}")
                },
                key_hashes: Vec::new(),
            });
            observed.key_hashes.resize(n, 0);
            observed
                .key_hashes
                .push(xxhash_rust::xxh3::xxh3_64(key.as_bytes()));
        }
        let (mut limit, home) = match &t.calendar {
            Some(c) => {
                let now = shared.local_clock.now_us();
                (c.limit(tp.limit, now), tp.home.map(|h| c.limit(h, now)))
            }
            None => (tp.limit, tp.home),
        };
        if shared.config.header_style.needs_quotas() {
            let q = tp.plan.map_or(r.quota, |p| p.quota);
            let refills = matches!(
                t.algorithm,
                crate::algorithm::kind::Algorithm::TokenBucket
                    | crate::algorithm::kind::Algorithm::LeakyBucket(_)
            );
            // 0 for a concurrency tier: no window, requests in flight.
            let period_us = match (t.algorithm, limit) {
                (crate::algorithm::kind::Algorithm::Concurrency { .. }, _) => 0,
                // The current calendar window's length (by this clock).
                (_, Limit::Calendar(c)) => {
                    let (start, end) = c.window(shared.local_clock.now_us());
                    end - start
                }
                _ => u64::try_from(q.period().as_micros()).unwrap_or(u64::MAX),
            };
            meta.quotas.push((q.limit(), period_us, refills));
        }
        if let Limit::Concurrency(c) = &mut limit {
            c.slot = next_slot_id();
        }
        // Candidates: the requests under the tier's own quota, when
        // checked (not for the fallback, nor to inspect).
        if !t.candidates.is_empty() && tp.plan.is_none() && purpose == Purpose::Check {
            let at = checks.len() + usize::from(t.overrides);
            if let (Ok(at), Ok(tier)) = (u8::try_from(at), u8::try_from(i)) {
                pending.push((at, tier, tp.raw_cost));
            }
        }
        checks.push(TierCheck {
            key: std::mem::replace(&mut key, super::spare::key()),
            limit,
            cost: tp.cost,
            home,
        });
        // MAX_TIERS is 64, so the index fits.
        meta.tiers.push(u8::try_from(i).unwrap_or(u8::MAX));
        if t.overrides {
            override_check(&mut checks, meta, !r.plans.is_empty());
        }
        if let Some(p) = t.penalty {
            penalty_check(&mut checks, meta, p, !r.plans.is_empty());
        }
    }
    super::spare::give_back_key(key);
    if !pending.is_empty() {
        super::candidates::plan(shared, &mut checks, meta, &pending);
    }
    if checks.is_empty() {
        super::spare::give_back(&mut checks);
        Planned::Pass(RequestDecision::Skipped)
    } else {
        if purpose != Purpose::Inspect && F::OBSERVED {
            let (method, route) = facts.endpoint();
            meta.endpoint = Some(shared.telemetry.observer.endpoint(method, route));
        }
        meta.quiet = !F::OBSERVED;
        meta.headless = !F::HEADERS;
        meta.details = F::DETAILS;
        Planned::Check(checks)
    }
}

/// The counter of failed key extractions.
pub(crate) const KEY_ERRORS: &str = "tiered_ratelimit_key_errors_total";

/// Counts a failed extraction on tier `t` and logs it (once a minute per
/// tier, with the number of lines suppressed since the last): at ERROR with
/// the fix for a configuration error, at WARN otherwise.
#[cold]
#[inline(never)]
pub(crate) fn key_failed(shared: &Shared, t: &BuiltTier, e: &KeyError) {
    metrics::counter!(
        KEY_ERRORS,
        "tier" => t.name.to_string(),
        "reason" => e.reason()
    )
    .increment(1);
    let Some(suppressed) = t.key_error_log.permit() else {
        return;
    };
    let policy = shared.config.failure_policy;
    let consequence = if policy == FailurePolicy::Closed {
        "answering 503 (failure policy Closed)"
    } else {
        "skipping this tier; the other tiers still apply"
    };
    if e.is_configuration() {
        tracing::error!(target: super::LOG_TARGET,
            tier = %t.name,
            extractor = t.key_type,
            reason = e.reason(),
            suppressed,
            "rate limiter misconfigured: tier \"{}\" cannot compute its key, {consequence}: {e}",
            t.name,
        );
    } else {
        tracing::warn!(target: super::LOG_TARGET,
            tier = %t.name,
            extractor = t.key_type,
            reason = e.reason(),
            suppressed,
            "rate limiter: tier \"{}\" could not compute this request's key, {consequence}: {e}",
            t.name,
        );
    }
}

/// Concurrency slot ids stay below 2^53 (the scripts' numbers are doubles).
const ID_MASK: u64 = (1 << 53) - 1;

/// A slot id no other request of this process holds, and (from a random
/// start per process) almost surely none of another instance: ids are
/// consecutive from a random 53-bit origin.
fn next_slot_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static ORIGIN: OnceLock<u64> = OnceLock::new();
    static N: AtomicU64 = AtomicU64::new(0);
    let origin = *ORIGIN.get_or_init(|| {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(std::process::id())
    });
    let id = origin.wrapping_add(N.fetch_add(1, Ordering::Relaxed)) & ID_MASK;
    id.max(1)
}
