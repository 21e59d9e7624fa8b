//! [`FallbackGuard`]: a tier's automatic fall back to shadow when its 429
//! rate leaves its band and the limiter, not the traffic, is the likely
//! cause (`[tier.guard]` in a policy file).

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::time::Duration;

/// Where a [`FallbackGuard`] takes the tier: shadow, and nothing else
/// (never `off`, never the denylist), so the tier keeps counting what it
/// would refuse while nobody is refused by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Fallback {
    /// Shadow mode, fleet-wide.
    #[default]
    Shadow,
}

impl<'de> Deserialize<'de> for Fallback {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "shadow" => Ok(Fallback::Shadow),
            other => Err(de::Error::custom(format!(
                "guard.fallback: {other:?}: the only fall back is \"shadow\" (never off, never the denylist)"
            ))),
        }
    }
}

/// The automatic fall back of one tier (`[tier.guard]`).
///
/// Every instance adds its checks of the tier to fleet-wide counts in
/// Redis, one bucket of `bucket` at a time (at each control-key poll, in
/// the same call that reads the counts back): checks, enforced 429s,
/// would-be 429s of unenforced checks, distinct refused keys and the five
/// most refused keys' share, the checks' rate per instance-second, and in a
/// canary stage the enforced cohort's checks. Every instance judges each
/// finished bucket the same way (`docs/rollout.md`, "The automatic fall
/// back", gives the rule and its numbers); one instance, the holder of the
/// guard's lease, acts: when `confirm` buckets in a row are out of band
/// with the cause `limiter`, it sets the tier's fleet mode to shadow and
/// stops its plan in one compare-and-set, and records the evidence in the
/// rollout log. Nothing re-advances by itself. Needs a control key.
///
/// Defaults: 5 s buckets, `k` = 4, `confirm` = 2, `warmup` = 10 buckets,
/// `min_sigma` = 0.05, `min_requests` = 20 a bucket, `min_denied_keys` =
/// 10, `surge_factor` = 2. With them and the
/// default 5 s poll, a wrong quota at ≥ 20 checks/s is in shadow on every
/// instance within 30 s.
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::rollout::FallbackGuard;
/// let guard = FallbackGuard::shadow().bucket(Duration::from_secs(2)).confirm(3);
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
#[must_use]
#[non_exhaustive]
pub struct FallbackGuard {
    /// Where the tier goes (`"shadow"`, the only choice).
    pub fallback: Fallback,
    /// The length of a bucket of the fleet-wide counts (humantime; default
    /// 5 s; at least 1 s and the control key's poll interval).
    #[serde(default = "default_bucket", with = "humantime_serde")]
    pub bucket: Duration,
    /// How many standard deviations of its baseline the 429 rate may move
    /// (default 4).
    #[serde(default = "default_k")]
    pub k: f64,
    /// Consecutive `limiter` buckets that fall back (default 2).
    #[serde(default = "default_confirm")]
    pub confirm: u32,
    /// Buckets of baseline before any judgement (default 10).
    #[serde(default = "default_warmup")]
    pub warmup: u32,
    /// The smallest standard deviation used, as a rate (default 0.05).
    #[serde(default = "default_min_sigma")]
    pub min_sigma: f64,
    /// Fleet-wide checks a bucket needs to be judged (default 20).
    #[serde(default = "default_min_requests")]
    pub min_requests: u64,
    /// Distinct refused keys a `limiter` bucket has at least (default 10):
    /// fewer is `abuse`.
    #[serde(default = "default_min_denied_keys")]
    pub min_denied_keys: u64,
    /// The request rate over its baseline's mean that is a `surge`
    /// (default 2).
    #[serde(default = "default_surge_factor")]
    pub surge_factor: f64,
}

fn default_bucket() -> Duration {
    Duration::from_secs(5)
}
fn default_k() -> f64 {
    4.0
}
fn default_confirm() -> u32 {
    2
}
fn default_warmup() -> u32 {
    10
}
fn default_min_sigma() -> f64 {
    0.05
}
fn default_min_requests() -> u64 {
    20
}
fn default_min_denied_keys() -> u64 {
    10
}
fn default_surge_factor() -> f64 {
    2.0
}

impl Default for FallbackGuard {
    fn default() -> Self {
        Self::shadow()
    }
}

impl FallbackGuard {
    /// Falls back to shadow, with the default thresholds.
    pub fn shadow() -> Self {
        Self {
            fallback: Fallback::Shadow,
            bucket: default_bucket(),
            k: default_k(),
            confirm: default_confirm(),
            warmup: default_warmup(),
            min_sigma: default_min_sigma(),
            min_requests: default_min_requests(),
            min_denied_keys: default_min_denied_keys(),
            surge_factor: default_surge_factor(),
        }
    }

    /// The buckets' length.
    pub fn bucket(mut self, d: Duration) -> Self {
        self.bucket = d;
        self
    }

    /// The band's half-width in standard deviations.
    pub fn k(mut self, k: f64) -> Self {
        self.k = k;
        self
    }

    /// Consecutive `limiter` buckets that fall back.
    pub fn confirm(mut self, n: u32) -> Self {
        self.confirm = n;
        self
    }

    /// Buckets of baseline before any judgement.
    pub fn warmup(mut self, n: u32) -> Self {
        self.warmup = n;
        self
    }

    /// The smallest standard deviation, as a rate.
    pub fn min_sigma(mut self, s: f64) -> Self {
        self.min_sigma = s;
        self
    }

    /// Fleet-wide checks a bucket needs to be judged.
    pub fn min_requests(mut self, n: u64) -> Self {
        self.min_requests = n;
        self
    }

    /// Distinct refused keys of a `limiter` bucket, at least.
    pub fn min_denied_keys(mut self, n: u64) -> Self {
        self.min_denied_keys = n;
        self
    }

    /// The request rate over its baseline that is a `surge`.
    pub fn surge_factor(mut self, f: f64) -> Self {
        self.surge_factor = f;
        self
    }

    /// Checks it as `build()` does: the field (`guard.k`) and why.
    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        let bad = |f: &str, why: &str| Err((format!("guard.{f}"), why.to_owned()));
        if self.bucket < Duration::from_secs(1) {
            return bad("bucket", "at least 1s");
        }
        if !(self.k.is_finite() && self.k > 0.0) {
            return bad("k", "a number greater than 0");
        }
        if self.confirm == 0 {
            return bad("confirm", "at least 1");
        }
        if !(self.min_sigma.is_finite() && (0.0..1.0).contains(&self.min_sigma)) {
            return bad("min_sigma", "a rate from 0 to below 1");
        }
        if self.min_requests == 0 {
            return bad("min_requests", "at least 1");
        }
        if !(self.surge_factor.is_finite() && self.surge_factor > 1.0) {
            return bad("surge_factor", "a factor greater than 1");
        }
        Ok(())
    }
}
