//! Connections: the single-node connection (the URL's, shared as
//! `shared.rs` keeps it, one shared connection out of a deadpool pool, or
//! the primary that Redis Sentinel names), the cluster routes, running an
//! `EVALSHA` with its `NOSCRIPT` reload, and how a Redis error is classified.

use super::{cluster, RedisBackend, Source};
use crate::error::BackendError;
use ::redis::aio::MultiplexedConnection;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

/// A single node's connection, shared by every request.
pub(super) type Conn = MultiplexedConnection;

impl RedisBackend {
    /// Runs `cmd`, an `EVALSHA` of `script` or an `FCALL` of the library's
    /// check ([`wire::Library`]). On `NOSCRIPT` (Redis restarted, or
    /// `SCRIPT FLUSH`) loads the script and runs it once more; on "Function
    /// not found" (the first call, a restart, `FUNCTION FLUSH`) loads the
    /// library the same way. Where Redis has no Functions (Redis 6: "unknown
    /// command"), or refuses the library (an ACL without `FUNCTION`), this
    /// backend switches to `EVALSHA` of the same code for good, and this
    /// call is sent again that way.
    pub(super) async fn eval<T: ::redis::FromRedisValue>(
        &self,
        cmd: &Cmd,
        script: &Script,
        conn: &mut Conn,
    ) -> Result<T, RedisError> {
        match query(cmd, conn).await {
            // Boxed: the rare paths stay out of every check's future.
            Err(e) => Box::pin(self.recover(e, cmd, script, conn)).await,
            ok => ok,
        }
    }

    /// After `cmd` failed with `e`: the reloads and the switch to scripts
    /// of [`Self::eval`], or `e`.
    async fn recover<T: ::redis::FromRedisValue>(
        &self,
        e: RedisError,
        cmd: &Cmd,
        script: &Script,
        conn: &mut Conn,
    ) -> Result<T, RedisError> {
        if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) {
            load_script(script, conn).await?;
            return query(cmd, conn).await;
        }
        if has_detail(&e, "unknown command") && is_fcall(cmd) {
            tracing::info!(
                target: "tiered_ratelimit::redis",
                "Redis has no FCALL (Redis < 7): checks use EVALSHA"
            );
            self.inner.functions.store(false, Ordering::Relaxed);
            return self
                .eval_script(&as_evalsha(cmd, script), script, conn)
                .await;
        }
        if !has_detail(&e, "Function not found") {
            return Err(e);
        }
        let mut load = ::redis::cmd("FUNCTION");
        load.arg("LOAD").arg(&self.inner.library.source);
        match query::<String>(&load, conn).await {
            Ok(_) => query(cmd, conn).await,
            // Another instance of this release loaded it first.
            Err(e) if has_detail(&e, "Library") && has_detail(&e, "already exists") => {
                query(cmd, conn).await
            }
            Err(e) if e.is_io_error() || e.is_timeout() => Err(e),
            Err(e) => {
                tracing::warn!(
                    target: "tiered_ratelimit::redis",
                    error = %e,
                    "FUNCTION LOAD refused: checks use EVALSHA from now on"
                );
                self.inner.functions.store(false, Ordering::Relaxed);
                self.eval_script(&as_evalsha(cmd, script), script, conn)
                    .await
            }
        }
    }

    /// `cmd`, an `EVALSHA` of `script`, with the `NOSCRIPT` reload.
    async fn eval_script<T: ::redis::FromRedisValue>(
        &self,
        cmd: &Cmd,
        script: &Script,
        conn: &mut Conn,
    ) -> Result<T, RedisError> {
        match query(cmd, conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                load_script(script, conn).await?;
                query(cmd, conn).await
            }
            other => other,
        }
    }

    /// A Redis call's error (single node or cluster), as the layer
    /// classifies it: a broken, refused or timed-out connection, a cluster
    /// error or a node that cannot serve yet (master down, read-only,
    /// loading) is a connection error, anything else a script error.
    ///
    /// A connection that broke, or whose node answers `READONLY` (demoted),
    /// `MASTERDOWN` or `LOADING`, is forgotten on every single-node path:
    /// the next call connects afresh — to whatever the URL names now (a DNS
    /// name or a proxy that moved to the new primary), a fresh pooled
    /// connection, or the primary the sentinels name now. A node that is
    /// still the right one costs one reconnect.
    pub(super) fn error(&self, e: RedisError) -> BackendError {
        let broken = e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal();
        let unserving = matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::BusyLoading
            )
        );
        if broken || unserving {
            self.forget_connection();
        }
        if broken || unserving || e.is_timeout() || e.is_cluster_error() {
            BackendError::connection(e)
        } else {
            BackendError::script(e)
        }
    }

    pub(super) async fn connection(&self) -> Result<Conn, BackendError> {
        match &self.inner.source {
            Source::Client {
                client,
                connect_timeout,
                conn,
            } => {
                conn.get(|| {
                    // The layer's backend_timeout bounds every call.
                    let config = ::redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(*connect_timeout))
                        .set_response_timeout(None);
                    let client = client.clone();
                    async move { connect(&client, &config).await }
                })
                .await
            }
            Source::Pool { pool, conn } => {
                if let Some(c) = lock(conn).clone() {
                    return Ok(c);
                }
                // Boxed: deadpool's checkout future is kilobytes, and every
                // check's future would otherwise carry (and move) its room.
                let obj = Box::pin(pool.get())
                    .await
                    .map_err(BackendError::connection)?;
                let c = deadpool_redis::Connection::take(obj);
                *lock(conn) = Some(c.clone());
                Ok(c)
            }
            Source::Sentinel(s) => s.connection().await,
            Source::Cluster { .. } | Source::ClusterPool { .. } => Err(BackendError::Unsupported(
                "a cluster backend has no single-node connection".to_owned(),
            )),
        }
    }

    /// A deadpool cluster pool's shared connection (taken on first use).
    async fn cluster_connection(&self) -> Result<ClusterConnection, BackendError> {
        match &self.inner.source {
            Source::ClusterPool { pool, conn } => {
                if let Some(c) = lock(conn).clone() {
                    return Ok(c);
                }
                let obj = pool.get().await.map_err(BackendError::connection)?;
                let c = deadpool_redis::cluster::Connection::take(obj);
                *lock(conn) = Some(c.clone());
                Ok(c)
            }
            Source::Client { .. }
            | Source::Pool { .. }
            | Source::Cluster { .. }
            | Source::Sentinel(_) => Err(BackendError::Unsupported(
                "no redis-rs cluster connection".to_owned(),
            )),
        }
    }

    /// Where this cluster backend's script calls go: its router, or for a
    /// deadpool cluster pool the shared redis-rs cluster connection.
    pub(super) async fn cluster_via(&self) -> Result<cluster::Via, BackendError> {
        match &self.inner.source {
            Source::Cluster { router, .. } => Ok(cluster::Via::Router(router.clone())),
            _ => Ok(cluster::Via::Conn(self.cluster_connection().await?)),
        }
    }

    fn forget_connection(&self) {
        match &self.inner.source {
            Source::Pool { conn, .. } => *lock(conn) = None,
            Source::ClusterPool { conn, .. } => *lock(conn) = None,
            Source::Sentinel(s) => s.forget(),
            Source::Client { conn, .. } => conn.forget(),
            Source::Cluster { .. } => {}
        }
    }
}

/// Connects to the URL's Redis. A connect refused, reset or timed out is
/// tried again, 10 ms to 200 ms apart, six times (about 0.5 s of waits, as
/// redis-rs's `ConnectionManager` retried), so a Redis that is coming back
/// is found by the requests already waiting for it; an error Redis
/// answered (credentials, database) ends the connect at once.
async fn connect(
    client: &::redis::Client,
    config: &::redis::AsyncConnectionConfig,
) -> Result<MultiplexedConnection, RedisError> {
    let mut wait = Duration::from_millis(10);
    for _ in 0..6 {
        match client
            .get_multiplexed_async_connection_with_config(config)
            .await
        {
            Err(e) if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() => {
                tracing::debug!(target: "tiered_ratelimit::redis", error = %e, "connect failed; trying again in {wait:?}");
            }
            other => return other,
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(200));
    }
    client
        .get_multiplexed_async_connection_with_config(config)
        .await
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn query<T: ::redis::FromRedisValue>(cmd: &Cmd, conn: &mut Conn) -> Result<T, RedisError> {
    cmd.query_async(conn).await
}

async fn load_script(script: &Script, conn: &mut Conn) -> Result<(), RedisError> {
    script.load_async(conn).await?;
    Ok(())
}

/// Whether a Redis error reply's text (after its code) contains `text`.
fn has_detail(e: &RedisError, text: &str) -> bool {
    e.detail().is_some_and(|d| d.contains(text))
}

fn is_fcall(cmd: &Cmd) -> bool {
    matches!(cmd.args_iter().next(), Some(::redis::Arg::Simple(b"FCALL")))
}

/// The `EVALSHA` of `script` with the arguments of `cmd`, an `FCALL` of
/// the same code (its name dropped): for the switch to scripts.
fn as_evalsha(cmd: &Cmd, script: &Script) -> Cmd {
    let mut out = ::redis::cmd("EVALSHA");
    out.arg(script.get_hash());
    for a in cmd.args_iter().skip(2) {
        if let ::redis::Arg::Simple(b) = a {
            out.arg(b);
        }
    }
    out
}
