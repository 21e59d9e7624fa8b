//! [`RateLimitService`]: the tower service the layer wraps around yours.

use crate::algorithm::{Decision, Limit};
use crate::backend::CheckFuture;
use crate::backend::{Backend, Check, Shadow, TierCheck, TierRefund, Verdict};
use crate::breaker::Permit;
use crate::control::Overrides;
use crate::deny_cache::{longest_wait_us, stays_exact, Denied, Lookup, Probe, ProbeGuard, Role};
use crate::error::BackendError;
use crate::future::{ResponseFuture, Waiter};
use crate::key::KeyError;
use crate::layer::{BuiltTier, FailurePolicy, PlanRuntime, Runtime, Shared, TierRuntime};
use crate::observe;
use crate::observe::topn::Kind;
use crate::observe::{TierCount, TierDecision};
use crate::response::{json_response, unavailable, HeaderStyle, RateLimitHeaders, Rejection};
use crate::rollout::{DenyStatus, Mode, Plan};
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tower_service::Service;

/// Rate-limits requests before they reach `S`. Built by
/// [`RateLimitLayer`](crate::RateLimitLayer).
///
/// `poll_ready` forwards to the inner service: limiting never shows up as
/// back-pressure, only as `429` responses.
pub struct RateLimitService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: Clone> Clone for RateLimitService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimitService<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the limiter, returning the wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// What to do with a request after its check.
pub(crate) enum Outcome {
    /// Call the inner service (after `delay`, when a shaping tier queued the
    /// request), then add these headers (none on fail-open), and issue these
    /// refunds by the response's status (tiers that skip failed or
    /// successful requests).
    Pass(Option<RateLimitHeaders>, Duration, Option<Box<Refunds>>),
    /// Answer with this response instead (429 or 503).
    Respond(Response<Bytes>),
}

/// The refunds a passed request may get once its response's status is
/// known: the charges of its tiers with `skip_failed_requests` (given back
/// on a status ≥ 400) and `skip_successful_requests` (< 400).
pub(crate) struct Refunds {
    backend: Backend,
    on_failure: Vec<TierRefund>,
    on_success: Vec<TierRefund>,
}

impl Refunds {
    /// The refunds of a charged request, if any of its tiers asks for them.
    fn of(shared: &Shared, meta: &Meta, v: &Verdict) -> Option<Box<Refunds>> {
        if !shared.refunds() {
            return None;
        }
        let mut r = Refunds {
            backend: shared.backend.clone(),
            on_failure: Vec::new(),
            on_success: Vec::new(),
        };
        for (i, charge) in v.charges.iter().enumerate() {
            // Only tiers this request was charged on (allowed, not denied
            // in shadow mode, and the request committed).
            let (Some(charge), Some(check)) = (charge, meta.sent.get(i)) else {
                continue;
            };
            let Some(t) = meta.tier(shared, i) else {
                continue;
            };
            let refund = || TierRefund {
                check: check.clone(),
                charge: *charge,
            };
            if t.skip_failed {
                r.on_failure.push(refund());
            }
            if t.skip_successful {
                r.on_success.push(refund());
            }
        }
        if r.on_failure.is_empty() && r.on_success.is_empty() {
            None
        } else {
            Some(Box::new(r))
        }
    }

    /// Gives back the charges `status` calls for, without delaying the
    /// response: in memory at once (one shard lock per key, as brief as a
    /// check's), on Redis in a task of its own.
    pub(crate) fn issue(self, status: http::StatusCode) {
        let refunds = if status.as_u16() >= 400 {
            self.on_failure
        } else {
            self.on_success
        };
        if refunds.is_empty() {
            return;
        }
        match self.backend {
            Backend::Memory(m) => m.refund(&refunds),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        if let Err(e) = r.refund(&refunds).await {
                            refund_failed(&e);
                        }
                    });
                }
                Err(_) => refund_failed(&BackendError::Script(
                    "no tokio runtime to send the refund on".to_owned(),
                )),
            },
        }
    }
}

/// A refund by status that did not land: the request keeps its charge
/// (capacity is under-used until it refills; nothing is over-admitted).
/// Counted always, logged at most once a second.
#[cfg(feature = "redis")]
fn refund_failed(e: &BackendError) {
    metrics::counter!(
        "tiered_ratelimit_refund_failures_total",
        "kind" => e.kind()
    )
    .increment(1);
    static LOG: std::sync::OnceLock<observe::LogThrottle> = std::sync::OnceLock::new();
    let log = LOG.get_or_init(|| observe::LogThrottle::new(Duration::from_secs(1)));
    if let Some(suppressed) = log.permit() {
        tracing::warn!(
            error = %e,
            suppressed,
            "rate limiter: refund by response status failed; the request keeps its charge"
        );
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
{
    type Response = Response<crate::response::ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let started = std::time::Instant::now();
        let shared = &self.shared;
        if shared.control.is_some() && shared.control_started.get().is_none() {
            crate::control::start(shared);
        }
        let (parts, body) = req.into_parts();
        let (result, meta) = match plan(shared, &parts, false) {
            Planned::Pass(decision) => {
                shared.count(decision);
                let req = Request::from_parts(parts, body);
                return ResponseFuture::call(self.inner.call(req), None, None);
            }
            Planned::Refuse(res) => return ResponseFuture::respond(res),
            Planned::Failed(e) => (Err(e), Meta::default()),
            Planned::Check(checks, mut meta) => {
                match deny_cached(shared, &checks, &meta, true) {
                    Cached::Respond(res) => return ResponseFuture::respond(res),
                    Cached::Wait(probe) => {
                        let wait = Box::pin(probe.wait(shared.backend_timeout));
                        let waiter = Waiter {
                            service: self.take_ready_inner(),
                            request: Request::from_parts(parts, body),
                            shared: self.shared.clone(),
                            checks,
                            meta,
                            started,
                        };
                        return ResponseFuture::wait(wait, waiter);
                    }
                    Cached::Check(probe) => meta.probe = probe,
                }
                match start(shared, checks, &mut meta, started, shared.backend_timeout) {
                    Started::Ready(result) => (result, meta),
                    Started::Pending(fut) => {
                        let shared = shared.clone();
                        let req = Request::from_parts(parts, body);
                        let inner = self.take_ready_inner();
                        return ResponseFuture::check(fut, inner, req, shared, meta);
                    }
                }
            }
        };
        let decided = outcome(shared, &meta, result, &parts);
        let req = Request::from_parts(parts, body);
        match decided {
            Outcome::Pass(headers, delay, refunds) if delay.is_zero() => {
                ResponseFuture::call(self.inner.call(req), headers, refunds)
            }
            Outcome::Pass(headers, delay, refunds) => {
                let inner = self.take_ready_inner();
                ResponseFuture::delay(delay, inner, req, headers, refunds)
            }
            Outcome::Respond(res) => ResponseFuture::respond(res),
        }
    }
}

/// How a backend check began.
pub(crate) enum Started {
    /// Decided already (the memory backend, an open circuit, a command that
    /// could not be built).
    Ready(Result<Verdict, BackendError>),
    /// In flight.
    Pending(CheckFuture),
}

/// Starts the backend check of `checks` (past the deny cache). `started`:
/// when the request reached the layer; `timeout`: the backend call's bound
/// (less than `backend_timeout` after a wait for a probe).
fn start(
    shared: &Shared,
    checks: Vec<TierCheck>,
    meta: &mut Meta,
    started: Instant,
    timeout: Duration,
) -> Started {
    meta.started = Some(started);
    meta.permit = shared.breaker.permit();
    if meta.permit == Permit::Reject {
        return Started::Ready(Err(BackendError::CircuitOpen));
    }
    meta.backend_started = Some(Instant::now());
    #[allow(irrefutable_let_patterns)] // without the `redis` feature
    if let Backend::Memory(m) = &shared.backend {
        // Synchronous: keep the checks themselves, no copies.
        let verdict = m.check(&checks, meta.shadow, shared.refunds());
        meta.sent = checks;
        Started::Ready(Ok(verdict))
    } else {
        // For the deny cache (off on the memory backend).
        meta.sent_us = shared.local_clock.now_us();
        let blocked = shared.blocked_set();
        let check = shared.backend.start_check(
            &checks,
            meta.shadow,
            shared.refunds(),
            blocked.as_deref(),
            Some(timeout),
        );
        meta.sent = checks;
        match check {
            Check::Ready(result) => Started::Ready(result),
            Check::Pending(fut) => Started::Pending(fut),
        }
    }
}

/// What a request that waited for another's probe does next.
pub(crate) enum Resumed {
    /// Answered from the deny cache.
    Respond(Response<Bytes>),
    Started(Started, Meta),
}

/// After the wait for a probe: the deny cache again (the probe's answer is
/// in it now), then the backend.
pub(crate) fn resume(
    shared: &Shared,
    checks: Vec<TierCheck>,
    mut meta: Meta,
    started: Instant,
) -> Resumed {
    // The wait counts against `backend_timeout`, the most the layer may add
    // to a request: the check gets what is left (none: the failure policy).
    let timeout = shared.backend_timeout.saturating_sub(started.elapsed());
    match deny_cached(shared, &checks, &meta, false) {
        Cached::Respond(res) => Resumed::Respond(res),
        // Nothing left: a timeout, without sending a check that could
        // charge after the request gave up on it.
        _ if timeout.is_zero() => {
            meta.started = Some(started);
            let timed_out = Err(BackendError::Timeout(shared.backend_timeout));
            Resumed::Started(Started::Ready(timed_out), meta)
        }
        Cached::Wait(_) => {
            let started = start(shared, checks, &mut meta, started, timeout);
            Resumed::Started(started, meta)
        }
        Cached::Check(probe) => {
            meta.probe = probe;
            let started = start(shared, checks, &mut meta, started, timeout);
            Resumed::Started(started, meta)
        }
    }
}

/// What the deny cache says about a request's enforced checks.
enum Cached {
    /// A 429 from a cached denial.
    Respond(Response<Bytes>),
    /// Another request is probing one of its lapsed keys: wait for its
    /// answer.
    Wait(Arc<Probe>),
    /// Ask the backend; with a guard when this request probes a lapsed key.
    Check(Option<ProbeGuard>),
}

/// Looks the enforced checks up in the deny cache. It answers 429 only
/// when it knows the whole answer the backend would give (see
/// [`crate::deny_cache`]): the binding tier — the enforced denying tier with
/// the longest wait, the first on a tie, as [`decide`] picks it — must be one
/// with a live entry, which holds when every other enforced check either
/// has a live entry with a shorter wait (or an equal one, after it) or
/// could not, whatever its stored state, deny with a wait that would make
/// it bind instead. Otherwise, for the first lapsed check, the probe to join
/// (`may_wait`: wait for another's; a request that already waited does not
/// wait again).
fn deny_cached(shared: &Shared, checks: &[TierCheck], meta: &Meta, may_wait: bool) -> Cached {
    if !shared.deny_cache.enabled() {
        return Cached::Check(None);
    }
    let now_us = shared.local_clock.now_us();
    let mut lapsed = None;
    // The binding cached denial so far: (check, entry, wait).
    let mut binding: Option<(usize, Denied, u64)> = None;
    // The enforced checks without a live entry, and those with one.
    let mut uncached: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
    let mut cached: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
    for (i, c) in checks.iter().enumerate() {
        if meta.shadow.contains(i) {
            continue;
        }
        match shared.deny_cache.lookup(&c.key, c.cost, &c.limit, now_us) {
            Lookup::Denied(d) => {
                cached.push(i);
                let wait = d.until_us.saturating_sub(now_us);
                if binding.is_none_or(|(_, _, b)| wait > b) {
                    binding = Some((i, d, wait));
                }
            }
            Lookup::Lapsed => {
                lapsed.get_or_insert(i);
                uncached.push(i);
            }
            Lookup::Miss => uncached.push(i),
        }
    }
    if let Some((i, d, wait)) = binding {
        // A check without a live entry binds instead if it may deny with a
        // longer wait (or an equal one, before the cached check). When the
        // 429 lists every violated tier, any check without an entry may be
        // one more of them: only a fully cached request is known.
        let lists = shared.on_rejection.uses_violated_policies();
        let known = (!lists || uncached.is_empty())
            && uncached.iter().all(|&j| {
                let c = &checks[j];
                let longest = longest_wait_us(&c.limit, c.cost, now_us);
                if j < i {
                    longest < wait
                } else {
                    longest <= wait
                }
            });
        if known {
            // Every enforced check with a live entry is denied, in tier order.
            let violated = cached.iter().map(|&j| meta.tier_name(shared, j)).collect();
            return Cached::Respond(cache_blocked(shared, checks, meta, i, &d, now_us, violated));
        }
    }
    let Some(i) = lapsed else {
        return Cached::Check(None);
    };
    match shared.deny_cache.join(&checks[i].key) {
        Role::Lead(guard) => Cached::Check(Some(guard)),
        Role::Follow(probe) if may_wait => Cached::Wait(probe),
        Role::Follow(_) => Cached::Check(None),
    }
}

/// The 429 for check `i`, cached as denied by `d`.
fn cache_blocked(
    shared: &Shared,
    checks: &[TierCheck],
    meta: &Meta,
    i: usize,
    d: &Denied,
    now_us: u64,
    violated: Vec<Arc<str>>,
) -> Response<Bytes> {
    shared.count("cache_blocked");
    shared.count_fleet_blocked(&checks[i].key, checks[i].cost, now_us);
    // The operator's view counts it like the backend's rejection.
    let now_s = now_us / 1_000_000;
    if let Some(tier) = meta.tiers.get(i).map(|&t| usize::from(t)) {
        if let Some(e) = &meta.endpoint {
            shared.observer.record(e, tier, true, false, now_s);
        }
        if let Some(t) = shared.tiers.get(tier) {
            let key = &checks[i].key;
            let part = key.get(t.key_base.len()..).unwrap_or(key);
            shared
                .observer
                .sketch(tier, Kind::Blocked, part, checks[i].cost, now_s);
        }
    }
    let wait = d.until_us.saturating_sub(now_us);
    let decision = Decision {
        allowed: false,
        // `X-RateLimit-Limit`: the capacity of the limit it was decided under.
        limit: d.quota.capacity(),
        remaining: d.remaining,
        reset_after_us: wait,
        retry_after_us: wait,
        delay_us: 0,
    };
    reject(shared, meta, i, &decision, now_us, false, violated)
}

impl<S: Clone> RateLimitService<S> {
    /// The readied inner service, for a future that calls it later; a clone
    /// takes its place (the tower pattern for services called after an await).
    fn take_ready_inner(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

/// What a request's check is about, kept for the decision: which tiers the
/// checks belong to, which of them only observe (shadow, or canary keys not
/// enforced), and what to log about those.
#[derive(Debug, Default)]
pub(crate) struct Meta {
    /// Tier index of each check (inline up to 8 checks).
    tiers: smallvec::SmallVec<[u8; 8]>,
    /// Checks whose denial does not reject.
    pub(crate) shadow: Shadow,
    /// For shadow checks: the endpoint label and a hash of each key, for the
    /// would-be-rejected log line (computed only when some tier observes).
    observed: Option<Observed>,
    /// What the circuit breaker allowed.
    pub(crate) permit: Permit,
    /// The local clock when the check was sent, and each check's key and
    /// cost (for the deny cache and the top-N sketches).
    sent_us: u64,
    sent: Vec<TierCheck>,
    /// The request's endpoint series (for the anomaly baseline).
    endpoint: Option<Arc<crate::observe::recorder::Endpoint>>,
    /// When the request reached the layer, and when the backend call started.
    started: Option<std::time::Instant>,
    backend_started: Option<std::time::Instant>,
    /// Decided by the local fallback limiter.
    fallback: bool,
    /// With IETF headers: each check's quota (requests), period in
    /// microseconds, and whether its algorithm refills continuously.
    quotas: Vec<(u64, u64, bool)>,
    /// Held while this request probes a lapsed deny-cache key: dropped with
    /// the meta, after the answer was fed to the cache (or on an error),
    /// which wakes the requests waiting for it.
    pub(crate) probe: Option<ProbeGuard>,
    /// For tiers with plans: each check's plan (`None` = the tier's
    /// default), with its position among the tier's plans.
    plans: Vec<Option<(usize, Arc<str>)>>,
}

#[derive(Debug)]
struct Observed {
    endpoint: String,
    key_hashes: Vec<u64>,
}

impl Meta {
    /// The tier check `i` belongs to.
    fn tier<'s>(&self, shared: &'s Shared, i: usize) -> Option<&'s BuiltTier> {
        self.tiers
            .get(i)
            .and_then(|&t| shared.tiers.get(usize::from(t)))
    }

    /// The name of the tier check `i` belongs to.
    fn tier_name(&self, shared: &Shared, i: usize) -> Arc<str> {
        self.tier(shared, i)
            .map_or_else(|| Arc::from("unknown"), |t| t.name.clone())
    }

    /// Check `i`'s plan slot for the tier-decision counter (0: the default
    /// plan, else 1 + its position) and name.
    fn plan_slot(&self, i: usize) -> (usize, &str) {
        match self.plans.get(i) {
            Some(Some((pos, name))) => (pos.saturating_add(1), name),
            _ => (0, "default"),
        }
    }
}

/// What the service does with a request before any backend call.
enum Planned {
    /// No tier applies (or the request is allowlisted): pass, counted as this.
    Pass(&'static str),
    /// Denylisted: answer this.
    Refuse(Response<Bytes>),
    /// Check these.
    Check(Vec<TierCheck>, Meta),
    /// An extractor could not run.
    Failed(BackendError),
}

/// The steps before any tier: the global mode (with the control key's
/// override), then the denylist, then the allowlist. Shared with replay's
/// direct engine, so both decide alike.
pub(crate) enum Gate {
    /// The global mode is off.
    Off,
    Denylisted,
    Allowlisted,
    /// Plan the tiers under this global mode.
    Tiers(Mode),
}

pub(crate) fn gate(shared: &Shared, rt: &Runtime, ov: &Overrides, parts: &Parts) -> Gate {
    let global = ov.mode.unwrap_or(rt.mode);
    if global == Mode::Off {
        Gate::Off
    } else if rt.deny.matches(parts, &shared.client_ip) {
        Gate::Denylisted
    } else if rt.allow.matches(parts, &shared.client_ip) {
        Gate::Allowlisted
    } else {
        Gate::Tiers(global)
    }
}

/// One tier's check of a request, as planned.
pub(crate) struct TierPlan<'r> {
    pub(crate) limit: Limit,
    /// Clamped to the capacity + 1: a cost above the capacity is denied
    /// anyway, and clamping keeps every algorithm's integer arithmetic far
    /// from overflow whatever a cost function returns (a client-declared
    /// batch size, say).
    pub(crate) cost: u64,
    /// False in shadow mode, or for a canary's keys outside its share.
    pub(crate) enforced: bool,
    /// The request's plan on this tier, when the tier has plans and the
    /// request names one of them.
    pub(crate) plan: Option<&'r PlanRuntime>,
}

/// Whether tier `i` (`t`, `r`) checks `parts`, and how. `key` is set to the
/// storage key (`<prefix>:<tier>:<part>`). `None`: the tier does not apply
/// (its mode is off, it does not count the method, the cost is 0, or the
/// extractor found no key). `fallback`: the local fallback's limits.
///
/// # Errors
/// The extractor could not run.
#[inline]
pub(crate) fn plan_tier<'r>(
    (i, t, r): (usize, &BuiltTier, &'r TierRuntime),
    ov: &Overrides,
    global: Mode,
    parts: &Parts,
    fallback: bool,
    key: &mut String,
) -> Result<Option<TierPlan<'r>>, KeyError> {
    let tier_mode = ov.tiers.get(i).copied().flatten().unwrap_or(r.mode);
    let mode = tier_mode.under(global);
    if mode == Mode::Off || !t.counts_method(&parts.method) {
        return Ok(None);
    }
    let cost = match &t.cost_fn {
        Some(f) => f(parts),
        None => t.cost,
    };
    if cost == 0 {
        return Ok(None);
    }
    key.clear();
    // Room for the prefix and a typical key part (an IPv4 address, a user
    // id, a 32-digit API key hash) without growing.
    key.reserve(t.key_base.len() + 40);
    key.push_str(&t.key_base);
    if !t.key.extract_into(parts, key)? {
        return Ok(None);
    }
    let plan = if r.plans.is_empty() {
        None
    } else {
        plan_of(t, r, parts)
    };
    let limit = match (plan, fallback) {
        (Some(p), false) => p.limit,
        (Some(p), true) => p.fallback,
        (None, false) => r.limit,
        (None, true) => r.fallback,
    };
    Ok(Some(TierPlan {
        limit,
        cost: cost.min(limit.capacity().saturating_add(1)),
        enforced: mode.enforces(&t.name, &key[t.key_base.len()..]),
        plan,
    }))
}

/// The checks for a request, after the global mode and the lists: one per
/// tier whose mode is not off, whose methods include the request's, whose
/// cost is not 0 and whose extractor returns a key.
fn plan(shared: &Shared, parts: &Parts, fallback: bool) -> Planned {
    let rt = shared.runtime.load();
    let ov = shared.overrides.load();
    let global = match gate(shared, &rt, &ov, parts) {
        Gate::Off => return Planned::Pass("skipped"),
        Gate::Denylisted => {
            shared.count("denylisted");
            return Planned::Refuse(denied_by_list(shared.deny_status));
        }
        Gate::Allowlisted => return Planned::Pass("allowlisted"),
        Gate::Tiers(global) => global,
    };
    let mut checks = Vec::with_capacity(shared.tiers.len());
    let mut meta = Meta::default();
    // A tier that does not apply leaves the buffer to the next.
    let mut key = String::new();
    for (i, (t, r)) in shared.tiers.iter().zip(rt.tiers.iter()).enumerate() {
        let tp = match plan_tier((i, t, r), &ov, global, parts, fallback, &mut key) {
            Ok(Some(tp)) => tp,
            Ok(None) => continue,
            Err(e) => {
                // The tier cannot be computed for this request: the failure
                // policy decides it alone (see `KeyError`). The fallback's
                // second plan of the same request is not counted again.
                if !fallback {
                    key_failed(shared, t, &e);
                }
                if shared.failure_policy == FailurePolicy::Closed {
                    return Planned::Failed(e.into());
                }
                continue;
            }
        };
        if !r.plans.is_empty() {
            // The plan label of this check's metrics (configured names only).
            meta.plans.resize(checks.len(), None);
            meta.plans.push(tp.plan.map(|p| {
                let pos = r.plans.iter().position(|x| std::ptr::eq(x, p));
                (pos.unwrap_or(usize::MAX - 1), p.name.clone())
            }));
        }
        if !tp.enforced {
            let n = checks.len();
            meta.shadow.0 |= 1 << n;
            let observed = meta.observed.get_or_insert_with(|| Observed {
                endpoint: {
                    let (m, r) = crate::key::route_of(parts);
                    format!("{m} {r}")
                },
                key_hashes: Vec::new(),
            });
            observed.key_hashes.resize(n, 0);
            observed
                .key_hashes
                .push(xxhash_rust::xxh3::xxh3_64(key.as_bytes()));
        }
        if shared.header_style.ietf() {
            let q = tp.plan.map_or(r.quota, |p| p.quota);
            let refills = matches!(
                t.algorithm,
                crate::tier::Algorithm::TokenBucket | crate::tier::Algorithm::LeakyBucket(_)
            );
            let period_us = u64::try_from(q.period().as_micros()).unwrap_or(u64::MAX);
            meta.quotas.push((q.limit(), period_us, refills));
        }
        checks.push(TierCheck {
            key: std::mem::take(&mut key),
            limit: tp.limit,
            cost: tp.cost,
        });
        // MAX_TIERS is 64, so the index fits.
        meta.tiers.push(u8::try_from(i).unwrap_or(u8::MAX));
    }
    if checks.is_empty() {
        Planned::Pass("skipped")
    } else {
        let (method, route) = crate::key::route_of(parts);
        meta.endpoint = Some(shared.observer.endpoint(method, route));
        Planned::Check(checks, meta)
    }
}

/// The counter of failed key extractions.
pub(crate) const KEY_ERRORS: &str = "tiered_ratelimit_key_errors_total";

/// Counts a failed extraction on tier `t` and logs it (once a minute per
/// tier, with the number of lines suppressed since the last): at ERROR with
/// the fix for a configuration error, at WARN otherwise.
#[cold]
#[inline(never)]
fn key_failed(shared: &Shared, t: &BuiltTier, e: &KeyError) {
    metrics::counter!(
        KEY_ERRORS,
        "tier" => t.name.to_string(),
        "reason" => e.reason()
    )
    .increment(1);
    let Some(suppressed) = t.key_error_log.permit() else {
        return;
    };
    let policy = shared.failure_policy;
    let consequence = if policy == FailurePolicy::Closed {
        "answering 503 (failure policy Closed)"
    } else {
        "skipping this tier; the other tiers still apply"
    };
    if e.is_configuration() {
        tracing::error!(
            tier = %t.name,
            extractor = t.key_type,
            reason = e.reason(),
            suppressed,
            "rate limiter misconfigured: tier \"{}\" cannot compute its key, {consequence}: {e}",
            t.name,
        );
    } else {
        tracing::warn!(
            tier = %t.name,
            extractor = t.key_type,
            reason = e.reason(),
            suppressed,
            "rate limiter: tier \"{}\" could not compute this request's key, {consequence}: {e}",
            t.name,
        );
    }
}

/// The request's plan on this tier, if it names one the tier knows (else the
/// tier's default quota applies). The plan extractor runs once per tier.
fn plan_of<'r>(t: &BuiltTier, r: &'r TierRuntime, parts: &Parts) -> Option<&'r PlanRuntime> {
    let from_fn;
    let plan: Option<&str> = match &t.plan_fn {
        Some(f) => {
            from_fn = f(parts);
            from_fn.as_deref()
        }
        None => parts.extensions.get::<Plan>().map(|p| p.0.as_str()),
    };
    plan.and_then(|p| r.plans.iter().find(|pr| &*pr.name == p))
}

fn denied_by_list(status: DenyStatus) -> Response<Bytes> {
    #[derive(serde::Serialize)]
    struct Body {
        error: &'static str,
    }
    match status {
        DenyStatus::Forbidden => {
            json_response(http::StatusCode::FORBIDDEN, &Body { error: "forbidden" })
        }
        DenyStatus::TooManyRequests => {
            let mut res = json_response(
                status.status(),
                &Body {
                    error: "rate_limit_exceeded",
                },
            );
            res.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("3600"),
            );
            res
        }
    }
}

/// Seconds, rounded up.
fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// Turns a backend result into what the client gets.
pub(crate) fn outcome(
    shared: &Shared,
    meta: &Meta,
    result: Result<Verdict, BackendError>,
    parts: &http::request::Parts,
) -> Outcome {
    let backend = shared.backend.name();
    // One span per check, with every tier's result as a field (formatted
    // only when a subscriber wants the span).
    let span = tracing::debug_span!(
        "rate_limit_check",
        backend,
        tiers = tracing::field::Empty,
        error = tracing::field::Empty
    );
    if !span.is_disabled() {
        match &result {
            Ok(v) => {
                let mut out = String::new();
                for (i, d) in v.decisions.iter().enumerate() {
                    let name = meta.tier(shared, i).map_or("?", |t| &*t.name);
                    let what = match (d.allowed, meta.shadow.contains(i)) {
                        (true, _) => "allowed",
                        (false, true) => "shadow_limited",
                        (false, false) => "limited",
                    };
                    use std::fmt::Write;
                    let _ = write!(
                        out,
                        "{}{name}={what}/{}",
                        if i > 0 { "," } else { "" },
                        d.remaining
                    );
                }
                span.record("tiers", out.as_str());
            }
            Err(e) => {
                span.record("error", tracing::field::display(e));
            }
        }
    }
    let _entered = span.enter();
    let backend_latency = meta.backend_started.map(|t| t.elapsed());
    let decided = match result {
        Ok(v) => {
            shared.breaker.success(meta.permit);
            feed_deny_cache(shared, meta, &v);
            observe_decisions(shared, meta, &v);
            match decide(shared, meta, &v) {
                Outcome::Pass(headers, delay, _) => {
                    Outcome::Pass(headers, delay, Refunds::of(shared, meta, &v))
                }
                respond => respond,
            }
        }
        Err(e) => {
            if !matches!(e, BackendError::CircuitOpen | BackendError::Key(_)) {
                shared.breaker.failure(meta.permit);
            }
            fail(shared, &e, parts)
        }
    };
    shared.metrics.latency(backend_latency, meta.started);
    decided
}

/// Feeds the anomaly series and the top-N sketches. Rejections by a tier
/// (enforced or shadow) count as blocked for that tier's sketch; allowed
/// requests with less than 20 % of a tier's capacity left as near-limit.
fn observe_decisions(shared: &Shared, meta: &Meta, v: &Verdict) {
    // The memory backend decided on this same clock a moment ago.
    let now_us = match shared.backend {
        Backend::Memory(_) => v.now_us,
        #[cfg(feature = "redis")]
        Backend::Redis(_) => shared.local_clock.now_us(),
    };
    let now_s = now_us / 1_000_000;
    for (i, d) in v.decisions.iter().enumerate() {
        let Some(tier) = meta.tiers.get(i).map(|&t| usize::from(t)) else {
            continue;
        };
        let shadow = meta.shadow.contains(i);
        if let Some(e) = &meta.endpoint {
            shared
                .observer
                .record(e, tier, !d.allowed && !shadow, !d.allowed && shadow, now_s);
        }
        let near = d.allowed && d.remaining.saturating_mul(5) < d.limit;
        if d.allowed && !near {
            continue;
        }
        let (Some(TierCheck { key, cost, .. }), Some(t)) =
            (meta.sent.get(i), shared.tiers.get(tier))
        else {
            continue;
        };
        let part = key.get(t.key_base.len()..).unwrap_or(key);
        let kind = if d.allowed {
            Kind::NearLimit
        } else {
            Kind::Blocked
        };
        shared.observer.sketch(tier, kind, part, *cost, now_s);
    }
}

/// Feeds the deny cache from a backend answer, for enforced tiers:
/// * a denial is cached until its retry instant;
/// * a charge that leaves less than another request of the same cost
///   (the backend says when the next one would pass) is cached until then
///   too, so the requests right after an admission that drained the bucket
///   are answered locally (a single Redis reports it for the token bucket,
///   fixed window and leaky bucket);
/// * any other charge forgets the key's entry: it changed the key's state,
///   so an entry written before (for another cost or limit) may no longer
///   give the backend's answer.
///
/// Only while the cached answer stays exactly the backend's
/// ([`stays_exact`]: its `remaining` cannot change before the retry
/// instant). Both are measured from when the check was sent (on a manual
/// clock, the instant the backend decided at). Tiers that refund by response
/// status are left out: a refund can make room before the cached instant.
fn feed_deny_cache(shared: &Shared, meta: &Meta, v: &Verdict) {
    if meta.sent.is_empty() || !shared.deny_cache.enabled() {
        return;
    }
    let mut now_us = None;
    let mut probed_room = false;
    for (i, (d, TierCheck { key, cost, limit })) in v.decisions.iter().zip(&meta.sent).enumerate() {
        let charged = v.charges.get(i).and_then(|c| c.as_ref());
        if meta.shadow.contains(i) {
            continue;
        }
        let wait_us = if d.allowed {
            charged.map_or(0, |c| c.next_after_us)
        } else {
            d.retry_after_us
        };
        // An instant already past when the answer arrived (a wait shorter
        // than the round trip) is of no use, and as a lapsed entry it would
        // only make the next requests wait a round trip for nothing.
        let until_us = meta.sent_us.saturating_add(wait_us);
        let cache = wait_us > 0
            && stays_exact(limit, *cost, d.remaining)
            && meta
                .tier(shared, i)
                .is_some_and(|t| !t.skip_failed && !t.skip_successful)
            && until_us > *now_us.get_or_insert_with(|| shared.local_clock.now_us());
        if !cache && meta.probe.as_ref().is_some_and(|p| p.key() == key) {
            probed_room = true;
        }
        if cache {
            shared.deny_cache.insert(
                key.clone(),
                Denied::new(
                    until_us,
                    *cost,
                    *limit,
                    d.remaining,
                    Duration::from_micros(wait_us),
                ),
            );
        } else if charged.is_some() {
            shared.deny_cache.forget(key, || {
                *now_us.get_or_insert_with(|| shared.local_clock.now_us())
            });
        }
    }
    // This request probed a lapsed key and the answer wrote no entry for it
    // (room left, or a denial the cache may not answer for): forget the
    // lapsed entry, or every request that overlaps another on this key
    // would wait a round trip for nothing until the entry ages out. (When
    // the key is still at its limit, the entry stays and keeps funnelling
    // requests behind one probe at a time.)
    if let Some(p) = meta.probe.as_ref().filter(|_| probed_room) {
        let now_us = now_us.unwrap_or_else(|| shared.local_clock.now_us());
        shared.deny_cache.remove_lapsed(p.key(), now_us);
    }
}

/// Counts every tier's decision on the request (one each) in
/// `tiered_ratelimit_tier_decisions_total`, but the binding tier's: its
/// `limited` is counted with the 429 ([`reject`]). And the request under
/// `request`, with the same lookup of the metric handles.
fn count_tier_decisions(
    shared: &Shared,
    meta: &Meta,
    ds: &[Decision],
    binding: Option<usize>,
    request: Option<&'static str>,
) {
    if let Some(d) = request {
        shared.counts.add(d);
    }
    let Some(e) = &meta.endpoint else {
        if let Some(d) = request {
            shared.metrics.count(d);
        }
        return;
    };
    let cells = ds.iter().enumerate().filter_map(|(i, d)| {
        let decision = match (d.allowed, meta.shadow.contains(i)) {
            _ if Some(i) == binding => return None,
            (true, _) if d.remaining.saturating_mul(5) < d.limit => TierDecision::NearLimit,
            (true, _) => TierDecision::Allowed,
            (false, true) => TierDecision::ShadowLimited,
            (false, false) => TierDecision::LimitedNotBinding,
        };
        Some(TierCount {
            check: i,
            tier: usize::from(*meta.tiers.get(i)?),
            slot: meta.plan_slot(i).0,
            decision,
        })
    });
    shared.metrics.count_tiers(request, e, cells, |i| {
        (
            meta.tier(shared, i).map_or("unknown", |t| &*t.name),
            meta.plan_slot(i).1,
        )
    });
}

fn decide(shared: &Shared, meta: &Meta, v: &Verdict) -> Outcome {
    let ds = &v.decisions;
    let tier_name = |i: usize| meta.tier_name(shared, i);
    // Would-be rejections by observing tiers: counted and logged, never enforced.
    let mut shadow_limited = false;
    for (i, d) in ds.iter().enumerate() {
        if !d.allowed && meta.shadow.contains(i) {
            shadow_limited = true;
            let tier = tier_name(i);
            if let Some(o) = &meta.observed {
                let key_hash = o.key_hashes.get(i).copied().unwrap_or(0);
                log_shadow(
                    shared.shadow_log_level,
                    &tier,
                    key_hash,
                    &o.endpoint,
                    d.retry_after_us,
                );
            }
        }
    }
    // Binding tier: the enforced denying tier with the longest wait (first on a tie).
    let mut binding: Option<(usize, &Decision)> = None;
    for (i, d) in ds.iter().enumerate() {
        if d.allowed || meta.shadow.contains(i) {
            continue;
        }
        if binding.is_none_or(|(_, b)| d.retry_after_us > b.retry_after_us) {
            binding = Some((i, d));
        }
    }
    let Some((i, d)) = binding else {
        // Headers describe the tier with the least remaining (on a tie, the one
        // that takes longest to refill), among enforced tiers and, when asked
        // for, observing ones.
        let shown = ds
            .iter()
            .enumerate()
            .filter(|(i, _)| shared.shadow_headers || !meta.shadow.contains(*i))
            .min_by(|(_, a), (_, b)| {
                a.remaining
                    .cmp(&b.remaining)
                    .then(b.reset_after_us.cmp(&a.reset_after_us))
            });
        let request = (!meta.fallback).then_some(if shadow_limited {
            "shadow_limited"
        } else {
            "allowed"
        });
        count_tier_decisions(shared, meta, ds, None, request);
        // A request queued by shaping tiers waits for the latest slot.
        let delay_us = ds
            .iter()
            .filter(|d| d.allowed)
            .map(|d| d.delay_us)
            .max()
            .unwrap_or(0);
        let headers = match shared.header_style {
            HeaderStyle::None => None,
            _ => shown.map(|(i, d)| headers_for(shared, meta, i, d, v.now_us, false)),
        };
        return Outcome::Pass(headers, Duration::from_micros(delay_us), None);
    };
    count_tier_decisions(shared, meta, ds, Some(i), None);
    let violated = ds
        .iter()
        .enumerate()
        .filter(|(j, d)| !d.allowed && !meta.shadow.contains(*j))
        .map(|(j, _)| meta.tier_name(shared, j))
        .collect();
    Outcome::Respond(reject(
        shared,
        meta,
        i,
        d,
        v.now_us,
        !meta.fallback,
        violated,
    ))
}

/// The headers describing check `i`'s decision.
fn headers_for(
    shared: &Shared,
    meta: &Meta,
    i: usize,
    d: &Decision,
    now_us: u64,
    denied: bool,
) -> RateLimitHeaders {
    let policy = meta.tier_name(shared, i);
    let (q, period_us, refills) = meta.quotas.get(i).copied().unwrap_or((d.limit, 0, false));
    let quota = (q, period_us.div_ceil(1_000_000));
    if denied {
        let retry_after = ceil_secs(d.retry_after_us).max(1);
        RateLimitHeaders {
            limit: d.limit,
            remaining: d.remaining,
            reset: ceil_secs(now_us.saturating_add(d.retry_after_us)),
            retry_after: Some(retry_after),
            reset_in: retry_after,
            // The binding tier has the longest wait of the denying tiers,
            // so `Retry-After` is never earlier than this `t`.
            window_in: retry_after,
            policy,
            quota,
            style: shared.header_style,
        }
    } else {
        let reset = ceil_secs(now_us.saturating_add(d.reset_after_us));
        RateLimitHeaders {
            limit: d.limit,
            remaining: d.remaining,
            reset,
            retry_after: None,
            // Seconds until full, rounded up: never above the window.
            reset_in: ceil_secs(d.reset_after_us),
            window_in: ceil_secs(crate::response::effective_window_us(
                d.limit,
                d.remaining,
                d.reset_after_us,
                refills.then_some((q, period_us)),
            )),
            policy,
            quota,
            style: shared.header_style,
        }
    }
}

/// The 429 for a denial by check `i`.
/// `count_limited`: count the request as `limited` (the deny cache and the
/// fallback count their own decision instead). `violated`: every enforced
/// denying tier, in tier order.
fn reject(
    shared: &Shared,
    meta: &Meta,
    i: usize,
    d: &Decision,
    now_us: u64,
    count_limited: bool,
    violated: Vec<Arc<str>>,
) -> Response<Bytes> {
    let tier = meta.tier_name(shared, i);
    let headers = headers_for(shared, meta, i, d, now_us, true);
    let retry_after = headers.retry_after.unwrap_or(1);
    if count_limited {
        shared.count("limited");
    }
    if let (Some(e), Some(t)) = (&meta.endpoint, meta.tiers.get(i)) {
        let c = TierCount {
            check: i,
            tier: usize::from(*t),
            slot: meta.plan_slot(i).0,
            decision: TierDecision::Limited,
        };
        shared
            .metrics
            .count_tiers(None, e, [c], |_| (&*tier, meta.plan_slot(i).1));
    }
    tracing::debug!(tier = &*tier, retry_after, "request rate limited");
    let rejection = Rejection {
        tier,
        violated_policies: violated,
        limit: headers.limit,
        remaining: headers.remaining,
        reset: headers.reset,
        retry_after,
        docs_url: shared.docs_url.clone(),
    };
    let mut res = shared.on_rejection.response(&rejection);
    headers.write(res.headers_mut());
    res.extensions_mut().insert(rejection);
    res
}

fn log_shadow(
    level: tracing::Level,
    tier: &str,
    key_hash: u64,
    endpoint: &str,
    retry_after_us: u64,
) {
    macro_rules! at {
        ($lvl:expr) => {
            tracing::event!(
                $lvl,
                tier,
                key_hash = format_args!("{key_hash:016x}"),
                endpoint,
                retry_after_us,
                "shadow: request would have been rate limited"
            )
        };
    }
    match level {
        tracing::Level::ERROR => at!(tracing::Level::ERROR),
        tracing::Level::WARN => at!(tracing::Level::WARN),
        tracing::Level::INFO => at!(tracing::Level::INFO),
        tracing::Level::DEBUG => at!(tracing::Level::DEBUG),
        _ => at!(tracing::Level::TRACE),
    }
}

fn fail(shared: &Shared, e: &BackendError, parts: &http::request::Parts) -> Outcome {
    let backend = shared.backend.name();
    observe::count_backend_error(e.kind(), backend);
    let policy = shared.failure_policy;
    if let Some(suppressed) = shared.failure_log.permit() {
        tracing::warn!(
            error = %e,
            backend,
            ?policy,
            suppressed,
            "rate limiter could not decide; applying failure policy"
        );
    }
    match policy {
        FailurePolicy::Open => {
            shared.count("fail_open");
            Outcome::Pass(None, Duration::ZERO, None)
        }
        FailurePolicy::Closed => {
            shared.count("fail_closed");
            Outcome::Respond(unavailable())
        }
        FailurePolicy::Fallback => {
            shared.count("fallback");
            let Some(local) = &shared.fallback else {
                return Outcome::Pass(None, Duration::ZERO, None);
            };
            match plan(shared, parts, true) {
                Planned::Check(checks, mut meta) => {
                    meta.fallback = true;
                    let v = local.check(&checks, meta.shadow, false);
                    decide(shared, &meta, &v)
                }
                Planned::Refuse(res) => Outcome::Respond(res),
                // An extractor failed: nothing local can decide either.
                Planned::Pass(_) | Planned::Failed(_) => Outcome::Pass(None, Duration::ZERO, None),
            }
        }
    }
}
