//! One multiplexed connection shared by every request (a single Redis's,
//! or the primary Redis Sentinel names), made on first use and made again
//! once it was forgotten (broken, or its node no longer a serving primary).
//!
//! A request clones the connection out of an `ArcSwapOption`: no lock, no
//! guard held while the command is in flight (redis-rs's
//! `ConnectionManager` holds one across every command, which, with more
//! commands in flight than arc-swap has fast slots per thread, took its
//! slow path on every check, `perf/README.md`).
//!
//! A connect runs in a task of its own, one at a time: requests that need a
//! connection meanwhile wait for it (each within its own `backend_timeout`),
//! and a request that gives up never cancels it, so a connect slower than
//! the timeout still ends and serves the requests after it. A failed connect
//! is reported to the requests that waited for it (one that joined it
//! late tries once more); for `retry_after` after it, requests fail at once
//! (Sentinel: 50 ms, no storm of lookups while the sentinels elect a new
//! primary; a URL's connect retries refused connects itself and has none),
//! then the next one tries again.

use crate::error::BackendError;
use ::redis::aio::MultiplexedConnection;
use ::redis::{ErrorKind, RedisError, RedisResult};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// A connect's outcome, as its waiting requests receive it (`None` until
/// it ends).
type Outcome = Option<RedisResult<MultiplexedConnection>>;

/// The shared connection and the connect that makes it.
pub(super) struct SharedConnection {
    /// The connection while it serves.
    ready: arc_swap::ArcSwapOption<MultiplexedConnection>,
    /// No connection: connecting, or the last connect failed.
    state: Mutex<State>,
    /// Bound on one whole connect.
    bound: Duration,
    /// After a failed connect, requests fail at once for this long before
    /// the next one tries again.
    retry_after: Duration,
}

enum State {
    /// No connect running: the last one failed (when, why), or none ran
    /// since the connection was dropped.
    Idle {
        failed: Option<(Instant, RedisError)>,
    },
    /// A connect is running; its outcome comes on this channel.
    Connecting(watch::Receiver<Outcome>),
}

impl SharedConnection {
    /// No connection yet; each connect bounded by `bound`, requests failing
    /// at once for `retry_after` after a connect failed.
    pub(super) fn new(bound: Duration, retry_after: Duration) -> Arc<Self> {
        Arc::new(Self {
            ready: arc_swap::ArcSwapOption::empty(),
            state: Mutex::new(State::Idle { failed: None }),
            bound,
            retry_after,
        })
    }

    /// The shared connection, or the outcome of a connect (made with
    /// `connect`, started here if none is running and the last one did not
    /// just fail).
    pub(super) async fn get<F, Fut>(
        self: &Arc<Self>,
        connect: F,
    ) -> Result<MultiplexedConnection, BackendError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = RedisResult<MultiplexedConnection>> + Send + 'static,
    {
        if let Some(c) = &*self.ready.load() {
            return Ok(MultiplexedConnection::clone(c));
        }
        // Boxed: the rare path stays out of every check's future.
        Box::pin(self.wait(connect)).await
    }

    /// [`Self::get`] without a connection: wait for the connect running,
    /// or start one.
    async fn wait<F, Fut>(
        self: &Arc<Self>,
        connect: F,
    ) -> Result<MultiplexedConnection, BackendError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = RedisResult<MultiplexedConnection>> + Send + 'static,
    {
        // A request that joined a connect already running may have joined
        // its last try just before Redis came back: it tries once more, with
        // a connect of its own if none runs.
        let mut joined = 0;
        loop {
            let (mut rx, started) = {
                let mut state = lock(&self.state);
                // Made while this request took the lock.
                if let Some(c) = &*self.ready.load() {
                    return Ok(MultiplexedConnection::clone(c));
                }
                match &*state {
                    State::Connecting(rx) => (rx.clone(), false),
                    State::Idle {
                        failed: Some((at, e)),
                    } if at.elapsed() < self.retry_after => {
                        return Err(BackendError::connection(e.clone()));
                    }
                    State::Idle { .. } => {
                        let (tx, rx) = watch::channel(None);
                        *state = State::Connecting(rx.clone());
                        tokio::spawn(self.clone().run(connect(), tx));
                        (rx, true)
                    }
                }
            };
            let outcome = rx
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|o| o.clone());
            if outcome.is_none() {
                // The connect's task ended without an outcome (the runtime
                // is shutting down): let the next request start another.
                let mut state = lock(&self.state);
                if matches!(&*state, State::Connecting(r) if r.same_channel(&rx)) {
                    *state = State::Idle { failed: None };
                }
            }
            match outcome {
                Some(Ok(c)) => return Ok(c),
                Some(Err(_)) if !started && joined == 0 => joined += 1,
                Some(Err(e)) => return Err(BackendError::connection(e)),
                None => {
                    return Err(BackendError::connection(RedisError::from((
                        ErrorKind::Io,
                        "redis: the connect was cancelled",
                    ))))
                }
            }
        }
    }

    /// Drops the shared connection (it broke, or its node was demoted): the
    /// next request connects again.
    pub(super) fn forget(&self) {
        self.ready.store(None);
    }

    /// One connect, bounded by `self.bound`; its outcome becomes the state,
    /// then goes to the requests that waited.
    async fn run(
        self: Arc<Self>,
        connect: impl Future<Output = RedisResult<MultiplexedConnection>>,
        tx: watch::Sender<Outcome>,
    ) {
        let outcome = match tokio::time::timeout(self.bound, connect).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from((
                ErrorKind::Io,
                "redis: no connection made in time",
                format!("{:?}", self.bound),
            ))),
        };
        if let Err(e) = &outcome {
            tracing::debug!(target: "tiered_ratelimit::redis", error = %e, "rate limiter: connect failed");
        }
        {
            let mut state = lock(&self.state);
            match &outcome {
                Ok(c) => {
                    self.ready.store(Some(Arc::new(c.clone())));
                    *state = State::Idle { failed: None };
                }
                Err(e) => {
                    *state = State::Idle {
                        failed: Some((Instant::now(), e.clone())),
                    }
                }
            }
        }
        let _ = tx.send(Some(outcome));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
