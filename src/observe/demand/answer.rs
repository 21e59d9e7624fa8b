//! From per-key peaks to a suggestion: the percentiles, the curve of keys
//! and requests denied against each limit, the keys left out, and the
//! smallest limit that denies at most the target share of keys. Pure: the
//! live API ([`RateLimitHandle::suggest`](crate::RateLimitHandle::suggest))
//! and the offline `tiered-ratelimit suggest` answer through it.

use super::buckets;
use std::collections::HashMap;

/// Fewer distinct keys than this: no suggestion
/// ([`SuggestError::NotEnoughData`]).
pub(crate) const MIN_KEYS: u64 = 50;

/// A key above this many times the p99.9 of the keys below it is an
/// outlier: left out of the distribution and named.
pub(crate) const OUTLIER_FACTOR: u64 = 10;

/// The percentiles answered, in thousandths.
const PERCENTILES: [(u64, &str); 4] = [(500, "p50"), (900, "p90"), (990, "p99"), (999, "p99.9")];

/// A suggested limit and the demand behind it: see
/// [`RateLimitHandle::suggest`](crate::RateLimitHandle::suggest).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Suggestion {
    /// The tier.
    pub tier: String,
    /// The plan (`None`: the tier's default quota).
    pub plan: Option<String>,
    /// The period per-key demand is counted over, in seconds (the quota's
    /// period, at least 1 s; periods aligned to the Unix epoch).
    pub period_s: u64,
    /// The share of keys the suggestion may deny.
    pub target: f64,
    /// The window read, in seconds (whole hours).
    pub window_s: u64,
    /// The percentiles of per-key demand (each key's most requests, in the
    /// tier's cost units, in one period of the window), as bucket edges:
    /// `[("p50", v), ("p90", v), ("p99", v), ("p99.9", v)]`.
    pub percentiles: Vec<(String, u64)>,
    /// The suggestion.
    pub suggested: Suggested,
    /// For each bucket edge holding a key: the keys whose demand is above it
    /// (`keys_denied`) and the requests above it in their peak periods
    /// (`requests_denied`), ascending.
    pub curve: Vec<CurvePoint>,
    /// The keys left out of the distribution, each named with why.
    pub left_out: Vec<LeftOut>,
    /// Distinct keys in the distribution (after the keys left out): all of
    /// them, or the sample's when `sampled`.
    pub keys: u64,
    /// Whether the window held more keys than an hour's sample keeps
    /// (1 024 keys): the distribution is then
    /// the bottom-k sample by hash of the window's keys (the same on every
    /// instance), and the curve's counts are scaled to `estimated_keys`.
    pub sampled: bool,
    /// Distinct keys in the window: exact, or when `sampled` the bottom-k
    /// estimate `(k − 1) · 2⁶⁴ / h_k` (`h_k` the k-th smallest hash; about
    /// 3 % standard error at k = 1024).
    pub estimated_keys: u64,
    /// Requests (cost units) seen in the window, every key's, attempts
    /// denied included.
    pub requests: u64,
    /// Requests not sampled: their key was beyond the per-period or
    /// per-hour key bound (see the module docs).
    pub unsampled_requests: u64,
}

impl Suggestion {
    /// The answer as the admin API and `tiered-ratelimit suggest` write
    /// it: `{"tier","plan","period_s","target","window_s","percentiles":
    /// {"p50","p90","p99","p99.9"},"suggested","applied":false,"curve",
    /// "left_out","keys","sampled","estimated_keys","requests",
    /// "unsampled_requests"}`, `suggested`
    /// `{"limit","period_s"}` or `{"rate","period_s","burst"}`.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        let percentiles: serde_json::Map<String, serde_json::Value> = self
            .percentiles
            .iter()
            .map(|(k, v)| (k.clone(), (*v).into()))
            .collect();
        serde_json::json!({
            "tier": self.tier,
            "plan": self.plan,
            "period_s": self.period_s,
            "target": self.target,
            "window_s": self.window_s,
            "percentiles": percentiles,
            "suggested": self.suggested,
            "applied": false,
            "curve": self.curve,
            "left_out": self.left_out,
            "keys": self.keys,
            "sampled": self.sampled,
            "estimated_keys": self.estimated_keys,
            "requests": self.requests,
            "unsampled_requests": self.unsampled_requests,
        })
    }
}

impl SuggestError {
    /// `{"error":"not_enough_data","keys":N,"needed":50}` and the like.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            SuggestError::NotEnoughData { keys, needed } => serde_json::json!({
                "error": "not_enough_data", "keys": keys, "needed": needed
            }),
            SuggestError::UnknownTier(t) => serde_json::json!({"error": "unknown_tier", "tier": t}),
            SuggestError::Off => {
                serde_json::json!({"error": "demand_off", "message": self.to_string()})
            }
            SuggestError::InvalidTarget(_) => {
                serde_json::json!({"error": "invalid_target", "message": self.to_string()})
            }
            SuggestError::Backend(_) => {
                serde_json::json!({"error": "backend_failed", "message": self.to_string()})
            }
        }
    }
}

/// A limit at one bucket edge and what it would have denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CurvePoint {
    /// The limit, per period.
    pub limit: u64,
    /// Keys whose peak is above it.
    pub keys_denied: u64,
    /// Their requests above it, in their peak periods.
    pub requests_denied: u64,
}

/// What to configure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum Suggested {
    /// A fixed or sliding window (or calendar) tier: `limit` per `period_s`.
    Limit {
        /// Requests per period.
        limit: u64,
        /// The period, in seconds.
        period_s: u64,
    },
    /// A token or leaky bucket: `rate` tokens per `period_s`, a bucket of
    /// `burst` (the per-period limit: a key within it every period is
    /// denied only when its whole period's demand follows straight on the
    /// period before's whole demand).
    Bucket {
        /// Tokens added per period.
        rate: u64,
        /// The period, in seconds.
        period_s: u64,
        /// The bucket's capacity.
        burst: u64,
    },
}

/// A key left out of the distribution.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LeftOut {
    /// The key part as stored, or `#<hash>` (16 hex digits of its xxh3)
    /// when its name was not kept.
    pub key: String,
    /// Its demand (the most in one period).
    pub demand: u64,
    /// `outlier`, `denylisted` or `penalised`.
    pub reason: &'static str,
}

/// Why there is no suggestion.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SuggestError {
    /// Fewer than 50 distinct keys in the window.
    #[error("not enough data: {keys} distinct keys, {needed} needed")]
    NotEnoughData {
        /// Distinct keys seen.
        keys: u64,
        /// The keys needed: 50.
        needed: u64,
    },
    /// No such tier, or no such plan on it.
    #[error("unknown tier or plan: {0}")]
    UnknownTier(String),
    /// The target is not in `0..1`.
    #[error("target must be at least 0 and below 1, got {0}")]
    InvalidTarget(f64),
    /// Per-key demand is not recorded: turn it on with
    /// [`RateLimitLayerBuilder::demand`](crate::RateLimitLayerBuilder::demand)
    /// or [`RateLimitHandle::set_demand`](crate::RateLimitHandle::set_demand).
    #[error("per-key demand is not recorded: turn it on with the builder's demand(true) or RateLimitHandle::set_demand(true)")]
    Off,
    /// The demand could not be read (Redis).
    #[error("demand could not be read: {0}")]
    Backend(String),
}

/// What a window holds: per key hash its peak, the names kept, the
/// requests and the unsampled requests.
#[derive(Debug, Default, Clone)]
pub(crate) struct Window {
    pub(crate) peaks: HashMap<u64, u64>,
    pub(crate) names: HashMap<u64, String>,
    pub(crate) requests: u64,
    pub(crate) unsampled: u64,
    /// An hour's sample was full: `peaks` is a sample of the keys.
    pub(crate) full: bool,
}

impl Window {
    /// Adds one hour: per-key peaks by max, the rest summed.
    pub(crate) fn add_hour(
        &mut self,
        peaks: impl IntoIterator<Item = (u64, u64)>,
        names: impl IntoIterator<Item = (u64, String)>,
        requests: u64,
        unsampled: u64,
        full: bool,
    ) {
        for (h, p) in peaks {
            let e = self.peaks.entry(h).or_insert(0);
            *e = (*e).max(p);
        }
        for (h, n) in names {
            self.names.entry(h).or_insert(n);
        }
        self.requests = self.requests.saturating_add(requests);
        self.unsampled = self.unsampled.saturating_add(unsampled);
        self.full |= full;
    }
}

/// The key's name, or `#<hash>`.
pub(crate) fn name_of(names: &HashMap<u64, String>, h: u64) -> String {
    names
        .get(&h)
        .cloned()
        .unwrap_or_else(|| format!("#{h:016x}"))
}

/// What the suggestion is about.
pub(crate) struct Ask<'a> {
    pub(crate) tier: &'a str,
    pub(crate) plan: Option<&'a str>,
    pub(crate) period_s: u64,
    pub(crate) bucket: bool,
    pub(crate) target: f64,
    pub(crate) window_s: u64,
}

/// The suggestion over `w`; `listed(name)` says why a named key is left
/// out before any rule (`denylisted`, `penalised`), if it is.
///
/// The rules: a key named by `listed` is left out; of the others, a key
/// above 10 × the p99.9 of the keys below it (by bucket
/// edge) is an outlier, asked from the heaviest down.
/// A percentile `p` of `n` keys is the bucket edge of the `⌈p·n⌉`-th
/// smallest peak; `suggested` is the bucket edge of the
/// `(n − ⌊target·n⌋)`-th smallest (at least 1): no smaller limit denies at
/// most `target` of the keys, to within the bucket.
///
/// # Errors
/// [`SuggestError::NotEnoughData`] below 50 distinct keys (all
/// the window's, before any is left out). Sampled (`w.full`): the
/// distribution is the window's bottom-k by hash.
pub(crate) fn suggest(
    ask: &Ask<'_>,
    w: &Window,
    listed: &dyn Fn(&str) -> Option<&'static str>,
) -> Result<Suggestion, SuggestError> {
    let mut sample: Vec<(u64, u64)> = w.peaks.iter().map(|(&h, &p)| (h, p)).collect();
    let k = super::MAX_HOUR_KEYS;
    let (sampled, distinct) = if w.full && !sample.is_empty() {
        // The bottom-k of the hours' bottom-k samples is the window's.
        sample.sort_unstable_by_key(|&(h, _)| (super::score(h), h));
        sample.truncate(usize::try_from(k).unwrap_or(usize::MAX));
        let hk = sample.last().map_or(u64::MAX, |&(h, _)| h);
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let est = ((sample.len() as f64 - 1.0) * 18_446_744_073_709_551_616.0 / (hk as f64 + 1.0))
            .round() as u64;
        (true, est.max(sample.len() as u64))
    } else {
        (false, sample.len() as u64)
    };
    if distinct < MIN_KEYS {
        return Err(SuggestError::NotEnoughData {
            keys: distinct,
            needed: MIN_KEYS,
        });
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = distinct as f64 / sample.len() as f64;
    let mut left_out = Vec::new();
    let mut kept: Vec<(u64, u64)> = Vec::with_capacity(sample.len());
    for &(h, p) in &sample {
        match w.names.get(&h).and_then(|n| listed(n)) {
            Some(reason) => left_out.push(LeftOut {
                key: name_of(&w.names, h),
                demand: p,
                reason,
            }),
            None => kept.push((p, h)),
        }
    }
    kept.sort_unstable();
    // From the top: a key above OUTLIER_FACTOR × the p99.9 of the keys
    // below it is left out, and the next one is asked the same.
    while kept.len() > 1 {
        let (rest, top) = kept.split_at(kept.len() - 1);
        let p999 = rank(rest, 999, 1000).map_or(0, buckets::top);
        if top[0].0 <= p999.saturating_mul(OUTLIER_FACTOR) {
            break;
        }
        let Some((p, h)) = kept.pop() else { break };
        left_out.push(LeftOut {
            key: name_of(&w.names, h),
            demand: p,
            reason: "outlier",
        });
    }
    left_out.sort_by(|a, b| b.demand.cmp(&a.demand).then_with(|| a.key.cmp(&b.key)));
    let n = kept.len() as u64;
    let percentiles = PERCENTILES
        .iter()
        .map(|&(p, name)| {
            let v = rank(&kept, p, 1000).map_or(0, buckets::top);
            (name.to_owned(), v)
        })
        .collect();
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let allowed_denied = ((ask.target * n as f64).floor() as u64).min(n);
    let at = n - allowed_denied;
    let limit = if at == 0 {
        1
    } else {
        let idx = usize::try_from(at - 1).unwrap_or(usize::MAX);
        kept.get(idx).map_or(1, |&(p, _)| buckets::top(p).max(1))
    };
    let suggested = if ask.bucket {
        Suggested::Bucket {
            rate: limit,
            period_s: ask.period_s,
            burst: limit,
        }
    } else {
        Suggested::Limit {
            limit,
            period_s: ask.period_s,
        }
    };
    Ok(Suggestion {
        tier: ask.tier.to_owned(),
        plan: ask.plan.map(str::to_owned),
        period_s: ask.period_s,
        target: ask.target,
        window_s: ask.window_s,
        percentiles,
        suggested,
        curve: curve(&kept, scale),
        left_out,
        keys: n,
        sampled,
        estimated_keys: distinct,
        requests: w.requests,
        unsampled_requests: w.unsampled,
    })
}

/// The `⌈num/den · n⌉`-th smallest peak of `sorted` (at least the first).
fn rank(sorted: &[(u64, u64)], num: u64, den: u64) -> Option<u64> {
    let n = sorted.len() as u64;
    if n == 0 {
        return None;
    }
    let r = (num * n).div_ceil(den).max(1);
    sorted
        .get(usize::try_from(r - 1).unwrap_or(usize::MAX))
        .map(|&(p, _)| p)
}

/// One point per bucket edge holding a key, ascending; counts multiplied
/// by `scale` (1 unless sampled).
fn curve(sorted: &[(u64, u64)], scale: f64) -> Vec<CurvePoint> {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let scaled = |v: u64| {
        if (scale - 1.0).abs() < f64::EPSILON {
            v
        } else {
            (v as f64 * scale).round() as u64
        }
    };
    let mut tops: Vec<u64> = sorted.iter().map(|&(p, _)| buckets::top(p)).collect();
    tops.dedup();
    // Suffix sums: keys above a limit are the tail past it.
    let total: u64 = sorted.iter().map(|&(p, _)| p).fold(0, u64::saturating_add);
    let mut i = 0;
    let mut below_sum = 0u64;
    tops.into_iter()
        .map(|limit| {
            while i < sorted.len() && sorted[i].0 <= limit {
                below_sum = below_sum.saturating_add(sorted[i].0);
                i += 1;
            }
            let above = (sorted.len() - i) as u64;
            CurvePoint {
                limit,
                keys_denied: scaled(above),
                requests_denied: scaled(
                    total
                        .saturating_sub(below_sum)
                        .saturating_sub(above.saturating_mul(limit)),
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(peaks: &[u64]) -> Window {
        let mut w = Window::default();
        w.add_hour(
            peaks.iter().enumerate().map(|(i, &p)| (i as u64 + 1, p)),
            [(1u64, "first".to_owned())],
            peaks.iter().sum(),
            0,
            false,
        );
        w
    }

    fn ask(target: f64) -> Ask<'static> {
        Ask {
            tier: "ip",
            plan: None,
            period_s: 60,
            bucket: false,
            target,
            window_s: 3600,
        }
    }

    #[test]
    fn refuses_below_fifty_keys() {
        let w = window(&[5; 49]);
        assert_eq!(
            suggest(&ask(0.01), &w, &|_| None),
            Err(SuggestError::NotEnoughData {
                keys: 49,
                needed: 50
            })
        );
    }

    #[test]
    fn percentiles_suggestion_curve_and_outliers() {
        // Keys 1..=100 send 1..=100, one more sends 100 000.
        let mut peaks: Vec<u64> = (1..=100).collect();
        peaks.push(100_000);
        let w = window(&peaks);
        let s = suggest(&ask(0.05), &w, &|_| None).unwrap();
        assert_eq!(s.keys, 100);
        assert_eq!(
            s.left_out,
            [LeftOut {
                key: format!("#{:016x}", 101),
                demand: 100_000,
                reason: "outlier"
            }]
        );
        let p: Vec<u64> = s.percentiles.iter().map(|x| x.1).collect();
        assert_eq!(p, [50, 90, buckets::top(99), buckets::top(100)]);
        // 5 % of 100 keys may be denied: the 95th smallest.
        assert_eq!(
            s.suggested,
            Suggested::Limit {
                limit: buckets::top(95),
                period_s: 60
            }
        );
        let at_90 = s.curve.iter().find(|c| c.limit == 90).unwrap();
        assert_eq!((at_90.keys_denied, at_90.requests_denied), (10, 55));
        assert_eq!(s.curve.last().unwrap().keys_denied, 0);
        // Named keys listed by the caller are left out first.
        let s = suggest(&ask(0.05), &w, &|n| (n == "first").then_some("denylisted")).unwrap();
        assert_eq!(s.keys, 99);
        assert_eq!(s.left_out[1].key, "first");
    }

    #[test]
    fn a_full_sample_is_the_windows_bottom_k_with_the_keys_estimated() {
        // 20 000 keys of demand 1..=100 by hash: the bottom-k by hash of
        // them, as the hours kept them.
        let k = usize::try_from(crate::observe::demand::MAX_HOUR_KEYS).unwrap();
        let mut keys: Vec<(u64, u64)> = (0..20_000u64)
            .map(|i| (crate::observe::demand::hash(&format!("k{i}")), 1 + i % 100))
            .collect();
        keys.sort_unstable_by_key(|&(h, _)| (crate::observe::demand::score(h), h));
        let mut w = Window::default();
        // Two hours whose samples overlap: the union is cut back to k.
        w.add_hour(keys[..k].iter().copied(), [], 0, 0, true);
        w.add_hour(keys[k / 2..k + k / 2].iter().copied(), [], 0, 0, true);
        let s = suggest(&ask(0.0), &w, &|_| None).unwrap();
        assert!(s.sampled);
        assert_eq!(s.keys, k as u64);
        // Within 15 % (five standard errors) of the 20 000 keys.
        assert!(
            (17_000..=23_000).contains(&s.estimated_keys),
            "{}",
            s.estimated_keys
        );
        let p50 = s.percentiles[0].1;
        assert!((40..=60).contains(&p50), "{p50}");
        // Scaled to the estimate: every key is denied below the smallest.
        assert_eq!(s.curve[0].limit, 1);
        let denied = s.curve[0].keys_denied;
        assert!(
            denied > s.estimated_keys * 95 / 100 && denied <= s.estimated_keys,
            "{denied}"
        );
    }
}
