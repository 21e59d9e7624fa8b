//! Batched settles of priced requests (issue 29): every settle an instance
//! sends to one Redis goes through one queue, drained by one task into one
//! `refund`-mode call of the cluster script (`lua/cluster.lua`, many keys
//! in one `EVALSHA`) at a time, at most one call per [`INTERVAL`]: under
//! load one call carries every settle that arrived meanwhile, whatever
//! their number; an idle queue sends the first settle at once. A Redis
//! Cluster gets one call per hash slot of the batch (`cluster::refund`:
//! every settle of one key in one call), all at once.

use super::RedisBackend;
use crate::backend::TierRefund;
use crate::error::BackendError;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The shortest time between two batched calls of one instance.
pub(crate) const INTERVAL: Duration = Duration::from_millis(10);

/// At most this many keys in one call (a larger batch is split).
const MAX_KEYS: usize = 1000;

/// Settles, the instant their call must have been answered by, and who
/// waits for its result.
type Item = (
    Vec<TierRefund>,
    tokio::time::Instant,
    oneshot::Sender<Result<(), BackendError>>,
);

/// The queue of one backend's settles (made, with its task, on first use).
pub(super) struct Queue(mpsc::UnboundedSender<Item>);

impl RedisBackend {
    /// Sends `settles` in the instance's next batched call and waits for
    /// its result (the batch's: one error fails every settle in it). The
    /// call is given up `timeout` from now (the batch's earliest such
    /// instant), so a settle whose caller stopped waiting is not sent later.
    ///
    /// # Errors
    /// The batch's [`BackendError`], or [`BackendError::NoRuntime`].
    pub(crate) async fn settle_batched(
        &self,
        settles: Vec<TierRefund>,
        timeout: Duration,
    ) -> Result<(), BackendError> {
        let queue = match self.inner.settle_queue.get() {
            Some(q) => q,
            None => {
                let rt =
                    tokio::runtime::Handle::try_current().map_err(|_| BackendError::NoRuntime)?;
                self.inner.settle_queue.get_or_init(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    // The task holds the backend weakly: it ends once the
                    // backend (and so the queue's sender) is dropped.
                    let weak = Weak {
                        inner: std::sync::Arc::downgrade(&self.inner),
                        clock: self.clock.clone(),
                        ttl_slack_ms: self.ttl_slack_ms,
                    };
                    rt.spawn(drain(weak, rx));
                    Queue(tx)
                })
            }
        };
        let (tx, rx) = oneshot::channel();
        queue
            .0
            .send((settles, tokio::time::Instant::now() + timeout, tx))
            .map_err(|_| BackendError::NoRuntime)?;
        rx.await.unwrap_or(Err(BackendError::NoRuntime))
    }
}

/// The backend, as the queue's task holds it.
struct Weak {
    inner: std::sync::Weak<super::Inner>,
    clock: Option<crate::backend::ManualClock>,
    ttl_slack_ms: u64,
}

/// The queue's task: one call at a time, at most one per [`INTERVAL`].
async fn drain(weak: Weak, mut rx: mpsc::UnboundedReceiver<Item>) {
    while let Some(first) = rx.recv().await {
        let Some(inner) = weak.inner.upgrade() else {
            return;
        };
        let backend = RedisBackend {
            inner,
            clock: weak.clock.clone(),
            ttl_slack_ms: weak.ttl_slack_ms,
        };
        let started = tokio::time::Instant::now();
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        let mut settles = Vec::new();
        let mut waiters = Vec::with_capacity(batch.len());
        let mut deadline = started + Duration::from_secs(3600);
        for (s, by, w) in batch {
            settles.extend(s);
            deadline = deadline.min(by);
            waiters.push(w);
        }
        let calls = async {
            let mut result = Ok(());
            let mut rest = &settles[..];
            while !rest.is_empty() {
                let (chunk, after) = rest.split_at(chunk_len(rest, MAX_KEYS));
                rest = after;
                if let Err(e) = backend.refund(chunk).await {
                    result = Err(e);
                }
            }
            result
        };
        // Given up at the deadline: a Redis that is down (reconnecting)
        // must not deliver the call once it is back, after its waiters
        // counted it as failed.
        let result = tokio::time::timeout_at(deadline, calls)
            .await
            .unwrap_or_else(|_| Err(BackendError::Timeout(deadline - started)));
        for w in waiters {
            let _ = w.send(result.clone());
        }
        drop(backend);
        tokio::time::sleep_until(started + INTERVAL).await;
    }
}

/// The length of the next call's share of `settles`, at most `max` (≥ 2):
/// an override's read stays in the call of the settle it precedes.
fn chunk_len(settles: &[TierRefund], max: usize) -> usize {
    let n = settles.len().min(max);
    if n < settles.len() && settles[n - 1].check.limit.is_override() {
        n - 1
    } else {
        n
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_len;
    use crate::algorithm::{Limit, TokenBucket};
    use crate::backend::{Charge, TierCheck, TierRefund};

    fn settle(limit: Limit) -> TierRefund {
        TierRefund {
            check: TierCheck {
                key: "k".into(),
                limit,
                cost: 1,
                home: None,
            },
            charge: Charge {
                at_us: 0,
                undo: 0,
                next_after_us: 0,
            },
            debt: false,
        }
    }

    #[test]
    fn an_override_read_stays_with_its_settle() {
        let tier = Limit::TokenBucket(TokenBucket::new(60, 60_000_000, 10).unwrap());
        let s = [tier, Limit::Override, tier, tier].map(settle);
        assert_eq!(chunk_len(&s, 3), 3);
        assert_eq!(chunk_len(&s, 2), 1);
        assert_eq!(chunk_len(&s[1..], 2), 2);
        assert_eq!(chunk_len(&s[3..], 2), 1);
    }
}
