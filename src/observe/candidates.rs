//! What each candidate quota would do (see `docs/rollout.md`, "Candidate
//! quotas"): per tier, per candidate, in this process, by clock hour —
//! requests checked, requests it would deny (cost), the distinct keys it
//! would deny, and its heaviest would-be-denied keys.
//!
//! One mutex per tier, taken once per request its candidates check (a few
//! additions per quota, or one for all of them when every quota allowed
//! the request, added to each before the counts are read or changed; a
//! denial also inserts the key's hash, computed once for the request, and
//! feeds the sketch). The
//! distinct keys are kept exactly, as 64-bit hashes of the key parts, up
//! to [`MAX_KEYS`] an hour: past that the count is a lower bound and the
//! report says so (`keys_capped`). The heaviest keys come from a
//! Space-Saving sketch per hour, as the top-N of blocked keys
//! ([`super::topn`]).

use compact_str::CompactString;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use topk::FilteredSpaceSaving;
use xxhash_rust::xxh3::xxh3_64;

/// Distinct denied keys kept per candidate and hour (hashes, 8 bytes
/// each): past it, `keys_denied` is a lower bound.
pub(crate) const MAX_KEYS: usize = 100_000;

/// Counters of the sketch of heaviest would-be-denied keys, per hour.
const SKETCH: usize = 256;

/// A set of key hashes (xxh3, already uniform): each its own hash in the
/// table, not hashed again.
type KeySet = std::collections::HashSet<u64, std::hash::BuildHasherDefault<KeyHash>>;

/// The hasher of [`KeySet`]: a `u64` written is the hash.
#[derive(Default)]
struct KeyHash(u64);

impl std::hash::Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64`s are written; anything else folded in all the same.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// What one candidate quota would have done over a window.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct CandidateReport {
    /// The candidate's quota as written in labels and keys: `80/1m`, or
    /// `80/1m,burst=100` with a burst of its own (a calendar tier's:
    /// `80/month`).
    pub quota: String,
    /// Requests it was checked on.
    pub requests: u64,
    /// Requests it would have denied.
    pub would_deny: u64,
    /// Distinct keys it would have denied at least once.
    pub keys_denied: u64,
    /// Whether `keys_denied` reached the bound kept per hour (100 000) and
    /// is a lower bound.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub keys_capped: bool,
    /// Its heaviest would-be-denied keys (key part, requests), heaviest
    /// first.
    pub top: Vec<CandidateKey>,
}

/// A tier's candidates beside its live quota over a window, in this
/// process ([`RateLimitHandle::candidates`](crate::RateLimitHandle::candidates)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct CandidatesReport {
    /// The tier's name.
    pub tier: String,
    /// The window counted, in seconds (whole clock hours, the current one
    /// included: 3 600 to 86 400).
    pub window_secs: u64,
    /// The live quota, counted the same way: the requests its tier was
    /// checked on beside the candidates, and the ones it denied (its
    /// `top`: its heaviest denied keys).
    pub live: CandidateReport,
    /// Each candidate, in the order configured.
    pub candidates: Vec<CandidateReport>,
}

/// One key of a candidate's top would-be-denied keys.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct CandidateKey {
    /// The key part, as stored (escaped, or hashed when long or secret).
    pub key: String,
    /// Requests of the window this candidate would have denied (an
    /// estimate past the sketch's 256 counters: never below the truth).
    pub count: u64,
}

/// Distinct denied keys, as hashes, up to [`MAX_KEYS`].
#[derive(Default)]
struct Keys {
    set: KeySet,
    /// Whether a key was left out (the count is a lower bound).
    capped: bool,
    /// The hash last found or put in `set` (a heavy key is denied many
    /// times in a row: it is there, no lookup needed).
    last: Option<u64>,
}

impl Keys {
    fn add(&mut self, hash: u64) {
        if self.last == Some(hash) {
            return;
        }
        if self.set.len() < MAX_KEYS {
            self.set.insert(hash);
        } else if !self.set.contains(&hash) {
            self.capped = true;
            return;
        }
        self.last = Some(hash);
    }
}

/// One clock hour of one candidate.
struct Hour {
    hour: u64,
    requests: u64,
    would_deny: u64,
    keys: Keys,
    /// Keyed by inline strings: a key part up to 24 bytes (an address)
    /// is counted without an allocation.
    top: FilteredSpaceSaving<CompactString>,
}

impl Hour {
    fn new(hour: u64) -> Self {
        Self {
            hour,
            requests: 0,
            would_deny: 0,
            keys: Keys::default(),
            top: FilteredSpaceSaving::new(SKETCH),
        }
    }
}

/// The metric of candidates' decisions.
pub(crate) const CANDIDATE_DECISIONS: &str = "tiered_ratelimit_candidate_decisions_total";

/// A tier's candidates' counts and its live quota's on the same
/// requests, each the last 24 clock hours and since the layer was built
/// (without its heaviest keys), and the candidates' metric
/// ([`CANDIDATE_DECISIONS`]), under **one** mutex: a request's decisions
/// on one key are counted with one lock.
pub(crate) struct CandidateStats {
    /// The tier's name and each candidate's label, for the metric.
    tier: Arc<str>,
    labels: Box<[Arc<str>]>,
    tally: Mutex<Tally>,
}

struct Tally {
    /// `[0]`: the live quota's; `[1 + j]`: candidate `j`'s.
    counts: Box<[Counts]>,
    /// The recorder the counters were registered with (its address), and
    /// each candidate's two counters (`allowed`, `would_deny`) once it was
    /// first counted with that recorder: registered again when another is
    /// installed (no label vector or registry lookup per request).
    recorder: usize,
    counters: Box<[Option<[metrics::Counter; 2]>]>,
    /// Requests every quota allowed in clock hour `pending.1`, not yet
    /// added to `counts` (each quota's latest hour is that one): added
    /// before anything else reads or changes them ([`Tally::settle`]).
    pending: (u64, u64),
}

impl Tally {
    /// Adds the pending requests to every quota's counts.
    fn settle(&mut self) {
        let n = std::mem::take(&mut self.pending.0);
        if n == 0 {
            return;
        }
        for c in &mut self.counts {
            c.total.0 += n;
            if let Some(h) = c.hours.back_mut() {
                h.requests += n;
            }
        }
    }

    /// Counts a request every quota allowed in clock hour `hour` as
    /// pending, if each quota's latest hour is that one (else false, and
    /// nothing is counted).
    #[inline]
    fn defer(&mut self, hour: u64) -> bool {
        if self.pending.0 > 0 && self.pending.1 == hour {
            self.pending.0 += 1;
            return true;
        }
        self.settle();
        if self
            .counts
            .iter()
            .all(|c| c.hours.back().is_some_and(|h| h.hour == hour))
        {
            self.pending = (1, hour);
            return true;
        }
        false
    }
}

#[derive(Default)]
struct Counts {
    hours: VecDeque<Hour>,
    /// Since the layer was built: requests, would-be denials, distinct
    /// denied keys (hashes, up to [`MAX_KEYS`]) and whether capped.
    total: (u64, u64, Keys),
}

impl std::fmt::Debug for CandidateStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandidateStats").finish_non_exhaustive()
    }
}

/// One request being counted, under the tally's lock.
struct Counting<'a> {
    stats: &'a CandidateStats,
    tally: &'a mut Tally,
    key: &'a str,
    hour: u64,
    /// The key's hash, computed once for the request's denials.
    hash: Option<u64>,
}

impl Counting<'_> {
    /// Quota `i` (0: the live one, `1 + j`: candidate `j`) denied the
    /// request (or would have) or not; a candidate's decision is counted
    /// in the metric too. An allowed request in the current hour, once
    /// the metric's counters are registered, is a few additions.
    #[inline(always)]
    fn count(&mut self, i: usize, denied: bool) {
        if let Some(c) = self.tally.counts.get_mut(i) {
            c.total.0 += 1;
            match c.hours.back_mut() {
                Some(h) if h.hour == self.hour && !denied => h.requests += 1,
                _ => c.record(self.key, &mut self.hash, denied, self.hour),
            }
        }
        if let Some(j) = i.checked_sub(1) {
            self.metric(j, denied);
        }
    }

    /// Candidate `j`'s decision in the metric.
    #[inline(always)]
    fn metric(&mut self, j: usize, denied: bool) {
        match self.tally.counters.get(j) {
            Some(Some(pair)) => pair[usize::from(denied)].increment(1),
            _ => self.register(j, denied),
        }
    }

    /// Candidate `j`'s decision in the metric, its counters registered
    /// first (once per recorder).
    #[cold]
    #[inline(never)]
    fn register(&mut self, j: usize, denied: bool) {
        let (Some(slot), Some(label)) = (self.tally.counters.get_mut(j), self.stats.labels.get(j))
        else {
            return;
        };
        let pair = slot.get_or_insert_with(|| {
            ["allowed", "would_deny"].map(|decision| {
                metrics::counter!(
                    CANDIDATE_DECISIONS,
                    "tier" => self.stats.tier.clone(),
                    "candidate" => label.clone(),
                    "decision" => decision
                )
            })
        });
        pair[usize::from(denied)].increment(1);
    }
}

impl Counts {
    /// One request checked in clock hour `hour` on key part `key` (its
    /// hash, computed once for the request's denials in `hash`), once
    /// counted in `total.0`: a denial, or the first of an hour.
    #[inline(never)]
    fn record(&mut self, key: &str, hash: &mut Option<u64>, denied: bool, hour: u64) {
        let Self { hours, total } = self;
        let hash = denied.then(|| *hash.get_or_insert_with(|| xxh3_64(key.as_bytes())));
        if let Some(hash) = hash {
            total.1 += 1;
            total.2.add(hash);
        }
        if hours.back().is_none_or(|h| h.hour != hour) {
            hours.push_back(Hour::new(hour));
            while hours.len() > 24 {
                hours.pop_front();
            }
        }
        let Some(h) = hours.back_mut() else {
            return;
        };
        h.requests += 1;
        if let Some(hash) = hash {
            h.would_deny += 1;
            h.keys.add(hash);
            h.top.insert(CompactString::from(key), 1);
        }
    }
}

impl CandidateStats {
    /// The counts of tier `tier`'s candidates, labelled `labels` in the
    /// metric, and of its live quota.
    pub(crate) fn new(tier: Arc<str>, labels: Box<[Arc<str>]>) -> Self {
        let n = labels.len();
        Self {
            tier,
            labels,
            tally: Mutex::new(Tally {
                counts: (0..=n).map(|_| Counts::default()).collect(),
                recorder: 0,
                counters: (0..n).map(|_| None).collect(),
                pending: (0, 0),
            }),
        }
    }

    /// One request checked at `now_s` (epoch seconds) on key part `key`:
    /// each `(i, denied)` of `decisions` says whether quota `i` (0: the
    /// live one, `1 + j`: candidate `j`) denied it (or would have); each
    /// candidate's decision is counted in the metric too.
    pub(crate) fn record(&self, key: &str, now_s: u64, decisions: &[(usize, bool)]) {
        self.with_tally(key, now_s, |tally| {
            tally.tally.settle();
            for &(i, denied) in decisions {
                tally.count(i, denied);
            }
        });
    }

    /// [`record`](Self::record) of the live quota and every candidate:
    /// `live_denied` the live quota's decision, bit `j` of `denied`
    /// candidate `j`'s. A request every quota allowed is counted in
    /// `total.0` and its hour's `requests` of each quota at once, later
    /// ([`Tally::defer`]); its metric at once.
    pub(crate) fn record_all(&self, key: &str, now_s: u64, live_denied: bool, denied: u64) {
        let n = self.labels.len();
        let mask = u32::try_from(n)
            .ok()
            .and_then(|n| 1u64.checked_shl(n))
            .map_or(u64::MAX, |b| b - 1);
        self.with_tally(key, now_s, |tally| {
            if !live_denied && denied & mask == 0 && tally.tally.defer(tally.hour) {
                for j in 0..n {
                    tally.metric(j, false);
                }
                return;
            }
            tally.tally.settle();
            tally.count(0, live_denied);
            for j in 0..n {
                let bit = u32::try_from(j).ok().and_then(|j| denied.checked_shr(j));
                tally.count(1 + j, bit.unwrap_or(0) & 1 == 1);
            }
        });
    }

    /// `count` given one request's [`Counting`], under the lock.
    fn with_tally(&self, key: &str, now_s: u64, count: impl FnOnce(&mut Counting<'_>)) {
        let recorder = metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize);
        let mut tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        if tally.recorder != recorder {
            tally.recorder = recorder;
            tally.counters.iter_mut().for_each(|c| *c = None);
        }
        count(&mut Counting {
            stats: self,
            tally: &mut tally,
            key,
            hour: now_s / 3600,
            hash: None,
        });
    }

    /// Quota `i`'s counts (0: the live one, `1 + j`: candidate `j`) of the
    /// last `hours_back` clock hours (1-24, the current one included)
    /// before `now_s`, with the `n` heaviest keys; with `u64::MAX`, since
    /// the layer was built (its heaviest keys those of the last 24 hours).
    pub(crate) fn report(
        &self,
        i: usize,
        quota: &str,
        hours_back: u64,
        n: usize,
        now_s: u64,
    ) -> CandidateReport {
        let first = (now_s / 3600).saturating_sub(hours_back.clamp(1, 24) - 1);
        let mut tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        tally.settle();
        let empty = Counts::default();
        let counts = tally.counts.get(i).unwrap_or(&empty);
        let hours = &counts.hours;
        let mut report = CandidateReport {
            quota: quota.to_owned(),
            requests: 0,
            would_deny: 0,
            keys_denied: 0,
            keys_capped: false,
            top: Vec::new(),
        };
        let mut keys = KeySet::default();
        let mut merged = FilteredSpaceSaving::new(SKETCH);
        for h in hours.iter().filter(|h| h.hour >= first) {
            report.requests += h.requests;
            report.would_deny += h.would_deny;
            report.keys_capped |= h.keys.capped;
            keys.extend(h.keys.set.iter().copied());
            // Same capacity everywhere: merging cannot fail.
            let _ = merged.merge(&h.top);
        }
        report.keys_denied = keys.len() as u64;
        if hours_back == u64::MAX {
            // Since the layer was built.
            report.requests = counts.total.0;
            report.would_deny = counts.total.1;
            report.keys_denied = counts.total.2.set.len() as u64;
            report.keys_capped = counts.total.2.capped;
        }
        report.top = merged
            .into_sorted_vec()
            .into_iter()
            .take(n)
            .map(|(key, c)| CandidateKey {
                key: key.into_string(),
                count: c.estimated_count(),
            })
            .collect();
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_hour_and_window() {
        let s = CandidateStats::new("ip".into(), Box::new(["5/1m".into()]));
        let t = 1_700_000_000 / 3600 * 3600;
        s.record("a", t, &[(1, true)]);
        s.record("a", t + 1, &[(1, true)]);
        s.record("b", t + 2, &[(1, false)]);
        s.record("b", t + 3600, &[(1, true)]);
        let last = s.report(1, "5/1m", 1, 10, t + 3600);
        assert_eq!(
            (last.requests, last.would_deny, last.keys_denied),
            (1, 1, 1)
        );
        let both = s.report(1, "5/1m", 2, 10, t + 3600);
        assert_eq!(
            (both.requests, both.would_deny, both.keys_denied),
            (4, 3, 2)
        );
        assert_eq!(
            both.top[0],
            CandidateKey {
                key: "a".into(),
                count: 2
            }
        );
        // The live quota was counted on none of them.
        assert_eq!(s.report(0, "10/1m", 2, 10, t + 3600).requests, 0);
    }

    #[test]
    fn one_record_counts_each_quota_apart() {
        let s = CandidateStats::new("ip".into(), Box::new(["5/1m".into(), "9/1m".into()]));
        let t = 1_700_000_000 / 3600 * 3600;
        s.record("a", t, &[(0, false), (1, true), (2, false)]);
        s.record("b", t + 1, &[(0, true), (1, true), (2, false)]);
        let counts = |i| {
            let r = s.report(i, "q", 1, 10, t + 1);
            let top: Vec<_> = r.top.iter().map(|k| (k.key.clone(), k.count)).collect();
            (r.requests, r.would_deny, r.keys_denied, top)
        };
        assert_eq!(counts(0), (2, 1, 1, vec![("b".into(), 1)]));
        let one = counts(1);
        assert_eq!((one.0, one.1, one.2, one.3.len()), (2, 2, 2, 2));
        assert_eq!(counts(2), (2, 0, 0, vec![]));
        let total = s.report(1, "q", u64::MAX, 10, t + 1);
        assert_eq!(
            (total.requests, total.would_deny, total.keys_denied),
            (2, 2, 2)
        );
        // An index past the quotas counts nothing and reads as empty.
        s.record("c", t + 2, &[(3, true)]);
        assert_eq!(s.report(3, "q", 1, 10, t + 2).requests, 0);
    }
}
