//! The deny cache step: answer a request from cached denials, join or lead
//! the single flight of a lapsed key, and feed the cache from backend answers.

use super::decide::reject;
use super::decision::Denial;
use super::plan::Meta;
use super::runtime::RefundOn;
use super::state::Shared;
use crate::algorithm::TierDecision;
use crate::backend::{TierCheck, Verdict};
use crate::engine::deny_cache::{
    keeps_room, longest_wait_us, stays_exact, Denied, Lookup, Probe, ProbeGuard, Role,
};
use crate::observe::topn::Kind;
use crate::observe::RequestDecision;
use std::sync::Arc;
use std::time::Duration;

/// What the deny cache says about a request's enforced checks.
pub(crate) enum Cached {
    /// A denial from cached entries.
    Deny(Denial),
    /// Another request is probing one of its lapsed keys: wait for its
    /// answer.
    Wait(Arc<Probe>),
    /// Ask the backend; with a guard when this request probes a lapsed key.
    Check(Option<ProbeGuard>),
}

/// Looks the enforced checks up in the deny cache. It answers 429 only
/// when it knows the whole answer the backend would give (see
/// [`crate::engine::deny_cache`]): the binding tier — the enforced denying tier with
/// the longest wait, the first on a tie, as [`decide`] picks it — must be one
/// with a live entry, which holds when every other enforced check either
/// has a live entry with a shorter wait (or an equal one, after it) or
/// could not, whatever its stored state, deny with a wait that would make
/// it bind instead. Otherwise, for the first lapsed check, the probe to join
/// (`may_wait`: wait for another's; a request that already waited does not
/// wait again). `now`: the clock as the caller just read it (else read
/// here).
pub(crate) fn deny_cached(
    shared: &Shared,
    checks: &[TierCheck],
    meta: &Meta,
    may_wait: bool,
    now: Option<std::time::Instant>,
) -> Cached {
    if !shared.guards.deny_cache.enabled() {
        return Cached::Check(None);
    }
    let now_us = shared
        .local_clock
        .at(now.unwrap_or_else(std::time::Instant::now));
    let mut lapsed = None;
    // The binding cached denial so far: (check, entry, wait).
    let mut binding: Option<(usize, Denied, u64)> = None;
    // The enforced checks without a live entry, and those with one.
    let mut uncached: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
    let mut cached: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
    for (i, c) in checks.iter().enumerate() {
        if meta.shadow.contains(i) {
            continue;
        }
        match shared
            .guards
            .deny_cache
            .lookup(&c.key, c.cost, &c.limit, now_us)
        {
            Lookup::Denied(d) => {
                cached.push(i);
                let wait = d.until_us.saturating_sub(now_us);
                if binding.is_none_or(|(_, _, b)| wait > b) {
                    binding = Some((i, d, wait));
                }
            }
            Lookup::Lapsed => {
                lapsed.get_or_insert(i);
                uncached.push(i);
            }
            // Known to pass: it neither binds nor is violated.
            Lookup::Room => {}
            Lookup::Miss => uncached.push(i),
        }
    }
    if let Some((i, d, wait)) = binding {
        // A check without a live entry binds instead if it may deny with a
        // longer wait (or an equal one, before the cached check). When the
        // 429 lists every violated tier, any check without an entry may be
        // one more of them: only a fully cached request is known.
        let lists = shared.config.lists_violated;
        let known = (!lists || uncached.is_empty())
            && uncached.iter().all(|&j| {
                let c = &checks[j];
                let longest = longest_wait_us(&c.limit, c.cost, now_us);
                if j < i {
                    longest < wait
                } else {
                    longest <= wait
                }
            });
        if known {
            // Every enforced check with a live entry is denied, in tier
            // order; a tier and its penalty box are one policy (as
            // `decide` lists them).
            let violated = cached
                .iter()
                .filter(|&&j| !(checks[j].limit.is_penalty() && j > 0 && cached.contains(&(j - 1))))
                .map(|&j| meta.tier_name(shared, j))
                .collect();
            return Cached::Deny(cache_blocked(shared, checks, meta, i, &d, now_us, violated));
        }
    }
    let Some(i) = lapsed else {
        return Cached::Check(None);
    };
    match shared.guards.deny_cache.join(&checks[i].key) {
        Role::Lead(guard) => Cached::Check(Some(guard)),
        Role::Follow(probe) if may_wait => Cached::Wait(probe),
        Role::Follow(_) => Cached::Check(None),
    }
}

/// The denial by check `i`, cached as denied by `d`.
pub(crate) fn cache_blocked(
    shared: &Shared,
    checks: &[TierCheck],
    meta: &Meta,
    i: usize,
    d: &Denied,
    now_us: u64,
    violated: Vec<Arc<str>>,
) -> Denial {
    // The first 429 of an entry an admission primed is the key's first
    // denial: the backend counted none, so it is `limited` (an operator
    // must see users refused); later ones are `cache_blocked`.
    let first = d.primed
        && shared
            .guards
            .deny_cache
            .first_denial(&checks[i].key, d.until_us);
    shared.count(if first {
        RequestDecision::Limited
    } else {
        RequestDecision::CacheBlocked
    });
    shared.count_fleet_blocked(&checks[i].key, checks[i].cost, now_us);
    // The operator's view counts it like the backend's rejection.
    let now_s = now_us / 1_000_000;
    if let Some(tier) = meta.tiers.get(i).map(|&t| usize::from(t)) {
        if let Some(e) = &meta.endpoint {
            shared
                .telemetry
                .observer
                .record(e, tier, true, false, now_s);
        }
        if let Some(t) = shared.config.tiers.get(tier) {
            let key = &checks[i].key;
            let part = key.get(t.key_base.len()..).unwrap_or(key);
            shared
                .telemetry
                .observer
                .sketch(tier, Kind::Blocked, part, checks[i].cost, now_s);
            if let Some(g) = shared.live.plans.guarded(tier) {
                g.denied(part);
            }
        }
    }
    let wait = d.until_us.saturating_sub(now_us);
    let decision = TierDecision {
        allowed: false,
        // `X-RateLimit-Limit`: what the backend's answer showed (a penalty
        // box's is its tier's).
        limit: d.shown_limit,
        remaining: d.remaining,
        reset_after_us: wait,
        retry_after_us: wait,
        delay_us: 0,
    };
    let boxed = checks[i].limit.is_penalty();
    reject(shared, meta, (i, boxed), &decision, now_us, false, violated)
}

/// Feeds the deny cache from a backend answer, for enforced tiers:
/// * a denial is cached until its retry instant;
/// * a charge that leaves less than another request of the same cost
///   (the backend says when the next one would pass) is cached until then
///   too, so the requests right after an admission that drained the bucket
///   are answered locally (a single Redis reports it for the token bucket,
///   fixed window and leaky bucket);
/// * when the answer cached one of those, the other checks of the request
///   that had room (token bucket, fixed window: [`keeps_room`]) get a room
///   fact for as long: until something charges them, the backend would let
///   them through, so they can bind no cached 429 (without it a tier that
///   could deny with a wait as long as the cached one's, a 1 000/s bucket's
///   1 ms, sends every request of that last stretch to the backend);
/// * any other charge forgets the key's entry: it changed the key's state,
///   so an entry written before (for another cost or limit) may no longer
///   give the backend's answer.
///
/// Only while the cached answer stays exactly the backend's
/// ([`stays_exact`]: its `remaining` cannot change before the retry
/// instant). Both are measured from when the check was sent (on a manual
/// clock, the instant the backend decided at). Tiers that refund by response
/// status are left out: a refund can make room before the cached instant.
/// `answered`: the clock read after the answer came, if the caller read it
/// (else it is read here, when needed).
pub(crate) fn feed_deny_cache(
    shared: &Shared,
    meta: &Meta,
    v: &Verdict,
    answered: Option<std::time::Instant>,
) {
    // Counted as fed before any entry is written or forgotten for it (the
    // room facts of answers fed meanwhile subtract its charges).
    if let Some(f) = &meta.flight {
        f.answered();
    }
    if meta.sent.is_empty() || !shared.guards.deny_cache.enabled() {
        return;
    }
    let mut now_us = answered.map(|t| shared.local_clock.at(t));
    let mut probed_room = false;
    // The longest-lived entry this answer writes: (until, wait).
    let mut written: Option<(u64, u64)> = None;
    // Checks with room, for room facts if an entry is written.
    let mut room: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
    for (
        i,
        (
            d,
            TierCheck {
                key, cost, limit, ..
            },
        ),
    ) in v.decisions.iter().zip(&meta.sent).enumerate()
    {
        let charged = v.charges.get(i).and_then(|c| c.as_ref());
        let overridden = shared.config.key_overrides
            && crate::backend::override_rule::overridden(&meta.sent, &v.decisions, i);
        if meta.shadow.contains(i) || overridden {
            // Its charge (a shadow tier that allows is charged) changed
            // the key's state all the same.
            if charged.is_some() {
                shared.guards.deny_cache.forget(key, || {
                    *now_us.get_or_insert_with(|| shared.local_clock.now_us())
                });
            }
            continue;
        }
        let wait_us = if d.allowed {
            charged.map_or(0, |c| c.next_after_us)
        } else {
            d.retry_after_us
        };
        // An instant already past when the answer arrived (a wait shorter
        // than the round trip) is of no use, and as a lapsed entry it would
        // only make the next requests wait a round trip for nothing.
        let until_us = meta.sent_us.saturating_add(wait_us);
        // A cost above the capacity is never cached: its 429 says it can
        // never pass (decide::never_fits), which a cached entry cannot.
        let exact = wait_us > 0
            && *cost <= limit.capacity()
            && stays_exact(limit, *cost, d.remaining)
            && meta
                .tier(shared, i)
                .is_some_and(|t| t.refund_on == RefundOn::Never && !t.priced);
        // A priced tier's settle can change its room at any time.
        let priced = meta.tier(shared, i).is_some_and(|t| t.priced);
        let cache = exact && until_us > *now_us.get_or_insert_with(|| shared.local_clock.now_us());
        // A probe's answer that writes no entry ends the single flight, but
        // an exact one whose instant passed within its round trip (a denial:
        // the probe reached the backend just before the key's next pass, as
        // the local clock, standing in for the backend's, ends entries
        // early; an admission: the next pass came within the round trip):
        // the key is still at its limit, so the next request probes again
        // while the others wait for it (as before issue 14's exactness rule).
        if !exact && meta.probe.as_ref().is_some_and(|p| p.key() == key) {
            probed_room = true;
        }
        if cache {
            shared.guards.deny_cache.insert(
                key.clone(),
                Denied::new(
                    until_us,
                    *cost,
                    *limit,
                    d.remaining,
                    Duration::from_micros(wait_us),
                )
                .primed(d.allowed)
                .showing_limit(d.limit),
            );
            if written.is_none_or(|(u, _)| until_us > u) {
                written = Some((until_us, wait_us));
            }
        } else if d.allowed
            && !priced
            && d.remaining > 0
            && keeps_room(limit)
            // A tier with per-key overrides: an override set later
            // changes its room.
            && !(i > 0 && meta.sent[i - 1].limit.is_override())
            && meta.flight.is_some()
        {
            room.push(i);
        } else if charged.is_some() {
            shared.guards.deny_cache.forget(key, || {
                *now_us.get_or_insert_with(|| shared.local_clock.now_us())
            });
        }
    }
    match (written, &meta.flight) {
        (Some((until_us, wait_us)), Some(flight)) => {
            for &i in &room {
                let c = &meta.sent[i];
                shared.guards.deny_cache.note_room(
                    &c.key,
                    v.decisions[i].remaining,
                    c.limit,
                    flight,
                    v.charges.get(i).is_some_and(|c| c.is_some()),
                    until_us,
                    Duration::from_micros(wait_us),
                );
            }
        }
        _ => {
            for &i in &room {
                if v.charges.get(i).is_some_and(|c| c.is_some()) {
                    shared.guards.deny_cache.forget(&meta.sent[i].key, || {
                        *now_us.get_or_insert_with(|| shared.local_clock.now_us())
                    });
                }
            }
        }
    }
    // This request probed a lapsed key and the answer wrote no entry for it
    // (room left, or an answer the cache may not answer for): forget the
    // lapsed entry, or every request that overlaps another on this key
    // would wait a round trip for nothing until the entry ages out. (When
    // the key is still at its limit, the entry stays and keeps funnelling
    // requests behind one probe at a time.)
    if let Some(p) = meta.probe.as_ref().filter(|_| probed_room) {
        let now_us = now_us.unwrap_or_else(|| shared.local_clock.now_us());
        shared.guards.deny_cache.remove_lapsed(p.key(), now_us);
    }
}
