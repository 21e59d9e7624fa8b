//! [`Tier`]: one named limit (a key extractor, a quota, a cost, an algorithm).

use crate::key::KeyExtractor;
use crate::Quota;
use std::fmt;
use std::sync::Arc;

/// The algorithm a tier counts with.
///
/// Only the token bucket exists so far; the enum is `non_exhaustive` so more
/// can be added without breaking callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Algorithm {
    /// Token bucket: capacity = the quota's burst, refilled at
    /// `limit / period`, in exact integer arithmetic (see
    /// [`algorithm::token_bucket`](crate::algorithm::token_bucket)).
    #[default]
    TokenBucket,
}

/// One named limit: requests whose key (from the extractor) is the same share
/// one bucket of `quota`, each request costing `cost` tokens.
///
/// ```
/// use tiered_ratelimit::{key::ApiKey, Algorithm, Quota, Tier};
///
/// let tier = Tier::new("api_key", ApiKey::header("x-api-key"), Quota::per_hour(10_000))
///     .cost(2)
///     .algorithm(Algorithm::TokenBucket);
/// assert_eq!(tier.name(), "api_key");
/// ```
///
/// The name (1-64 characters of `[A-Za-z0-9_-]`, unique within a layer) is part
/// of every storage key and of the metrics labels.
#[derive(Clone)]
#[must_use]
pub struct Tier {
    pub(crate) name: String,
    pub(crate) key: Arc<dyn KeyExtractor>,
    pub(crate) quota: Quota,
    pub(crate) cost: u64,
    pub(crate) algorithm: Algorithm,
}

impl fmt::Debug for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tier")
            .field("name", &self.name)
            .field("quota", &self.quota)
            .field("cost", &self.cost)
            .field("algorithm", &self.algorithm)
            .finish_non_exhaustive()
    }
}

impl Tier {
    /// A tier named `name`, keyed by `key`, limited to `quota`, cost 1.
    pub fn new(name: impl Into<String>, key: impl KeyExtractor, quota: Quota) -> Self {
        Self {
            name: name.into(),
            key: Arc::new(key),
            quota,
            cost: 1,
            algorithm: Algorithm::TokenBucket,
        }
    }

    /// Tokens each request takes (default 1). Zero, or more than the burst,
    /// is rejected by `build()`.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = cost;
        self
    }

    /// The counting algorithm (default [`Algorithm::TokenBucket`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The tier's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tier's quota.
    pub fn quota(&self) -> Quota {
        self.quota
    }
}
