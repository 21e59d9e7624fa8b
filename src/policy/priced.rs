//! `[tier.priced]`: a tier priced by its response (see
//! [`Tier::priced`](crate::Tier::priced)).
//!
//! ```toml
//! [tier.priced]
//! estimate = { header = "x-max-tokens", default = 1000, max = 32000 }
//! actual = { header = "x-usage-tokens" }
//! ```
//!
//! `estimate` is either `{ header, default, max }` (all three required),
//! `{ json = "max_tokens", default, max }` (a field of the JSON request body,
//! read by [`RateLimitLayer::json_body`](crate::RateLimitLayer::json_body);
//! `max_body_bytes` optional, default 2 MiB) or `{ fixed = n }`; `actual` is `{ header = "..." }` (a response header, or
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

/// `estimate = { header = "x-max-tokens", default = 1000, max = 32000 }`,
/// `estimate = { json = "max_tokens", default = 1000, max = 32000,
/// max_body_bytes = 1048576 }` or `estimate = { fixed = 100 }` (in the tier's
/// units: tokens).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct EstimatePolicy {
    /// A request header holding the estimate.
    #[serde(default)]
    pub header: Option<String>,
    /// A top-level field of the JSON request body holding the estimate
    /// ([`Estimate::json`]).
    #[serde(default)]
    pub json: Option<String>,
    /// With `header` or `json`: the estimate when the header (field) is
    /// missing or not a whole number.
    #[serde(default)]
    pub default: Option<u64>,
    /// With `header` or `json`: the largest estimate a request may reserve.
    #[serde(default)]
    pub max: Option<u64>,
    /// With `json`: the largest request body read, in bytes (default 2 MiB;
    /// a larger body is answered 413).
    #[serde(default)]
    pub max_body_bytes: Option<usize>,
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
        let bounds = |with: &str| -> Result<(u64, u64), ConfigError> {
            let default = e.default.ok_or_else(|| {
                refuse("priced.estimate.default", &format!("required with {with}"))
            })?;
            let max = e
                .max
                .ok_or_else(|| refuse("priced.estimate.max", &format!("required with {with}")))?;
            Ok((default, max))
        };
        let estimate = match (&e.header, &e.json, e.fixed) {
            (Some(h), None, None) => {
                let (default, max) = bounds("priced.estimate.header")?;
                Estimate::header(h.clone(), default, max)
            }
            (None, Some(field), None) => {
                let (default, max) = bounds("priced.estimate.json")?;
                let json = Estimate::json(field.clone(), default, max);
                match e.max_body_bytes {
                    Some(n) => json.max_body_bytes(n),
                    None => json,
                }
            }
            (None, None, Some(n)) if e.default.is_none() && e.max.is_none() => Estimate::fixed(n),
            (None, None, Some(_)) => {
                return Err(refuse(
                    "priced.estimate.fixed",
                    "takes no default or max (they go with header or json)",
                ))
            }
            (None, None, None) => {
                return Err(refuse(
                    "priced.estimate",
                    "needs header or json (with default and max) or fixed",
                ))
            }
            (Some(_), None, Some(_)) => {
                return Err(refuse(
                    "priced.estimate",
                    "either header (with default and max) or fixed, not both",
                ))
            }
            _ => {
                return Err(refuse(
                    "priced.estimate",
                    "json goes alone (with default and max), without header or fixed",
                ))
            }
        };
        if e.max_body_bytes.is_some() && e.json.is_none() {
            return Err(refuse(
                "priced.estimate.max_body_bytes",
                "goes with json only (no other estimate reads the body)",
            ));
        }
        let actual = match &self.actual.header {
            Some(h) => Actual::header(h.clone()),
            None => Actual::reported(),
        };
        Ok((estimate, actual))
    }
}
