//! Routing of the cluster script calls (checks and refunds) by hash slot,
//! on connections of our own rather than redis-rs's cluster connection.
//!
//! Why: redis-rs 1.8.1's `cluster_async::ClusterConnection` wedges under a
//! live reshard. After a `MOVED` it refreshes its slot map in
//! `refresh_slots`, which waits for `conn_lock.write()`; request futures
//! that hold read permits are not polled while the connection recovers, so
//! under load the write lock is never granted and the shared connection
//! answers nothing again. It also answers `ASK` by sending `ASKING` as a
//! command of its own on the shared node connection, so a concurrent
//! command to that node can take the one-shot flag first.
//!
//! Here:
//! * The slot map is ours: `CLUSTER SLOTS` read from any reachable node,
//!   held in an [`ArcSwap`] (never locked across an await), refreshed in
//!   the background, one refresh at a time, never awaited by a call.
//! * One `MultiplexedConnection` per primary address, created on first use
//!   (one connect at a time per address), dropped when it fails.
//! * `MOVED` updates that slot, schedules a refresh and goes to the named
//!   node; `ASK` sends `ASKING` and the call as **one** pipeline on the
//!   named node's connection, so nothing comes between them; `NOSCRIPT`
//!   sends the same call as `EVAL` to the same node; `TRYAGAIN`,
//!   `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY` (its connection
//!   dropped too) and failed connects wait
//!   [`MIN_WAIT`], doubling up to [`MAX_WAIT`], refresh the map and go
//!   again. A redirected, refused or unconnected call did not run, so
//!   following it charges nothing twice. A connection that breaks after the
//!   call was written is **not** retried (the script may have run): the
//!   error goes to the caller, the connection is dropped and the map
//!   refreshed.
//!
//! At most [`ATTEMPTS`] attempts per call; the layer's `backend_timeout`
//! bounds a check however many there are.

use ::redis::aio::MultiplexedConnection;
use ::redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    RedisError, RedisResult, ServerErrorKind, Value,
};
use arc_swap::ArcSwap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::OnceCell;

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16384;
/// No known owner.
const NONE: u16 = u16::MAX;
/// How long connecting to a node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a node may take to answer `CLUSTER SLOTS`.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(1);
/// Attempts of one call: the first, then redirections and retries.
pub(super) const ATTEMPTS: u32 = 16;
/// The first wait before a retry; it doubles per retry up to [`MAX_WAIT`].
pub(super) const MIN_WAIT: Duration = Duration::from_millis(5);
/// The longest wait between two attempts.
pub(super) const MAX_WAIT: Duration = Duration::from_millis(200);
/// At most this many node connections are kept; past it the map starts
/// over (nodes that left the cluster are forgotten this way).
const MAX_CONNECTIONS: usize = 64;

/// Which node serves each slot, as `host:port` indices into `nodes`.
struct SlotMap {
    nodes: Vec<Arc<str>>,
    owner: Box<[u16]>,
}

impl SlotMap {
    fn empty() -> Self {
        Self {
            nodes: Vec::new(),
            owner: vec![NONE; SLOTS].into_boxed_slice(),
        }
    }

    fn get(&self, slot: u16) -> Option<Arc<str>> {
        let i = *self.owner.get(usize::from(slot))?;
        self.nodes.get(usize::from(i)).cloned()
    }

    fn index(&mut self, addr: &str) -> u16 {
        match self.nodes.iter().position(|n| &**n == addr) {
            Some(i) => u16::try_from(i).unwrap_or(NONE),
            None => {
                self.nodes.push(Arc::from(addr));
                u16::try_from(self.nodes.len() - 1).unwrap_or(NONE)
            }
        }
    }

    /// This map with `slot` served by `addr`.
    fn with(&self, slot: u16, addr: &str) -> Self {
        let mut m = Self {
            nodes: self.nodes.clone(),
            owner: self.owner.clone(),
        };
        let i = m.index(addr);
        if let Some(o) = m.owner.get_mut(usize::from(slot)) {
            *o = i;
        }
        m
    }
}

type Slot = Arc<OnceCell<MultiplexedConnection>>;

/// The script calls' router of one cluster backend (see the module docs).
pub(crate) struct Router {
    /// Credentials, TLS and protocol of the first node URL; only the
    /// address is replaced per node.
    template: ConnectionInfo,
    /// The configured nodes (`host:port`): where the map is read first, and
    /// where calls go while the map knows no owner.
    seeds: Vec<Arc<str>>,
    map: ArcSwap<SlotMap>,
    conns: Mutex<HashMap<Arc<str>, Slot>>,
    refreshing: AtomicBool,
}

impl Router {
    /// A router for the cluster that `nodes` (URLs) belong to; connects
    /// nothing yet.
    pub(super) fn new(nodes: &[String]) -> RedisResult<Self> {
        let mut template = None;
        let mut seeds = Vec::new();
        for n in nodes {
            let info = n.as_str().into_connection_info()?;
            let (host, port) = match info.addr() {
                ConnectionAddr::Tcp(h, p)
                | ConnectionAddr::TcpTls {
                    host: h, port: p, ..
                } => (h.clone(), *p),
                _ => return Err((ErrorKind::InvalidClientConfig, "cluster nodes need TCP").into()),
            };
            seeds.push(Arc::from(format!("{host}:{port}")));
            template.get_or_insert(info);
        }
        let template = template.ok_or((ErrorKind::InvalidClientConfig, "no cluster node URL"))?;
        Ok(Self {
            template,
            seeds,
            map: ArcSwap::from_pointee(SlotMap::empty()),
            conns: Mutex::new(HashMap::new()),
            refreshing: AtomicBool::new(false),
        })
    }

    /// One script call for the keys of `slot`: `build(false)` is the
    /// `EVALSHA`, `build(true)` the same call as `EVAL`. Returns the reply,
    /// an error reply as `Err`.
    pub(super) async fn call(
        self: &Arc<Self>,
        slot: u16,
        build: impl Fn(bool) -> Cmd,
    ) -> RedisResult<Value> {
        let mut redirect: Option<(Arc<str>, bool)> = None; // (node, asking)
        let mut eval = false;
        let mut wait = MIN_WAIT;
        let mut seed = usize::from(slot);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (addr, asking) = match &redirect {
                Some((a, asking)) => (a.clone(), *asking),
                None => match self.map.load().get(slot) {
                    Some(a) => (a, false),
                    None => {
                        // No map yet: any node answers MOVED with the owner.
                        self.schedule_refresh();
                        seed += 1;
                        (self.seeds[seed % self.seeds.len()].clone(), false)
                    }
                },
            };
            let err = match self.connection(&addr).await {
                Err(e) => e, // not sent: safe to retry
                Ok(mut conn) => match send(&mut conn, build(eval), asking).await {
                    Ok(v) => return Ok(v),
                    Err(e) if is_broken(&e) || e.is_timeout() => {
                        // Written, maybe run: not retried.
                        self.drop_connection(&addr);
                        self.schedule_refresh();
                        return Err(e);
                    }
                    Err(e) => e,
                },
            };
            if attempt >= ATTEMPTS {
                return Err(err);
            }
            match err.kind() {
                ErrorKind::Server(ServerErrorKind::Moved) => {
                    let (to, at) = redirected(&err)?;
                    self.map.rcu(|m| m.with(at, &to));
                    self.schedule_refresh();
                    redirect = Some((to, false));
                    eval = false;
                }
                ErrorKind::Server(ServerErrorKind::Ask) => {
                    let (to, _) = redirected(&err)?;
                    redirect = Some((to, true));
                    eval = false;
                }
                ErrorKind::Server(ServerErrorKind::NoScript) if !eval => {
                    // The same node (and ASKING again if it was asked).
                    redirect = Some((addr, asking));
                    eval = true;
                }
                ErrorKind::Server(
                    ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading,
                ) => {
                    self.back_off(&mut wait).await;
                    redirect = None;
                }
                ErrorKind::Server(ServerErrorKind::ReadOnly) => {
                    // A node demoted behind an address that now names a
                    // replica: a script refused there wrote nothing. Drop
                    // the connection, refresh the map and go again.
                    self.drop_connection(&addr);
                    self.back_off(&mut wait).await;
                    redirect = None;
                }
                _ if is_broken(&err) || err.is_timeout() => {
                    // Only a connect fails this way here (a written call's
                    // broken connection returned above): nothing was sent.
                    self.drop_connection(&addr);
                    self.back_off(&mut wait).await;
                    redirect = None;
                }
                _ => return Err(err),
            }
        }
    }

    async fn back_off(self: &Arc<Self>, wait: &mut Duration) {
        self.schedule_refresh();
        tokio::time::sleep(*wait).await;
        *wait = (*wait * 2).min(MAX_WAIT);
    }

    /// The connection to `addr` (`host:port`), connecting if there is none
    /// (one connect at a time per address; the others wait for it).
    async fn connection(&self, addr: &Arc<str>) -> RedisResult<MultiplexedConnection> {
        let cell = {
            let mut conns = lock(&self.conns);
            if !conns.contains_key(addr) && conns.len() >= MAX_CONNECTIONS {
                conns.clear();
            }
            conns.entry(addr.clone()).or_default().clone()
        };
        cell.get_or_try_init(|| self.connect(addr)).await.cloned()
    }

    async fn connect(&self, addr: &str) -> RedisResult<MultiplexedConnection> {
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            .ok_or((ErrorKind::Client, "bad node address"))?;
        let at = match self.template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        let client = ::redis::Client::open(self.template.clone().set_addr(at))?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(None);
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    fn drop_connection(&self, addr: &Arc<str>) {
        lock(&self.conns).remove(addr);
    }

    /// Starts a background refresh of the slot map unless one is running.
    fn schedule_refresh(self: &Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            this.refresh().await;
            // At most one refresh per few ms, however many calls ask.
            tokio::time::sleep(MIN_WAIT).await;
            this.refreshing.store(false, Ordering::Release);
        });
    }

    /// Reads `CLUSTER SLOTS` from the first node that answers (the known
    /// nodes, then the configured ones) and installs it.
    async fn refresh(&self) {
        let mut candidates: Vec<Arc<str>> = self.map.load().nodes.clone();
        for s in &self.seeds {
            if !candidates.contains(s) {
                candidates.push(s.clone());
            }
        }
        for addr in candidates {
            let read = async {
                let mut conn = self.connection(&addr).await?;
                ::redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn)
                    .await
            };
            match tokio::time::timeout(REFRESH_TIMEOUT, read).await {
                Ok(Ok(v)) => {
                    if let Some(m) = parse_slots(&v, &addr) {
                        self.map.store(Arc::new(m));
                        return;
                    }
                }
                Ok(Err(e)) if is_broken(&e) => self.drop_connection(&addr),
                _ => {}
            }
        }
    }
}

/// `cmd`, after `ASKING` in one pipeline if `asking`.
async fn send(conn: &mut MultiplexedConnection, cmd: Cmd, asking: bool) -> RedisResult<Value> {
    if !asking {
        return cmd.query_async(conn).await;
    }
    let mut pipe = ::redis::pipe();
    pipe.cmd("ASKING").add_command(cmd).ignore_errors();
    let mut replies: Vec<Value> = pipe.query_async(conn).await?;
    match (replies.pop(), replies.pop()) {
        (Some(reply), Some(asked)) => {
            asked.extract_error()?;
            reply.extract_error()
        }
        _ => Err((ErrorKind::Parse, "ASKING pipeline: expected 2 replies").into()),
    }
}

fn is_broken(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// The node (`host:port`) and slot of a `MOVED`/`ASK`.
fn redirected(e: &RedisError) -> RedisResult<(Arc<str>, u16)> {
    let (addr, slot) = e
        .redirect_node()
        .ok_or((ErrorKind::Parse, "redirect without a node"))?;
    Ok((Arc::from(addr), slot))
}

/// A `CLUSTER SLOTS` reply from the node at `from` as a slot map (an empty
/// host means `from`'s host); `None` when it is malformed or covers nothing.
fn parse_slots(v: &Value, from: &str) -> Option<SlotMap> {
    let from_host = from.rsplit_once(':').map_or(from, |(h, _)| h);
    let Value::Array(ranges) = v else { return None };
    let mut m = SlotMap::empty();
    for r in ranges {
        let Value::Array(r) = r else { return None };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
            (r.first(), r.get(1), r.get(2))
        else {
            return None;
        };
        let host = match primary.first()? {
            Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            Value::SimpleString(s) => s.clone(),
            Value::Nil => String::new(),
            _ => return None,
        };
        let Some(Value::Int(port)) = primary.get(1) else {
            return None;
        };
        let host = if host.is_empty() || host == "?" {
            from_host
        } else {
            &host
        };
        let i = m.index(&format!("{host}:{port}"));
        let (start, end) = (usize::try_from(*start).ok()?, usize::try_from(*end).ok()?);
        for o in m.owner.get_mut(start..=end)? {
            *o = i;
        }
    }
    (!m.nodes.is_empty()).then_some(m)
}

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag (the bytes
/// between the first `{` and the next `}`, if not empty), else of the whole
/// key, modulo 16384.
pub(super) fn slot_of(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn slots_agree_with_redis_rs() {
        use ::redis::cluster_routing::Slot as RsSlot;
        for k in [
            "{rl:user:alice}",
            "a{}b",
            "{}",
            "x{y}z{w}",
            "plain",
            "{a",
            "",
            "{rl:global:all}",
        ] {
            assert_eq!(
                RsSlot::new(slot_of(k.as_bytes())),
                Some(RsSlot::for_key(k)),
                "{k}"
            );
        }
        // The CRC16/XMODEM check value (below 16384, so the slot itself).
        assert_eq!(slot_of(b"123456789"), 0x31c3);
    }

    #[test]
    fn cluster_slots_reply_becomes_the_map() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("10.0.0.1"), Value::Int(7000), bulk("id1")]),
                Value::Array(vec![bulk("10.0.0.4"), Value::Int(7003), bulk("id4")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                Value::Array(vec![bulk(""), Value::Int(7001), bulk("id2")]),
            ]),
        ]);
        let m = parse_slots(&reply, "10.0.0.9:7002").expect("a map");
        assert_eq!(m.get(0).as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(m.get(5460).as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(m.get(5461).as_deref(), Some("10.0.0.9:7001"));
        assert_eq!(m.get(16383).as_deref(), Some("10.0.0.9:7001"));
        let moved = m.with(5461, "10.0.0.1:7000");
        assert_eq!(moved.get(5461).as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(moved.get(5462).as_deref(), Some("10.0.0.9:7001"));
        assert_eq!(moved.nodes.len(), 2);
        assert!(parse_slots(&Value::Array(vec![]), "a:1").is_none());
    }
}
