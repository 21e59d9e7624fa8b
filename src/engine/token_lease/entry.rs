//! One leased (tier, key) on this instance: the tokens it holds (one atomic,
//! spent by compare-and-swap), the lease's expiry on the local clock, the
//! shared bucket's count at its last answer, the key's local demand (for
//! sizing), and the landing, refund and expiry of its lease.

use super::pool::TierLease;
use super::pool::{Inner, LEASE_TOKENS, UNKNOWN};
use crate::algorithm::{Limit, TierDecision};
use crate::backend::{Charge, TierCheck, TierRefund};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One leased key on this instance.
pub(super) struct Entry {
    pub(super) key: Box<str>,
    pub(super) limit: Limit,
    /// The tier's configured limit when `limit` is another
    /// (`TierCheck::home`), sent with the lease's takes and returns.
    pub(super) home: Option<Limit>,
    pub(super) lease: TierLease,
    /// The most tokens held at once.
    pub(super) max: u64,
    /// The limit's capacity (requests) and the refill time of one request
    /// (µs; buckets), for the headers.
    pub(super) capacity: u64,
    pub(super) per_request_us: u64,
    pub(super) fixed_window: bool,
    /// Tokens (requests) held, unspent.
    pub(super) tokens: AtomicU64,
    /// Local clock (µs) at which the lease's tokens may no longer be spent;
    /// 0: no lease.
    pub(super) expires_us: AtomicU64,
    /// The shared bucket's remaining (requests) at its last answer.
    pub(super) seen: AtomicU64,
    /// Tokens asked for since `since_us`.
    pub(super) demand: AtomicU64,
    pub(super) since_us: AtomicU64,
    /// The size of the last lease.
    pub(super) last_lease: AtomicU64,
    /// Local clock at which a fixed window's current window ends.
    pub(super) window_end_us: AtomicU64,
    /// Single flight of the background take.
    pub(super) fetching: AtomicBool,
    /// The last lease's charge, for returning its tokens.
    pub(super) charge: Mutex<Option<Charge>>,
}

impl Entry {
    pub(super) fn new(
        key: &str,
        limit: Limit,
        home: Option<Limit>,
        lease: TierLease,
        now: u64,
    ) -> Self {
        let probe = limit.check(None, 0, 1);
        let capacity = limit.capacity();
        let max = lease.max.unwrap_or(capacity / 8).clamp(1, capacity.max(1));
        Self {
            key: Box::from(key),
            limit,
            home,
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

    pub(super) fn note_demand(&self, cost: u64, now: u64) {
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
    pub(super) fn spend(&self, cost: u64, now: u64) -> Option<u64> {
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
    pub(super) fn unspend(&self, cost: u64) {
        self.tokens.fetch_add(cost, Ordering::AcqRel);
    }

    /// The decision shown for a request spent locally, `left` tokens left
    /// in the lease.
    pub(super) fn decision(&self, left: u64, now: u64) -> TierDecision {
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
        TierDecision {
            allowed: true,
            limit: self.capacity,
            remaining,
            reset_after_us,
            retry_after_us: 0,
            delay_us: 0,
        }
    }

    /// The next lease's size, if one is worth taking now.
    pub(super) fn size(&self, now: u64) -> Option<u64> {
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
    pub(super) fn wants(&self, now: u64) -> Option<u64> {
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
    pub(super) fn maybe_fetch(&self, inner: &Arc<Inner>, now: u64) {
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
    pub(super) async fn install(
        &self,
        inner: &Inner,
        k: u64,
        charge: Option<Charge>,
        d: &TierDecision,
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
    pub(super) fn land(
        &self,
        k: u64,
        charge: Option<Charge>,
        d: &TierDecision,
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
    pub(super) fn refund(&self, n: u64) -> Option<TierRefund> {
        let charge = (*self
            .charge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))?;
        Some(TierRefund {
            check: TierCheck {
                key: self.key.to_string(),
                limit: self.limit,
                cost: n,
                home: self.home,
            },
            charge,
            debt: false,
        })
    }

    /// The lease expired: its tokens go back (in a task).
    pub(super) fn expire(&self, inner: &Arc<Inner>, now: u64) {
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
                if let Err(e) = inner.backend.refund_charges(vec![r]).await {
                    tracing::debug!(target: crate::engine::LOG_TARGET, error = %e, "token lease return failed");
                }
                inner.busy.fetch_sub(1, Ordering::AcqRel);
            });
        }
    }
}
