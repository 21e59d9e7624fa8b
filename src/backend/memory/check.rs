//! A request's check: its tiers' shards locked together, every tier charged
//! or none; and the refund of a charge.

use super::shard::{shard_of, Held, Lookup, Writer};
use super::MemoryBackend;
use crate::algorithm::{State, TierDecision};
use crate::backend::{Charge, Shadow, TierCheck, TierRefund, Verdict};
use smallvec::SmallVec;

impl MemoryBackend {
    /// Checks, and charges when every enforced tier allows. `with_charges`:
    /// fill [`Verdict::charges`] (what refunds need; skipped, with its
    /// allocation, when no tier refunds).
    pub(crate) fn check(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
    ) -> Verdict {
        let mut verdict = Verdict {
            now_us: 0,
            decisions: Vec::with_capacity(checks.len()),
            charges: Vec::new(),
        };
        self.check_reusing(checks, shadow, with_charges, &mut verdict);
        verdict
    }

    /// What [`Backend::check`](crate::backend::Backend::check) does on this
    /// store (every tier charged or none; each charge listed in
    /// [`Verdict::charges`]), for a caller that checks in a loop: the checks
    /// are borrowed and the answer is written into `verdict`, whose vectors
    /// are cleared and reused. Once they have room for the checks, a check
    /// of keys the store holds allocates nothing; a new key may grow its
    /// shard's table (and stores a key longer than 24 bytes on the heap).
    ///
    /// A cost above a tier's capacity is clamped to the capacity + 1, as
    /// `Backend::check` does (on a copy of the checks).
    ///
    /// ```
    /// use tiered_ratelimit::algorithm::{Limit, TokenBucket};
    /// use tiered_ratelimit::backend::{MemoryBackend, TierCheck, Verdict};
    /// let store = MemoryBackend::new();
    /// let checks = [TierCheck {
    ///     key: "rl:ip:198.51.100.7".to_owned(),
    ///     limit: Limit::TokenBucket(TokenBucket::new(10, 1_000_000, 10).unwrap()),
    ///     cost: 1,
    ///     home: None,
    /// }];
    /// let mut verdict = Verdict::default();
    /// for remaining in (7..10).rev() {
    ///     store.check_into(&checks, &mut verdict);
    ///     assert!(verdict.allowed());
    ///     assert_eq!(verdict.decisions[0].remaining, remaining);
    /// }
    /// ```
    pub fn check_into(&self, checks: &[TierCheck], verdict: &mut Verdict) {
        // A cost of 1 never exceeds a capacity + 1: no division for the
        // token bucket's burst on the common check.
        let over = |c: &TierCheck| c.cost > 1 && c.cost > c.limit.capacity().saturating_add(1);
        if checks.iter().any(over) {
            let clamped: Vec<TierCheck> = checks
                .iter()
                .map(|c| TierCheck {
                    cost: c.cost.min(c.limit.capacity().saturating_add(1)),
                    ..c.clone()
                })
                .collect();
            self.check_reusing(&clamped, Shadow::NONE, true, verdict);
        } else {
            self.check_reusing(checks, Shadow::NONE, true, verdict);
        }
    }

    /// [`MemoryBackend::check`] into `out`, whose vectors are cleared and
    /// refilled: a caller that hands back the previous verdict allocates
    /// nothing once they have grown to its number of checks.
    #[inline]
    pub(crate) fn check_reusing(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
        out: &mut Verdict,
    ) {
        self.check_deciding(checks, shadow, with_charges, out, None);
    }

    /// [`MemoryBackend::check_reusing`], and on its locked path the
    /// candidates `inline` names, decided on the pack of their live key's
    /// entry as found by the live check (no second lookup): their
    /// decisions pushed after the live ones, and `inline.done` set. Not
    /// there (a lock-free answer, a key without a pack yet, a key listed
    /// twice), nothing of them is done.
    fn check_deciding(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        with_charges: bool,
        out: &mut Verdict,
        inline: Option<&mut super::pack::Inline<'_>>,
    ) {
        let now_us = self.inner.clock.now_us();
        let n = checks.len();
        if let [c] = checks {
            // One tier (the layer's default): one hash, and none of the
            // several tiers' scratch space, before the fast path.
            out.now_us = now_us;
            out.charges.clear();
            let hash = self.hash(&c.key);
            let out_pair = (&mut out.decisions, &mut out.charges);
            if self.check_one_fast(c, shadow, with_charges, out_pair, now_us, hash) {
                return;
            }
        }
        // Scratch space per check: on the stack for up to 8 tiers (indexing a
        // SmallVec checks where its data lives on every access).
        let (mut hashes_a, mut hashes_v) = ([0u64; 8], Vec::new());
        let hashes = scratch(&mut hashes_a, &mut hashes_v, n);
        let mut shards = 0u64;
        for (h, c) in hashes.iter_mut().zip(checks) {
            *h = self.hash(&c.key);
            shards |= 1 << shard_of(*h);
        }
        out.now_us = now_us;
        let Verdict {
            decisions, charges, ..
        } = out;
        charges.clear();
        if n > 1
            && self.check_fast(
                checks,
                shadow,
                with_charges,
                decisions,
                charges,
                now_us,
                hashes,
            )
        {
            return;
        }
        // Entries read from the tables stay valid while `guard` lives.
        let guard = self.inner.collector.enter();
        // Lock in ascending shard order (the set bits, low to high): no two
        // requests can wait on each other.
        let mut locked: SmallVec<[Writer<'_>; 8]> = SmallVec::new();
        let mut rest = shards;
        while rest != 0 {
            locked.push(Writer::lock(
                &self.inner.shards[rest.trailing_zeros() as usize],
            ));
            rest &= rest - 1;
        }
        let guards = locked.as_mut_slice();
        // The cells this check decides on, frozen until it is done (dropped
        // before the shards' mutexes: declared after them).
        let mut held = Held::new(&guard);
        // A shard's guard: the number of locked shards below it.
        let guard_of = |h: u64| (shards & ((1u64 << shard_of(h)) - 1)).count_ones() as usize;
        // Every check's entry first, then the decisions: the lookups are
        // loads only, so their cache misses overlap (a decision freezes its
        // cell with an atomic swap, which a later lookup would wait behind).
        let (mut entries_a, mut entries_v) = ([None; 8], Vec::new());
        let entries = scratch(&mut entries_a, &mut entries_v, n);
        for (e, (c, &h)) in entries.iter_mut().zip(checks.iter().zip(hashes.iter())) {
            let key = Lookup {
                hash: h,
                text: &c.key,
            };
            *e = guards[guard_of(h)].find(key, &held);
        }

        decisions.clear();
        decisions.reserve(n);
        // Per check, what the commit needs: the key's entry (so it is not
        // looked up again), and the token bucket's charged state,
        // which its check computes anyway. `None` for a new key, and for a
        // key listed earlier in the same check (a caller of Backend::check
        // may pass one; the layer's tiers never share a key): its second
        // charge must see the first, so it is computed at commit.
        let (mut found_a, mut found_v) = ([None; 8], Vec::new());
        let found = scratch(&mut found_a, &mut found_v, n);
        let (mut prepared_a, mut prepared_v) = ([const { None }; 8], Vec::new());
        let prepared: &mut [Option<(State, u64)>] = scratch(&mut prepared_a, &mut prepared_v, n);
        let mut strikes: SmallVec<[(usize, (State, u64)); 1]> = SmallVec::new();
        // The states carried over a quota change (`Limit::carry`): stored
        // whatever the commit, unless the tier's charge stores its own.
        let mut carried: SmallVec<[(usize, (State, u64)); 1]> = SmallVec::new();
        // The checks under an override of another quota, and that quota:
        // their charge's undo value is in its units.
        let mut under: SmallVec<[(usize, crate::algorithm::Limit); 1]> = SmallVec::new();
        // The override the check just before found (it precedes its
        // tier's), and the checks an override leaves uncharged.
        let mut overridden: Option<crate::backend::override_rule::Active> = None;
        let mut uncharged = 0u64;
        for (i, (c, &h)) in checks.iter().zip(hashes.iter()).enumerate() {
            let entry = entries[i];
            let repeated = hashes[..i]
                .iter()
                .zip(checks)
                .any(|(&other, o)| other == h && o.key == c.key);
            // A penalty box right after its tier: its strike is written
            // below, whatever the commit.
            let tier_allowed = decisions.last().is_none_or(|d: &TierDecision| d.allowed);
            let (d, charged) = held.with_live(entry, now_us, |state| {
                if c.limit.is_penalty() {
                    match c.limit.penalty_check(state, now_us, tier_allowed) {
                        Some((d, Some(w))) => {
                            strikes.push((i, w));
                            (d, None)
                        }
                        Some((d, None)) => (d, None),
                        None => c.limit.check_prepared(state, now_us, c.cost),
                    }
                } else if c.limit.is_override() {
                    overridden = self.override_of(&c.key, now_us);
                    uncharged |= 1 << i;
                    (
                        crate::backend::override_rule::Active::code_decision(overridden.as_ref()),
                        None,
                    )
                } else if let Some(a) = overridden.take() {
                    if let crate::backend::override_rule::Effect::Limit(_) = a.effect {
                        let limit = a.limit_of(c.limit);
                        if !repeated {
                            if let Some(w) = limit.carry(state, now_us) {
                                carried.push((i, w));
                            }
                        }
                        under.push((i, limit));
                    }
                    let (d, charged) = a.check(c, state, now_us);
                    if charged.is_none() {
                        uncharged |= 1 << i;
                    }
                    (d, charged)
                } else {
                    if !repeated {
                        if let Some(w) = c.limit.carry(state, now_us) {
                            carried.push((i, w));
                        }
                    }
                    c.limit.check_prepared(state, now_us, c.cost)
                }
            });
            decisions.push(d);
            if !repeated {
                found[i] = entry;
                prepared[i] = charged;
            }
        }
        let commits = shadow.commits(decisions);
        if let Some(inline) = inline {
            // Decided before the live commit, on states of their own: the
            // commit that follows may move the pack, never change it.
            if let Some(Some(super::shard::Entry::Packed(p))) = found.get(inline.live) {
                let others = decisions
                    .iter()
                    .enumerate()
                    .all(|(i, d)| d.allowed || shadow.contains(i) || i == inline.live);
                let mut pack = super::shard::locked(&p.pack);
                match inline.denials.as_deref_mut() {
                    Some(denials) => {
                        pack.decide(inline.group, inline.tags, others, now_us, denials);
                    }
                    None => pack.decide(inline.group, inline.tags, others, now_us, decisions),
                }
                inline.done = true;
            }
        }
        if commits {
            if with_charges {
                if charges.capacity() < n {
                    *charges = Vec::with_capacity(n);
                }
                charges.resize(n, None);
            }
            let mut charge = |i: usize, undo: u64| {
                if with_charges {
                    charges[i] = Some(Charge {
                        at_us: now_us,
                        undo,
                        next_after_us: 0,
                    });
                }
            };
            // A shadow tier that would deny charges nothing. The keys found
            // first: a new key may sweep its table (which leaves the cells
            // this check holds).
            for (i, c) in checks.iter().enumerate() {
                let charged = decisions[i].allowed && uncharged & (1 << i) == 0;
                let Some(e) = found[i].filter(|_| charged) else {
                    continue;
                };
                let h = hashes[i];
                let w = &mut guards[guard_of(h)];
                let under_limit = under.iter().find(|(j, _)| *j == i).map(|(_, l)| *l);
                let undo = match under_limit {
                    None => w.commit(e, &mut held, h, c, prepared[i].take(), now_us),
                    Some(limit) => {
                        let c = TierCheck { limit, ..c.clone() };
                        w.commit(e, &mut held, h, &c, prepared[i].take(), now_us)
                    }
                };
                charge(i, undo);
            }
            // Then, in order, the new keys and the keys listed twice.
            for (i, c) in checks.iter().enumerate() {
                if found[i].is_some()
                    || !decisions[i].allowed
                    || c.limit.is_penalty()
                    || uncharged & (1 << i) != 0
                {
                    continue;
                }
                let h = hashes[i];
                let key = Lookup {
                    hash: h,
                    text: &c.key,
                };
                let w = &mut guards[guard_of(h)];
                let limit = under
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map_or(c.limit, |(_, l)| *l);
                if let Some(e) = w.find(key, &held) {
                    let undo = if limit == c.limit {
                        w.commit(e, &mut held, h, c, prepared[i].take(), now_us)
                    } else {
                        let c = TierCheck { limit, ..c.clone() };
                        w.commit(e, &mut held, h, &c, prepared[i].take(), now_us)
                    };
                    charge(i, undo);
                    continue;
                }
                let (state, ttl_us) = prepared[i]
                    .take()
                    .unwrap_or_else(|| limit.charge(None, now_us, c.cost));
                charge(i, limit.undo_of(&state, now_us));
                let expires_us = now_us.saturating_add(ttl_us);
                w.store(None, &mut held, key, state, expires_us, now_us);
            }
        }
        for (i, (state, ttl_us)) in carried {
            if commits && decisions[i].allowed && uncharged & (1 << i) == 0 {
                continue;
            }
            let key = Lookup {
                hash: hashes[i],
                text: &checks[i].key,
            };
            let w = &mut guards[guard_of(key.hash)];
            let e = w.find(key, &held);
            let expires_us = now_us.saturating_add(ttl_us);
            w.store(e, &mut held, key, state, expires_us, now_us);
        }
        for (i, (state, ttl_us)) in strikes {
            let key = Lookup {
                hash: hashes[i],
                text: &checks[i].key,
            };
            let w = &mut guards[guard_of(key.hash)];
            let e = w.find(key, &held);
            let expires_us = now_us.saturating_add(ttl_us);
            w.store(e, &mut held, key, state, expires_us, now_us);
        }
        // The cells released before the mutexes.
        drop(held);
    }

    /// [`MemoryBackend::check_reusing`] of the live checks, then the last
    /// `live_of.len()` checks as candidate quotas (`docs/rollout.md`,
    /// "Candidate quotas"), each of the live check at its index in
    /// `live_of`: decided on its own state, and charged when it allows and
    /// every enforced live check but its own allows, whatever the live
    /// commit. Their decisions follow the live ones in `out`; they are
    /// never listed in its charges (never refunded).
    ///
    /// The candidates of one live check (consecutive in `live_of`, as the
    /// engine plans them) whose keys are its key then a suffix share the
    /// live key's entry (`pack.rs`): one write for all of them, on the
    /// entry the live check found when it ran locked and they are its
    /// only candidates, else after one more lookup. Another candidate is
    /// checked on its own key.
    /// Either way a candidate's state is its own, so deciding it after the
    /// live decisions (before or after their commit, under their locks or
    /// not) changes nothing of either: its rule reads only the live
    /// decisions.
    ///
    /// `tags`: empty, or each candidate's [`candidate_tag`](super::candidate_tag)
    /// (of its suffix past its live key, `{c:80/1m}`) when the caller left
    /// the candidates' keys empty (the engine does: no key string built or
    /// hashed per candidate); each is then packed under its live key, as
    /// it would be with its whole key.
    pub(crate) fn check_with_candidates(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        live_of: &[u8],
        tags: &[u64],
        with_charges: bool,
        out: &mut Verdict,
    ) {
        let n = checks.len().saturating_sub(live_of.len());
        let named = tags.len() == live_of.len();
        // One live check's candidates, named by their tags (as the engine
        // plans them) or packable: decided on the pack its check finds.
        let of_keys: SmallVec<[u64; 4]>;
        let group = &checks[n..];
        let single = |live: u8| usize::from(live) < n && live_of.iter().all(|&l| l == live);
        let mut inline = match live_of.first() {
            Some(&live) if single(live) => {
                let of = &checks[usize::from(live)].key;
                let tags = if named {
                    Some(tags)
                } else if super::pack::packable(of, group) {
                    of_keys = group
                        .iter()
                        .map(|c| super::candidate_tag(c.key.get(of.len()..).unwrap_or("")))
                        .collect();
                    Some(&of_keys[..])
                } else {
                    None
                };
                tags.map(|tags| super::pack::Inline {
                    live: usize::from(live),
                    group,
                    tags,
                    denials: None,
                    done: false,
                })
            }
            _ => None,
        };
        self.check_deciding(&checks[..n], shadow, with_charges, out, inline.as_mut());
        if live_of.is_empty() {
            return;
        }
        let charged = out.charges.len() == n && n > 0;
        if inline.is_some_and(|i| i.done) {
            if charged {
                out.charges.resize(out.decisions.len(), None);
            }
            return;
        }
        let now_us = out.now_us;
        let mut j = 0;
        while j < live_of.len() {
            let live = live_of[j];
            let end = j + live_of[j..].iter().take_while(|&&l| l == live).count();
            let group = &checks[n + j..n + end];
            let names = if named { tags.get(j..end) } else { None };
            j = end;
            let others = out.decisions[..n]
                .iter()
                .enumerate()
                .all(|(i, d)| d.allowed || shadow.contains(i) || i == usize::from(live));
            match (checks[..n].get(usize::from(live)), names) {
                (Some(of), Some(names)) => {
                    self.check_pack(
                        &of.key,
                        group,
                        Some(names),
                        others,
                        now_us,
                        &mut out.decisions,
                    );
                }
                (Some(of), None) if super::pack::packable(&of.key, group) => {
                    self.check_pack(&of.key, group, None, others, now_us, &mut out.decisions);
                }
                // Named by their tags without a live check (never planned
                // so): under an empty tier key.
                (None, Some(names)) => {
                    self.check_pack("", group, Some(names), others, now_us, &mut out.decisions);
                }
                _ => {
                    for c in group {
                        if let Some(d) = self.check_alone(c, others) {
                            out.decisions.push(d);
                        }
                    }
                }
            }
        }
        if charged {
            out.charges.resize(out.decisions.len(), None);
        }
    }

    /// [`check_with_candidates`](Self::check_with_candidates) of candidates
    /// named by their tags, as the engine plans them on this store, given
    /// apart from the live `checks`: each of `groups` is one live check's
    /// (its index, its candidates, their tags), and each candidate is
    /// decided, charged and stored exactly as there. Their decisions are
    /// not kept: `denials` gets whether each denied, in order over the
    /// groups (the engine counts nothing else of them, and the candidates'
    /// checks can then be built once per tier rather than per request).
    pub(crate) fn check_with_packs(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        groups: &[PackGroup<'_>],
        with_charges: bool,
        out: &mut Verdict,
        denials: &mut super::pack::Denials,
    ) {
        let n = checks.len();
        let mut inline = match groups {
            [g] if g.live < n => Some(super::pack::Inline {
                live: g.live,
                group: g.checks,
                tags: g.tags,
                denials: Some(&mut *denials),
                done: false,
            }),
            _ => None,
        };
        self.check_deciding(checks, shadow, with_charges, out, inline.as_mut());
        if inline.is_some_and(|i| i.done) {
            return;
        }
        let now_us = out.now_us;
        for g in groups {
            let others = out
                .decisions
                .iter()
                .take(n)
                .enumerate()
                .all(|(i, d)| d.allowed || shadow.contains(i) || i == g.live);
            let of = checks.get(g.live).map_or("", |c| c.key.as_str());
            self.check_pack(of, g.checks, Some(g.tags), others, now_us, denials);
        }
    }

    /// A candidate on a key of its own: alone and enforced when `charge`
    /// (charged iff it allows), else peeked.
    fn check_alone(&self, c: &TierCheck, charge: bool) -> Option<TierDecision> {
        if !charge {
            return self.peek(c).decisions.first().copied();
        }
        let mut one = Verdict::default();
        self.check_reusing(std::slice::from_ref(c), Shadow::NONE, false, &mut one);
        one.decisions.first().copied()
    }

    /// Gives back charges (see [`Limit::refund`](crate::algorithm::Limit::refund)),
    /// one key at a time, each under its shard's lock only while it is
    /// rewritten.
    pub(crate) fn refund(&self, refunds: &[TierRefund]) {
        let now_us = self.inner.clock.now_us();
        // An override's read just before a refund (a priced request's
        // settle): the refund runs under the key's override, as its check
        // did (lua/cluster.lua's refund mode does the same).
        let mut overridden: Option<crate::backend::override_rule::Active> = None;
        for r in refunds {
            if r.check.limit.is_override() {
                overridden = self.override_of(&r.check.key, now_us);
                continue;
            }
            let limit = overridden
                .take()
                .map_or(r.check.limit, |a| a.limit_of(r.check.limit));
            let h = self.hash(&r.check.key);
            let guard = self.inner.collector.enter();
            let mut w = Writer::lock(&self.inner.shards[shard_of(h)]);
            let mut held = Held::new(&guard);
            w.refund(&mut held, h, limit, r, now_us);
        }
    }
}

/// One live check's candidates for
/// [`MemoryBackend::check_with_packs`]: each named by its tag (its key is
/// not read), packed under the live check's key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackGroup<'a> {
    /// The live check's index among the checks.
    pub(crate) live: usize,
    pub(crate) checks: &'a [TierCheck],
    /// Each candidate's [`candidate_tag`](super::candidate_tag).
    pub(crate) tags: &'a [u64],
}

/// `n` elements of `array` (each as it was), or of `vec` filled with
/// defaults when `n` is over its length.
fn scratch<'a, T: Default>(array: &'a mut [T; 8], vec: &'a mut Vec<T>, n: usize) -> &'a mut [T] {
    if n <= array.len() {
        &mut array[..n]
    } else {
        vec.resize_with(n, T::default);
        vec
    }
}
