//! The gates a stage passes before the next one, read by the leader: the
//! sample floor (checks and distinct keys) and the enforced cohort's share
//! of the checks, of the fleet's stage (`stage_parts`, `lua/stage.lua`:
//! each instance adds its counts and ORs its map of keys into
//! `{<control>}:stage:<tier>:<since_us>` in its poll's call when it has
//! any; the leader's tick, later in the same call, judges these floors on
//! the totals just answered, `lua/poll.lua`), the check latency's p99 (the
//! leader's own) against the stage before's, and the application guard
//! (asked by the leader before its call when its own best numbers pass the
//! floors).
//!
//! While a plan runs, each check of its tier adds to [`StageStats`]
//! (a hash of the key, two striped counters and a bit in a 64 Kbit map of
//! keys seen), and each request's latency to [`Latency`]; while none runs
//! a request pays one relaxed load per planned tier.

use super::super::Shared;
use crate::rollout::{GuardVerdict, Mode, RolloutPlan, Stored};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Counter stripes (by the key's hash: different keys rarely share a line).
const STRIPES: usize = 8;
/// Bits of the map of keys seen (linear counting).
const KEY_BITS: usize = 1 << 16;

#[repr(align(64))]
#[derive(Default)]
struct Stripe {
    requests: AtomicU64,
    enforced: AtomicU64,
}

/// What the gates read of one planned tier in its current stage.
pub(crate) struct StageStats {
    /// Whether a plan of the tier runs (the request path counts only then).
    active: AtomicBool,
    stripes: [Stripe; STRIPES],
    keys: Box<[AtomicU64]>,
    /// What was last added to the fleet's stage: (the stage's `since_us`,
    /// checks, enforced, bits set in the map).
    flushed: std::sync::Mutex<(u64, u64, u64, u64)>,
    /// The fleet's stage as the last flush answered it.
    fleet: std::sync::Mutex<Option<FleetStage>>,
}

/// A stage's counts summed over the fleet (`lua/stage.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FleetStage {
    /// The stage's `since_us` (which stage these are of).
    since_us: u64,
    requests: u64,
    enforced: u64,
    /// Bits set in the OR of every instance's map of keys.
    bits: u64,
}

impl Default for StageStats {
    fn default() -> Self {
        Self {
            active: AtomicBool::new(false),
            stripes: Default::default(),
            keys: (0..KEY_BITS / 64).map(|_| AtomicU64::new(0)).collect(),
            flushed: std::sync::Mutex::new((0, 0, 0, 0)),
            fleet: std::sync::Mutex::new(None),
        }
    }
}

impl StageStats {
    /// Whether the request path counts this tier's checks.
    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.active.load(Relaxed)
    }

    pub(crate) fn set_active(&self, active: bool) {
        self.active.store(active, Relaxed);
    }

    /// One check of key part `key`, in the enforced cohort or not.
    #[inline]
    pub(crate) fn record(&self, key: &str, enforced: bool) {
        let h = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
        let s = &self.stripes[(h >> 61) as usize % STRIPES];
        s.requests.fetch_add(1, Relaxed);
        if enforced {
            s.enforced.fetch_add(1, Relaxed);
        }
        #[allow(clippy::cast_possible_truncation)] // masked to 16 bits
        let bit = (h as usize) & (KEY_BITS - 1);
        let word = &self.keys[bit / 64];
        let mask = 1u64 << (bit % 64);
        if word.load(Relaxed) & mask == 0 {
            word.fetch_or(mask, Relaxed);
        }
    }

    /// A new stage: everything from zero.
    pub(crate) fn begin_stage(&self) {
        for s in &self.stripes {
            s.requests.store(0, Relaxed);
            s.enforced.store(0, Relaxed);
        }
        for w in self.keys.iter() {
            w.store(0, Relaxed);
        }
    }

    /// Checks and checks in the enforced cohort so far in the stage.
    pub(crate) fn counts(&self) -> (u64, u64) {
        self.stripes.iter().fold((0, 0), |(r, e), s| {
            (r + s.requests.load(Relaxed), e + s.enforced.load(Relaxed))
        })
    }

    /// Distinct keys so far in the stage: linear counting over the map
    /// (exact while the keys' bits do not collide, within about 1 % up to
    /// 100 000 keys; the map's size, 65 536 × ln 65 536, when it is full).
    fn keys(&self) -> u64 {
        keys_of(self.bits())
    }

    /// Bits set in the map of keys.
    fn bits(&self) -> u64 {
        self.keys
            .iter()
            .map(|w| u64::from(w.load(Relaxed).count_ones()))
            .sum()
    }

    /// The map of keys as bytes (8 KiB), for the fleet's OR.
    fn map(&self) -> Vec<u8> {
        self.keys
            .iter()
            .flat_map(|w| w.load(Relaxed).to_le_bytes())
            .collect()
    }

    /// This instance's best numbers of the stage that began at `since_us`:
    /// the fleet's (checks, enforced, keys) its last call answered plus its
    /// own checks since (its own keys when it sees more); its own counts
    /// when no call answered yet.
    fn best(&self, since_us: u64) -> (u64, u64, u64) {
        let (r, e) = self.counts();
        let own_keys = self.keys();
        let flushed = *self.flushed.lock().unwrap_or_else(|e| e.into_inner());
        match self.fleet(since_us) {
            Some((fr, fe, fk)) if flushed.0 == since_us => (
                fr + r.saturating_sub(flushed.1),
                fe + e.saturating_sub(flushed.2),
                fk.max(own_keys),
            ),
            _ => (r, e, own_keys),
        }
    }

    /// The fleet's (checks, enforced, keys) of the stage that began at
    /// `since_us`, when a flush answered them.
    fn fleet(&self, since_us: u64) -> Option<(u64, u64, u64)> {
        let f = (*self.fleet.lock().unwrap_or_else(|e| e.into_inner()))?;
        (f.since_us == since_us).then(|| (f.requests, f.enforced, keys_of(f.bits)))
    }
}

/// Distinct keys of a map with `set` bits set: linear counting.
fn keys_of(set: u64) -> u64 {
    let m = KEY_BITS as f64;
    #[allow(clippy::cast_precision_loss)] // at most 65 536
    let zero = (m - set as f64).max(1.0);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = (-m * (zero / m).ln()).round() as u64;
    n
}

/// `{<control>}:stage:<tier>:<since_us>` and its suffixes, in the control
/// key's slot.
fn stage_key(control: &str, tier: &str, since_us: u64, suffix: &str) -> String {
    let log = super::log_key(control);
    let base = log.strip_suffix(":rollout").unwrap_or(&log);
    format!("{base}:stage:{tier}:{since_us}{suffix}")
}

/// How long a stage's fleet counts are kept after their last flush.
#[cfg(feature = "redis")]
const STAGE_TTL_S: u64 = 8 * 24 * 3600;

/// Every instance's part of each poll's call for each running plan (read
/// at the last poll): adds its checks of the stage since its last poll to
/// the fleet's (and ORs its map of keys into the fleet's), and answers the
/// fleet's totals for the gates. An instance with nothing to add sends no
/// part, but one whose step is a gated tick (`gated[i]`) does: the call
/// judges the sample floors on those totals.
#[cfg(feature = "redis")]
pub(crate) fn stage_parts(
    shared: &Shared,
    key: &str,
    states: &[Stored],
    gated: &[bool],
    out: &mut super::poll::Parts,
) {
    let plans = &shared.live.plans;
    for (i, state) in states.iter().enumerate() {
        let Some(stats) = plans.stats.get(i).and_then(Option::as_ref) else {
            continue;
        };
        if !state.running() {
            continue;
        }
        let since = state.since_us;
        let (requests, enforced) = stats.counts();
        let bits = stats.bits();
        let before = {
            let mut f = stats.flushed.lock().unwrap_or_else(|e| e.into_inner());
            if f.0 != since {
                *f = (since, 0, 0, 0);
            }
            *f
        };
        let map = if bits != before.3 {
            stats.map()
        } else {
            Vec::new()
        };
        let asked = gated.get(i).copied().unwrap_or(false);
        if requests == before.1 && enforced == before.2 && map.is_empty() && !asked {
            continue;
        }
        let tier = &shared.config.tiers[i].name;
        out.push(
            crate::backend::PollPart {
                kind: "stage",
                tier: tier.to_string(),
                keys: vec![
                    stage_key(key, tier, since, ""),
                    stage_key(key, tier, since, ":keys"),
                    stage_key(key, tier, since, &format!(":scratch:{}", plans.instance)),
                ],
                args: vec![
                    requests.saturating_sub(before.1).to_string().into_bytes(),
                    enforced.saturating_sub(before.2).to_string().into_bytes(),
                    map,
                    STAGE_TTL_S.to_string().into_bytes(),
                ],
            },
            super::poll::What::Stage {
                i,
                since,
                requests,
                enforced,
                bits,
            },
        );
    }
}

/// Records the answer to tier `i`'s stage part: what was added (`sent`:
/// checks, enforced, bits, as read before the call) and the fleet's
/// totals.
#[cfg(feature = "redis")]
pub(crate) fn staged(
    shared: &Shared,
    i: usize,
    since: u64,
    sent: (u64, u64, u64),
    answer: ::redis::Value,
) {
    let Some(stats) = shared.live.plans.stats.get(i).and_then(Option::as_ref) else {
        return;
    };
    match ::redis::from_redis_value::<(u64, u64, u64)>(answer) {
        Ok((r, e, b)) => {
            *stats.flushed.lock().unwrap_or_else(|e| e.into_inner()) =
                (since, sent.0, sent.1, sent.2);
            *stats.fleet.lock().unwrap_or_else(|e| e.into_inner()) = Some(FleetStage {
                since_us: since,
                requests: r,
                enforced: e,
                bits: b,
            });
        }
        Err(e) => {
            let tier = &*shared.config.tiers[i].name;
            tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, error = %e,
                "rollout plan: adding this instance's stage counts failed; trying again at the next poll");
        }
    }
}

/// Octave sub-buckets of [`Latency`] (about 9 % wide).
const SUB: u32 = 8;
/// Buckets: 2^24 µs (16 s) and above share the last.
const BUCKETS: usize = 24 * SUB as usize + 1;

/// The check latency of the requests while a plan runs: a log-linear
/// histogram of microseconds, this stage's and the last one's p99.
pub(crate) struct Latency {
    buckets: Box<[AtomicU64]>,
    /// The p99 of the stage before, in µs (`u64::MAX`: none measured).
    before_p99_us: AtomicU64,
}

impl Default for Latency {
    fn default() -> Self {
        Self {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            before_p99_us: AtomicU64::new(u64::MAX),
        }
    }
}

fn bucket_of(us: u64) -> usize {
    if us == 0 {
        return 0;
    }
    let octave = 63 - us.leading_zeros();
    let frac = if octave >= 3 {
        (us >> (octave - 3)) & u64::from(SUB - 1)
    } else {
        (us << (3 - octave)) & u64::from(SUB - 1)
    };
    #[allow(clippy::cast_possible_truncation)]
    ((octave * SUB) as usize + frac as usize + 1).min(BUCKETS - 1)
}

/// A bucket's upper bound in µs.
fn bucket_top(b: usize) -> u64 {
    if b == 0 {
        return 0;
    }
    #[allow(clippy::cast_possible_truncation)]
    let (octave, frac) = (((b - 1) as u32) / SUB, ((b - 1) as u32) % SUB);
    let base = 1u64 << octave;
    base + (base * u64::from(frac + 1)) / u64::from(SUB)
}

impl Latency {
    #[inline]
    pub(crate) fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(us)].fetch_add(1, Relaxed);
    }

    /// The p99 so far, in µs (`None`: no sample).
    fn p99_us(&self) -> Option<u64> {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = total - total / 100;
        let mut seen = 0;
        for (b, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(bucket_top(b));
            }
        }
        None
    }

    /// A new stage: this one's p99 becomes the one to compare with.
    pub(crate) fn begin_stage(&self) {
        if let Some(p) = self.p99_us() {
            self.before_p99_us.store(p, Relaxed);
        }
        for b in self.buckets.iter() {
            b.store(0, Relaxed);
        }
    }
}

/// The gates' answer for one tier at one poll, as this instance sees them
/// before its call: the call judges the sample floors again on the fleet's
/// totals it has just added to (`lua/poll.lua`).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// The sample floors' hold on this instance's best numbers (empty:
    /// they pass): the guard is asked only when they pass.
    floors: String,
    /// The hold of the other gates (the check's p99, then the guard;
    /// empty: they pass).
    rest: String,
    /// Whether every other gate was asked (the guard is not while the
    /// floors hold here).
    known: bool,
    /// `requests=… keys=… enforced=…`, on this instance's best numbers.
    numbers: String,
    /// The other gates' numbers, for the log.
    rest_evidence: String,
    /// The guard asked to fall back to shadow, with its reason.
    pub(crate) fall_back: Option<String>,
}

impl Verdict {
    /// The evidence as this instance sees it.
    pub(crate) fn full_evidence(&self) -> String {
        format!("{} {}", self.numbers, self.rest_evidence)
    }

    /// The gate arguments of a `gated` part (`lua/poll.lua`).
    pub(crate) fn gate_args(&self, plan: &RolloutPlan, state: &Stored) -> Vec<String> {
        let gates = &plan.gates;
        let percent = match plan.stages.get(state.stage).map(|s| s.mode) {
            Some(Mode::Canary { percent }) => Some(percent),
            _ => None,
        };
        vec![
            gates.min_requests.to_string(),
            bits_for(gates.min_keys).to_string(),
            percent.map_or_else(|| "-1".to_owned(), |p| most_bp(p).to_string()),
            requests_reason(gates.min_requests),
            keys_reason(gates.min_keys),
            percent.map(share_reason).unwrap_or_default(),
            if self.known { "1" } else { "0" }.to_owned(),
            self.rest.clone(),
            self.rest_evidence.clone(),
        ]
    }
}

fn requests_reason(min: u64) -> String {
    format!("min_requests: fewer than {min} checks in the stage")
}

fn keys_reason(min: u64) -> String {
    format!("min_keys: fewer than {min} keys in the stage")
}

/// The enforced cohort's most share of the checks in canary:`percent`, in
/// basis points: twice the nominal percent.
fn most_bp(percent: u8) -> u64 {
    u64::from(percent.min(100)) * 200
}

fn share_reason(percent: u8) -> String {
    format!(
        "enforced_share: over {} % of the checks are in the enforced cohort (2 × canary:{percent}): a few heavy keys are in it",
        most_bp(percent) / 100
    )
}

/// The fewest bits set in the map of keys that count `min` keys
/// ([`keys_of`] is monotone); past the full map, one more than its bits.
fn bits_for(min: u64) -> u64 {
    let (mut lo, mut hi) = (0u64, KEY_BITS as u64 + 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if mid <= KEY_BITS as u64 && keys_of(mid) >= min {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// The gates of tier `i`'s plan at its stage `state` (asked when the
/// stage's time has about passed), on this instance's best numbers: the
/// fleet's totals its last call answered plus its own checks since. The
/// guard is asked only when those pass the sample floors, and given at
/// most `budget` to answer (a slower one holds).
pub(crate) async fn evaluate(
    shared: &Shared,
    i: usize,
    plan: &RolloutPlan,
    state: &Stored,
    budget: Duration,
) -> Verdict {
    let tier = &shared.config.tiers[i].name;
    let plans = &shared.live.plans;
    let (requests, enforced, keys) = plans.stats[i]
        .as_ref()
        .map_or((0, 0, 0), |s| s.best(state.since_us));
    let p99 = plans.latency.p99_us();
    let before = plans.latency.before_p99_us.load(Relaxed);
    let before_text = if before == u64::MAX {
        "none".to_owned()
    } else {
        before.to_string()
    };
    let mut v = Verdict {
        numbers: format!("requests={requests} keys={keys} enforced={enforced}"),
        rest_evidence: format!(
            "check_p99_us={} before_p99_us={before_text}",
            p99.map_or_else(|| "none".to_owned(), |p| p.to_string()),
        ),
        known: true,
        ..Verdict::default()
    };
    let gates = &plan.gates;
    let mode = plan.stages.get(state.stage).map(|s| s.mode);
    if requests < gates.min_requests {
        v.floors = requests_reason(gates.min_requests);
    } else if keys < gates.min_keys {
        v.floors = keys_reason(gates.min_keys);
    } else if let (Some(Mode::Canary { percent }), true) = (mode, requests > 0) {
        if enforced * 10_000 / requests > most_bp(percent) {
            v.floors = share_reason(percent);
        }
    }
    if let (Some(p), true) = (p99, before != u64::MAX) {
        let most = u64::try_from(gates.max_check_p99_increase.as_micros()).unwrap_or(u64::MAX);
        if p > before.saturating_add(most) {
            v.rest = format!(
                "max_check_p99_increase: the check's p99 rose more than {most} µs over the stage before's"
            );
        }
    }
    if let (Some(guard), true) = (&plan.guard, v.rest.is_empty()) {
        if v.floors.is_empty() {
            match tokio::time::timeout(budget, guard(tier)).await {
                Ok(GuardVerdict::Healthy) => v.rest_evidence.push_str(" guard=healthy"),
                Ok(GuardVerdict::Hold(why)) => {
                    v.rest_evidence.push_str(" guard=hold");
                    v.rest = format!("guard: {why}");
                }
                Ok(GuardVerdict::FallBack(why)) => {
                    v.rest_evidence.push_str(" guard=fall_back");
                    v.fall_back = Some(format!("guard: {why}"));
                }
                Err(_) => {
                    v.rest_evidence.push_str(" guard=timeout");
                    v.rest = format!("guard: no answer within {budget:?}");
                }
            }
        } else {
            v.known = false;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_hold_their_values() {
        for us in [1u64, 2, 3, 7, 8, 9, 100, 999, 1000, 3000, 1_000_000] {
            let b = bucket_of(us);
            assert!(
                bucket_top(b) >= us,
                "{us}: bucket {b} tops at {}",
                bucket_top(b)
            );
            assert!(bucket_top(b) <= us + us / 8 + 1, "{us}: {}", bucket_top(b));
        }
        let l = Latency::default();
        for _ in 0..99 {
            l.record(Duration::from_micros(100));
        }
        l.record(Duration::from_millis(50));
        assert_eq!(l.p99_us(), Some(bucket_top(bucket_of(100))));
        l.record(Duration::from_millis(50));
        assert_eq!(l.p99_us(), Some(bucket_top(bucket_of(50_000))));
    }

    #[test]
    fn keys_are_counted_exactly_while_few() {
        let s = StageStats::default();
        for k in 0..500 {
            s.record(&format!("k{k}"), k == 0);
            s.record(&format!("k{k}"), k == 0);
        }
        assert_eq!(s.counts(), (1000, 2));
        let keys = s.keys();
        assert!((498..=502).contains(&keys), "{keys}");
        s.begin_stage();
        assert_eq!((s.counts(), s.keys()), ((0, 0), 0));
    }

    #[test]
    fn the_floors_bits_are_the_fewest_that_count_the_keys() {
        assert_eq!(bits_for(0), 0);
        for min in [1, 5, 100, 10_000] {
            let b = bits_for(min);
            assert!(keys_of(b) >= min && keys_of(b - 1) < min, "{min}: {b}");
        }
        assert_eq!(bits_for(u64::MAX), KEY_BITS as u64 + 1);
    }
}
