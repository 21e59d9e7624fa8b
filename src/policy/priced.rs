//! `[tier.priced]`: a tier priced by its response (see
//! [`Tier::priced`](crate::Tier::priced)).
//!
//! ```toml
//! [tier.priced]
//! estimate = { header = "x-max-tokens", default = 1000, max = 32000 }
//! actual = { header = "x-usage-tokens" }
//! ```
//!
//! `estimate` is either `{ header, default, max }` (all three required) or
//! `{ fixed = n }`; `actual` is `{ header = "..." }` (a response header, or
//! a trailer of that name), or left out: only what the handler reports
//! through [`Usage`](crate::priced::Usage).

use crate::error::ConfigError;
use crate::http::priced::{Actual, Estimate};
use serde::Deserialize;

/// A `[tier.priced]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PricedPolicy {
    /// Where the estimate (the cost reserved at admission) comes from.
    pub estimate: EstimatePolicy,
    /// Where the actual cost is read (default: the `Usage` handle only).
    #[serde(default)]
    pub actual: ActualPolicy,
}

/// `estimate = { header = "x-max-tokens", default = 1000, max = 32000 }` or
/// `estimate = { fixed = 100 }` (in the tier's units: tokens).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct EstimatePolicy {
    /// A request header holding the estimate.
    #[serde(default)]
    pub header: Option<String>,
    /// With `header`: the estimate when the header is missing or not a
    /// whole number.
    #[serde(default)]
    pub default: Option<u64>,
    /// With `header`: the largest estimate a request may reserve.
    #[serde(default)]
    pub max: Option<u64>,
    /// The same estimate for every request.
    #[serde(default)]
    pub fixed: Option<u64>,
}

/// `actual = { header = "x-usage-tokens" }`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ActualPolicy {
    /// A response header (or trailer) holding the actual cost.
    #[serde(default)]
    pub header: Option<String>,
}

impl PricedPolicy {
    /// The estimate and actual of tier `tier`.
    pub(crate) fn compile(&self, tier: &str) -> Result<(Estimate, Actual), ConfigError> {
        let refuse = |field: &'static str, reason: &str| ConfigError::Priced {
            tier: tier.to_owned(),
            field,
            reason: reason.to_owned(),
        };
        let e = &self.estimate;
        let estimate = match (&e.header, e.fixed) {
            (Some(h), None) => {
                let default = e.default.ok_or_else(|| {
                    refuse(
                        "priced.estimate.default",
                        "required with priced.estimate.header",
                    )
                })?;
                let max = e.max.ok_or_else(|| {
                    refuse(
                        "priced.estimate.max",
                        "required with priced.estimate.header",
                    )
                })?;
                Estimate::header(h.clone(), default, max)
            }
            (None, Some(n)) if e.default.is_none() && e.max.is_none() => Estimate::fixed(n),
            (None, Some(_)) => {
                return Err(refuse(
                    "priced.estimate.fixed",
                    "takes no default or max (they go with header)",
                ))
            }
            (Some(_), Some(_)) => {
                return Err(refuse(
                    "priced.estimate",
                    "either header (with default and max) or fixed, not both",
                ))
            }
            (None, None) => {
                return Err(refuse(
                    "priced.estimate",
                    "needs header (with default and max) or fixed",
                ))
            }
        };
        let actual = match &self.actual.header {
            Some(h) => Actual::header(h.clone()),
            None => Actual::reported(),
        };
        Ok((estimate, actual))
    }
}
