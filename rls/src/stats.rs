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
        let hits = d.hits_addend.as_ref().map_or(request_hits, |h| h.value);
        // Labels from the key's levels, never from its dotted text: a
        // value with dots stays one label.
        let mut levels = stat.levels_of(&entries).into_iter().map(|l| sanitize(&l));
        let mut labels = vec![
            ("domain", sanitize(&req.domain)),
            ("key1", levels.next().unwrap_or_default()),
        ];
        if let Some(key2) = levels.next() {
            labels.push(("key2", key2));
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

/// The reference's stat-name sanitizing (its `SanitizeStatName`): `:` and
/// `|` as `_`, and the dots of an IPv4 address (four groups of 1-3 digits)
/// as `_`, so `remote_address_50.0.0.5` is `remote_address_50_0_0_5` as
/// there. Other dots stay (the label is whole, where the reference's
/// dotted stat name would split it).
#[must_use]
pub fn sanitize(level: &str) -> String {
    let mut out: Vec<u8> = level
        .bytes()
        .map(|b| if b == b':' || b == b'|' { b'_' } else { b })
        .collect();
    let mut i = 0;
    while i < out.len() {
        match ipv4_at(&out, i) {
            Some(end) => {
                for b in &mut out[i..end] {
                    if *b == b'.' {
                        *b = b'_';
                    }
                }
                i = end;
            }
            None => i += 1,
        }
    }
    // Only ASCII bytes were replaced by ASCII bytes: still UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The end of `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}` matched at `start`, as
/// Go's leftmost-first regexp matches it (each group takes the most digits
/// that still let the rest match; the last takes up to 3).
fn ipv4_at(s: &[u8], start: usize) -> Option<usize> {
    fn groups(s: &[u8], at: usize, left: u8) -> Option<usize> {
        let digits = s[at..]
            .iter()
            .take(3)
            .take_while(|b| b.is_ascii_digit())
            .count();
        if left == 1 {
            return (digits > 0).then_some(at + digits);
        }
        (1..=digits).rev().find_map(|n| {
            let dot = at + n;
            (s.get(dot) == Some(&b'.'))
                .then(|| groups(s, dot + 1, left - 1))
                .flatten()
        })
    }
    groups(s, start, 4)
}

#[cfg(test)]
mod tests {
    use super::sanitize;

    #[test]
    fn stat_names_are_sanitized_as_the_reference_does() {
        assert_eq!(
            sanitize("remote_address_50.0.0.5"),
            "remote_address_50_0_0_5"
        );
        assert_eq!(sanitize("host_example.com"), "host_example.com");
        assert_eq!(sanitize("a:b|c"), "a_b_c");
        // Leftmost-first, as Go: 1234.5.6.7 matches from the 2.
        assert_eq!(sanitize("1234.5.6.7"), "1234_5_6_7");
        assert_eq!(sanitize("1.2.3"), "1.2.3");
        assert_eq!(sanitize("v_1.2.3.4.5"), "v_1_2_3_4.5");
        assert_eq!(sanitize("path_/é.1.2.3.4"), "path_/é.1_2_3_4");
    }
}
