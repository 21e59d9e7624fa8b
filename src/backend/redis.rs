use super::clock::ManualClock;
use super::{TierCheck, Verdict};
use crate::algorithm::Decision;
use crate::error::{BackendError, ConfigError};
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use ::redis::{Client, RedisError, Script};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// The multi-tier token bucket script, loaded once per connection with
/// `SCRIPT LOAD` semantics (EVALSHA, falling back to EVAL on `NOSCRIPT`).
const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");

/// Buckets in Redis, shared by every app server that points at it.
///
/// Each request runs **one** `EVALSHA` of `lua/token_bucket.lua` covering all of
/// its tiers: one round trip however many tiers, atomic (Redis runs a script
/// to completion before any other command), all or nothing, and timed by
/// Redis `TIME` so that app servers with skewed clocks agree on every bucket.
///
/// Connections: requests share multiplexed connections (commands from
/// concurrent requests are pipelined on one socket), never a pool checkout
/// per request.
/// * [`RedisBackend::from_url`] holds a `redis::aio::ConnectionManager`,
///   which reconnects on its own after a failure.
/// * [`RedisBackend::from_pool`] takes one connection out of your
///   `deadpool-redis` pool and shares it; when it fails it is dropped and the
///   next request takes a fresh one from the pool (no per-request recycle
///   check).
///
/// A script missing after a Redis restart or `SCRIPT FLUSH` (`NOSCRIPT`) is
/// reloaded once, transparently; it never counts as a backend failure.
///
/// ```no_run
/// # fn main() -> Result<(), tiered_ratelimit::ConfigError> {
/// use tiered_ratelimit::backend::RedisBackend;
/// let redis = RedisBackend::from_url("redis://127.0.0.1:6379/")?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
    clock: Option<ManualClock>,
}

struct Inner {
    source: Source,
    script: Script,
}

enum Source {
    Client {
        client: Client,
        connect_timeout: Duration,
        manager: OnceLock<ConnectionManager>,
    },
    Pool {
        pool: deadpool_redis::Pool,
        conn: Mutex<Option<MultiplexedConnection>>,
    },
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.inner.source {
            Source::Client { client, .. } => format!("{:?}", client.get_connection_info().addr()),
            Source::Pool { .. } => "deadpool".to_owned(),
        };
        f.debug_struct("RedisBackend")
            .field("source", &kind)
            .field("manual_clock", &self.clock.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// A backend for the Redis at `url` (`redis://[user:pass@]host:port/[db]`).
    ///
    /// Does not connect yet: the first request does, so the app can start
    /// while Redis is down (requests then follow the failure policy).
    ///
    /// # Errors
    /// [`ConfigError::InvalidRedisUrl`] when the URL does not parse.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        let client = Client::open(url).map_err(|e| ConfigError::InvalidRedisUrl(e.to_string()))?;
        Ok(Self::new(Source::Client {
            client,
            connect_timeout: Duration::from_secs(1),
            manager: OnceLock::new(),
        }))
    }

    /// A backend that takes its connections from a `deadpool-redis` pool.
    pub fn from_pool(pool: deadpool_redis::Pool) -> Self {
        Self::new(Source::Pool {
            pool,
            conn: Mutex::new(None),
        })
    }

    fn new(source: Source) -> Self {
        Self {
            inner: Arc::new(Inner {
                source,
                script: Script::new(TOKEN_BUCKET_LUA),
            }),
            clock: None,
        }
    }

    /// Makes the scripts use `clock` instead of Redis `TIME`. For tests only:
    /// in production every app server must use Redis's clock.
    #[must_use]
    pub fn with_manual_clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The SHA1 of the script, as used with `EVALSHA` (handy with
    /// `redis-cli SCRIPT EXISTS`).
    pub fn script_sha(&self) -> &str {
        self.inner.script.get_hash()
    }

    async fn connection(&self) -> Result<Conn, BackendError> {
        match &self.inner.source {
            Source::Client {
                client,
                connect_timeout,
                manager,
            } => {
                if let Some(m) = manager.get() {
                    return Ok(Conn::Manager(m.clone()));
                }
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(*connect_timeout))
                    .set_response_timeout(None);
                let m = ConnectionManager::new_lazy_with_config(client.clone(), config)
                    .map_err(|e| BackendError::Connection(e.to_string()))?;
                Ok(Conn::Manager(manager.get_or_init(|| m).clone()))
            }
            Source::Pool { pool, conn } => {
                if let Some(c) = lock(conn).clone() {
                    return Ok(Conn::Multiplexed(c));
                }
                let obj = pool
                    .get()
                    .await
                    .map_err(|e| BackendError::Connection(e.to_string()))?;
                let c = deadpool_redis::Connection::take(obj);
                *lock(conn) = Some(c.clone());
                Ok(Conn::Multiplexed(c))
            }
        }
    }

    fn forget_connection(&self) {
        if let Source::Pool { conn, .. } = &self.inner.source {
            *lock(conn) = None;
        }
    }

    pub(crate) async fn check(self, checks: Vec<TierCheck>) -> Result<Verdict, BackendError> {
        let mut invocation = self.inner.script.prepare_invoke();
        match &self.clock {
            Some(c) => invocation.arg(c.now_us()),
            None => invocation.arg(""),
        };
        for c in &checks {
            invocation
                .key(c.key.as_str())
                .arg(c.bucket.capacity)
                .arg(c.bucket.rate)
                .arg(c.bucket.unit)
                .arg(c.cost);
        }
        let mut conn = self.connection().await?;
        let reply: Result<Vec<i64>, RedisError> = match &mut conn {
            Conn::Manager(m) => invocation.invoke_async(m).await,
            Conn::Multiplexed(m) => invocation.invoke_async(m).await,
        };
        let reply = reply.map_err(|e| {
            if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                self.forget_connection();
                BackendError::Connection(e.to_string())
            } else {
                BackendError::Script(e.to_string())
            }
        })?;
        parse_reply(&reply, &checks)
    }
}

enum Conn {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
}

fn parse_reply(reply: &[i64], checks: &[TierCheck]) -> Result<Verdict, BackendError> {
    if reply.len() != 1 + 4 * checks.len() {
        return Err(BackendError::Script(format!(
            "expected {} values, got {}",
            1 + 4 * checks.len(),
            reply.len()
        )));
    }
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    let decisions = reply[1..]
        .chunks_exact(4)
        .zip(checks)
        .map(|(r, c)| Decision {
            allowed: r[0] == 1,
            limit: c.bucket.burst(),
            remaining: u(r[1]),
            reset_after_us: u(r[2]),
            retry_after_us: u(r[3]),
        })
        .collect();
    Ok(Verdict {
        now_us: u(reply[0]),
        decisions,
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
