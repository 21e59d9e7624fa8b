//! [`RedisBackend`]: its sources (URL, pools, cluster, sentinel), its
//! public methods. A request's check and refund are in `check.rs`, the wire
//! format of the script calls in `wire/`, connections in `connection.rs`, the cluster
//! path in `cluster.rs` and `router.rs`, Redis Sentinel in `sentinel.rs`.

use super::clock::ManualClock;
use crate::error::{BackendError, ConfigError};
use ::redis::aio::MultiplexedConnection;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, RedisError, Script};
pub(crate) use poll::PollPart;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;
pub(crate) use wire::params as redis_params;

pub use sentinel::SentinelMaster;

mod batch;
mod blocked;
mod candidates;
mod check;
mod cluster;
mod connection;
mod control;
mod demand;
mod overrides;
mod peek;
mod plan;
mod poll;
mod router;
mod sentinel;
mod settle;
mod shared;
mod slot;
mod timed;
mod wire;

/// Buckets in Redis, shared by every app server that points at it.
///
/// On a single Redis, each request runs **one** `EVALSHA` of the script
/// (`lua/check.lua` and the algorithm files) covering all of its tiers: one
/// round trip however many tiers, atomic (Redis runs a script to completion
/// before any other command), all or nothing, and timed by Redis `TIME` so
/// that app servers with skewed clocks agree on every bucket.
///
/// Connections: requests share multiplexed connections (commands from
/// concurrent requests are pipelined on one socket), never a pool checkout
/// per request.
/// * [`RedisBackend::from_url`] holds one `redis::aio::MultiplexedConnection`,
///   made again after a failure (a connect at a time, refused connects
///   retried 10 to 200 ms apart); when the node answers
///   `READONLY` (a primary demoted behind a DNS name or a proxy that moved,
///   as managed Redis services do on failover), `MASTERDOWN` or `LOADING`,
///   the connection is dropped and the next request connects afresh, so
///   limiting follows the name to the new primary.
/// * [`RedisBackend::from_pool`] takes one connection out of your
///   `deadpool-redis` pool and shares it; when it fails it is dropped and the
///   next request takes a fresh one from the pool (no per-request recycle
///   check).
/// * [`RedisBackend::sentinel`] asks Redis Sentinels for the primary and
///   shares one multiplexed connection to it; when it fails (the primary
///   died, or was demoted and answers `READONLY`) the next request asks the
///   sentinels again, so limiting follows a failover.
/// * [`RedisBackend::cluster`] routes every command (script calls, control
///   key) by hash slot itself: a slot map of its own from `CLUSTER SLOTS`,
///   one multiplexed connection per primary, `MOVED`/`ASK`/`TRYAGAIN`
///   followed in this crate (redis-rs 1.8.1's cluster connection wedges
///   under a live reshard; see `docs/redis.md`, "Resharding").
///   [`RedisBackend::from_cluster_pool`] sends everything through one
///   `redis::cluster_async::ClusterConnection` taken from the pool. In both,
///   a request's tiers are grouped by hash slot: one script call per slot,
///   all slots at once, with a refund when another slot denies (see
///   `docs/redis.md`, "Redis Cluster").
///
/// A script missing after a Redis restart or `SCRIPT FLUSH` (`NOSCRIPT`) is
/// reloaded once, transparently; it never counts as a backend failure. In a
/// cluster this happens per node: only the node that answered `NOSCRIPT`
/// gets the script.
///
/// ```no_run
/// # fn main() -> Result<(), tiered_ratelimit::ConfigError> {
/// use tiered_ratelimit::backend::RedisBackend;
/// let redis = RedisBackend::from_url("redis://127.0.0.1:6379/")?;
/// let cluster = RedisBackend::cluster(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"])?;
/// // or, from a deadpool-redis cluster pool: RedisBackend::from_cluster_pool(pool)
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
    clock: Option<ManualClock>,
    ttl_slack_ms: u64,
}

struct Inner {
    source: Source,
    script: Script,
    /// The check as a Redis Functions library (a single Redis, or the
    /// Sentinel primary; a cluster runs `EVALSHA`): called with `FCALL`
    /// while `functions` holds.
    library: wire::Library,
    /// The source of `script`.
    script_source: &'static str,
    /// Whether checks use `FCALL` (cleared for good when Redis does not
    /// know `FUNCTION`/`FCALL`, Redis < 7, or refuses to load the library:
    /// then `EVALSHA` of the same code).
    functions: AtomicBool,
    /// The cluster script, whose `refund` mode a single Redis runs too (for
    /// refunds by response status).
    refund_script: Script,
    /// Calibration of Redis's clock against this process's monotonic clock,
    /// from the last reply: Redis `TIME` minus the local midpoint of the
    /// exchange, in µs (`i64::MIN` until the first reply).
    offset_us: AtomicI64,
    origin: Instant,
    /// The layer's backend timeout in µs (0 = no deadline): a script that
    /// reaches Redis later than this after it was sent writes nothing.
    budget_us: AtomicU64,
    /// The queue of batched settles of priced requests (`settle.rs`).
    settle_queue: std::sync::OnceLock<settle::Queue>,
    /// Group commit (`batch.rs`): the checks of requests that arrive while
    /// a check is in flight, sent together in the next call.
    batcher: batch::Batcher,
    /// The group commit's script (`lua/batch.lua`), for `EVALSHA`.
    batch_script: Script,
}

enum Source {
    Client {
        client: Client,
        connect_timeout: Duration,
        /// The shared connection (`shared.rs`): made on first use, made
        /// again after it was forgotten (broken, or its node no longer a
        /// serving primary).
        conn: Arc<shared::SharedConnection>,
    },
    Pool {
        pool: deadpool_redis::Pool,
        conn: Mutex<Option<MultiplexedConnection>>,
    },
    Cluster {
        /// Where every command goes: our own routing by slot.
        router: Arc<router::Router>,
    },
    ClusterPool {
        pool: deadpool_redis::cluster::Pool,
        conn: Mutex<Option<ClusterConnection>>,
    },
    /// The primary the sentinels name, and its connection.
    Sentinel(Arc<sentinel::Sentinel>),
}

impl RedisBackend {
    /// The backend as an operator finds it, without credentials:
    /// `redis at 127.0.0.1:6379`, `redis cluster`, `redis primary of
    /// "mymaster" via sentinels`, `redis (deadpool pool)`.
    pub fn describe(&self) -> String {
        match &self.inner.source {
            Source::Client { client, .. } => {
                format!("redis at {}", client.get_connection_info().addr())
            }
            Source::Pool { .. } => "redis (deadpool pool)".to_owned(),
            Source::Cluster { .. } => "redis cluster".to_owned(),
            Source::ClusterPool { .. } => "redis cluster (deadpool pool)".to_owned(),
            Source::Sentinel(s) => {
                format!("redis primary of {:?} via sentinels", s.master_name())
            }
        }
    }

    /// Connects if needed and sends one `PING` (on a cluster, to the node
    /// of one slot). See [`Backend::ping`](crate::backend::Backend::ping).
    pub(crate) async fn ping(&self) -> Result<(), BackendError> {
        let pong: String = self.command_on("ping", &::redis::cmd("PING")).await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(BackendError::Reply(format!("PING answered {pong:?}")))
        }
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.inner.source {
            Source::Client { client, .. } => format!("{:?}", client.get_connection_info().addr()),
            Source::Pool { .. } => "deadpool".to_owned(),
            Source::Cluster { .. } => "cluster".to_owned(),
            Source::ClusterPool { .. } => "deadpool cluster".to_owned(),
            Source::Sentinel(s) => format!("sentinel master {:?}", s.master_name()),
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
        let connect_timeout = Duration::from_secs(1);
        Ok(Self::new(Source::Client {
            client,
            connect_timeout,
            // The TCP connect, then the handshake (`HELLO`, `AUTH`, `SELECT`).
            conn: shared::SharedConnection::new(connect_timeout * 2, Duration::ZERO),
        }))
    }

    /// A backend that takes its connections from a `deadpool-redis` pool.
    pub fn from_pool(pool: deadpool_redis::Pool) -> Self {
        Self::new(Source::Pool {
            pool,
            conn: Mutex::new(None),
        })
    }

    /// A backend for the Redis Cluster that `nodes` belong to (any reachable
    /// primaries or replicas, e.g. `["redis://127.0.0.1:7000", ...]`; the
    /// rest of the topology is discovered).
    ///
    /// Does not connect yet: the first request does. Requests then share one
    /// multiplexed connection per primary; the backend keeps its own slot
    /// map (`CLUSTER SLOTS`, refreshed in the background), follows
    /// `MOVED`/`ASK` and retries `TRYAGAIN`/`CLUSTERDOWN` and refused
    /// connects 5–200 ms apart, within the layer's `backend_timeout`; live
    /// resharding costs no request.
    ///
    /// # Errors
    /// [`ConfigError::InvalidRedisUrl`] when a URL does not parse, or the
    /// nodes disagree on credentials or TLS.
    pub fn cluster<I, S>(nodes: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        if nodes.is_empty() {
            return Err(ConfigError::InvalidRedisUrl(
                "cluster: at least one node URL is required".to_owned(),
            ));
        }
        let router = router::Router::new(&nodes)
            .map_err(|e| ConfigError::InvalidRedisUrl(format!("cluster: {e}")))?;
        Ok(Self::new(Source::Cluster {
            router: Arc::new(router),
        }))
    }

    /// A Redis Cluster backend that takes **one** connection out of your
    /// `deadpool-redis` cluster pool the first time and shares it (a cluster
    /// connection multiplexes every node); when it is dropped, the next
    /// request takes a fresh one from the pool.
    ///
    /// Limitation: the pool hands out only redis-rs cluster connections, so
    /// this backend's script calls go through redis-rs's own routing, not
    /// the slot router of [`RedisBackend::cluster`]. With redis-rs 1.8.1 a
    /// live reshard (`MOVED` under load) can wedge that connection (requests
    /// then time out and follow the failure policy; a timeout does not drop
    /// it, so it can stay wedged);
    /// `ASK` is followed with `ASKING` sent on its own. Prefer
    /// [`RedisBackend::cluster`] where slots are moved while serving.
    pub fn from_cluster_pool(pool: deadpool_redis::cluster::Pool) -> Self {
        Self::new(Source::ClusterPool {
            pool,
            conn: Mutex::new(None),
        })
    }

    fn new(source: Source) -> Self {
        let script = match source {
            Source::Cluster { .. } | Source::ClusterPool { .. } => wire::CLUSTER_LUA,
            Source::Client { .. } | Source::Pool { .. } | Source::Sentinel(_) => wire::CHECK_LUA,
        };
        let functions = !matches!(source, Source::Cluster { .. } | Source::ClusterPool { .. });
        let script_source = script;
        let script = Script::new(script);
        Self {
            inner: Arc::new(Inner {
                script_source,
                source,
                library: wire::Library::new(),
                batch_script: Script::new(wire::BATCH_LUA),
                batcher: batch::Batcher::default(),
                functions: AtomicBool::new(functions),
                script,
                refund_script: Script::new(wire::CLUSTER_LUA),
                offset_us: AtomicI64::new(i64::MIN),
                origin: Instant::now(),
                budget_us: AtomicU64::new(0),
                settle_queue: std::sync::OnceLock::new(),
            }),
            clock: None,
            ttl_slack_ms: 0,
        }
    }

    /// Whether this backend talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(
            self.inner.source,
            Source::Cluster { .. } | Source::ClusterPool { .. }
        )
    }

    /// Makes the scripts use `clock` instead of Redis `TIME`. For tests only:
    /// in production every app server must use Redis's clock.
    #[must_use]
    pub fn with_manual_clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The manual clock, if one was set (the layer's deny cache and fallback
    /// then use it too).
    pub(crate) fn manual_clock(&self) -> Option<&ManualClock> {
        self.clock.as_ref()
    }

    /// The clock argument of the control scripts (`lua/plan.lua`,
    /// `lua/poll.lua`): the manual clock's µs, or "" (Redis `TIME`).
    fn script_clock(&self) -> String {
        self.clock
            .as_ref()
            .map(|c| c.now_us().to_string())
            .unwrap_or_default()
    }

    /// With a manual clock, adds `slack` to every key's TTL, so that Redis's
    /// real-time expiry never runs ahead of a test clock that advances slower
    /// than real time. Decisions never depend on a key outliving its TTL.
    /// Tests only (the `__testing` feature).
    #[cfg(feature = "__testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "__testing")))]
    #[must_use]
    pub fn with_test_ttl_slack(mut self, slack: Duration) -> Self {
        self.ttl_slack_ms = u64::try_from(slack.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// The `n` keys most rejected fleet-wide whose storage key starts with
    /// `key_prefix`, over the hourly sets `hours` (names), merged.
    pub(crate) async fn top_blocked(
        &self,
        sets: &[String],
        key_prefix: &str,
        n: usize,
    ) -> Result<Vec<(String, u64)>, BackendError> {
        let mut totals: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        for set in sets {
            let mut cmd = ::redis::cmd("ZRANGE");
            cmd.arg(set).arg(0).arg(-1).arg("WITHSCORES");
            let r: Result<Vec<(String, f64)>, RedisError> =
                cmd.query_async(&mut self.connection().await?).await;
            for (member, score) in r.map_err(BackendError::connection)? {
                if let Some(part) = member.strip_prefix(key_prefix) {
                    *totals.entry(part.to_owned()).or_default() += score.max(0.0) as u64;
                }
            }
        }
        let mut v: Vec<(String, u64)> = totals.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        Ok(v)
    }

    /// The SHA1 of the script, as used with `EVALSHA` (handy with
    /// `redis-cli SCRIPT EXISTS`). A cluster backend runs another script
    /// (the per-slot check and its refund), with its own SHA1.
    pub fn script_sha(&self) -> &str {
        self.inner.script.get_hash()
    }

    /// The source of the Redis Functions library that holds
    /// [`Self::function_name`], as `FUNCTION LOAD` takes it: for an operator
    /// who loads it ahead of a deploy, or with other credentials than the
    /// application's (whose ACL then needs only `FCALL`).
    ///
    /// ```sh
    /// redis-cli -x FUNCTION LOAD < library.lua   # "Library ... already exists" is fine
    /// ```
    pub fn function_library(&self) -> &str {
        &self.inner.library.source
    }

    /// The Lua source of the script [`Self::script_sha`] names, as
    /// `SCRIPT LOAD` takes it.
    pub fn script_source(&self) -> &str {
        self.inner.script_source
    }

    /// The name of the Redis Function the checks call with `FCALL` on a
    /// single Redis or a Sentinel primary (Redis ≥ 7): `trl_check_<v>`, in
    /// the library `tiered_ratelimit_<v>`, where `<v>` is the first 12 hex
    /// digits of the SHA1 of the library's body (the check and group
    /// commit's `trl_batch_<v>`). The backend loads the library itself
    /// (`FUNCTION LOAD`) when Redis answers that the function is missing;
    /// where Redis has no Functions or refuses to load them, checks run as
    /// `EVALSHA` of the same code. A cluster backend runs `EVALSHA`.
    pub fn function_name(&self) -> &str {
        &self.inner.library.function
    }
}
