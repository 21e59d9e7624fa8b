//! Quotas compiled into the integer parameters of each algorithm, checked
//! so that every value the scripts compute stays exact (see
//! [`Quota`](crate::Quota) for the bounds).

use crate::algorithm::kind::{Algorithm, LeakyBucket};
use crate::algorithm::{Gcra, Limit, TokenBucket, Window, MAX_PERIOD_US};
use crate::error::ConfigError;
use crate::quota::Quota;

/// Checks a quota for a tier (limit, period, burst against the fixed cost)
/// and derives the algorithm's integer parameters.
pub(crate) fn checked_limit(
    tier: &str,
    algorithm: Algorithm,
    q: Quota,
    cost: u64,
) -> Result<Limit, ConfigError> {
    if q.limit() == 0 {
        return Err(ConfigError::ZeroLimit {
            tier: tier.to_owned(),
        });
    }
    let period_us = u64::try_from(q.period().as_micros()).unwrap_or(u64::MAX);
    if period_us == 0 {
        return Err(ConfigError::ZeroPeriod {
            tier: tier.to_owned(),
            period: q.period(),
        });
    }
    if q.burst_size() < cost {
        return Err(ConfigError::BurstBelowCost {
            tier: tier.to_owned(),
            burst: q.burst_size(),
            cost,
        });
    }
    limit_for(tier, algorithm, q, period_us)
}

/// The fallback limit: the quota divided by `instances` (at least 1, and at
/// least the fixed cost).
pub(crate) fn fallback_limit(
    tier: &str,
    algorithm: Algorithm,
    q: Quota,
    cost: u64,
    instances: u32,
) -> Result<Limit, ConfigError> {
    let n = u64::from(instances.max(1));
    let limit = (q.limit() / n).max(1);
    let burst = (q.burst_size() / n).max(1).max(cost);
    let divided = if q.burst_size() == q.limit() && limit >= cost {
        Quota::new(limit, q.period())
    } else {
        Quota::new(limit, q.period()).burst(burst)
    };
    // Window algorithms have no burst: keep their limit at least the cost.
    let divided = match algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingWindowLog | Algorithm::SlidingWindowCounter => {
            Quota::new(limit.max(cost), q.period())
        }
        _ => divided,
    };
    checked_limit(tier, algorithm, divided, cost)
}

/// The integer parameters of a tier's algorithm, checked so that every value
/// the Redis script computes stays at or below 2^53 (the bounds are on
/// [`Quota`](crate::Quota)).
fn limit_for(
    tier: &str,
    algorithm: Algorithm,
    q: crate::quota::Quota,
    period_us: u64,
) -> Result<Limit, ConfigError> {
    let too_large = |field: &'static str, detail: String| ConfigError::QuotaTooLarge {
        tier: tier.to_owned(),
        field,
        detail,
    };
    if period_us > MAX_PERIOD_US {
        return Err(too_large(
            "period",
            format!(
                "{period_us} µs is above {MAX_PERIOD_US} µs (2^51 µs, about 71 years), the longest period"
            ),
        ));
    }
    let window = || -> Result<Window, ConfigError> {
        if q.burst_size() != q.limit() {
            return Err(ConfigError::BurstNotSupported {
                tier: tier.to_owned(),
                algorithm,
            });
        }
        Ok(Window {
            limit: q.limit(),
            window_us: period_us,
        })
    };
    let capped = |w: Window| -> Result<Window, ConfigError> {
        if w.limit > Window::MAX_LIMIT {
            return Err(too_large(
                "limit",
                format!(
                    "{} is above {} (2^52 - 1), the largest limit of {algorithm:?}",
                    w.limit,
                    Window::MAX_LIMIT
                ),
            ));
        }
        Ok(w)
    };
    let bucket = || -> Result<TokenBucket, ConfigError> {
        let (unit, rate) = TokenBucket::unit_and_rate(q.limit(), period_us);
        let capacity = u128::from(q.burst_size()) * u128::from(unit);
        if capacity > u128::from(TokenBucket::MAX_CAPACITY_UNITS) {
            // Name the field the user wrote: without a burst, the capacity
            // is the limit.
            let (field, what) = if q.has_burst() {
                ("burst", "burst")
            } else {
                ("limit", "limit (the capacity: no burst is set)")
            };
            return Err(too_large(
                field,
                format!(
                    "{what} × period in units, {} × {unit} = {capacity}, is above 2^52; use a smaller {field} or a shorter period",
                    q.burst_size()
                ),
            ));
        }
        if rate > TokenBucket::MAX_RATE {
            return Err(too_large(
                "limit",
                format!(
                    "the refill rate, {rate} units per µs (limit / gcd(limit, period in µs)), is above 2^51"
                ),
            ));
        }
        TokenBucket::new(q.limit(), period_us, q.burst_size()).ok_or_else(|| {
            too_large(
                "burst",
                format!("{} tokens cannot be counted", q.burst_size()),
            )
        })
    };
    Ok(match algorithm {
        Algorithm::Concurrency { slot_ttl } => {
            let ttl_us = u64::try_from(slot_ttl.as_micros()).unwrap_or(u64::MAX);
            if ttl_us == 0 {
                return Err(ConfigError::Policy(format!(
                    "tier \"{tier}\": lease: must be at least 1 microsecond"
                )));
            }
            if ttl_us > MAX_PERIOD_US {
                return Err(too_large(
                    "lease",
                    format!("{ttl_us} µs is above {MAX_PERIOD_US} µs (2^51 µs)"),
                ));
            }
            if q.limit() > Window::MAX_LIMIT {
                return Err(too_large(
                    "limit",
                    format!("{} is above {}", q.limit(), Window::MAX_LIMIT),
                ));
            }
            Limit::Concurrency(crate::algorithm::Concurrency {
                limit: q.limit(),
                ttl_us,
                slot: 0,
            })
        }
        Algorithm::FixedWindow => Limit::FixedWindow(capped(window()?)?),
        Algorithm::SlidingWindowLog => Limit::SlidingWindowLog(capped(window()?)?),
        Algorithm::SlidingWindowCounter => {
            let w = window()?;
            if !w.counter_is_exact() {
                return Err(too_large(
                    "limit",
                    format!(
                        "(2 × limit + 1) × period, (2 × {} + 1) × {} µs, is above 2^53; use a smaller limit or a shorter period",
                        w.limit, w.window_us
                    ),
                ));
            }
            Limit::SlidingWindowCounter(w)
        }
        Algorithm::TokenBucket => Limit::TokenBucket(bucket()?),
        Algorithm::LeakyBucket(LeakyBucket::Police) => Limit::LeakyBucket(Gcra {
            bucket: bucket()?,
            max_delay_us: None,
        }),
        Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) => {
            let b = bucket()?;
            let max_delay_us = max_delay.as_micros();
            let ticks = max_delay_us
                .saturating_mul(u128::from(b.rate))
                .saturating_add(u128::from(b.capacity));
            if ticks > u128::from(TokenBucket::MAX_CAPACITY_UNITS) {
                return Err(too_large(
                    "max_delay",
                    format!(
                        "capacity + max_delay × rate, {} + {max_delay_us} × {} units, is above 2^52; use a shorter max_delay or a smaller burst",
                        b.capacity, b.rate
                    ),
                ));
            }
            Limit::LeakyBucket(Gcra {
                bucket: b,
                // At most 2^52 by the check above.
                max_delay_us: Some(u64::try_from(max_delay_us).unwrap_or(u64::MAX)),
            })
        }
    })
}
