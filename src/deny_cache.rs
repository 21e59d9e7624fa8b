//! The local deny cache: a key the backend just denied is denied here, with
//! no backend call, until its exact retry time. It is also **primed by
//! admissions**: when a request's charge leaves a tier less than another
//! request of the same cost, a single Redis says (in the same reply) when
//! the next one would pass — token bucket, fixed window, leaky bucket — and
//! the key is cached as denied until then. So under a flood from one key
//! only the admitted requests (one per token) reach Redis; the denied ones
//! do not, not even the first after each admission.
//!
//! Under a flood from one abusive key this removes almost all backend
//! traffic. It is exact, never stricter than the backend: an entry records
//! the retry instant the backend computed for a request of a given cost,
//! measured from *before* the request was sent (so it can only end early,
//! never late), and it applies only to requests of exactly that cost on the
//! same storage key — nothing another request does can make such a request
//! pass earlier, since denied requests consume nothing. (A larger cost would
//! wait longer than the cached `Retry-After` says, and a smaller one may fit:
//! both go to the backend.) Nor does it apply under another limit: the same
//! key is checked under another plan's quota, or the quota changed while the
//! check that wrote the entry was in flight. Tiers that refund by response status
//! (`skip_failed_requests`, `skip_successful_requests`) are never cached: a
//! refund could make room earlier. Nor are shadow tiers. Entries are dropped
//! by any runtime change (modes, quotas, lists, the kill switch).
//!
//! What it cannot know: an admission on the same key by *another* instance
//! (or by a request of another cost) after the denial can push the real
//! retry time later than the cached one; the cached answer is then the
//! backend's answer at the denial, aged — optimistic by that much, and it
//! never admits anything. With costs above 1, `X-RateLimit-Remaining` is the
//! value at the denial (refill below the cost does not show). Turn it off
//! with [`deny_cache(0)`](crate::RateLimitLayerBuilder::deny_cache) where
//! that matters more than sparing the backend.
//!
//! Bounded by entry count (a `moka` cache, TinyLFU eviction); each entry also
//! expires at its retry time.

use crate::algorithm::Limit;
use moka::sync::Cache;
use moka::Expiry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A cached denial.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Denied {
    /// Backend-clock microseconds at which requests of `min_cost` pass again.
    pub(crate) until_us: u64,
    /// The cost that was denied; other costs go to the backend.
    pub(crate) min_cost: u64,
    /// The limit it was decided under: a request checked under another (its
    /// plan differs, or the quota changed while the check was in flight) goes
    /// to the backend.
    pub(crate) quota: Limit,
    /// What was left at the denial.
    pub(crate) remaining: u64,
    /// How long the entry lives in real time.
    ttl: Duration,
}

impl Denied {
    pub(crate) fn new(
        until_us: u64,
        min_cost: u64,
        quota: Limit,
        remaining: u64,
        ttl: Duration,
    ) -> Self {
        Self {
            until_us,
            min_cost,
            quota,
            remaining,
            ttl,
        }
    }
}

struct UntilRetry;

impl Expiry<String, Denied> for UntilRetry {
    fn expire_after_create(
        &self,
        _key: &String,
        value: &Denied,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
    fn expire_after_update(
        &self,
        _key: &String,
        value: &Denied,
        _updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
}

pub(crate) struct DenyCache {
    cache: Option<Cache<String, Denied>>,
    /// The latest `until_us` of any entry: once the clock passes it every
    /// entry has lapsed, and a lookup (hashing the key) can be skipped. Most
    /// requests of a service nobody floods take that shortcut.
    latest_until_us: AtomicU64,
}

impl DenyCache {
    /// A cache of at most `capacity` entries; 0 disables it.
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            latest_until_us: AtomicU64::new(0),
            cache: (capacity > 0).then(|| {
                Cache::builder()
                    .max_capacity(capacity)
                    .expire_after(UntilRetry)
                    .build()
            }),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// The denial cached for `key` that still applies at `now_us` to a
    /// request of `cost` checked under `quota`.
    pub(crate) fn get(&self, key: &str, cost: u64, quota: &Limit, now_us: u64) -> Option<Denied> {
        if now_us >= self.latest_until_us.load(Ordering::Relaxed) {
            return None;
        }
        let d = self.cache.as_ref()?.get(key)?;
        (now_us < d.until_us && cost == d.min_cost && *quota == d.quota).then_some(d)
    }

    pub(crate) fn insert(&self, key: String, denied: Denied) {
        if let Some(c) = &self.cache {
            self.latest_until_us
                .fetch_max(denied.until_us, Ordering::Relaxed);
            c.insert(key, denied);
        }
    }

    /// Drops every entry (runtime changes and the kill switch).
    pub(crate) fn clear(&self) {
        if let Some(c) = &self.cache {
            self.latest_until_us.store(0, Ordering::Relaxed);
            c.invalidate_all();
        }
    }
}
