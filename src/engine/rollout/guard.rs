//! The fall back guard of a tier ([`FallbackGuard`]): each instance's
//! counts of the tier flushed into fleet-wide buckets at each control-key
//! poll, every instance's judgement of each finished bucket
//! ([`crate::observe::guard`]), and the fall back to shadow by the holder
//! of the guard's lease.
//!
//! Each guarded tier is one part (`lua/guard.lua`) of the instance's one
//! call a poll (`poll.rs`): it adds what it counted since its last poll to
//! the bucket of the moment (`HINCRBY` into `{<control>}:guard:<tier>:<bucket>`, in the
//! control key's slot), renews or takes the guard's lease
//! (`{<control>}:guard:<tier>:lease`, three polls long, so a stopped holder
//! is replaced within three polls), and reads the bucket being judged: the
//! last one finished at least half a poll ago (no instance adds to it any
//! more). Every instance judges it the same way; the lease holder, when
//! `confirm` buckets in a row are `limiter` and the tier enforces (enforce
//! or canary), runs `lua/plan.lua`'s `guard` step at once, a call of its
//! own (once per fall back, not per poll: waiting for the next poll's call
//! would add a poll to the fall back): the tier's fleet mode becomes shadow
//! and its plan, if running or paused, `fellback`, in one compare-and-set,
//! logged in the rollout log with the evidence. The lease
//! is the guard's own, not the plan's, so a tier without a plan (its mode
//! set by the operator) is guarded the same way.
//!
//! What the request path adds: nothing on an allowed request; a refused
//! (or would-be refused) request of a guarded tier adds its key's hash to
//! a small map under a lock (at most [`TALLY_CAP`] keys between two
//! polls), beside the top-N sketch it already feeds.

use super::super::Shared;
use crate::observe::guard::{Cause, Detector, FleetBucket, Judgement};
use crate::observe::BucketCounts;
use crate::rollout::{FallbackGuard, Mode};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The most distinct refused keys tallied between two polls (more are
/// counted as distinct without their share).
pub(crate) const TALLY_CAP: usize = 4096;

/// How many times the fall back reads again when the plan moved under it.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
const ATTEMPTS: usize = 4;

#[derive(Default)]
struct Tally {
    /// Refused key part's hash → refusals since the last flush.
    keys: HashMap<u64, u64>,
    /// Distinct keys past the cap.
    overflow: u64,
}

#[derive(Default)]
struct Flushed {
    /// The observer's open bucket as last read.
    observer: Option<BucketCounts>,
    /// The stage statistics' (checks, enforced cohort) as last read.
    stage: (u64, u64),
    at: Option<Instant>,
}

#[derive(Default)]
struct Judged {
    detector: Detector,
    /// The last bucket judged.
    bucket: u64,
    last: Option<Judgement>,
    leader: bool,
}

/// One guarded tier's state in this process.
pub(crate) struct TierGuard {
    pub(crate) config: FallbackGuard,
    tally: Mutex<Tally>,
    flushed: Mutex<Flushed>,
    judged: Mutex<Judged>,
}

/// What `GET /api/anomalies` shows of a guarded tier.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) struct GuardView {
    pub(crate) tier: String,
    /// Whether this instance holds the guard's lease.
    pub(crate) leader: bool,
    /// The last bucket judged (`None`: none yet).
    pub(crate) last: Option<Judgement>,
}

impl TierGuard {
    pub(crate) fn new(config: FallbackGuard) -> Self {
        Self {
            config,
            tally: Mutex::default(),
            flushed: Mutex::default(),
            judged: Mutex::default(),
        }
    }

    /// A refusal (enforced or not) of key part `key` by the tier.
    pub(crate) fn denied(&self, key: &str) {
        let h = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
        let mut t = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        let full = t.keys.len() >= TALLY_CAP;
        match t.keys.get_mut(&h) {
            Some(n) => *n += 1,
            None if full => t.overflow += 1,
            None => {
                t.keys.insert(h, 1);
            }
        }
    }

    /// Distinct refused keys and the five most refused keys' refusals
    /// since the last call.
    fn take_tally(&self) -> (u64, u64) {
        let t = std::mem::take(&mut *self.tally.lock().unwrap_or_else(|e| e.into_inner()));
        let mut counts: Vec<u64> = t.keys.into_values().collect();
        let distinct = counts.len() as u64 + t.overflow;
        let top = if counts.len() > 5 {
            let (_, _, _) = counts.select_nth_unstable_by(4, |a, b| b.cmp(a));
            counts[..5].iter().sum()
        } else {
            counts.iter().sum()
        };
        (distinct, top)
    }

    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    pub(crate) fn view(&self, tier: &str) -> GuardView {
        let j = self.judged.lock().unwrap_or_else(|e| e.into_inner());
        GuardView {
            tier: tier.to_owned(),
            leader: j.leader,
            last: j.last,
        }
    }
}

/// This instance's counts of tier `i` since the last call: the observer's
/// counters read (no counter of its own on the request path).
fn take(shared: &Shared, i: usize, g: &TierGuard) -> FleetBucket {
    let observer = &shared.telemetry.observer;
    let open = observer.open_bucket(i);
    let stage = shared.live.plans.stats[i]
        .as_ref()
        .filter(|s| s.active())
        .map_or((0, 0), super::gates::StageStats::counts);
    let (denied_keys, top) = g.take_tally();
    let mut f = g.flushed.lock().unwrap_or_else(|e| e.into_inner());
    let now = Instant::now();
    let ms = f.at.map_or(0, |at| {
        u64::try_from(now.duration_since(at).as_millis()).unwrap_or(u64::MAX)
    });
    f.at = Some(now);
    let mut b = FleetBucket {
        denied_keys,
        top,
        ms,
        ..FleetBucket::default()
    };
    let add = |b: &mut FleetBucket, now: &BucketCounts, before: Option<&BucketCounts>| {
        let (r, l, s) = before.map_or((0, 0, 0), |x| (x.requests, x.limited, x.shadow_limited));
        b.checked += now.requests.saturating_sub(r);
        b.limited += now.limited.saturating_sub(l);
        b.shadow += now.shadow_limited.saturating_sub(s);
    };
    match (&f.observer, &open) {
        (Some(before), Some(open)) if before.start == open.start => add(&mut b, open, Some(before)),
        (Some(before), Some(open)) => {
            // The observer closed buckets since: the rest of the one last
            // read, every one after it, and the open one so far.
            for h in observer.history(i) {
                if h.start == before.start {
                    add(&mut b, &h, Some(before));
                } else if h.start > before.start && h.start < open.start {
                    add(&mut b, &h, None);
                }
            }
            add(&mut b, open, None);
        }
        // The first read: counting starts now.
        _ => {}
    }
    f.observer = open;
    let (requests, enforced) = stage;
    let (r0, e0) = f.stage;
    // A new stage starts its statistics from zero.
    let (dr, de) = if requests < r0 || enforced < e0 {
        (requests, enforced)
    } else {
        (requests - r0, enforced - e0)
    };
    f.stage = stage;
    let _ = dr;
    b.cohort = de;
    b
}

/// Tier `i`'s mode in force here (its fleet override, else its own).
fn tier_mode(shared: &Shared, i: usize) -> Mode {
    shared
        .live
        .mode_overrides
        .load()
        .tiers
        .get(i)
        .copied()
        .flatten()
        .unwrap_or(shared.live.runtime.load().tiers[i].mode)
}

/// `{<control>}:guard:<tier>:<suffix>`, in the control key's slot.
pub(crate) fn guard_key(control: &str, tier: &str, suffix: &str) -> String {
    let log = super::log_key(control);
    let base = log.strip_suffix(":rollout").unwrap_or(&log);
    format!("{base}:guard:{tier}:{suffix}")
}

fn parse_bucket(fields: &[(String, String)]) -> FleetBucket {
    let get = |name: &str| {
        fields
            .iter()
            .find(|(f, _)| f == name)
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    FleetBucket {
        checked: get("checked"),
        limited: get("limited"),
        shadow: get("shadow"),
        denied_keys: get("denied_keys"),
        top: get("top"),
        ms: get("ms"),
        cohort: get("cohort"),
    }
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// Adds each guarded tier's part of the poll's call: this instance's
/// counts since its last poll added to the bucket of the moment, the
/// guard's lease renewed or taken, and the bucket being judged read.
/// `poll`: the control key's poll interval.
#[cfg(feature = "redis")]
pub(crate) fn guard_parts(
    shared: &Shared,
    key: &str,
    poll: Duration,
    out: &mut super::poll::Parts,
) {
    for (i, g) in shared.live.plans.guards.iter().enumerate() {
        let Some(g) = g else {
            continue;
        };
        let tier = &shared.config.tiers[i].name;
        let mine = take(shared, i, g);
        let bucket_us = us(g.config.bucket);
        let now_us = shared.local_clock.now_us();
        let lag_us = us(poll.min(g.config.bucket)) / 2;
        let bucket = now_us / bucket_us;
        let judged = (now_us.saturating_sub(lag_us) / bucket_us).saturating_sub(1);
        let lease_ms = u64::try_from((poll * crate::rollout::LEASE_POLLS).as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let ttl_s = g.config.bucket.as_secs().max(1) * 10 + 60;
        let args: Vec<Vec<u8>> = [
            shared.live.plans.instance.clone(),
            lease_ms.to_string(),
            ttl_s.to_string(),
        ]
        .into_iter()
        .chain(
            [
                mine.checked,
                mine.limited,
                mine.shadow,
                mine.denied_keys,
                mine.top,
                mine.ms,
                mine.cohort,
            ]
            .iter()
            .map(u64::to_string),
        )
        .map(String::into_bytes)
        .collect();
        out.push(
            crate::backend::PollPart {
                kind: "guard",
                tier: tier.to_string(),
                keys: vec![
                    guard_key(key, tier, &bucket.to_string()),
                    guard_key(key, tier, &judged.to_string()),
                    guard_key(key, tier, "lease"),
                ],
                args,
            },
            super::poll::What::Guard { i, judged },
        );
    }
}

/// Tier `i`'s guard part answered (`lua/guard.lua`: whether this instance
/// holds the lease, the judged bucket's fields): judges the bucket.
/// Answers the fall back to make now when the lease holder finds it due on
/// an enforcing tier: its reason and evidence.
#[cfg(feature = "redis")]
pub(crate) fn guarded(
    shared: &Shared,
    i: usize,
    judged: u64,
    answer: ::redis::Value,
) -> Option<(String, String)> {
    let g = shared.live.plans.guards.get(i)?.as_ref()?;
    let tier = &*shared.config.tiers[i].name;
    let (lead, fields) = match ::redis::from_redis_value::<(i64, Vec<(String, String)>)>(answer) {
        Ok((lead, fields)) => (lead == 1, fields),
        Err(e) => {
            tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier, error = %e,
                "fall back guard: the flush failed; this poll's counts are lost");
            return None;
        }
    };
    let mode = tier_mode(shared, i);
    let (judgement, before) = {
        let mut j = g.judged.lock().unwrap_or_else(|e| e.into_inner());
        j.leader = lead;
        let before = j.last.and_then(|l| l.cause);
        if judged > j.bucket {
            j.bucket = judged;
            let b = parse_bucket(&fields);
            let canary = matches!(mode, Mode::Canary { .. });
            let verdict = j.detector.observe(&g.config, &b, canary);
            if verdict.is_some() {
                j.last = verdict;
            }
            (verdict, before)
        } else {
            (None, before)
        }
    };
    let v = judgement?;
    // Logged when the cause changes, not at every bucket.
    if v.cause != before {
        tracing::info!(target: super::super::CONTROL_LOG_TARGET, tier,
            cause = v.cause.map_or("none", Cause::name), evidence = v.evidence(),
            "fall back guard: the fleet's 429 rate changed cause (none: inside its band)");
    }
    let enforcing = matches!(mode, Mode::Enforce | Mode::Canary { .. });
    if !(v.fall_back && lead && enforcing) {
        return None;
    }
    let reason = format!(
        "limiter: the 429 rate left its band ({:.1} % against {:.1} % ± {:.1} × {:.1}) for {} buckets at normal traffic, spread over {} keys",
        v.rate * 100.0,
        v.mean * 100.0,
        g.config.k,
        v.sigma * 100.0,
        v.streak,
        v.denied_keys,
    );
    Some((reason, v.evidence()))
}

/// Sets tier `i`'s fleet mode to shadow and stops its plan (`lua/plan.lua`'s
/// `guard` step, a call of its own: once per fall back, not per poll),
/// logging the evidence, then reads the control hash so this instance
/// applies it at once.
#[cfg(feature = "redis")]
pub(crate) async fn fall_back(
    shared: &std::sync::Arc<Shared>,
    redis: &crate::backend::RedisBackend,
    key: &str,
    i: usize,
    reason: &str,
    evidence: &str,
) {
    let plans = &shared.live.plans;
    let tier = &shared.config.tiers[i].name;
    let log = super::log_key(key);
    for _ in 0..ATTEMPTS {
        let version = plans.read.load().get(i).map_or(0, |s| s.version);
        let a = match &plans.configured[i] {
            Some(plan) => super::args(
                tier,
                &plans.instance,
                version,
                "guard",
                None,
                reason,
                "guard",
                evidence,
                plan,
            ),
            None => vec![
                tier.to_string(),
                plans.instance.clone(),
                version.to_string(),
                "guard".into(),
                String::new(),
                reason.to_owned(),
                "guard".into(),
                evidence.to_owned(),
                super::LOG_CAP.to_string(),
                "0".into(),
            ],
        };
        match redis.plan_step(key, &log, &a).await {
            Ok((1, _)) => {
                tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier,
                    instance = plans.instance.as_str(), reason, evidence,
                    "fall back guard: the tier falls back to shadow fleet-wide; its plan stops");
                if let Err(e) = super::super::watch::refresh(shared, key).await {
                    tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier, error = %e,
                        "fall back guard: could not read the control key back; the next poll will");
                }
                return;
            }
            Ok((0, _)) => return,
            Ok((-1, _)) => {
                if let Err(e) = super::super::watch::refresh(shared, key).await {
                    tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier, error = %e,
                        "fall back guard: could not read the plan again; trying at the next poll");
                    return;
                }
            }
            Ok((code, text)) => {
                tracing::error!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier, code, text,
                    "fall back guard: the fall back was refused");
                return;
            }
            Err(e) => {
                tracing::warn!(target: super::super::CONTROL_LOG_TARGET, tier = &**tier, error = %e,
                    "fall back guard: the fall back failed; trying again at the next poll");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_keys_share_the_control_keys_slot() {
        assert_eq!(
            guard_key("rl:control", "ip", "7"),
            "{rl:control}:guard:ip:7"
        );
        assert_eq!(
            guard_key("{rl}:control", "ip", "lease"),
            "{rl}:control:guard:ip:lease"
        );
    }

    #[test]
    fn the_tally_counts_distinct_keys_and_the_top_five() {
        let g = TierGuard::new(FallbackGuard::shadow());
        for (k, n) in [
            ("a", 9),
            ("b", 7),
            ("c", 5),
            ("d", 3),
            ("e", 2),
            ("f", 1),
            ("g", 1),
        ] {
            for _ in 0..n {
                g.denied(k);
            }
        }
        assert_eq!(g.take_tally(), (7, 26));
        assert_eq!(g.take_tally(), (0, 0));
    }
}
