//! Limits suggested from a log (`tiered-ratelimit suggest`): the layer
//! records per-key demand as it does live (`tiered_ratelimit::observe::demand`);
//! with [`ReplayOptions::demand`](crate::replay::ReplayOptions::demand) its
//! counts are flushed each time the virtual clock passes a second, as the
//! live task flushes once a second, so the offline answer is the live one
//! on the same traffic.

use super::Replayer;
use std::future::Future;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tiered_ratelimit::observe::demand::{SuggestError, Suggestion};

/// Polls a future of the memory backend's demand store, ready at once.
fn now<F: Future>(f: F) -> Option<F::Output> {
    match std::pin::pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// Flushes `handle`'s per-key demand when the virtual clock `now_us`
/// enters a new second (`last`: the second of the last flush).
pub(super) fn flush_demand(
    last: &mut Option<u64>,
    handle: &tiered_ratelimit::RateLimitHandle,
    now_us: u64,
) {
    let second = now_us / 1_000_000;
    if *last != Some(second) {
        *last = Some(second);
        // In process: never pending, never failing.
        let _ = now(handle.flush_demand());
    }
}

impl Replayer {
    /// The suggestion for `tier` (and `plan`) over the last `window` of the
    /// log (ending at its latest time), as
    /// [`RateLimitHandle::suggest`](tiered_ratelimit::RateLimitHandle::suggest)
    /// answers it live.
    ///
    /// # Errors
    /// As `RateLimitHandle::suggest`.
    pub fn suggest(
        &self,
        tier: &str,
        plan: Option<&str>,
        target: f64,
        window: Duration,
    ) -> Result<Suggestion, SuggestError> {
        now(self.handle.suggest(tier, plan, target, window)).unwrap_or_else(|| {
            Err(SuggestError::Backend(
                "the in-process demand store did not answer at once".into(),
            ))
        })
    }

    /// Every tier and its plans: what `suggest` answers for.
    pub fn tiers_and_plans(&self) -> Vec<(String, Option<String>)> {
        let mut out = Vec::new();
        for t in self.handle.tiers() {
            out.push((t.name.clone(), None));
            for (p, _) in &t.plans {
                out.push((t.name.clone(), Some(p.clone())));
            }
        }
        out
    }
}
