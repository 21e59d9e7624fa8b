//! [`Tier`]: one named limit (a key extractor, a quota, a cost, an algorithm).

use crate::algorithm::kind::{Algorithm, DEFAULT_SLOT_TTL};
use crate::key::KeyExtractor;
use crate::{quota::Quota, rollout::Mode};
use std::fmt;
use std::sync::Arc;

/// A per-request cost function (see [`Tier::cost_fn`]).
pub(crate) type CostFn = Arc<dyn Fn(&http::request::Parts) -> u64 + Send + Sync>;
/// A plan extractor (see [`Tier::plan_fn`]).
pub(crate) type PlanFn = Arc<dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync>;

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
    /// The extractor's type, for the log line of a failed extraction.
    pub(crate) key_type: &'static str,
    pub(crate) quota: Quota,
    pub(crate) cost: u64,
    pub(crate) cost_fn: Option<CostFn>,
    pub(crate) algorithm: Algorithm,
    pub(crate) mode: Mode,
    pub(crate) methods: Option<Vec<http::Method>>,
    pub(crate) plans: Vec<(String, Quota)>,
    pub(crate) plan_fn: Option<PlanFn>,
    pub(crate) skip_failed_requests: bool,
    pub(crate) skip_successful_requests: bool,
    pub(crate) penalty: Option<crate::algorithm::penalty::Penalty>,
    pub(crate) overrides: bool,
    pub(crate) lease: Option<crate::engine::TokenLease>,
    pub(crate) calendar: Option<crate::algorithm::Calendar>,
    pub(crate) exhausted_status: Option<u16>,
    pub(crate) priced: Option<(crate::http::priced::Estimate, crate::http::priced::Actual)>,
    pub(crate) quota_unit: Option<crate::response::QuotaUnit>,
    pub(crate) rollout: Option<crate::rollout::RolloutPlan>,
    pub(crate) candidates: Vec<Quota>,
    pub(crate) guard: Option<crate::rollout::FallbackGuard>,
}

impl fmt::Debug for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tier")
            .field("name", &self.name)
            .field("key", &self.key_type)
            .field("quota", &self.quota)
            .field("cost", &self.cost)
            .field("cost_fn", &self.cost_fn.is_some())
            .field("algorithm", &self.algorithm)
            .field("mode", &self.mode)
            .field("methods", &self.methods)
            .field("plans", &self.plans)
            .field("skip_failed_requests", &self.skip_failed_requests)
            .field("skip_successful_requests", &self.skip_successful_requests)
            .field("penalty", &self.penalty)
            .field("overrides", &self.overrides)
            .field("lease", &self.lease)
            .field("calendar", &self.calendar)
            .field("priced", &self.priced)
            .field("rollout", &self.rollout)
            .field("candidates", &self.candidates)
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}

impl Tier {
    /// A tier named `name`, keyed by `key`, limited to `quota`, cost 1.
    pub fn new<K: KeyExtractor>(name: impl Into<String>, key: K, quota: Quota) -> Self {
        Self {
            name: name.into(),
            key: Arc::new(key),
            key_type: short_type_name(std::any::type_name::<K>()),
            quota,
            cost: 1,
            cost_fn: None,
            algorithm: Algorithm::TokenBucket,
            mode: Mode::Enforce,
            methods: None,
            plans: Vec::new(),
            plan_fn: None,
            skip_failed_requests: false,
            skip_successful_requests: false,
            penalty: None,
            overrides: false,
            lease: None,
            calendar: None,
            exhausted_status: None,
            priced: None,
            quota_unit: None,
            rollout: None,
            candidates: Vec::new(),
            guard: None,
        }
    }

    /// A calendar quota: the quota's `limit` per calendar window (a local
    /// day, week, month or year of [`Calendar`](crate::algorithm::Calendar),
    /// in its time zone, from its anchor), counted as a fixed window over
    /// those boundaries; the quota's own period is replaced by the
    /// calendar's, and so are those of the tier's plans and per-key
    /// overrides (their `limit` counts per calendar window). The algorithm
    /// becomes [`Algorithm::FixedWindow`]; another one set later is
    /// refused by `build()` with
    /// [`ConfigError::CalendarAlgorithm`](crate::ConfigError::CalendarAlgorithm).
    /// Lease mode is refused too. The window a request falls in is
    /// decided by the backend's clock (Redis `TIME`); see
    /// [`algorithm::Calendar`](crate::algorithm::Calendar).
    ///
    /// ```
    /// use tiered_ratelimit::{algorithm::Calendar, key::ApiKey, Quota, RateLimitLayer, Tier};
    /// // 10 000 calls a month, renewed on the 15th at midnight in New York.
    /// let month = Calendar::month().time_zone("America/New_York")?.anchor("15")?;
    /// let tier = Tier::new("monthly", ApiKey::header("x-api-key"), Quota::per_hour(10_000))
    ///     .calendar(month);
    /// assert!(RateLimitLayer::builder().tier(tier).build().is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "calendar")]
    #[cfg_attr(docsrs, doc(cfg(feature = "calendar")))]
    pub fn calendar(mut self, calendar: crate::algorithm::Calendar) -> Self {
        let nominal = std::time::Duration::from_micros(calendar.longest_us());
        self.quota = Quota::new(self.quota.limit(), nominal);
        self.algorithm = Algorithm::FixedWindow;
        self.calendar = Some(calendar);
        self
    }

    /// Without the `calendar` feature there is no calendar to give.
    #[cfg(not(feature = "calendar"))]
    pub(crate) fn calendar(self, calendar: crate::algorithm::Calendar) -> Self {
        match calendar {}
    }

    /// The HTTP status of this tier's denials: 429 (the default) or, for a
    /// calendar quota ([`calendar`](Self::calendar)), 403: "come back next
    /// month" is not a rate problem. The built-in bodies say it (the
    /// problem body keeps the draft's `quota-exceeded` type) and the layer
    /// sets it on a custom [`OnRejection`](crate::response::OnRejection)'s
    /// response; `Retry-After` and the reset fields are sent as on a 429.
    /// Another status, or 403 on a tier that is not a calendar quota, is
    /// refused by `build()` naming `exhausted_status`. (A gRPC request is
    /// still answered `RESOURCE_EXHAUSTED`.)
    pub fn exhausted_status(mut self, status: u16) -> Self {
        self.exhausted_status = Some(status);
        self
    }

    /// Lease mode for this tier (TOML `sync = "lease"`; see
    /// [`crate::engine::token_lease`]): on Redis, this instance takes batches of
    /// tokens out of a hot key's shared bucket and admits requests from them
    /// without a Redis call, never over the quota. A no-op on the memory
    /// backend. Token bucket, policing leaky bucket and fixed window only,
    /// without a penalty box, per-key overrides or refunds by status
    /// ([`ConfigError::LeaseUnsupported`](crate::ConfigError::LeaseUnsupported)
    /// from `build()` otherwise).
    pub fn lease(mut self, lease: crate::engine::TokenLease) -> Self {
        self.lease = Some(lease);
        self
    }

    /// A penalty box on this tier (see [`Penalty`](crate::Penalty)): keys
    /// it denies too often are blocked for a while, fleet-wide.
    pub fn penalty(mut self, penalty: crate::algorithm::penalty::Penalty) -> Self {
        self.penalty = Some(penalty);
        self
    }

    /// Whether this tier takes per-key overrides (default `false`; see
    /// [`handle`](crate::handle#per-key-overrides)): another quota, no limit, or a block for one
    /// exact key, set at run time through
    /// [`RateLimitHandle::set_override`](crate::RateLimitHandle::set_override)
    /// or the admin API. Each check of the tier then reads the key's
    /// override in the same script call (one more key of its `MGET` on
    /// Redis). Ignored on a concurrency tier.
    pub fn overrides(mut self, yes: bool) -> Self {
        self.overrides = yes;
        self
    }

    /// Gives the request's cost back **on this tier** when the response's
    /// status is 400 or above (default `false`): only successful requests
    /// count. For endpoints where failures are cheap and retries legitimate.
    ///
    /// The refund is issued once the inner service's response head is
    /// available (from its status), without delaying the response: on the
    /// memory backend it is done before the response is returned, on Redis
    /// in a task of its own (one script call, its failure counted in
    /// `tiered_ratelimit_refund_failures_total` and logged). So the
    /// response's rate-limit headers still describe the state **before** the
    /// refund, and a request sent right after the response may, on Redis,
    /// still see the charge.
    ///
    /// A refund gives back what the charge still takes away, never more:
    /// refill or a new window may already have absorbed part of it, so it
    /// never leaves more room than if the request had never been charged
    /// (and never pushes `remaining` above the limit). Only a request this
    /// tier charged is refunded: not one it denied, not one another tier
    /// denied, not one in shadow mode that this tier would have denied, and
    /// not one decided by the local fallback (the failure policy).
    pub fn skip_failed_requests(mut self, skip: bool) -> Self {
        self.skip_failed_requests = skip;
        self
    }

    /// Gives the request's cost back **on this tier** when the response's
    /// status is below 400 (default `false`): only failed requests count.
    /// For login endpoints: failed attempts are limited, a user who logs in
    /// is not. Same timing and rules as
    /// [`skip_failed_requests`](Self::skip_failed_requests).
    ///
    /// ```
    /// use tiered_ratelimit::{key::ClientIp, Quota, Tier};
    /// // Bursts of 5 failed logins per IP, one more a minute; successful
    /// // logins are free.
    /// let tier = Tier::new("login", ClientIp::default(), Quota::per_minute(1).burst(5))
    ///     .skip_successful_requests(true);
    /// ```
    pub fn skip_successful_requests(mut self, skip: bool) -> Self {
        self.skip_successful_requests = skip;
        self
    }

    /// The tier's rollout mode (default [`Mode::Enforce`]); changeable at run
    /// time through [`RateLimitHandle`](crate::RateLimitHandle).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The tier's staged rollout plan (see [`RolloutPlan`](crate::rollout::RolloutPlan)):
    /// started, paused, resumed and aborted through
    /// [`RateLimitHandle::plan`](crate::RateLimitHandle::plan) or the admin
    /// API, and advanced by the fleet itself. Needs a
    /// [`ControlKey`](crate::handle::ControlKey): `build()` refuses a plan
    /// without one, naming the field.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiered_ratelimit::{key::User, rollout::RolloutPlan, Quota, Tier};
    /// let tier = Tier::new("user", User, Quota::per_minute(60))
    ///     .rollout(RolloutPlan::recipe(Duration::from_secs(3600)).min_requests(1000));
    /// ```
    pub fn rollout(mut self, plan: crate::rollout::RolloutPlan) -> Self {
        self.rollout = Some(plan);
        self
    }

    /// Up to four candidate quotas beside the live one: each is checked and
    /// charged on its own state (a tier key's candidates packed together
    /// where the backend can: in the tier key's own entry in memory, in its
    /// own value on Redis) in the same backend
    /// call as the live check, under the tier's key, algorithm and cost,
    /// and never changes an answer. Each counts what it would do (requests
    /// checked, would-be denials, distinct keys it would deny, its heaviest
    /// would-be-denied keys: [`RateLimitHandle::candidates`](crate::RateLimitHandle::candidates)
    /// and the metric `tiered_ratelimit_candidate_decisions_total`). A
    /// candidate is charged as if it were the tier's quota: when it allows
    /// and every other enforced check of the request allows. It applies to
    /// the requests under the tier's own quota (not a plan's, not a per-key
    /// override's). A calendar tier's candidates count per its calendar
    /// window (their `period` is not used). Refused by `build()`: more than
    /// four, on a concurrency tier, beside lease mode, or a quota the tier
    /// itself would be refused (the error names `candidates[i]`). See
    /// `docs/rollout.md`, "Candidate quotas".
    ///
    /// ```
    /// use tiered_ratelimit::{key::User, Quota, RateLimitLayer, Tier};
    /// let tier = Tier::new("user", User, Quota::per_minute(100))
    ///     .candidates([Quota::per_minute(50), Quota::per_minute(80).burst(100)]);
    /// assert!(RateLimitLayer::builder().tier(tier).build().is_ok());
    /// ```
    pub fn candidates(mut self, quotas: impl IntoIterator<Item = Quota>) -> Self {
        self.candidates = quotas.into_iter().collect();
        self
    }

    /// The tier's automatic fall back to shadow (see
    /// [`FallbackGuard`](crate::rollout::FallbackGuard)): when its 429 rate
    /// leaves its band at normal traffic, spread over many keys, the tier
    /// goes to shadow fleet-wide and its plan stops. Needs a
    /// [`ControlKey`](crate::handle::ControlKey): `build()` refuses a guard
    /// without one, naming the field.
    ///
    /// ```
    /// use tiered_ratelimit::{key::User, rollout::FallbackGuard, Quota, Tier};
    /// let tier = Tier::new("user", User, Quota::per_minute(60)).guard(FallbackGuard::shadow());
    /// ```
    pub fn guard(mut self, guard: crate::rollout::FallbackGuard) -> Self {
        self.guard = Some(guard);
        self
    }

    /// Only requests with these methods are counted. By default every method
    /// but `OPTIONS` is (CORS preflights should not spend a client's quota);
    /// list `OPTIONS` here to count it too.
    pub fn methods(mut self, methods: impl IntoIterator<Item = http::Method>) -> Self {
        self.methods = Some(methods.into_iter().collect());
        self
    }

    /// Quotas per client plan: a request whose plan (by default the
    /// [`Plan`](crate::rollout::Plan) in the request extensions) is listed gets that
    /// plan's quota; an unknown or missing plan gets the tier's own quota.
    /// Each plan's quota is checked like the tier's at `build()`.
    ///
    /// ```
    /// use tiered_ratelimit::{key::User, Quota, Tier};
    /// let tier = Tier::new("user", User, Quota::per_minute(60))
    ///     .plans([("free", Quota::per_minute(100)), ("pro", Quota::per_minute(1000))]);
    /// ```
    pub fn plans<P: Into<String>>(mut self, plans: impl IntoIterator<Item = (P, Quota)>) -> Self {
        self.plans = plans.into_iter().map(|(p, q)| (p.into(), q)).collect();
        self
    }

    /// Reads the plan with `f` instead of the [`Plan`](crate::rollout::Plan) extension
    /// (for example from a header set by a trusted gateway).
    pub fn plan_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.plan_fn = Some(Arc::new(f));
        self
    }

    /// Tokens each request takes (default 1). Zero, or more than the burst,
    /// is rejected by `build()`.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = cost;
        self
    }

    /// A per-request cost, computed from the request head (by endpoint, by a
    /// declared batch size header, ...); replaces the fixed [`cost`](Self::cost).
    ///
    /// A cost of 0 means the tier does not charge (nor check) this request. A
    /// cost above the tier's capacity can never pass: it is rejected at once
    /// with 429, and `Retry-After` is the time until the tier is full again
    /// (the best it will ever be).
    ///
    /// ```
    /// use tiered_ratelimit::{key::Global, Quota, Tier};
    /// let tier = Tier::new("global", Global, Quota::per_minute(600)).cost_fn(|p: &http::request::Parts| {
    ///     p.headers
    ///         .get("x-batch-size")
    ///         .and_then(|v| v.to_str().ok()?.parse().ok())
    ///         .unwrap_or(1)
    /// });
    /// ```
    pub fn cost_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&http::request::Parts) -> u64 + Send + Sync + 'static,
    {
        self.cost_fn = Some(Arc::new(f));
        self
    }

    /// Prices the tier by the response (AI APIs' tokens per minute): at
    /// admission the request **reserves** its `estimate` (this tier's cost,
    /// replacing [`cost`](Self::cost) and [`cost_fn`](Self::cost_fn)), all
    /// or nothing with the other tiers in the one backend call; when the
    /// response ends the layer **settles** `actual − estimate`: a refund
    /// when negative, an extra charge when positive, which may put the key
    /// in **debt** (denied until refill repays it; `Remaining` 0;
    /// `Retry-After` the exact wait). The actual comes from the
    /// [`Usage`](crate::priced::Usage) handle in the request's extensions, a
    /// response header or a trailer ([`Actual`](crate::priced::Actual));
    /// see [`crate::priced`] for when the settle runs and what a dropped
    /// body does.
    ///
    /// The bound: when every estimate covers its actual, the tier never
    /// admits more than its quota; when some do not, it overshoots by at
    /// most Σ (actual − estimate) of the requests whose settle has not
    /// landed, and the excess is carried as debt (`docs/algorithms.md`,
    /// "Priced requests"). Token bucket and fixed window only; not with
    /// refunds by status (`build()` refuses them, naming the field). With
    /// per-key overrides a key's settle runs under its override; in lease
    /// mode an estimate spent from the lease settles there (`docs/http.md`,
    /// "Priced requests").
    ///
    /// ```
    /// use tiered_ratelimit::priced::{Actual, Estimate};
    /// use tiered_ratelimit::{key::ApiKey, Quota, Tier};
    /// let tokens = Tier::new("tokens", ApiKey::header("x-api-key"), Quota::per_minute(100_000))
    ///     .priced(
    ///         Estimate::header("x-max-tokens", 1_000, 32_000),
    ///         Actual::header("x-usage-tokens"),
    ///     );
    /// ```
    pub fn priced(
        mut self,
        estimate: crate::http::priced::Estimate,
        actual: crate::http::priced::Actual,
    ) -> Self {
        self.priced = Some((estimate, actual));
        self
    }

    /// A concurrency tier: at most `limit` requests of one key **in flight**
    /// at once, each holding its slot (a TTL of 60 s,
    /// renewed while the request runs; change it with
    /// `.algorithm(Algorithm::Concurrency { slot_ttl })`) until its response
    /// body has been sent or dropped (client disconnect, handler panic or
    /// timeout included). A request takes one slot whatever its cost. Its
    /// 429 says `Retry-After: 1` (an estimate: a slot frees whenever a
    /// running request ends; less when a slot expires sooner).
    ///
    /// ```
    /// use tiered_ratelimit::{key::User, Tier};
    /// let tier = Tier::concurrency("user_inflight", User, 5);
    /// ```
    pub fn concurrency<K: KeyExtractor>(name: impl Into<String>, key: K, limit: u64) -> Self {
        Self::new(name, key, Quota::new(limit, DEFAULT_SLOT_TTL)).algorithm(
            Algorithm::Concurrency {
                slot_ttl: DEFAULT_SLOT_TTL,
            },
        )
    }

    /// What the tier's quota counts, the IETF `RateLimit-Policy` item's
    /// `qu` (draft-11 §3.1.2): by default `concurrent-requests` for a
    /// concurrency tier, `tokens` for a [priced](Self::priced) tier,
    /// `cost-units` for a tier with a [cost function](Self::cost_fn) or a
    /// fixed [cost](Self::cost) other than 1, else `requests` (not
    /// written: the draft's default). A custom unit is 1-32 characters of
    /// `[a-z0-9-]` (`build()` names the field `quota_unit` otherwise).
    ///
    /// ```
    /// use tiered_ratelimit::{key::ClientIp, response::QuotaUnit, Quota, Tier};
    /// // A cost function returning the request's Content-Length.
    /// let upload = Tier::new("upload", ClientIp::default(), Quota::per_minute(10_000_000))
    ///     .cost_fn(|p: &http::request::Parts| {
    ///         p.headers
    ///             .get(http::header::CONTENT_LENGTH)
    ///             .and_then(|v| v.to_str().ok()?.parse().ok())
    ///             .unwrap_or(1)
    ///     })
    ///     .quota_unit(QuotaUnit::ContentBytes);
    /// ```
    pub fn quota_unit(mut self, unit: crate::response::QuotaUnit) -> Self {
        self.quota_unit = Some(unit);
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

/// `ClientIp` for `tiered_ratelimit::key::client_ip::ClientIp`: the type's
/// own name, without its module path (generic arguments kept whole).
fn short_type_name(full: &'static str) -> &'static str {
    let head = full.find('<').map_or(full, |i| &full[..i]);
    match head.rfind("::") {
        Some(i) => &full[i + 2..],
        None => full,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn short_type_names() {
        use super::short_type_name as s;
        assert_eq!(s("tiered_ratelimit::key::client_ip::ClientIp"), "ClientIp");
        assert_eq!(s("Global"), "Global");
        assert_eq!(s("a::B<c::D>"), "B<c::D>");
    }
}
