//! Where buckets live: [`MemoryBackend`] (one process) or [`RedisBackend`]
//! (shared by every app server).
//!
//! Both run the same algorithm code: the memory backend calls the pure models
//! in [`crate::algorithm`]; the Redis backend runs their Lua twins from `lua/`
//! in one script call per request, covering every tier.

mod charge;
pub(crate) mod clock;
mod memory;
pub(crate) mod override_rule;
#[cfg(feature = "redis")]
mod redis;

#[cfg(feature = "redis")]
pub(crate) use self::redis::{redis_params, PollPart};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{RedisBackend, SentinelMaster};
#[cfg(feature = "__testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "__testing")))]
pub use charge::{Charge, TierRefund};
#[cfg(not(feature = "__testing"))]
pub(crate) use charge::{Charge, TierRefund};
pub use clock::ManualClock;
pub use memory::MemoryBackend;
pub(crate) use memory::{candidate_tag, Denials, PackGroup};

use crate::algorithm::{Limit, TierDecision};
use crate::error::BackendError;
use std::future::Future;
use std::pin::Pin;

/// The storage a layer checks its tiers against.
///
/// Built from a backend with `.into()`; the builder's `.backend(..)` takes
/// either kind directly.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Backend {
    /// In-process buckets.
    Memory(MemoryBackend),
    /// Buckets in Redis, checked with one Lua script call per request.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    Redis(RedisBackend),
}

impl From<MemoryBackend> for Backend {
    fn from(b: MemoryBackend) -> Self {
        Backend::Memory(b)
    }
}

#[cfg(feature = "redis")]
impl From<RedisBackend> for Backend {
    fn from(b: RedisBackend) -> Self {
        Backend::Redis(b)
    }
}

/// One tier's share of a request's check: which key, under which limit, at
/// what cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierCheck {
    /// The full storage key. The layer builds `<prefix>:<tier>:<key part>`;
    /// callers of [`Backend::check`] must keep keys free of request-controlled
    /// structure themselves (see [`crate::key::storage_key_part`]).
    pub key: String,
    /// The algorithm and its parameters.
    pub limit: Limit,
    /// Cost in requests (tokens), at least 1.
    pub cost: u64,
    /// The tier's configured quota when `limit` is another one (changed at
    /// run time, a plan's), else `None`. A key's state carries its used
    /// capacity over quota changes on both backends (`docs/rollout.md`, "A
    /// quota change"); the Redis backend stores values written under the
    /// configured quota in its compact forms and reads those as that
    /// quota's, so it needs to know which quota that is. The memory
    /// backend ignores it.
    pub home: Option<Limit>,
}

/// The backend's answer for all tiers of one request.
///
/// The default is an empty verdict (clock 0, no decisions), for
/// [`MemoryBackend::check_into`] to fill.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verdict {
    /// The backend's clock when it decided, in Unix epoch microseconds.
    pub now_us: u64,
    /// One decision per [`TierCheck`], in order.
    pub decisions: Vec<TierDecision>,
    /// Per [`TierCheck`], when the request was charged: what a later refund
    /// of that charge needs (empty, or `None` for a tier not charged).
    /// Used by the layer's refunds by response status.
    #[doc(hidden)]
    pub charges: Vec<Option<Charge>>,
}

impl Verdict {
    /// Whether every tier allowed the request (and so it was charged).
    pub fn allowed(&self) -> bool {
        self.decisions.iter().all(|d| d.allowed)
    }
}

/// Which checks (by index, at most 64) are in shadow mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Shadow(pub(crate) u64);

impl Shadow {
    pub(crate) const NONE: Shadow = Shadow(0);

    pub(crate) fn contains(self, i: usize) -> bool {
        i < 64 && self.0 & (1 << i) != 0
    }

    /// The commit rule of every backend: charge when every enforced tier
    /// allows the request.
    pub(crate) fn commits(self, decisions: &[TierDecision]) -> bool {
        decisions
            .iter()
            .enumerate()
            .all(|(i, d)| d.allowed || self.contains(i))
    }
}

/// The shadow mask a reply with `n` checks, the last `candidates` of them
/// candidate quotas, is read under: the candidates observe, so the live
/// checks' commit is read as theirs alone.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn candidates_observe(shadow: Shadow, n: usize, candidates: usize) -> Shadow {
    let mut mask = shadow.0;
    for i in n.saturating_sub(candidates)..n.min(64) {
        mask |= 1 << i;
    }
    Shadow(mask)
}

pub(crate) type CheckFuture = Pin<Box<dyn Future<Output = Result<Verdict, BackendError>> + Send>>;

/// A check that finished at once (memory) or must be awaited (Redis).
pub(crate) enum Check {
    Ready(Result<Verdict, BackendError>),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Pending(CheckFuture),
}

impl Backend {
    /// Checks every tier of one request, all or nothing: the request is
    /// charged on every tier only if every tier allows it. This is what the
    /// layer does per request, without HTTP (no timeout, no failure policy).
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails or answers unexpectedly.
    pub async fn check(&self, mut checks: Vec<TierCheck>) -> Result<Verdict, BackendError> {
        // Costs above the capacity are denied anyway; clamped, they cannot
        // overflow any algorithm's arithmetic.
        for c in &mut checks {
            c.cost = c.cost.min(c.limit.capacity().saturating_add(1));
        }
        match self {
            Backend::Memory(m) => Ok(m.check(&checks, Shadow::NONE, true)),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => {
                let sent = std::time::Instant::now();
                r.start_check(&checks, Shadow::NONE, &[], true, None, None, sent)
                    .await
            }
        }
    }

    /// Like [`Backend::check`], with some tiers in shadow mode: a shadow
    /// tier's denial does not block charging the others.
    ///
    /// `charges`: report each charge's undo value in [`Verdict::charges`]
    /// (what refunds by status need; the charge itself is always listed).
    /// `blocked`: on a single Redis, the hourly sorted set that counts
    /// rejected keys fleet-wide, written by the same script call. `timeout`
    /// bounds a remote check ([`BackendError::Timeout`] after it); `sent` is
    /// the caller's reading of the clock, now: a Redis check's deadline in
    /// Redis's clock counts from it (the memory backend ignores both).
    ///
    /// The checks are only borrowed: a Redis check's command is built here,
    /// so the caller keeps them (for the deny cache and the top-N sketches)
    /// without a copy.
    ///
    /// `live_of`: the last `live_of.len()` checks are candidate quotas
    /// (`docs/rollout.md`, "Candidate quotas"), each naming its tier's live
    /// check by index; empty for none.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_check(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        live_of: &[u8],
        charges: bool,
        blocked: Option<(&str, &str)>,
        timeout: Option<std::time::Duration>,
        sent: std::time::Instant,
    ) -> Check {
        match self {
            Backend::Memory(m) => {
                let _ = (blocked, timeout, sent);
                let mut verdict = Verdict::default();
                m.check_with_candidates(checks, shadow, live_of, &[], charges, &mut verdict);
                Check::Ready(Ok(verdict))
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => Check::Pending(
                r.start_check(checks, shadow, live_of, charges, blocked, timeout, sent),
            ),
        }
    }

    /// Like [`Backend::check`] with candidate quotas (`docs/rollout.md`,
    /// "Candidate quotas"): the last `live_of.len()` checks are candidates,
    /// each of the live check at its index in `live_of`; the checks whose
    /// bit is set in `shadow` are in shadow mode. The verdict has a decision
    /// per check, candidates included; a candidate never changes the live
    /// checks' decisions or commit, and is charged when it allows and every
    /// enforced check but its live one allows (the `__testing` feature: the
    /// layer checks its own).
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails or answers unexpectedly.
    #[cfg(feature = "__testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "__testing")))]
    pub async fn check_candidates(
        &self,
        mut checks: Vec<TierCheck>,
        shadow: u64,
        live_of: &[u8],
    ) -> Result<Verdict, BackendError> {
        for c in &mut checks {
            c.cost = c.cost.min(c.limit.capacity().saturating_add(1));
        }
        let sent = std::time::Instant::now();
        match self.start_check(&checks, Shadow(shadow), live_of, true, None, None, sent) {
            Check::Ready(v) => v,
            Check::Pending(f) => f.await,
        }
    }

    /// The clock decisions are made on, as this process can read it: the
    /// backend's manual clock if it has one, else `None` (Redis reads its
    /// own `TIME`; the memory backend's clock is its own).
    pub(crate) fn local_clock(&self) -> clock::Clock {
        match self {
            Backend::Memory(m) => m.clock(),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => match r.manual_clock() {
                Some(c) => clock::Clock::Manual(c.clone()),
                None => clock::Clock::monotonic(),
            },
        }
    }

    /// Gives back charges, each only as far as it still takes capacity away
    /// (see [`Limit::refund`](crate::algorithm::Limit::refund)): a refund
    /// never leaves more room than if the request had never been charged.
    /// Used by `skip_failed_requests` / `skip_successful_requests`.
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails.
    pub(crate) async fn refund_charges(
        &self,
        refunds: Vec<TierRefund>,
    ) -> Result<(), BackendError> {
        match self {
            Backend::Memory(m) => {
                m.refund(&refunds);
                Ok(())
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => r.refund(&refunds).await,
        }
    }

    /// Like [`Backend::check`], without asking for the charges' undo values,
    /// as the layer checks a tier without refunds: on Redis the scripts'
    /// written-out paths (`check_plain` in `lua/dispatch.lua`), which
    /// `check` (its undo values asked for) never takes (the `__testing`
    /// feature).
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails or answers unexpectedly.
    #[cfg(feature = "__testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "__testing")))]
    pub async fn check_without_undo(
        &self,
        mut checks: Vec<TierCheck>,
    ) -> Result<Verdict, BackendError> {
        for c in &mut checks {
            c.cost = c.cost.min(c.limit.capacity().saturating_add(1));
        }
        match self {
            Backend::Memory(m) => Ok(m.check(&checks, Shadow::NONE, false)),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => {
                let sent = std::time::Instant::now();
                r.start_check(&checks, Shadow::NONE, &[], false, None, None, sent)
                    .await
            }
        }
    }

    /// Gives back charges (as the layer does) for the tests that prove model = memory =
    /// Redis on refunds (the `__testing` feature; the layer refunds itself).
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails.
    #[cfg(feature = "__testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "__testing")))]
    pub async fn refund(&self, refunds: Vec<TierRefund>) -> Result<(), BackendError> {
        self.refund_charges(refunds).await
    }

    /// The decision `check` would get now, **without charging** anything:
    /// one tier's numbers for one key (what
    /// [`RateLimitHandle::peek`](crate::RateLimitHandle::peek) shows). The
    /// verdict has one decision and no charges; its `now_us` is the
    /// backend's clock (Redis `TIME`). On Redis a read-only script call
    /// (`EVALSHA_RO` of `lua/peek.lua`; `EVALSHA` before Redis 7.0); on a
    /// cluster, to the key's slot.
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails or answers unexpectedly.
    pub async fn peek(&self, check: &TierCheck) -> Result<Verdict, BackendError> {
        let mut check = check.clone();
        check.cost = check
            .cost
            .clamp(1, check.limit.capacity().saturating_add(1));
        match self {
            Backend::Memory(m) => Ok(m.peek(&check)),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => r.peek(&check).await,
        }
    }

    /// Deletes `key`'s state (the full storage key, as in [`TierCheck`]):
    /// the next request finds a fresh key. Returns whether the key held any
    /// state.
    ///
    /// # Errors
    /// A [`BackendError`] when Redis fails.
    pub async fn reset(&self, key: &str) -> Result<bool, BackendError> {
        match self {
            Backend::Memory(m) => Ok(m.reset(key)),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => r.reset(key).await,
        }
    }

    /// Stores a per-key override under `key` (`<tier key>{ov}`) and its
    /// listing in `index` (see [`handle`](crate::handle#per-key-overrides)).
    pub(crate) async fn set_override(
        &self,
        key: &str,
        active: crate::backend::override_rule::Active,
        ttl_ms: Option<u64>,
        index: &str,
        field: &str,
        listing: &str,
    ) -> Result<(), BackendError> {
        match self {
            Backend::Memory(m) => {
                let _ = ttl_ms;
                m.set_override(key, active, index, field, listing);
                Ok(())
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => {
                r.set_override(key, active, ttl_ms, index, field, listing)
                    .await
            }
        }
    }

    /// Removes a per-key override: its expiry (Unix epoch µs, 0 for none),
    /// if there was one.
    pub(crate) async fn remove_override(
        &self,
        key: &str,
        index: &str,
        field: &str,
    ) -> Result<Option<u64>, BackendError> {
        match self {
            Backend::Memory(m) => Ok(m.remove_override(key, index, field)),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => r.remove_override(key, index, field).await,
        }
    }

    /// A tier's override listing (key part, `<until µs> <rule>`).
    pub(crate) async fn list_overrides(
        &self,
        index: &str,
    ) -> Result<Vec<(String, String)>, BackendError> {
        match self {
            Backend::Memory(m) => Ok(m.list_overrides(index)),
            #[cfg(feature = "redis")]
            Backend::Redis(r) => r.list_overrides(index).await,
        }
    }

    /// Connects (if not yet connected) and sends one `PING`, within
    /// `timeout`: whether the backend answers now. Nothing else depends on
    /// it (a backend connects on first use, and requests follow the
    /// failure policy while it is down); call it at start-up to say so
    /// then, rather than on the first request (or use
    /// [`RateLimitLayerBuilder::build_checked`](crate::RateLimitLayerBuilder::build_checked)).
    /// The memory backend always answers. Returns the round trip.
    ///
    /// # Errors
    /// A [`PingError`](crate::PingError) naming the backend (a Redis
    /// address without credentials) and the cause: no connection, a
    /// timeout, an error reply.
    pub async fn ping(
        &self,
        timeout: std::time::Duration,
    ) -> Result<std::time::Duration, crate::error::PingError> {
        let started = std::time::Instant::now();
        match self {
            Backend::Memory(_) => {
                let _ = timeout;
                Ok(started.elapsed())
            }
            #[cfg(feature = "redis")]
            Backend::Redis(r) => {
                let answer = match tokio::time::timeout(timeout, r.ping()).await {
                    Ok(answer) => answer,
                    Err(_) => Err(BackendError::Timeout(timeout)),
                };
                answer
                    .map(|()| started.elapsed())
                    .map_err(|source| crate::error::PingError {
                        backend: r.describe(),
                        source,
                    })
            }
        }
    }

    /// `"memory"` or `"redis"` (the `backend` metrics label).
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Backend::Redis(_) => "redis",
        }
    }
}
