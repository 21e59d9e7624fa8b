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

#[derive(Debug, Default)]
pub(crate) struct Counts {
    allowed: AtomicU64,
    limited: AtomicU64,
    shadow_limited: AtomicU64,
    allowlisted: AtomicU64,
    denylisted: AtomicU64,
    fail_open: AtomicU64,
    fail_closed: AtomicU64,
    skipped: AtomicU64,
    cache_blocked: AtomicU64,
    fallback: AtomicU64,
}

impl Counts {
    /// Counts one request under `decision`.
    pub(crate) fn add(&self, decision: RequestDecision) {
        let c = match decision {
            RequestDecision::Allowed => &self.allowed,
            RequestDecision::Limited => &self.limited,
            RequestDecision::ShadowLimited => &self.shadow_limited,
            RequestDecision::Allowlisted => &self.allowlisted,
            RequestDecision::Denylisted => &self.denylisted,
            RequestDecision::FailOpen => &self.fail_open,
            RequestDecision::FailClosed => &self.fail_closed,
            RequestDecision::Skipped => &self.skipped,
            RequestDecision::CacheBlocked => &self.cache_blocked,
            RequestDecision::Fallback => &self.fallback,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> DecisionCounts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DecisionCounts {
            allowed: r(&self.allowed),
            limited: r(&self.limited),
            shadow_limited: r(&self.shadow_limited),
            allowlisted: r(&self.allowlisted),
            denylisted: r(&self.denylisted),
            fail_open: r(&self.fail_open),
            fail_closed: r(&self.fail_closed),
            skipped: r(&self.skipped),
            cache_blocked: r(&self.cache_blocked),
            fallback: r(&self.fallback),
        }
    }
}
