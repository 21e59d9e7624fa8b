//! When a cached denial is exactly the backend's answer: which denials
//! may be cached, and which uncached tiers cannot bind a cached 429.

use crate::algorithm::Limit;

/// Whether a denial of `cost` under `limit`, seen with `remaining` left,
/// stays exactly the backend's answer until its retry instant: its retry
/// instant is fixed (every algorithm's is, while the key's state does not
/// change), and so must be its `remaining`. A fixed window's count does not
/// move within the window (and its retry instant is the window's end). For
/// the others, `remaining` only grows while a key is left alone, and stays
/// below `cost` while the request is denied: it is constant when it is
/// already `cost − 1` (always so for a cost of 1).
/// A concurrency denial never does: a slot frees whenever a running request
/// ends.
pub(crate) fn stays_exact(limit: &Limit, cost: u64, remaining: u64) -> bool {
    match limit {
        Limit::FixedWindow(_) | Limit::Calendar(_) => true,
        Limit::Concurrency(_) => false,
        _ => remaining.saturating_add(1) == cost,
    }
}

/// The longest `Retry-After` (µs) that a check of `cost` under `limit` at
/// `now_us` could be denied with, whatever the key's stored state: a tier
/// the cache knows nothing about cannot bind a request's 429 when this is
/// shorter than a cached tier's wait. `u64::MAX` when there is no such
/// bound: a leaky bucket's backlog may have been built under another limit
/// of the same rate (a plan, a quota changed at run time); or a cost above
/// the capacity, whose 429 binds whatever the wait (it can never pass:
/// `decide::never_fits`), which only the backend's answer says.
pub(crate) fn longest_wait_us(limit: &Limit, cost: u64, now_us: u64) -> u64 {
    if cost > limit.capacity() && !limit.is_penalty() && !limit.is_override() {
        return u64::MAX;
    }
    match *limit {
        // The window's end (or its reset, the same instant).
        Limit::FixedWindow(w) => w.window_us - now_us % w.window_us,
        Limit::Calendar(c) => c.window(now_us).1.saturating_sub(now_us),
        // The newest entry was logged at or before now.
        Limit::SlidingWindowLog(w) => w.window_us,
        // At most the end of the next window.
        Limit::SlidingWindowCounter(w) => 2 * w.window_us - now_us % w.window_us,
        // From an empty bucket: the cost (or a full bucket, above it).
        Limit::TokenBucket(b) => cost.saturating_mul(b.unit).min(b.capacity).div_ceil(b.rate),
        Limit::LeakyBucket(_) => u64::MAX,
        // The estimate's cap.
        Limit::Concurrency(_) => crate::algorithm::RETRY_ESTIMATE_US,
        // The longest block.
        Limit::Penalty(p) => p.max_block_us,
        // Never denies (its tier's check does).
        Limit::Override => 0,
    }
}

/// Whether a key under `limit` keeps the room an answer showed on it until
/// something charges it, so that a room fact holds: a token bucket only
/// refills, a fixed window's count only resets, and for both `remaining`
/// is exactly the cost that still fits. (The sliding windows and the leaky
/// bucket would too, but are left out: their `remaining` is rounded.)
pub(crate) fn keeps_room(limit: &Limit) -> bool {
    matches!(
        limit,
        Limit::TokenBucket(_) | Limit::FixedWindow(_) | Limit::Calendar(_)
    )
}
