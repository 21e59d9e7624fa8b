//! Tiers that never apply: a tier whose extractor finds no key skips the
//! request, which is right for one anonymous request and wrong for all of
//! them (an auth middleware placed inside the limiter instead of outside
//! it, a header no client sends). Every such request is counted in
//! [`NO_KEY`] (registered at 0 when the layer is built), and a tier that had
//! no key on **every one** of its first N requests logs one `WARN` naming
//! the tier and the likely cause
//! ([`KeyExtractor::no_key_cause`](crate::key::KeyExtractor::no_key_cause)).

use crate::observe::RequestMetrics;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The counter of requests on which a tier had no key (label `tier`).
pub(crate) const NO_KEY: &str = "tiered_ratelimit_tier_no_key_total";

/// The default N of [`NoKeyWatch`]: the requests a tier may see without a
/// key before the warning.
pub(crate) const DEFAULT_NO_KEY_WARN_AFTER: u64 = 1000;

/// Watches one tier's first requests: how many in a row had no key, until
/// one has a key (then nothing more is watched: one relaxed load a request)
/// or N had none (then one warning, and nothing more is watched).
#[derive(Debug)]
pub(crate) struct NoKeyWatch {
    /// N (0: never warn).
    after: u64,
    /// The keyless requests so far, or [`DONE`].
    seen: AtomicU64,
    /// What to say about the likely cause.
    cause: Option<Box<str>>,
}

/// Nothing more to watch: a request had a key, or the warning was logged.
const DONE: u64 = u64::MAX;

impl NoKeyWatch {
    pub(crate) fn new(after: u64, cause: Option<String>) -> Self {
        Self {
            after,
            seen: AtomicU64::new(if after == 0 { DONE } else { 0 }),
            cause: cause.map(String::into_boxed_str),
        }
    }

    /// A request of this tier had a key.
    #[inline]
    pub(crate) fn keyed(&self) {
        if self.seen.load(Ordering::Relaxed) != DONE {
            self.seen.store(DONE, Ordering::Relaxed);
        }
    }

    /// A request of this tier had none: true exactly once, on the Nth in a
    /// row from the start.
    fn missing(&self) -> bool {
        let after = self.after;
        let mut now = 0;
        let moved = self
            .seen
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                if s == DONE {
                    return None;
                }
                now = s + 1;
                Some(if now >= after { DONE } else { now })
            });
        moved.is_ok() && now >= after
    }
}

impl NoKeyWatch {
    /// Counts a request on which tier number `tier`, named `name`, whose
    /// keys come from `key_type`, had no key, and logs the warning when it
    /// is the Nth keyless one from the start.
    #[cold]
    #[inline(never)]
    pub(crate) fn record(
        &self,
        metrics: &RequestMetrics,
        tier: usize,
        name: &Arc<str>,
        key_type: &str,
    ) {
        metrics.count_no_key(NO_KEY, tier, name);
        if !self.missing() {
            return;
        }
        self.warn(name, key_type);
    }

    fn warn(&self, name: &str, key_type: &str) {
        let n = self.after;
        let cause = self.cause.as_deref().unwrap_or(
            "its key extractor returned no key for any of them: check that what it reads \
         reaches the limiter",
        );
        tracing::warn!(target: super::LOG_TARGET,
            tier = %name,
            extractor = key_type,
            requests = n,
            "rate limiter: tier \"{name}\" had no key on every one of its first {n} requests, so it \
             never applied (each is counted in {NO_KEY}); {cause}",
        );
    }
}

/// Registers tier `name`'s series at 0 (a dashboard sees it before the
/// first keyless request).
pub(crate) fn register(name: &Arc<str>) {
    metrics::counter!(NO_KEY, "tier" => name.clone()).increment(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_once_on_the_nth_keyless_request_and_never_after_a_key() {
        let w = NoKeyWatch::new(3, None);
        assert!(!w.missing());
        assert!(!w.missing());
        assert!(w.missing());
        assert!(!w.missing());
        let w = NoKeyWatch::new(3, None);
        assert!(!w.missing());
        w.keyed();
        assert!(!w.missing() && !w.missing() && !w.missing());
        let w = NoKeyWatch::new(0, None);
        assert!(!w.missing());
        let w = NoKeyWatch::new(1, None);
        assert!(w.missing());
    }
}
