//! A layer's background flush to Redis, off the request path: started by
//! the first count recorded inside a tokio runtime on a Redis backend (a
//! layer may be built outside one), then one flush every interval, and a
//! last one once the layer is dropped. Used by the deny cache's 429s
//! ([`super::fleet`]) and the candidate quotas' counts
//! ([`super::fleet_candidates`]).

// Without the `redis` feature nothing is ever flushed.
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_imports))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Notify;

/// The handle of one flush task; dropping it flushes once more and stops
/// the task.
pub(crate) struct FlushTask {
    interval: Duration,
    /// The task holds a `Weak` of this: once the layer is gone it flushes
    /// a last time and stops.
    alive: Arc<()>,
    started: AtomicBool,
    /// Wakes the task early when the layer is dropped.
    stop: Arc<Notify>,
}

impl FlushTask {
    /// A task flushing every `interval` (at least 10 ms), not started.
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval: interval.max(Duration::from_millis(10)),
            alive: Arc::new(()),
            started: AtomicBool::new(false),
            stop: Arc::new(Notify::new()),
        }
    }

    /// The flush interval (at least 10 ms).
    pub(crate) fn interval(&self) -> Duration {
        self.interval
    }

    /// Whether the task runs: one relaxed load, for the request path.
    pub(crate) fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }

    /// Starts the task, once, calling `flush` every interval, when called
    /// inside a tokio runtime (else the counts wait for a later call).
    #[cfg(feature = "redis")]
    pub(crate) fn start<F, Fut>(&self, redis: &crate::backend::RedisBackend, flush: F)
    where
        F: Fn(crate::backend::RedisBackend) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        let (interval, stop) = (self.interval, self.stop.clone());
        let alive = Arc::downgrade(&self.alive);
        rt.spawn(run(interval, stop, alive, redis.clone(), flush));
    }
}

impl Drop for FlushTask {
    fn drop(&mut self) {
        // A permit is stored if the task is not waiting right now.
        self.stop.notify_one();
    }
}

/// Every interval, one flush; stops after a last flush once the layer is
/// dropped.
#[cfg(feature = "redis")]
async fn run<F, Fut>(
    interval: Duration,
    stop: Arc<Notify>,
    alive: Weak<()>,
    redis: crate::backend::RedisBackend,
    flush: F,
) where
    F: Fn(crate::backend::RedisBackend) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        let stopping = tokio::select! {
            () = tokio::time::sleep(interval) => alive.upgrade().is_none(),
            () = stop.notified() => true,
        };
        flush(redis.clone()).await;
        if stopping {
            return;
        }
    }
}
