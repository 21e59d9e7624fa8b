//! The 429-rate baseline and its alert ([`AnomalyConfig`] says how it works).

/// The settings of an automatic baseline of the 429 rate, per (tier,
/// endpoint), that alerts when the current rate leaves `k` standard
/// deviations of normal.
///
/// Time is cut into buckets (default 60 s). At the end of each bucket the
/// series' 429 rate `x = limited / requests` updates an exponentially
/// weighted mean and variance (West's EWMA, weight `alpha`):
///
/// ```text
/// d    = x − mean
/// mean = mean + alpha·d
/// var  = (1 − alpha)·(var + alpha·d²)
/// ```
///
/// After `warmup` buckets, a bucket is *anomalous* when
/// `|x − mean| > k · σ`, with `σ = max(√var, √(mean·(1 − mean)/requests),
/// min_sigma)`: the baseline's own spread, but never less than the sampling
/// noise of a rate measured over that many requests, nor `min_sigma`
/// (default 0.01, one percentage point). `confirm` consecutive anomalous
/// buckets (default 2) raise the alert (a `tracing` warning and the gauge
/// `tiered_ratelimit_anomaly{tier, endpoint} = 1`): at k = 2 a single bucket
/// leaves the band by chance about 5 % of the time, two in a row rarely. The
/// alert clears (info log, gauge 0) at the first bucket back inside the
/// band. Anomalous buckets do not update the baseline, so a long attack does
/// not become normal. Buckets with fewer than `min_requests` requests are
/// skipped. **Delay**: a step change is flagged at the end of its
/// `confirm`-th bucket (2 minutes with the defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnomalyConfig {
    /// Bucket length in seconds (default 60).
    pub bucket_secs: u64,
    /// EWMA weight of a new bucket (default 0.1).
    pub alpha: f64,
    /// Alert threshold in standard deviations (default 2).
    pub k: f64,
    /// Buckets before alerts are possible (default 10).
    pub warmup: u32,
    /// Smallest σ used, as a rate (default 0.01).
    pub min_sigma: f64,
    /// Buckets with fewer requests are ignored (default 20).
    pub min_requests: u64,
    /// Consecutive anomalous buckets that raise the alert (default 2).
    pub confirm: u32,
}

impl Default for AnomalyConfig {
    fn default() -> Self {
        Self {
            bucket_secs: 60,
            alpha: 0.1,
            k: 2.0,
            warmup: 10,
            min_sigma: 0.01,
            min_requests: 20,
            confirm: 2,
        }
    }
}

/// One series' baseline.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Baseline {
    /// EWMA of the 429 rate.
    pub(crate) mean: f64,
    /// EWMA variance.
    pub(crate) var: f64,
    /// Buckets seen.
    pub(crate) buckets: u32,
    /// Whether the alert is raised.
    pub(crate) alerting: bool,
    /// The last bucket's rate.
    pub(crate) last_rate: f64,
    /// Consecutive anomalous buckets so far.
    pub(crate) streak: u32,
}

/// What a bucket did to the alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// The alert was raised.
    Raised,
    /// The alert cleared.
    Cleared,
}

impl Baseline {
    /// Feeds one finished bucket.
    pub(crate) fn observe(
        &mut self,
        cfg: &AnomalyConfig,
        requests: u64,
        limited: u64,
    ) -> Option<Transition> {
        if requests < cfg.min_requests.max(1) {
            return None;
        }
        let x = limited as f64 / requests as f64;
        self.last_rate = x;
        let d = x - self.mean;
        let sampling = (self.mean * (1.0 - self.mean) / requests as f64).sqrt();
        let sigma = self.var.sqrt().max(sampling).max(cfg.min_sigma);
        let anomalous = self.buckets >= cfg.warmup && d.abs() > cfg.k * sigma;
        self.streak = if anomalous {
            self.streak.saturating_add(1)
        } else {
            0
        };
        if !anomalous {
            if self.buckets == 0 {
                self.mean = x;
            } else {
                self.mean += cfg.alpha * d;
                self.var = (1.0 - cfg.alpha) * (self.var + cfg.alpha * d * d);
            }
            self.buckets = self.buckets.saturating_add(1);
        }
        match (anomalous, self.alerting) {
            (true, false) if self.streak >= cfg.confirm.max(1) => {
                self.alerting = true;
                Some(Transition::Raised)
            }
            (false, true) => {
                self.alerting = false;
                Some(Transition::Cleared)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift: deterministic noise.
    struct Rng(u64);
    impl Rng {
        fn unit(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
        /// Binomial(n, p) by summing Bernoulli draws.
        fn binomial(&mut self, n: u64, p: f64) -> u64 {
            (0..n).filter(|_| self.unit() < p).count() as u64
        }
    }

    #[test]
    fn steady_noisy_traffic_never_alerts() {
        let cfg = AnomalyConfig::default();
        let mut b = Baseline::default();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut alerts = 0;
        // A week of minutes at a 5 % 429 rate over 1 000 requests a minute.
        for _ in 0..7 * 24 * 60 {
            let limited = rng.binomial(1000, 0.05);
            if b.observe(&cfg, 1000, limited) == Some(Transition::Raised) {
                alerts += 1;
            }
        }
        assert_eq!(alerts, 0, "baseline {b:?}");
        assert!((b.mean - 0.05).abs() < 0.005, "{b:?}");
    }

    #[test]
    fn a_step_is_flagged_within_the_confirm_buckets_and_clears() {
        let cfg = AnomalyConfig::default();
        let mut b = Baseline::default();
        let mut rng = Rng(42);
        for _ in 0..60 {
            assert_eq!(b.observe(&cfg, 1000, rng.binomial(1000, 0.02)), None);
        }
        // The 429 rate jumps to 30 %: the second bucket (confirm = 2) raises it.
        assert_eq!(b.observe(&cfg, 1000, rng.binomial(1000, 0.30)), None);
        assert_eq!(
            b.observe(&cfg, 1000, rng.binomial(1000, 0.30)),
            Some(Transition::Raised)
        );
        // It stays raised and does not pollute the baseline...
        for _ in 0..30 {
            assert_eq!(b.observe(&cfg, 1000, rng.binomial(1000, 0.30)), None);
        }
        assert!(b.mean < 0.03, "{b:?}");
        // ...and clears at the first normal bucket.
        assert_eq!(
            b.observe(&cfg, 1000, rng.binomial(1000, 0.02)),
            Some(Transition::Cleared)
        );
    }

    #[test]
    fn warmup_and_thin_buckets_are_quiet() {
        let cfg = AnomalyConfig::default();
        let mut b = Baseline::default();
        for _ in 0..9 {
            b.observe(&cfg, 100, 0);
        }
        // Still warming up: no alert even for a huge change.
        assert_eq!(b.observe(&cfg, 100, 90), None);
        // Too few requests: ignored.
        assert_eq!(b.observe(&cfg, 5, 5), None);
        assert_eq!(b.buckets, 10);
    }
}
