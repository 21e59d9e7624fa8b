//! The per-process request counts by decision ([`DecisionCounts`], read by
//! [`RateLimitHandle::counts`](crate::RateLimitHandle::counts)), kept beside
//! the metrics so that they answer without a recorder.

use super::RequestDecision;
use std::sync::atomic::{AtomicU64, Ordering};

/// Requests by decision since the layer was built (this process only), as
/// read by [`RateLimitHandle::counts`](crate::RateLimitHandle::counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DecisionCounts {
    /// Passed every applicable tier.
    pub allowed: u64,
    /// Rejected with 429 by an enforced tier: answered by the backend, or a
    /// key's first 429 answered by the deny cache (from an entry the
    /// admission that emptied the tier wrote).
    pub limited: u64,
    /// Passed, but a shadow (or not-enforced canary) tier would have rejected it.
    pub shadow_limited: u64,
    /// On the allowlist: not limited.
    pub allowlisted: u64,
    /// On the denylist: refused.
    pub denylisted: u64,
    /// Passed because the backend failed and the policy is open.
    pub fail_open: u64,
    /// Refused with 503 because the backend failed and the policy is closed.
    pub fail_closed: u64,
    /// No tier applied (anonymous on a user tier, OPTIONS, mode off, ...).
    pub skipped: u64,
    /// Rejected by the local deny cache, without a backend call, after the
    /// key's first 429 (counted `limited`). All 429s: `limited +
    /// cache_blocked`.
    pub cache_blocked: u64,
    /// Decided by the local fallback limiter while the backend was down.
    pub fallback: u64,
}

/// The counts of one thread, on cache lines of their own (128 bytes: the
/// pair x86's adjacent-line prefetcher fetches together), indexed by
/// [`RequestDecision`]'s discriminant.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe([AtomicU64; 10]);

/// The request counts by decision, a [`Stripe`] per thread that counts
/// (`thread_local`'s per-thread slots): a request writes its own thread's
/// line only, never one the other workers write, so counting costs no
/// cache-line transfer between cores. Only the owning thread writes a
/// stripe; a snapshot sums every thread's.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    by_thread: thread_local::ThreadLocal<Stripe>,
}

impl Counts {
    /// Counts one request under `decision`.
    #[inline]
    pub(crate) fn add(&self, decision: RequestDecision) {
        let c = &self.by_thread.get_or_default().0[decision as usize];
        // The owner is the only writer: a load and a store, no
        // read-modify-write.
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> DecisionCounts {
        let mut n = [0u64; 10];
        for stripe in self.by_thread.iter() {
            for (n, c) in n.iter_mut().zip(&stripe.0) {
                *n += c.load(Ordering::Relaxed);
            }
        }
        let [allowed, limited, shadow_limited, allowlisted, denylisted, fail_open, fail_closed, skipped, cache_blocked, fallback] =
            n;
        DecisionCounts {
            allowed,
            limited,
            shadow_limited,
            allowlisted,
            denylisted,
            fail_open,
            fail_closed,
            skipped,
            cache_blocked,
            fallback,
        }
    }
}
