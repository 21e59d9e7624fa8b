//! The reference service's per-limit stats
//! (`ratelimit.service.rate_limit.<stat key>.<stat>`) as Prometheus
//! counters, named as the reference's own Prometheus mapping names them
//! (its `USE_PROMETHEUS` default mapper, the same as its statsd_exporter
//! example): `ratelimit_service_rate_limit_<stat>{domain, key1[, key2]}`,
//! `key1`/`key2` the stat key's first two levels (deeper ones dropped, as
//! there). docs/envoy.md has the mapping and where the counts differ.

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tiered_ratelimit::descriptor::{Answer, Code};

/// The reference's `NEAR_LIMIT_RATIO` default: a hit past 80 % of the
/// limit is `near_limit`.
pub const NEAR_LIMIT_RATIO: f32 = 0.8;

/// The count past which passing hits are `near_limit`: `floor(limit ×
/// ratio)`, computed as the reference computes it (the product in 32-bit
/// floating point, so `NEAR_LIMIT_RATIO=0.7` on a limit of 90 gives 63, as
/// there, not the 62 of 64 bits).
#[must_use]
pub fn near_limit_threshold(requests_per_unit: u32, ratio: f32) -> u64 {
    // The reference: uint64(math.Floor(float64(float32(limit) * ratio))).
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let near = f64::from(requests_per_unit as f32 * ratio).floor() as u64;
    near
}

/// Counts one answered request: per descriptor whose rule came from the
/// reference's YAML, `total_hits` += its hits; then, with a limit,
/// `within_limit` (and the part past the near-limit threshold in
/// `near_limit`) when it passed, or `over_limit` (and `shadow_mode` for a
/// rule in shadow) when it was over. `near_limit_ratio` is the reference's
/// `NEAR_LIMIT_RATIO` ([`near_limit_threshold`]).
pub fn record(req: &RateLimitRequest, answer: &Answer, near_limit_ratio: f32) {
    let request_hits = u64::from(req.hits_addend.max(1));
    // Denied: nothing was charged (under the global shadow mode a status
    // says OVER_LIMIT, the request is OK and was charged).
    let denied = answer.overall == Code::OverLimit;
    for (d, s) in req.descriptors.iter().zip(&answer.statuses) {
        let Some(stat) = &s.stat else { continue };
        let entries: Vec<(&str, &str)> = d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        let key = stat.key(&req.domain, &entries);
        let hits = d.hits_addend.as_ref().map_or(request_hits, |h| h.value);
        let mut parts = key.split('.');
        let domain = parts.next().unwrap_or_default().to_owned();
        let key1 = parts.next().unwrap_or_default().to_owned();
        let mut labels = vec![("domain", domain), ("key1", key1)];
        if let Some(key2) = parts.next() {
            labels.push(("key2", key2.to_owned()));
        }
        let count = |name: &'static str, n: u64| {
            metrics::counter!(name, &labels).increment(n);
        };
        count("ratelimit_service_rate_limit_total_hits", hits);
        let Some(limit) = &s.limit else { continue };
        if s.code == Code::OverLimit || s.shadow_over {
            count("ratelimit_service_rate_limit_over_limit", hits);
            if s.shadow_over {
                count("ratelimit_service_rate_limit_shadow_mode", hits);
            }
            continue;
        }
        let per_unit = u64::from(limit.requests_per_unit);
        // The counter before and after this request's hits: when another
        // descriptor denied the request, `remaining` is before them.
        let (before, after) = if denied {
            let before = per_unit.saturating_sub(s.remaining);
            (before, before.saturating_add(hits))
        } else {
            let after = per_unit.saturating_sub(s.remaining);
            (after.saturating_sub(hits), after)
        };
        let near = near_limit_threshold(limit.requests_per_unit, near_limit_ratio);
        if after > near {
            count(
                "ratelimit_service_rate_limit_near_limit",
                after - before.max(near),
            );
        }
        count("ratelimit_service_rate_limit_within_limit", hits);
    }
}
