//! Peek and reset of one key: a read-only script call (`EVALSHA_RO` of
//! `lua/peek.lua`, plain `EVALSHA` on a Redis older than 7.0), and `DEL`.
//! On a cluster both go to the key's slot, under the same hash tag as the
//! check's.

use super::cluster::{self, cluster_key, Via};
use super::connection::Conn;
use super::router::slot_of;
use super::wire::{self, CheckReply, PEEK_LUA};
use super::RedisBackend;
use crate::backend::{Shadow, TierCheck, Verdict};
use crate::error::BackendError;
use ::redis::{Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The peek script (one per process: it never changes).
fn script() -> &'static Script {
    static SCRIPT: OnceLock<Script> = OnceLock::new();
    SCRIPT.get_or_init(|| Script::new(PEEK_LUA))
}

/// Set once a Redis answered that it has no `EVALSHA_RO` (before 7.0):
/// every later peek of this process uses `EVALSHA`.
static NO_RO: AtomicBool = AtomicBool::new(false);

fn unknown_command(e: &RedisError) -> bool {
    e.to_string()
        .to_ascii_lowercase()
        .contains("unknown command")
}

impl RedisBackend {
    /// The decision `check` would get now, with nothing charged.
    pub(crate) async fn peek(&self, check: &TierCheck) -> Result<Verdict, BackendError> {
        let key = self.storage_key(&check.key);
        let clock = self.clock_arg();
        let spec = wire::TierSpec::new(check, 0);
        let build = |eval: bool, ro: bool| -> Cmd {
            let mut cmd = match (eval, ro) {
                (false, true) => ::redis::cmd("EVALSHA_RO"),
                (false, false) => ::redis::cmd("EVALSHA"),
                (true, true) => ::redis::cmd("EVAL_RO"),
                (true, false) => ::redis::cmd("EVAL"),
            };
            if eval {
                cmd.arg(PEEK_LUA);
            } else {
                cmd.arg(script().get_hash());
            }
            cmd.arg(1)
                .arg(key.as_str())
                .arg(clock.as_bytes())
                .arg(spec.as_bytes());
            cmd
        };
        let mut target = self.target().await?;
        let mut ro = !NO_RO.load(Ordering::Relaxed);
        let reply: Vec<i64> = loop {
            match self
                .call_on(&mut target, &key, script(), |eval| build(eval, ro))
                .await
            {
                Err(e) if ro && unknown_command(&e) => {
                    NO_RO.store(true, Ordering::Relaxed);
                    ro = false;
                }
                other => break other.map_err(|e| self.error(e))?,
            }
        };
        // lua/peek.lua answers long, whatever the flags.
        match wire::parse_check(&reply, &[wire::ReplyTier::from(check)], 0, Shadow::NONE)? {
            CheckReply::Decided(mut v) => {
                v.charges.clear();
                Ok(v)
            }
            CheckReply::Late => Err(BackendError::Reply(
                "a peek without a deadline answered late".to_owned(),
            )),
        }
    }

    /// One call of `script` on the node of `key` (`build(false)` its
    /// `…SHA` form, `build(true)` the same call with the script's text),
    /// reloading it on `NOSCRIPT`.
    pub(super) async fn call_on<T: ::redis::FromRedisValue>(
        &self,
        target: &mut Target,
        key: &str,
        script: &Script,
        build: impl Fn(bool) -> Cmd,
    ) -> RedisResult<T> {
        match target {
            Target::Node(conn) => self.eval(&build(false), script, conn).await,
            Target::Cluster(Via::Router(router)) => {
                let reply = router.call(slot_of(key.as_bytes()), build).await?;
                ::redis::from_redis_value(reply).map_err(Into::into)
            }
            Target::Cluster(Via::Conn(conn)) => match build(false).query_async(conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    build(true).query_async(conn).await
                }
                other => other,
            },
        }
    }

    /// Deletes `key`'s state: the next request finds a fresh key. Whether
    /// there was one.
    pub(crate) async fn reset(&self, key: &str) -> Result<bool, BackendError> {
        let key = self.storage_key(key);
        let deleted: i64 = self.command_on(&key, ::redis::cmd("DEL").arg(&key)).await?;
        Ok(deleted > 0)
    }

    /// A layer key as stored: on a cluster, the whole key as hash tag.
    pub(super) fn storage_key(&self, key: &str) -> String {
        if self.is_cluster() {
            cluster_key(key)
        } else {
            key.to_owned()
        }
    }
}

/// Where a call for one key goes: a single node's connection, or the
/// cluster.
pub(super) enum Target {
    Node(Conn),
    Cluster(Via),
}

impl RedisBackend {
    pub(super) async fn target(&self) -> Result<Target, BackendError> {
        Ok(if self.is_cluster() {
            Target::Cluster(self.cluster_via().await?)
        } else {
            Target::Node(self.connection().await?)
        })
    }

    /// One plain command (not a script) for `key` (as given: on a cluster,
    /// already hash-tagged).
    pub(super) async fn command_on<T: ::redis::FromRedisValue>(
        &self,
        key: &str,
        cmd: &Cmd,
    ) -> Result<T, BackendError> {
        let r = match &mut self.target().await? {
            Target::Node(m) => cmd.query_async(m).await,
            Target::Cluster(via) => cluster::command(via, key, cmd).await,
        };
        r.map_err(|e| self.error(e))
    }
}

/// A script's call head: `EVALSHA <sha>`, or `EVAL <source>` when
/// `with_source` (the same call sent again after a `NOSCRIPT`: `call_on`).
pub(super) fn script_cmd(with_source: bool, script: &Script, source: &str) -> Cmd {
    if with_source {
        let mut c = ::redis::cmd("EVAL");
        c.arg(source);
        c
    } else {
        let mut c = ::redis::cmd("EVALSHA");
        c.arg(script.get_hash());
        c
    }
}
