//! [`RateLimitLayerBuilder::build`]: the engine built from the settings and
//! each tier's engine half, the HTTP front door from the rest.

use super::{RateLimitLayer, RateLimitLayerBuilder};
use crate::engine::TierSpec;
use crate::error::ConfigError;
use crate::http::front::{Front, HttpTier};
use crate::http::tier::Tier;
use crate::rollout::{AccessLists, Lists};
use std::sync::Arc;
use std::time::Duration;

impl RateLimitLayerBuilder {
    /// Checks the configuration and builds the layer.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: no tiers, a duplicate or invalid
    /// tier name, a zero limit, period or cost, a burst below the cost, a
    /// quota too large to count exactly, an invalid key prefix, a
    /// [`client_ip`](Self::client_ip) with an IPv6 prefix above 128.
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
        self.build_inner()
    }

    /// [`build`](Self::build), then one [`Backend::ping`](crate::backend::Backend::ping) (within the
    /// backend timeout, at least 1 s for the first connection): a backend
    /// that does not answer at start-up is said at start-up, not on the
    /// first request. Under [`FailurePolicy::Closed`](crate::FailurePolicy::Closed)
    /// it is an error (every request would get 503); under the other
    /// policies one `WARN` line naming the backend and what the requests
    /// will get, and the layer (the backend connects when it can).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use tiered_ratelimit::{key::Global, FailurePolicy, Quota, RateLimitLayer, Tier};
    /// use tiered_ratelimit::backend::RedisBackend;
    ///
    /// // Nothing listens on port 1.
    /// let redis = RedisBackend::from_url("redis://127.0.0.1:1/").unwrap();
    /// let err = RateLimitLayer::builder()
    ///     .backend(redis)
    ///     .failure_policy(FailurePolicy::Closed)
    ///     .tier(Tier::new("global", Global, Quota::per_second(10)))
    ///     .build_checked()
    ///     .await
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("redis at 127.0.0.1:1"));
    /// # }
    /// ```
    ///
    /// # Errors
    /// Any of [`build`](Self::build)'s, and
    /// [`ConfigError::BackendUnreachable`] under `Closed`.
    pub async fn build_checked(self) -> Result<RateLimitLayer, ConfigError> {
        let timeout = self.engine.backend_timeout.max(Duration::from_secs(1));
        let policy = self.engine.failure_policy;
        let layer = self.build_inner()?;
        if let Err(e) = layer.shared.backend.ping(timeout).await {
            if policy == crate::engine::FailurePolicy::Closed {
                return Err(ConfigError::BackendUnreachable(e));
            }
            let then = match policy {
                crate::engine::FailurePolicy::Fallback => {
                    "requests are decided by the local fallback limiter until it answers"
                }
                _ => "requests pass unlimited (failure_policy = \"open\") until it answers",
            };
            tracing::warn!(target: "tiered_ratelimit::layer::build",
                backend = %e.backend,
                "rate limiter backend unreachable at start-up: {e}; {then}",
            );
        }
        Ok(layer)
    }

    fn build_inner(self) -> Result<RateLimitLayer, ConfigError> {
        self.client_ip.check()?;
        if self.tiers.is_empty() {
            return Err(ConfigError::NoTiers);
        }
        let mut engine = self.engine;
        engine.lists_violated = self.on_rejection.uses_violated_policies();
        let mut http_tiers = Vec::with_capacity(self.tiers.len());
        let mut actual_headers = Vec::with_capacity(self.tiers.len());
        let mut json = crate::http::json_body::JsonSpec::default();
        for mut t in self.tiers {
            // A priced tier's estimate becomes its cost function; the
            // engine checks that its algorithm can settle.
            let priced = crate::http::priced::compile(&mut t)?;
            let (actual, field) = priced
                .as_ref()
                .map_or((None, None), |c| (c.actual.clone(), c.json.clone()));
            actual_headers.push(actual);
            if let Some((field, limit)) = field {
                json.add(field, limit);
            }
            let (mut spec, http) = split(t);
            spec.priced = priced.is_some();
            engine = engine.tier(spec);
            http_tiers.push(http);
        }
        let engine = engine.build()?;
        let shared = engine.shared.clone();
        let configured = Lists {
            allow: Arc::new(self.allow),
            deny: Arc::new(self.deny),
            deny_status: self.deny_status,
        };
        let lists = Arc::new(AccessLists::new(configured.clone()));
        // Fleet-wide settings may replace the lists' entries (and give the
        // configured ones back).
        let _ = shared.live.fleet.lists.set((lists.clone(), configured));
        let front = Arc::new(Front {
            engine,
            tiers: http_tiers.into_boxed_slice(),
            client_ip: self.client_ip,
            lists: lists.clone(),
            on_rejection: self.on_rejection,
            actual_headers: actual_headers.into(),
            json_body: json.finish(),
            #[cfg(feature = "grpc")]
            protocol: self.protocol,
        });
        Ok(RateLimitLayer { shared, front })
    }
}

/// A tier's engine half (name, algorithm, quotas, options, mode) and its
/// HTTP half (how a request's key, cost and plan are read).
fn split(t: Tier) -> (TierSpec, HttpTier) {
    let spec = TierSpec {
        no_key_cause: t.key.no_key_cause(),
        name: t.name,
        algorithm: t.algorithm,
        quota: t.quota,
        cost: t.cost,
        mode: t.mode,
        plans: t.plans,
        penalty: t.penalty,
        overrides: t.overrides,
        lease: t.lease,
        calendar: t.calendar,
        exhausted_status: t.exhausted_status,
        skip_failed: t.skip_failed_requests,
        skip_successful: t.skip_successful_requests,
        key_type: t.key_type,
        priced: false,
        unit: t.quota_unit,
        weighted: t.cost_fn.is_some(),
        rollout: t.rollout,
        candidates: t.candidates,
        guard: t.guard,
    };
    let http = HttpTier {
        key: t.key,
        cost: t.cost,
        cost_fn: t.cost_fn,
        methods: t.methods.map(Vec::into_boxed_slice),
        plan_fn: t.plan_fn,
    };
    (spec, http)
}
