//! The fall back guard's judgement of one fleet-wide bucket
//! ([`FallbackGuard`](crate::rollout::FallbackGuard)): whether the tier's
//! 429 rate left its band, and why ([`Cause`]).
//!
//! The rule, on each finished bucket of fleet counts with at least
//! `min_requests` checks, once `warmup` buckets built the baselines:
//!
//! * the rate judged is the would-deny rate `x = (enforced 429s + would-be
//!   429s of unenforced checks) / checks`, the same in every mode, so a
//!   shadow stage builds the baseline enforcement is judged by;
//! * `σ = max(√var, √(mean·(1 − mean)/checks), min_sigma)` of its EWMA
//!   baseline (weight 0.1); the bucket is out of band when
//!   `|x − mean| > k·σ`, or, in a canary stage, when the enforced cohort's
//!   429 rate exceeds the shadowed cohort's by more than `k` standard
//!   errors and `min_sigma` (the two match when the limiter is right);
//! * an out-of-band bucket's cause: `unknown` when the rate fell (and no
//!   cohort gap); else `abuse` when fewer than `min_denied_keys` keys were
//!   refused, or the 429s outside the five most refused keys did not rise:
//!   their rate `y = (429s − top five's) / checks` stays within
//!   `max(2·√(ȳ·(1 − ȳ)/checks), 0.02)` of its own baseline ȳ (a few keys
//!   explain the rise; they lead the top-N); else `surge` when the request
//!   rate per instance-second is over `surge_factor` × its baseline's mean;
//!   else `limiter`;
//! * `confirm` consecutive `limiter` buckets fall back. Out-of-band buckets
//!   do not feed the baselines; buckets with too few checks are skipped
//!   (they neither break nor extend a streak).

use crate::rollout::FallbackGuard;

/// EWMA weight of a new bucket in both baselines.
const ALPHA: f64 = 0.1;

/// One bucket of fleet-wide counts of a guarded tier, summed over the
/// instances that flushed into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct FleetBucket {
    /// Checks of the tier.
    pub(crate) checked: u64,
    /// Refused by the tier (enforced 429s).
    pub(crate) limited: u64,
    /// Would have been refused, not enforced (shadow, a canary's other keys).
    pub(crate) shadow: u64,
    /// Distinct refused keys, summed over instances (an upper bound).
    pub(crate) denied_keys: u64,
    /// The five most refused keys' 429s, summed over instances' own top
    /// five (an upper bound of the fleet's top five).
    pub(crate) top: u64,
    /// Instance-milliseconds the counts cover.
    pub(crate) ms: u64,
    /// Checks in the enforced cohort (while a plan runs; 0 otherwise).
    pub(crate) cohort: u64,
}

/// Why a bucket's 429 rate left its band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The limiter: the 429s rose, spread over many keys, at normal traffic.
    Limiter,
    /// A few keys: the refused keys are few or a few hold most 429s.
    Abuse,
    /// The traffic: the request rate is far above its baseline.
    Surge,
    /// None of those (the 429 rate fell, say).
    Unknown,
}

impl Cause {
    /// `limiter`, `abuse`, `surge` or `unknown`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Cause::Limiter => "limiter",
            Cause::Abuse => "abuse",
            Cause::Surge => "surge",
            Cause::Unknown => "unknown",
        }
    }
}

/// A judged bucket and the numbers it was decided on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Judgement {
    /// `None`: inside the band.
    pub(crate) cause: Option<Cause>,
    /// The would-deny rate (0-1).
    pub(crate) rate: f64,
    /// Its baseline's mean (0-1).
    pub(crate) mean: f64,
    /// The σ the band was drawn with.
    pub(crate) sigma: f64,
    /// Checks of the bucket.
    pub(crate) checked: u64,
    /// Checks per instance-second.
    pub(crate) request_rate: f64,
    /// Its baseline's mean.
    pub(crate) request_mean: f64,
    /// Distinct refused keys (summed over instances).
    pub(crate) denied_keys: u64,
    /// The five most refused keys' share of the 429s (0-1).
    pub(crate) top_share: f64,
    /// The 429 rate outside the five most refused keys, and its baseline.
    pub(crate) rest: (f64, f64),
    /// In a canary stage: the enforced cohort's and the shadowed cohort's
    /// 429 rates.
    pub(crate) cohorts: Option<(f64, f64)>,
    /// Consecutive `limiter` buckets so far.
    pub(crate) streak: u32,
    /// Whether this bucket completes `confirm`: fall back.
    pub(crate) fall_back: bool,
}

impl Judgement {
    /// The numbers, as the rollout log's evidence.
    pub(crate) fn evidence(&self) -> String {
        let mut s = format!(
            "cause={} rate={:.4} mean={:.4} sigma={:.4} checked={} request_rate={:.2} request_mean={:.2} denied_keys={} top5_share={:.3} rest_rate={:.4} rest_mean={:.4} streak={}",
            self.cause.map_or("none", Cause::name),
            self.rate,
            self.mean,
            self.sigma,
            self.checked,
            self.request_rate,
            self.request_mean,
            self.denied_keys,
            self.top_share,
            self.rest.0,
            self.rest.1,
            self.streak,
        );
        if let Some((e, sh)) = self.cohorts {
            s.push_str(&format!(" enforced_rate={e:.4} shadowed_rate={sh:.4}"));
        }
        s
    }
}

/// One tier's baselines and streak, fed one fleet bucket at a time.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Detector {
    mean: f64,
    var: f64,
    /// The baseline of the 429 rate outside each bucket's top five keys.
    rest_mean: f64,
    req_mean: f64,
    buckets: u32,
    streak: u32,
}

impl Detector {
    /// Judges one finished bucket (`None`: too few checks, skipped).
    /// `canary`: the tier is in a canary stage with a cohort split counted.
    pub(crate) fn observe(
        &mut self,
        cfg: &FallbackGuard,
        b: &FleetBucket,
        canary: bool,
    ) -> Option<Judgement> {
        if b.checked < cfg.min_requests.max(1) || b.ms == 0 {
            return None;
        }
        let n = b.checked as f64;
        let denied = b.limited + b.shadow;
        let x = (denied as f64 / n).min(1.0);
        let r = b.checked as f64 * 1000.0 / b.ms as f64;
        let d = x - self.mean;
        let sampling = (self.mean * (1.0 - self.mean) / n).sqrt();
        let sigma = self.var.sqrt().max(sampling).max(cfg.min_sigma);
        let warm = self.buckets >= cfg.warmup;
        let mut out = warm && d.abs() > cfg.k * sigma;
        let cohorts = (canary && b.cohort > 0 && b.cohort < b.checked).then(|| {
            let ne = b.cohort as f64;
            let ns = (b.checked - b.cohort) as f64;
            (
                (b.limited as f64 / ne).min(1.0),
                (b.shadow as f64 / ns).min(1.0),
            )
        });
        let mut cohort_gap = false;
        if let Some((pe, ps)) = cohorts {
            let ne = b.cohort as f64;
            let ns = (b.checked - b.cohort) as f64;
            let se = (x * (1.0 - x) * (1.0 / ne + 1.0 / ns)).sqrt();
            cohort_gap = pe - ps > (cfg.k * se).max(cfg.min_sigma);
            out |= cohort_gap;
        }
        let top_share = if denied == 0 {
            0.0
        } else {
            (b.top as f64 / denied as f64).min(1.0)
        };
        let y = (denied.saturating_sub(b.top) as f64 / n).min(1.0);
        let rest_band = (2.0 * (self.rest_mean * (1.0 - self.rest_mean) / n).sqrt()).max(0.02);
        let rest_rose = y - self.rest_mean > rest_band;
        let cause = if !out {
            None
        } else if d <= 0.0 && !cohort_gap {
            Some(Cause::Unknown)
        } else if b.denied_keys < cfg.min_denied_keys || !rest_rose {
            Some(Cause::Abuse)
        } else if r > cfg.surge_factor * self.req_mean {
            Some(Cause::Surge)
        } else {
            Some(Cause::Limiter)
        };
        self.streak = if cause == Some(Cause::Limiter) {
            self.streak.saturating_add(1)
        } else {
            0
        };
        let request_mean = self.req_mean;
        if !out {
            if self.buckets == 0 {
                self.mean = x;
                self.rest_mean = y;
                self.req_mean = r;
            } else {
                self.mean += ALPHA * d;
                self.var = (1.0 - ALPHA) * (self.var + ALPHA * d * d);
                self.req_mean += ALPHA * (r - self.req_mean);
                self.rest_mean += ALPHA * (y - self.rest_mean);
            }
            self.buckets = self.buckets.saturating_add(1);
        }
        Some(Judgement {
            cause,
            rate: x,
            mean: self.mean,
            sigma,
            checked: b.checked,
            request_rate: r,
            request_mean,
            denied_keys: b.denied_keys,
            top_share,
            rest: (y, self.rest_mean),
            cohorts,
            streak: self.streak,
            fall_back: self.streak == cfg.confirm.max(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64: deterministic noise, cheap enough for millions of
    /// buckets in a debug build.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// True with probability `p` (a 32-bit threshold).
        fn bern(&mut self, p32: u64) -> bool {
            (self.next() >> 32) < p32
        }
    }

    fn p32(p: f64) -> u64 {
        (p * 4_294_967_296.0) as u64
    }

    /// Keys of steady traffic: 200 keys, key `i` drawn with weight ∝
    /// 1/√(i+1), each with its own would-deny probability (heavy keys nearer
    /// their quota): 8 %, 6 %, 4 %, then 2 % for the rest. Per bucket about
    /// 40 checks (20/s at 2 s buckets: 20 + Binomial(40, ½)).
    struct Traffic {
        cumulative: Vec<u64>,
        deny: Vec<u64>,
        /// With a quota 10× too low: key `i` uses 20-50 % of its right
        /// quota, so 2-5× the wrong one, and is refused 1 − 1/(10·use):
        /// 50-80 % of its checks.
        wrong: Vec<u64>,
    }

    const KEYS: usize = 200;

    impl Traffic {
        fn steady() -> Self {
            let w: Vec<f64> = (0..KEYS).map(|i| 1.0 / ((i + 1) as f64).sqrt()).collect();
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let cumulative = w
                .iter()
                .map(|x| {
                    acc += x / total;
                    p32(acc)
                })
                .collect();
            let deny = (0..KEYS)
                .map(|i| p32([0.08, 0.06, 0.04].get(i).copied().unwrap_or(0.02)))
                .collect();
            let wrong = (0..KEYS)
                .map(|i| p32(1.0 - 1.0 / (10.0 * (0.2 + 0.1 * (i % 4) as f64))))
                .collect();
            Self {
                cumulative,
                deny,
                wrong,
            }
        }

        /// One bucket, at the right quota or the wrong one. `denials`: a
        /// scratch tally of (key, 429s).
        fn bucket(
            &self,
            rng: &mut Rng,
            wrong: bool,
            denials: &mut Vec<(usize, u64)>,
        ) -> FleetBucket {
            let n = 20 + u64::from((rng.next() & ((1 << 40) - 1)).count_ones());
            denials.clear();
            for _ in 0..n {
                let u = rng.next() >> 32;
                let k = self.cumulative.partition_point(|&c| c <= u).min(KEYS - 1);
                let p = if wrong { self.wrong[k] } else { self.deny[k] };
                if rng.bern(p) {
                    match denials.iter_mut().find(|(key, _)| *key == k) {
                        Some((_, c)) => *c += 1,
                        None => denials.push((k, 1)),
                    }
                }
            }
            let denied: u64 = denials.iter().map(|(_, c)| c).sum();
            denials.sort_unstable_by_key(|d| std::cmp::Reverse(d.1));
            FleetBucket {
                checked: n,
                limited: denied,
                shadow: 0,
                denied_keys: denials.len() as u64,
                top: denials.iter().take(5).map(|(_, c)| c).sum(),
                ms: 2000,
                cohort: 0,
            }
        }
    }

    /// The rate detector nearly alone (no denied-key floor, no surge),, on 1.2 M
    /// buckets of steady traffic, 667 hours at 2 s buckets: no fall back,
    /// and single out-of-band buckets rare enough that `confirm` = 2 in a
    /// row bound the false fall backs far below one per 1 000 hours (1.8 M
    /// buckets): (q̂)² × 1.8 M ≤ 1 needs q̂ ≤ 7.4·10⁻⁴.
    #[test]
    fn steady_traffic_falls_back_less_than_once_per_1000_hours() {
        let mut cfg = FallbackGuard::shadow().min_denied_keys(0);
        cfg.surge_factor = f64::MAX;
        let traffic = Traffic::steady();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut d = Detector::default();
        let mut denials = Vec::new();
        let (mut out, mut falls) = (0u64, 0u64);
        const BUCKETS: u64 = 1_200_000;
        for _ in 0..BUCKETS {
            let b = traffic.bucket(&mut rng, false, &mut denials);
            if let Some(j) = d.observe(&cfg, &b, false) {
                out += u64::from(j.cause == Some(Cause::Limiter));
                falls += u64::from(j.fall_back);
            }
        }
        let q = out as f64 / BUCKETS as f64;
        // One bucket out of band in 1.2 M (q̂ = 8.3·10⁻⁷): two in a row
        // about q̂² × 1.8 M = 1.3·10⁻⁶ times per 1 000 hours.
        assert_eq!((falls, out), (0, 1));
        assert!(q * q * 1.8e6 <= 1.0, "q = {q} ({out} buckets)");
        assert!((d.mean - 0.025).abs() < 0.002, "{d:?}");
    }

    /// A quota 10× too low (see [`Traffic`]'s `wrong`):
    /// every one of 200 trials falls back at exactly its `confirm`-th
    /// bucket, with the cause `limiter`.
    #[test]
    fn a_ten_times_too_low_quota_falls_back_at_the_confirm_th_bucket() {
        let cfg = FallbackGuard::shadow().min_denied_keys(5);
        let traffic = Traffic::steady();
        let mut rng = Rng(42);
        let mut denials = Vec::new();
        let mut delays = Vec::new();
        for _ in 0..200 {
            let mut d = Detector::default();
            for _ in 0..60 {
                let b = traffic.bucket(&mut rng, false, &mut denials);
                assert!(!d.observe(&cfg, &b, false).unwrap().fall_back);
            }
            let delay = (1..=10).find(|_| {
                let b = traffic.bucket(&mut rng, true, &mut denials);
                let j = d.observe(&cfg, &b, false).unwrap();
                assert_eq!(j.cause, Some(Cause::Limiter), "{j:?}");
                j.fall_back
            });
            delays.push(delay);
        }
        assert!(delays.iter().all(|&d| d == Some(2)), "{delays:?}");
    }

    fn bucket(checked: u64, denied: u64, keys: u64, top: u64) -> FleetBucket {
        FleetBucket {
            checked,
            limited: denied,
            shadow: 0,
            denied_keys: keys,
            top,
            ms: 2000,
            cohort: 0,
        }
    }

    fn warm(d: &mut Detector, cfg: &FallbackGuard) {
        for i in 0..20 {
            d.observe(cfg, &bucket(100, 2 + i % 2, 2, 2), false);
        }
    }

    /// Five keys refused at 50× their rate: `abuse`, never a fall back;
    /// twice the traffic everywhere: `surge`; a 429 rate that falls:
    /// `unknown`.
    #[test]
    fn abuse_surge_and_a_fall_are_no_fall_back() {
        let cfg = FallbackGuard::shadow();
        let mut d = Detector::default();
        warm(&mut d, &cfg);
        for _ in 0..10 {
            let j = d.observe(&cfg, &bucket(600, 500, 40, 495), false).unwrap();
            assert_eq!((j.cause, j.fall_back), (Some(Cause::Abuse), false));
            assert!((j.top_share - 0.99).abs() < 1e-9);
        }
        for _ in 0..10 {
            let j = d.observe(&cfg, &bucket(300, 150, 80, 10), false).unwrap();
            assert_eq!((j.cause, j.fall_back), (Some(Cause::Surge), false));
        }
        let mut d = Detector::default();
        for _ in 0..20 {
            d.observe(&cfg, &bucket(100, 40, 30, 8), false);
        }
        let j = d.observe(&cfg, &bucket(100, 0, 0, 0), false).unwrap();
        assert_eq!(j.cause, Some(Cause::Unknown));
        // Too few checks: skipped.
        assert_eq!(d.observe(&cfg, &bucket(19, 19, 19, 5), false), None);
    }

    /// In a canary stage, an enforced cohort refused far more than the
    /// shadowed one (same limiter, same time) is a limiter fault even
    /// while the overall rate stays in its band.
    #[test]
    fn a_canary_cohort_gap_is_the_limiter() {
        let cfg = FallbackGuard::shadow();
        let mut d = Detector::default();
        for _ in 0..20 {
            let mut b = bucket(1000, 20, 20, 5);
            b.shadow = 18;
            b.limited = 2;
            b.cohort = 100;
            d.observe(&cfg, &b, true);
        }
        // Cohort of 100: 30 refused; the 900 others: 18 would be.
        let mut b = bucket(1000, 30, 30, 5);
        b.shadow = 18;
        b.cohort = 100;
        let j = d.observe(&cfg, &b, true).unwrap();
        assert_eq!(j.cause, Some(Cause::Limiter), "{j:?}");
        assert_eq!(j.cohorts, Some((0.3, 0.02)));
        let j = d.observe(&cfg, &b, true).unwrap();
        assert!(j.fall_back);
    }
}
