//! [`RateLimitLayer`] and its builder: the code form of a [`Policy`](crate::Policy).

use crate::algorithm::{Gcra, Limit, TokenBucket, Window};
use crate::backend::{Backend, MemoryBackend};
use crate::error::ConfigError;
use crate::key::KeyExtractor;
use crate::observe::LogThrottle;
use crate::response::{JsonRejection, OnRejection};
use crate::service::RateLimitService;
use crate::tier::{CostFn, LeakyBucket};
use crate::{Algorithm, Tier};
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// What the layer does when the backend cannot decide (error, timeout, or a
/// key extractor that cannot run).
///
/// Whichever applies, the failure is logged at `warn` (at most once a second,
/// with a count of what was suppressed) and counted in
/// `tiered_ratelimit_backend_errors_total{kind}` and
/// `tiered_ratelimit_requests_total{decision="fail_open"|"fail_closed"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Let the request through, without rate-limit headers (the default:
    /// a limiter outage must not become an API outage).
    #[default]
    Open,
    /// Answer `503 Service Unavailable` with
    /// `{"error":"rate_limiter_unavailable"}` (for routes where an unlimited
    /// request is worse than none, such as login).
    Closed,
}

/// One tier as the service runs it.
pub(crate) struct BuiltTier {
    pub(crate) name: Arc<str>,
    /// `<prefix>:<tier>:`; the key part is appended per request.
    pub(crate) key_base: String,
    pub(crate) key: Arc<dyn KeyExtractor>,
    pub(crate) limit: Limit,
    pub(crate) cost: u64,
    pub(crate) cost_fn: Option<CostFn>,
}

/// Everything the service shares between requests.
pub(crate) struct Shared {
    pub(crate) backend: Backend,
    pub(crate) tiers: Box<[BuiltTier]>,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) backend_timeout: Duration,
    pub(crate) docs_url: Option<Arc<str>>,
    pub(crate) on_rejection: Arc<dyn OnRejection>,
    pub(crate) failure_log: LogThrottle,
}

/// A tower [`Layer`](tower_layer::Layer) that rate-limits every request by a
/// list of tiers.
///
/// Tiers are checked in the order added; a request passes only if every tier
/// that applies to it allows it, and then it is charged on all of them (a
/// request denied by one tier consumes nothing anywhere). See the crate docs
/// for the full HTTP contract.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::get, Router};
/// use tiered_ratelimit::{key::{ClientIp, Global}, Quota, RateLimitLayer, Tier};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(1000).burst(2000)))
///     .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(300)))
///     .backend_timeout(Duration::from_millis(50))
///     .build()
///     .expect("valid rate-limit configuration");
/// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer);
/// ```
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tiers: Vec<&str> = self.shared.tiers.iter().map(|t| &*t.name).collect();
        f.debug_struct("RateLimitLayer")
            .field("backend", &self.shared.backend.name())
            .field("tiers", &tiers)
            .field("failure_policy", &self.shared.failure_policy)
            .field("backend_timeout", &self.shared.backend_timeout)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A builder with the defaults: in-memory backend, key prefix `rl`,
    /// [`FailurePolicy::Open`], 100 ms backend timeout, no docs URL.
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder::default()
    }

    /// The tier names, in check order.
    pub fn tier_names(&self) -> impl Iterator<Item = &str> {
        self.shared.tiers.iter().map(|t| &*t.name)
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.shared.clone())
    }
}

/// Builds a [`RateLimitLayer`]; every setting is checked in
/// [`build`](Self::build).
#[must_use]
pub struct RateLimitLayerBuilder {
    backend: Option<Backend>,
    key_prefix: String,
    tiers: Vec<Tier>,
    failure_policy: FailurePolicy,
    backend_timeout: Duration,
    docs_url: Option<String>,
    on_rejection: Arc<dyn OnRejection>,
}

impl Default for RateLimitLayerBuilder {
    fn default() -> Self {
        Self {
            backend: None,
            key_prefix: "rl".to_owned(),
            tiers: Vec::new(),
            failure_policy: FailurePolicy::Open,
            backend_timeout: Duration::from_millis(100),
            docs_url: None,
            on_rejection: Arc::new(JsonRejection),
        }
    }
}

impl fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("backend", &self.backend)
            .field("key_prefix", &self.key_prefix)
            .field("tiers", &self.tiers)
            .field("failure_policy", &self.failure_policy)
            .field("backend_timeout", &self.backend_timeout)
            .field("docs_url", &self.docs_url)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayerBuilder {
    /// Where buckets live: a [`MemoryBackend`] (the default) or a
    /// [`RedisBackend`](crate::backend::RedisBackend).
    pub fn backend(mut self, backend: impl Into<Backend>) -> Self {
        self.backend = Some(backend.into());
        self
    }

    /// Prefix of every storage key (`<prefix>:<tier>:<key>`); default `rl`.
    /// 1-64 printable ASCII characters without `{` or `}`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Adds a tier; tiers are checked in the order added.
    pub fn tier(mut self, tier: Tier) -> Self {
        self.tiers.push(tier);
        self
    }

    /// What to do when the backend cannot decide (default [`FailurePolicy::Open`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// The longest a backend check may add to a request (default 100 ms);
    /// past it the failure policy applies.
    pub fn backend_timeout(mut self, timeout: Duration) -> Self {
        self.backend_timeout = timeout;
        self
    }

    /// A URL explaining your limits, sent as `docs` in the 429 body.
    pub fn docs_url(mut self, url: impl Into<String>) -> Self {
        self.docs_url = Some(url.into());
        self
    }

    /// Replaces the 429 response (see [`OnRejection`]).
    pub fn on_rejection(mut self, on_rejection: impl OnRejection) -> Self {
        self.on_rejection = Arc::new(on_rejection);
        self
    }

    /// Checks the configuration and builds the layer.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: no tiers, a duplicate or invalid
    /// tier name, a zero limit, period or cost, a burst below the cost, a
    /// quota too large to count exactly, an invalid key prefix.
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
        let prefix = self.key_prefix;
        if prefix.is_empty()
            || prefix.len() > 64
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(ConfigError::InvalidKeyPrefix(prefix));
        }
        if self.tiers.is_empty() {
            return Err(ConfigError::NoTiers);
        }
        let mut seen = HashSet::new();
        let mut tiers = Vec::with_capacity(self.tiers.len());
        for t in self.tiers {
            let valid_name = !t.name.is_empty()
                && t.name.len() <= 64
                && t.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid_name {
                return Err(ConfigError::InvalidTierName(t.name));
            }
            if !seen.insert(t.name.clone()) {
                return Err(ConfigError::DuplicateTier(t.name));
            }
            let q = t.quota;
            if q.limit() == 0 {
                return Err(ConfigError::ZeroLimit { tier: t.name });
            }
            let period_us = u64::try_from(q.period().as_micros()).unwrap_or(u64::MAX);
            if period_us == 0 {
                return Err(ConfigError::ZeroPeriod {
                    tier: t.name,
                    period: q.period(),
                });
            }
            if t.cost == 0 {
                return Err(ConfigError::ZeroCost { tier: t.name });
            }
            if q.burst_size() < t.cost {
                return Err(ConfigError::BurstBelowCost {
                    tier: t.name,
                    burst: q.burst_size(),
                    cost: t.cost,
                });
            }
            let limit = limit_for(&t.name, t.algorithm, q, period_us)?;
            tiers.push(BuiltTier {
                key_base: format!("{prefix}:{}:", t.name),
                name: Arc::from(t.name),
                key: t.key,
                limit,
                cost: t.cost,
                cost_fn: t.cost_fn,
            });
        }
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                backend: self
                    .backend
                    .unwrap_or_else(|| Backend::Memory(MemoryBackend::new())),
                tiers: tiers.into_boxed_slice(),
                failure_policy: self.failure_policy,
                backend_timeout: self.backend_timeout,
                docs_url: self.docs_url.map(Arc::from),
                on_rejection: self.on_rejection,
                failure_log: LogThrottle::new(Duration::from_secs(1)),
            }),
        })
    }
}

/// The integer parameters of a tier's algorithm, checked.
fn limit_for(
    tier: &str,
    algorithm: Algorithm,
    q: crate::Quota,
    period_us: u64,
) -> Result<Limit, ConfigError> {
    let too_large = || ConfigError::QuotaTooLarge {
        tier: tier.to_owned(),
    };
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
    let bucket = || TokenBucket::new(q.limit(), period_us, q.burst_size()).ok_or_else(too_large);
    Ok(match algorithm {
        Algorithm::FixedWindow => Limit::FixedWindow(window()?),
        Algorithm::SlidingWindowLog => Limit::SlidingWindowLog(window()?),
        Algorithm::SlidingWindowCounter => {
            let w = window()?;
            match w.limit.checked_mul(w.window_us) {
                Some(p) if p <= Window::MAX_PRODUCT => Limit::SlidingWindowCounter(w),
                _ => return Err(too_large()),
            }
        }
        Algorithm::TokenBucket => Limit::TokenBucket(bucket()?),
        Algorithm::LeakyBucket(LeakyBucket::Police) => Limit::LeakyBucket(Gcra {
            bucket: bucket()?,
            max_delay_us: None,
        }),
        Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) => {
            let b = bucket()?;
            let max_delay_us = u64::try_from(max_delay.as_micros()).map_err(|_| too_large())?;
            let ticks = max_delay_us
                .checked_mul(b.rate)
                .and_then(|t| t.checked_add(b.capacity))
                .ok_or_else(too_large)?;
            if ticks > TokenBucket::MAX_CAPACITY_UNITS {
                return Err(too_large());
            }
            Limit::LeakyBucket(Gcra {
                bucket: b,
                max_delay_us: Some(max_delay_us),
            })
        }
    })
}
