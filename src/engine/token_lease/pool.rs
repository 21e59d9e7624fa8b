//! Token leases (lease mode, `sync = "lease"`; see [`crate::engine::token_lease`]):
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

use super::entry::Entry;
use super::taken::Taken;
use crate::algorithm::Limit;
use crate::backend::clock::Clock;
use crate::backend::{Backend, Shadow, TierCheck};
use crate::engine::token_lease::{LeaseCounts, LeaseStatus, TokenLease};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock, Weak};
use std::time::Duration;

/// Entries kept per layer (keys beyond it are checked per request).
pub(crate) const MAX_ENTRIES: usize = 65_536;
pub(super) const SHARDS: usize = 16;
/// `seen` before any answer.
pub(super) const UNKNOWN: u64 = u64::MAX;

pub(crate) const LEASE_CALLS: &str = "tiered_ratelimit_lease_calls_total";
pub(crate) const LEASE_TOKENS: &str = "tiered_ratelimit_lease_tokens_total";

/// A leased tier's settings, resolved at build.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TierLease {
    pub(super) interval_us: u64,
    pub(super) max: Option<u64>,
    pub(super) min: u64,
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
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) backend: Backend,
    pub(super) clock: Clock,
    pub(super) timeout: Duration,
    /// Per tier index: its lease settings, if leased.
    pub(super) tiers: Box<[Option<TierLease>]>,
    pub(super) shards: Box<[Shard]>,
    pub(super) hasher: std::collections::hash_map::RandomState,
    pub(super) len: AtomicUsize,
    pub(super) sweeper: OnceLock<()>,
    pub(super) calls: AtomicU64,
    pub(super) taken: AtomicU64,
    pub(super) returned: AtomicU64,
    pub(super) local: AtomicU64,
    /// Fetches and returns in flight.
    pub(super) busy: AtomicUsize,
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
            let Some(entry) = self
                .inner
                .entry(&check.key, check.limit, check.home, *lease, now)
            else {
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
    #[cfg(feature = "__testing")]
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
    pub(super) fn shard(&self, key: &str) -> &Shard {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        &self.shards[i]
    }

    /// The entry of `key` under `limit`, created when missing (`None` when
    /// the map is full). An entry of another limit (the quota changed) is
    /// replaced; its tokens go back.
    pub(super) fn entry(
        self: &Arc<Inner>,
        key: &str,
        limit: Limit,
        home: Option<Limit>,
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
        let e = Arc::new(Entry::new(key, limit, home, lease, now));
        if let Some(old) = map.insert(Box::from(key), e.clone()) {
            // The quota changed: the old lease's tokens go back.
            old.expires_us.store(0, Ordering::Release);
            old.expire(self, now);
        } else {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
        Some(e)
    }

    pub(super) fn start_sweeper(&self, me: &Arc<Inner>) {
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
    pub(super) fn sweep(self: &Arc<Inner>) {
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
}
