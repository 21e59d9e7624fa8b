//! Token leases (lease mode, `sync = "lease"`; see [`crate::token_lease`]):
//! the request path's local spending, the background taking of leases, and
//! their return. Distinct from `engine/lease.rs`, a concurrency tier's slot
//! leases.
//!
//! Per leased (tier, key) this instance keeps an [`Entry`]: the tokens it
//! holds (one atomic, spent by compare-and-swap), the lease's expiry on the
//! local clock, the shared bucket's count at its last answer, and the key's
//! local demand (for sizing). The map is sharded and bounded
//! ([`MAX_ENTRIES`]); a sweeper task returns expired leases and drops idle
//! entries.
//!
//! The request path ([`LeasePool::take`]) runs right before the backend
//! call: each enforced check of a leased tier is spent from its entry when
//! the entry holds enough; the others stay in the call, as without lease
//! mode. The backend call then carries only the checks not spent locally
//! (none: no call at all); when it denies, or fails, the local spending is
//! given back ([`Taken::merge`]): all or nothing across tiers holds.

use crate::algorithm::{Decision, Limit};
use crate::backend::clock::Clock;
use crate::backend::{Backend, Charge, Check, Shadow, TierCheck, TierRefund, Verdict};
use crate::error::BackendError;
use crate::token_lease::{LeaseCounts, LeaseStatus, TokenLease};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

/// Entries kept per layer (keys beyond it are checked per request).
pub(crate) const MAX_ENTRIES: usize = 65_536;
const SHARDS: usize = 16;
/// `seen` before any answer.
const UNKNOWN: u64 = u64::MAX;

pub(crate) const LEASE_CALLS: &str = "tiered_ratelimit_lease_calls_total";
pub(crate) const LEASE_TOKENS: &str = "tiered_ratelimit_lease_tokens_total";

/// A leased tier's settings, resolved at build.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TierLease {
    interval_us: u64,
    max: Option<u64>,
    min: u64,
}

impl From<TokenLease> for TierLease {
    fn from(l: TokenLease) -> Self {
        Self {
            interval_us: u64::try_from(l.interval.as_micros())
                .unwrap_or(u64::MAX)
                .max(1),
            max: l.max,
            min: l.min.max(1),
        }
    }
}

/// Whether lease mode can run `limit` (checked at build for the tier's
/// quota; plans and runtime quotas of another kind fall back to a check per
/// request).
pub(crate) fn leasable(limit: &Limit) -> bool {
    match limit {
        Limit::TokenBucket(_) | Limit::FixedWindow(_) => true,
        Limit::LeakyBucket(g) => g.max_delay_us.is_none(),
        _ => false,
    }
}

/// One shard of the entries: storage key → entry.
type Shard = RwLock<HashMap<Box<str>, Arc<Entry>>>;

/// The tokens of every leased (tier, key) of one layer.
pub(crate) struct LeasePool {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Backend,
    clock: Clock,
    timeout: Duration,
    /// Per tier index: its lease settings, if leased.
    tiers: Box<[Option<TierLease>]>,
    shards: Box<[Shard]>,
    hasher: std::collections::hash_map::RandomState,
    len: AtomicUsize,
    sweeper: OnceLock<()>,
    calls: AtomicU64,
    taken: AtomicU64,
    returned: AtomicU64,
    local: AtomicU64,
    /// Fetches and returns in flight.
    busy: AtomicUsize,
}

/// One leased key on this instance.
struct Entry {
    key: Box<str>,
    limit: Limit,
    lease: TierLease,
    /// The most tokens held at once.
    max: u64,
    /// The limit's capacity (requests) and the refill time of one request
    /// (µs; buckets), for the headers.
    capacity: u64,
    per_request_us: u64,
    fixed_window: bool,
    /// Tokens (requests) held, unspent.
    tokens: AtomicU64,
    /// Local clock (µs) at which the lease's tokens may no longer be spent;
    /// 0: no lease.
    expires_us: AtomicU64,
    /// The shared bucket's remaining (requests) at its last answer.
    seen: AtomicU64,
    /// Tokens asked for since `since_us`.
    demand: AtomicU64,
    since_us: AtomicU64,
    /// The size of the last lease.
    last_lease: AtomicU64,
    /// Local clock at which a fixed window's current window ends.
    window_end_us: AtomicU64,
    /// Single flight of the background take.
    fetching: AtomicBool,
    /// The last lease's charge, for returning its tokens.
    charge: Mutex<Option<Charge>>,
}

/// What one request spent locally, for the merge with the backend's answer.
pub(crate) struct Taken {
    pool: Arc<Inner>,
    /// Checks decided locally (by index).
    mask: u64,
    spent: SmallVec<[(Arc<Entry>, u64); 4]>,
    decisions: SmallVec<[(usize, Decision); 4]>,
    /// Leased checks that went to the backend: their answer updates `seen`.
    sent: SmallVec<[(usize, Arc<Entry>); 4]>,
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken").field("mask", &self.mask).finish()
    }
}

impl LeasePool {
    /// A pool for `tiers` (per tier index, its lease settings) on a Redis
    /// `backend`; `None` on the memory backend or without a leased tier.
    pub(crate) fn new(
        backend: &Backend,
        clock: Clock,
        timeout: Duration,
        tiers: Vec<Option<TokenLease>>,
    ) -> Option<Self> {
        if matches!(backend, Backend::Memory(_)) || tiers.iter().all(Option::is_none) {
            return None;
        }
        // Every series registered at 0, so a dashboard sees "returned"
        // before the first return.
        metrics::counter!(LEASE_CALLS).increment(0);
        metrics::counter!(LEASE_TOKENS, "op" => "taken").increment(0);
        metrics::counter!(LEASE_TOKENS, "op" => "returned").increment(0);
        Some(Self {
            inner: Arc::new(Inner {
                backend: backend.clone(),
                clock,
                timeout,
                tiers: tiers.into_iter().map(|t| t.map(TierLease::from)).collect(),
                shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
                hasher: std::collections::hash_map::RandomState::new(),
                len: AtomicUsize::new(0),
                sweeper: OnceLock::new(),
                calls: AtomicU64::new(0),
                taken: AtomicU64::new(0),
                returned: AtomicU64::new(0),
                local: AtomicU64::new(0),
                busy: AtomicUsize::new(0),
            }),
        })
    }

    /// Spends what it can of `checks` from local leases (enforced checks of
    /// leased tiers only; `tiers` = each check's tier index). `None` when no
    /// check is of a leased tier.
    pub(crate) fn take(
        &self,
        checks: &[TierCheck],
        tiers: &[u8],
        shadow: Shadow,
    ) -> Option<Box<Taken>> {
        let inner = &*self.inner;
        let mut taken: Option<Box<Taken>> = None;
        let mut now = None;
        for (i, check) in checks.iter().enumerate() {
            let Some(Some(lease)) = tiers.get(i).and_then(|&t| inner.tiers.get(usize::from(t)))
            else {
                continue;
            };
            if i >= 64 || shadow.contains(i) || !leasable(&check.limit) {
                continue;
            }
            let now = *now.get_or_insert_with(|| inner.clock.now_us());
            let Some(entry) = self.inner.entry(&check.key, check.limit, *lease, now) else {
                continue;
            };
            inner.start_sweeper(&self.inner);
            let t = taken.get_or_insert_with(|| {
                Box::new(Taken {
                    pool: self.inner.clone(),
                    mask: 0,
                    spent: SmallVec::new(),
                    decisions: SmallVec::new(),
                    sent: SmallVec::new(),
                })
            });
            entry.note_demand(check.cost, now);
            let expires = entry.expires_us.load(Ordering::Acquire);
            if expires != 0 && now >= expires {
                entry.expire(&self.inner, now);
            }
            match entry.spend(check.cost, now) {
                Some(left) => {
                    t.mask |= 1 << i;
                    t.decisions.push((i, entry.decision(left, now)));
                    t.spent.push((entry.clone(), check.cost));
                }
                None => t.sent.push((i, entry.clone())),
            }
            entry.maybe_fetch(&self.inner, now);
        }
        taken
    }

    /// Hands every unspent token back to its shared bucket (waiting first
    /// for the leases being taken), and answers how many.
    pub(crate) async fn return_all(&self) -> u64 {
        self.inner.clone().return_all().await
    }

    /// Every entry holding tokens.
    pub(crate) fn status(&self) -> Vec<LeaseStatus> {
        let mut out = Vec::new();
        for shard in self.inner.shards.iter() {
            let map = shard
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for e in map.values() {
                let tokens = e.tokens.load(Ordering::Acquire);
                if tokens > 0 {
                    out.push(LeaseStatus {
                        key: e.key.to_string(),
                        tokens,
                    });
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    pub(crate) fn counts(&self) -> LeaseCounts {
        let i = &self.inner;
        LeaseCounts {
            calls: i.calls.load(Ordering::Relaxed),
            taken: i.taken.load(Ordering::Relaxed),
            returned: i.returned.load(Ordering::Relaxed),
            local: i.local.load(Ordering::Relaxed),
        }
    }

    /// Loses every lease without returning it (a crashed instance; tests).
    #[doc(hidden)]
    pub(crate) fn abandon(&self) -> u64 {
        let mut lost = 0;
        for shard in self.inner.shards.iter() {
            let map = shard
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for e in map.values() {
                lost += e.tokens.swap(0, Ordering::AcqRel);
                e.expires_us.store(0, Ordering::Release);
            }
        }
        lost
    }
}

impl Drop for LeasePool {
    /// Graceful shutdown: the unspent tokens go back, in a task (when a
    /// Tokio runtime is running; else they are lost like a crashed
    /// instance's).
    fn drop(&mut self) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let inner = self.inner.clone();
            rt.spawn(async move {
                inner.return_all().await;
            });
        }
    }
}

impl Inner {
    fn shard(&self, key: &str) -> &Shard {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        &self.shards[i]
    }

    /// The entry of `key` under `limit`, created when missing (`None` when
    /// the map is full). An entry of another limit (the quota changed) is
    /// replaced; its tokens go back.
    fn entry(
        self: &Arc<Inner>,
        key: &str,
        limit: Limit,
        lease: TierLease,
        now: u64,
    ) -> Option<Arc<Entry>> {
        let shard = self.shard(key);
        {
            let map = shard
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(e) = map.get(key) {
                if e.limit == limit {
                    return Some(e.clone());
                }
            }
        }
        if self.len.load(Ordering::Relaxed) >= MAX_ENTRIES {
            return None;
        }
        let mut map = shard
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(e) = map.get(key) {
            if e.limit == limit {
                return Some(e.clone());
            }
        }
        let e = Arc::new(Entry::new(key, limit, lease, now));
        if let Some(old) = map.insert(Box::from(key), e.clone()) {
            // The quota changed: the old lease's tokens go back.
            old.expires_us.store(0, Ordering::Release);
            old.expire(self, now);
        } else {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
        Some(e)
    }

    fn start_sweeper(&self, me: &Arc<Inner>) {
        if self.sweeper.get().is_some() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.sweeper.set(()).is_err() {
            return;
        }
        let every = self
            .tiers
            .iter()
            .flatten()
            .map(|t| t.interval_us)
            .min()
            .unwrap_or(100_000);
        let weak: Weak<Inner> = Arc::downgrade(me);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(every));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.sweep();
            }
        });
    }

    /// Returns expired leases and drops idle entries.
    fn sweep(self: &Arc<Inner>) {
        let now = self.clock.now_us();
        for shard in self.shards.iter() {
            let mut map = shard
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            map.retain(|_, e| {
                let expires = e.expires_us.load(Ordering::Acquire);
                if expires != 0 && now >= expires {
                    e.expire(self, now);
                }
                let idle = e.tokens.load(Ordering::Acquire) == 0
                    && !e.fetching.load(Ordering::Acquire)
                    && now.saturating_sub(e.since_us.load(Ordering::Relaxed))
                        > e.lease.interval_us.saturating_mul(8);
                if idle {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                }
                !idle
            });
        }
    }

    async fn return_all(self: Arc<Inner>) -> u64 {
        // Leases being taken land first (bounded by the backend timeout).
        let deadline = tokio::time::Instant::now() + self.timeout + Duration::from_millis(50);
        while self.busy.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut refunds = Vec::new();
        let mut total = 0;
        for shard in self.shards.iter() {
            let map = shard
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for e in map.values() {
                e.expires_us.store(0, Ordering::Release);
                let n = e.tokens.swap(0, Ordering::AcqRel);
                if n == 0 {
                    continue;
                }
                total += n;
                if let Some(r) = e.refund(n) {
                    refunds.push(r);
                }
            }
        }
        self.give_back(refunds, total).await;
        total
    }

    async fn give_back(&self, refunds: Vec<TierRefund>, tokens: u64) {
        if tokens == 0 {
            return;
        }
        self.returned.fetch_add(tokens, Ordering::Relaxed);
        metrics::counter!(LEASE_TOKENS, "op" => "returned").increment(tokens);
        if refunds.is_empty() {
            return;
        }
        if let Err(e) = self.backend.refund(refunds).await {
            tracing::debug!(target: super::LOG_TARGET, error = %e, "token lease return failed");
        }
    }

    /// Takes a lease of `k` tokens for `entry` (the background task), at
    /// most one retry with a quarter of what the shared bucket has left.
    async fn fetch(self: Arc<Inner>, entry: Arc<Entry>, mut k: u64, started: u64) {
        for _ in 0..2 {
            self.calls.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(LEASE_CALLS).increment(1);
            let check = TierCheck {
                key: entry.key.to_string(),
                limit: entry.limit,
                cost: k,
            };
            let result = match self.backend.start_check(
                std::slice::from_ref(&check),
                Shadow::NONE,
                true,
                None,
                Some(self.timeout),
            ) {
                Check::Ready(r) => r,
                Check::Pending(f) => f.await,
            };
            let v = match result {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(target: super::LOG_TARGET, error = %e, "token lease take failed");
                    return;
                }
            };
            let Some(d) = v.decisions.first() else { return };
            if d.allowed {
                let charge = v.charges.first().copied().flatten();
                entry.install(&self, k, charge, d, started).await;
                // The entry was replaced meanwhile (the quota changed) or
                // dropped: no request will spend these, hand them back.
                let current = self
                    .shard(&entry.key)
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get(&*entry.key)
                    .is_some_and(|e| Arc::ptr_eq(e, &entry));
                if !current {
                    entry.expires_us.store(0, Ordering::Release);
                    let n = entry.tokens.swap(0, Ordering::AcqRel);
                    let refund = entry.refund(n);
                    self.give_back(refund.into_iter().collect(), n).await;
                }
                return;
            }
            entry.seen.store(d.remaining, Ordering::Release);
            let again = k.min(d.remaining / 4);
            if again < entry.lease.min || again == 0 {
                return;
            }
            k = again;
        }
    }
}

impl Entry {
    fn new(key: &str, limit: Limit, lease: TierLease, now: u64) -> Self {
        let probe = limit.check(None, 0, 1);
        let capacity = limit.capacity();
        let max = lease.max.unwrap_or(capacity / 8).clamp(1, capacity.max(1));
        Self {
            key: Box::from(key),
            limit,
            lease,
            max,
            capacity,
            per_request_us: probe.reset_after_us,
            fixed_window: matches!(limit, Limit::FixedWindow(_)),
            tokens: AtomicU64::new(0),
            expires_us: AtomicU64::new(0),
            seen: AtomicU64::new(UNKNOWN),
            demand: AtomicU64::new(0),
            since_us: AtomicU64::new(now),
            last_lease: AtomicU64::new(0),
            window_end_us: AtomicU64::new(0),
            fetching: AtomicBool::new(false),
            charge: Mutex::new(None),
        }
    }

    fn note_demand(&self, cost: u64, now: u64) {
        let since = self.since_us.load(Ordering::Relaxed);
        if now.saturating_sub(since) > self.lease.interval_us.saturating_mul(8) {
            // A stale measure would hide a surge.
            self.since_us.store(now, Ordering::Relaxed);
            self.demand.store(cost, Ordering::Relaxed);
        } else {
            self.demand.fetch_add(cost, Ordering::Relaxed);
        }
    }

    /// Spends `cost` from the lease: the tokens left, or `None` (too few,
    /// or the lease expired).
    fn spend(&self, cost: u64, now: u64) -> Option<u64> {
        if now >= self.expires_us.load(Ordering::Acquire) {
            return None;
        }
        let mut cur = self.tokens.load(Ordering::Acquire);
        loop {
            if cur < cost {
                return None;
            }
            match self.tokens.compare_exchange_weak(
                cur,
                cur - cost,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(cur - cost),
                Err(v) => cur = v,
            }
        }
    }

    /// Gives back what a request spent (another tier denied it).
    fn unspend(&self, cost: u64) {
        self.tokens.fetch_add(cost, Ordering::AcqRel);
    }

    /// The decision shown for a request spent locally, `left` tokens left
    /// in the lease.
    fn decision(&self, left: u64, now: u64) -> Decision {
        let seen = match self.seen.load(Ordering::Acquire) {
            UNKNOWN => 0,
            s => s,
        };
        let remaining = seen.saturating_add(left).min(self.capacity);
        let reset_after_us = if self.fixed_window {
            self.window_end_us
                .load(Ordering::Acquire)
                .saturating_sub(now)
        } else {
            (self.capacity - remaining).saturating_mul(self.per_request_us)
        };
        Decision {
            allowed: true,
            limit: self.capacity,
            remaining,
            reset_after_us,
            retry_after_us: 0,
            delay_us: 0,
        }
    }

    /// The next lease's size, if one is worth taking now.
    fn size(&self, now: u64) -> Option<u64> {
        let interval = self.lease.interval_us;
        let elapsed = now.saturating_sub(self.since_us.load(Ordering::Relaxed));
        let window = elapsed.max(interval / 4).max(1);
        let demand = self.demand.load(Ordering::Relaxed);
        // A lone request after a quiet spell (the measure restarts) is no
        // burst: at least two requests' worth since the measure began.
        if demand < 2 {
            return None;
        }
        let want = u64::try_from(u128::from(demand) * u128::from(interval) / u128::from(window))
            .unwrap_or(u64::MAX);
        if want < self.lease.min {
            return None;
        }
        let held = self.tokens.load(Ordering::Acquire);
        let mut k = want.min(self.max.saturating_sub(held));
        let seen = self.seen.load(Ordering::Acquire);
        if seen != UNKNOWN {
            k = k.min(seen / 4);
        }
        (k >= self.lease.min && k > 0).then_some(k)
    }

    /// The size of the lease to take now, when the tokens held are down to
    /// a quarter of the last lease (or expired) and none is being taken.
    fn wants(&self, now: u64) -> Option<u64> {
        let held = self.tokens.load(Ordering::Acquire);
        let last = self.last_lease.load(Ordering::Relaxed);
        let expires = self.expires_us.load(Ordering::Acquire);
        let low = held == 0 || held.saturating_mul(4) <= last || now >= expires;
        if !low || self.fetching.load(Ordering::Acquire) {
            return None;
        }
        self.size(now)
    }

    /// Starts the background take of the next lease when the tokens held
    /// are down to a quarter of the last lease (single flight).
    fn maybe_fetch(&self, inner: &Arc<Inner>, now: u64) {
        let Some(k) = self.wants(now) else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.fetching.swap(true, Ordering::AcqRel) {
            return;
        }
        // Look the entry up again to own an Arc of it.
        let Some(entry) = inner
            .shard(&self.key)
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&*self.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(e), self))
            .cloned()
        else {
            self.fetching.store(false, Ordering::Release);
            return;
        };
        inner.busy.fetch_add(1, Ordering::AcqRel);
        let inner = inner.clone();
        rt.spawn(async move {
            let e = entry.clone();
            let i = inner.clone();
            inner.fetch(entry, k, now).await;
            e.fetching.store(false, Ordering::Release);
            i.busy.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// A lease of `k` tokens arrived (taken at local time `started`).
    async fn install(
        &self,
        inner: &Inner,
        k: u64,
        charge: Option<Charge>,
        d: &Decision,
        started: u64,
    ) {
        let back = self.land(k, charge, d, started);
        inner.taken.fetch_add(k, Ordering::Relaxed);
        metrics::counter!(LEASE_TOKENS, "op" => "taken").increment(k);
        if let Some((r, n)) = back {
            inner.give_back(vec![r], n).await;
        }
    }

    /// The local half of [`install`](Self::install): the lease's tokens join
    /// the counter; a fixed window's leftover of an earlier window comes
    /// back to be returned.
    fn land(
        &self,
        k: u64,
        charge: Option<Charge>,
        d: &Decision,
        started: u64,
    ) -> Option<(TierRefund, u64)> {
        let lifetime = self.lease.interval_us.saturating_mul(2);
        let mut expires = started.saturating_add(lifetime);
        // A fixed window's tokens are worth nothing after their window.
        let mut back = None;
        if self.fixed_window {
            let end = started.saturating_add(d.reset_after_us);
            expires = expires.min(end);
            self.window_end_us.store(end, Ordering::Release);
            let old = self.tokens.swap(0, Ordering::AcqRel);
            if old > 0 {
                back = self.refund(old).map(|r| (r, old));
            }
        }
        {
            let mut c = self
                .charge
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *c = charge;
        }
        self.seen.store(d.remaining, Ordering::Release);
        self.last_lease.store(k, Ordering::Relaxed);
        self.since_us.store(started, Ordering::Relaxed);
        self.demand.store(0, Ordering::Relaxed);
        self.expires_us.store(expires, Ordering::Release);
        self.tokens.fetch_add(k, Ordering::AcqRel);
        back
    }

    /// The refund that hands `n` tokens of the last lease back.
    fn refund(&self, n: u64) -> Option<TierRefund> {
        let charge = (*self
            .charge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))?;
        Some(TierRefund {
            check: TierCheck {
                key: self.key.to_string(),
                limit: self.limit,
                cost: n,
            },
            charge,
        })
    }

    /// The lease expired: its tokens go back (in a task).
    fn expire(&self, inner: &Arc<Inner>, now: u64) {
        let n = self.tokens.swap(0, Ordering::AcqRel);
        if n == 0 {
            return;
        }
        if now < self.expires_us.load(Ordering::Acquire) {
            // A new lease landed meanwhile: these are its tokens.
            self.tokens.fetch_add(n, Ordering::AcqRel);
            return;
        }
        let refund = self.refund(n);
        inner.returned.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(LEASE_TOKENS, "op" => "returned").increment(n);
        if let (Some(r), Ok(rt)) = (refund, tokio::runtime::Handle::try_current()) {
            // Counted as busy: a graceful return waits for it.
            inner.busy.fetch_add(1, Ordering::AcqRel);
            let inner = inner.clone();
            rt.spawn(async move {
                if let Err(e) = inner.backend.refund(vec![r]).await {
                    tracing::debug!(target: super::LOG_TARGET, error = %e, "token lease return failed");
                }
                inner.busy.fetch_sub(1, Ordering::AcqRel);
            });
        }
    }
}

impl Taken {
    /// Whether every check was decided locally (no backend call).
    pub(crate) fn all(&self, n: usize) -> bool {
        n <= 64 && self.mask.count_ones() as usize == n
    }

    /// How many checks were decided locally.
    pub(crate) fn count(&self) -> usize {
        self.mask.count_ones() as usize
    }

    /// The checks the backend call carries (those not decided locally, in
    /// order) and their shadow bits. Their keys are moved out of `checks`
    /// (no copy); [`restore`](Self::restore) puts them back.
    pub(crate) fn rest(
        &self,
        checks: &mut [TierCheck],
        shadow: Shadow,
    ) -> (Vec<TierCheck>, Shadow) {
        let mut rest = Vec::with_capacity(checks.len().saturating_sub(self.count()));
        let mut bits = 0u64;
        for (i, c) in checks.iter_mut().enumerate() {
            if !self.local(i) {
                if shadow.contains(i) && rest.len() < 64 {
                    bits |= 1 << rest.len();
                }
                rest.push(TierCheck {
                    key: std::mem::take(&mut c.key),
                    limit: c.limit,
                    cost: c.cost,
                });
            }
        }
        (rest, Shadow(bits))
    }

    /// Gives `checks` back the keys [`rest`](Self::rest) moved out.
    pub(crate) fn restore(&self, checks: &mut [TierCheck], rest: Vec<TierCheck>) {
        let mut rest = rest.into_iter();
        for (i, c) in checks.iter_mut().enumerate() {
            if !self.local(i) {
                if let Some(r) = rest.next() {
                    c.key = r.key;
                }
            }
        }
    }

    /// Whether check `i` was decided locally.
    pub(crate) fn local(&self, i: usize) -> bool {
        i < 64 && self.mask & (1 << i) != 0
    }

    /// The verdict of a request decided wholly from local leases.
    pub(crate) fn verdict(&self, now_us: u64) -> Verdict {
        self.admitted();
        let mut decisions: Vec<Decision> = Vec::with_capacity(self.decisions.len());
        decisions.extend(self.decisions.iter().map(|(_, d)| *d));
        Verdict {
            now_us,
            decisions,
            charges: Vec::new(),
        }
    }

    /// The backend's answer for the checks not spent locally, merged with
    /// the local decisions into one verdict over all `n` checks (in order).
    /// A denial or an error gives the local spending back.
    pub(crate) fn merge(
        &self,
        result: Result<Verdict, BackendError>,
        n: usize,
        shadow: Shadow,
    ) -> Result<Verdict, BackendError> {
        let remote = match result {
            Ok(v) => v,
            Err(e) => {
                self.give_back();
                return Err(e);
            }
        };
        if self.all(n) {
            return Ok(remote);
        }
        let mut decisions = Vec::with_capacity(n);
        let mut charges = Vec::new();
        let mut local = self.decisions.iter();
        let mut from = remote.decisions.into_iter();
        let mut from_charges = remote.charges.into_iter();
        let with_charges = from_charges.len() > 0;
        for i in 0..n {
            if self.local(i) {
                let Some((_, d)) = local.next() else {
                    self.give_back();
                    return Err(BackendError::Reply(
                        "lease merge: local decision missing".into(),
                    ));
                };
                decisions.push(*d);
                if with_charges {
                    charges.push(None);
                }
            } else {
                let Some(d) = from.next() else {
                    self.give_back();
                    return Err(BackendError::Reply("lease merge: short reply".into()));
                };
                if let Some((_, e)) = self.sent.iter().find(|(j, _)| *j == i) {
                    // The shared bucket's count, for the next lease's size
                    // and the headers.
                    e.seen.store(d.remaining, Ordering::Release);
                }
                decisions.push(d);
                if with_charges {
                    charges.push(from_charges.next().flatten());
                }
            }
        }
        if shadow.commits(&decisions) {
            self.admitted();
        } else {
            self.give_back();
        }
        Ok(Verdict {
            now_us: remote.now_us,
            decisions,
            charges,
        })
    }

    fn admitted(&self) {
        self.pool
            .local
            .fetch_add(self.count() as u64, Ordering::Relaxed);
    }

    fn give_back(&self) {
        for (e, cost) in &self.spent {
            e.unspend(*cost);
        }
    }
}

#[cfg(test)]
mod tests;
