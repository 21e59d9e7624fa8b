//! The per-meter headers' numbers ([`HeaderStyle::PerMeter`]): every tier
//! that checked the request offers its numbers to its meter, tokens for a
//! priced tier and requests for the others (`response/meters.rs` keeps the
//! one closest to exhaustion and writes them).

use super::plan::Meta;
use super::state::Shared;
use crate::algorithm::TierDecision;
use crate::response::{HeaderStyle, Meter, Meters, RateLimitHeaders};

/// Attaches the meters of the checks `ds` to `headers` (with the per-meter
/// style only). Observing tiers count when their headers are asked for; a
/// penalty box or an override entry has no numbers of its own. On a
/// `denied` request (charged nothing, all or nothing) a tier that allowed
/// it shows what it holds: its result less the request's cost (its
/// remaining plus the cost, and for a tier that refills continuously the
/// cost's refill time off its reset).
#[inline]
pub(super) fn attach(
    shared: &Shared,
    meta: &Meta,
    ds: &[TierDecision],
    denied: bool,
    headers: &mut RateLimitHeaders,
) {
    if shared.config.header_style == HeaderStyle::PerMeter {
        attach_meters(shared, meta, ds, denied, headers);
    }
}

/// [`attach`] with the per-meter style.
fn attach_meters(
    shared: &Shared,
    meta: &Meta,
    ds: &[TierDecision],
    denied: bool,
    headers: &mut RateLimitHeaders,
) {
    let mut meters = Meters::default();
    for (i, d) in ds.iter().enumerate() {
        if (meta.shadow.contains(i) && !shared.config.shadow_headers)
            || super::decide::is_penalty(meta, i)
        {
            continue;
        }
        let Some(&t) = meta.tiers.get(i) else {
            continue;
        };
        let priced = shared
            .config
            .tiers
            .get(usize::from(t))
            .is_some_and(|b| b.priced);
        let (remaining, reset_us) = if denied && d.allowed {
            let cost = meta.sent.get(i).map_or(0, |c| c.cost);
            let back = match meta.quotas.get(i) {
                Some(&(q, period_us, true)) if q > 0 => {
                    u128::from(cost) * u128::from(period_us) / u128::from(q)
                }
                _ => 0,
            };
            (
                d.remaining.saturating_add(cost).min(d.limit),
                d.reset_after_us
                    .saturating_sub(u64::try_from(back).unwrap_or(u64::MAX)),
            )
        } else {
            (d.remaining, d.reset_after_us)
        };
        meters.offer(
            priced,
            Meter {
                policy: meta.tier_name(shared, i),
                limit: d.limit,
                remaining,
                reset_ms: reset_us.div_ceil(1000),
            },
        );
    }
    headers.meters = Some(Box::new(meters));
}
