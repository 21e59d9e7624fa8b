//! Connections: the single-node connection (a `ConnectionManager`, one
//! shared connection out of a deadpool pool, or the primary that Redis
//! Sentinel names), the cluster routes, running an
//! `EVALSHA` with its `NOSCRIPT` reload, and how a Redis error is classified.

use super::{cluster, RedisBackend, Source};
use crate::error::BackendError;
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

/// A single node's connection, shared by every request.
pub(super) enum Conn {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
}

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
                manager,
            } => {
                if let Some(m) = &*manager.load() {
                    return Ok(Conn::Manager(ConnectionManager::clone(m)));
                }
                // Reconnect attempts back off to at most 200 ms apart, so a
                // Redis that comes back is found within a fraction of a second.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(*connect_timeout))
                    .set_response_timeout(None)
                    .set_max_delay(Duration::from_millis(200));
                let m = ConnectionManager::new_lazy_with_config(client.clone(), config)
                    .map_err(BackendError::connection)?;
                // Another request may have made one meanwhile: keep theirs.
                let none: Option<std::sync::Arc<ConnectionManager>> = None;
                let new = std::sync::Arc::new(m);
                let prev = manager.compare_and_swap(&none, Some(new.clone()));
                let m = prev.as_ref().map_or(new, std::sync::Arc::clone);
                Ok(Conn::Manager(ConnectionManager::clone(&m)))
            }
            Source::Pool { pool, conn } => {
                if let Some(c) = lock(conn).clone() {
                    return Ok(Conn::Multiplexed(c));
                }
                // Boxed: deadpool's checkout future is kilobytes, and every
                // check's future would otherwise carry (and move) its room.
                let obj = Box::pin(pool.get())
                    .await
                    .map_err(BackendError::connection)?;
                let c = deadpool_redis::Connection::take(obj);
                *lock(conn) = Some(c.clone());
                Ok(Conn::Multiplexed(c))
            }
            Source::Sentinel(s) => s.connection().await.map(Conn::Multiplexed),
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
            Source::Client { manager, .. } => manager.store(None),
            Source::Cluster { .. } => {}
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn query<T: ::redis::FromRedisValue>(cmd: &Cmd, conn: &mut Conn) -> Result<T, RedisError> {
    match conn {
        Conn::Manager(m) => cmd.query_async(m).await,
        Conn::Multiplexed(m) => cmd.query_async(m).await,
    }
}

async fn load_script(script: &Script, conn: &mut Conn) -> Result<(), RedisError> {
    match conn {
        Conn::Manager(m) => script.load_async(m).await?,
        Conn::Multiplexed(m) => script.load_async(m).await?,
    };
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
