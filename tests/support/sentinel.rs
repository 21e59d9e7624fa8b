//! Redis Sentinel of our own: a primary, one replica and three sentinels
//! (`redis-sentinel <conf>`, or `redis-server <conf> --sentinel` when the
//! Debian package `redis-sentinel` is not installed: it is the same binary),
//! all on free loopback ports, killed (and their directory removed) on drop.

use super::redis_server::{command, connect, free_port, RedisServer};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The monitored master's name.
pub const MASTER: &str = "mymaster";
/// Milliseconds of silence before a sentinel deems the primary down: short,
/// so a killed primary is replaced in about two seconds.
pub const DOWN_AFTER_MS: u64 = 500;
/// The sentinels' `failover-timeout` (also the least time between two
/// failovers of the master).
pub const FAILOVER_TIMEOUT_MS: u64 = 2000;

static SEQ: AtomicU32 = AtomicU32::new(0);

pub struct SentinelSet {
    pub primary: RedisServer,
    pub replica: RedisServer,
    sentinels: Vec<(u16, Child)>,
    dir: PathBuf,
}

impl SentinelSet {
    /// A primary, its replica (in sync) and three sentinels with quorum 2
    /// that all know each other and the replica: ready for a failover.
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tiered-ratelimit-sentinel-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("sentinel temp dir");
        // A replica's full sync goes through an RDB file on disk: in a
        // directory of each node's own, not the tests' working directory.
        let node_dir = |name: &str| {
            let d = dir.join(name);
            std::fs::create_dir_all(&d).expect("node dir");
            d.to_str().expect("a UTF-8 temp dir").to_owned()
        };
        let primary = RedisServer::start_with(&["--dir", &node_dir("primary")]);
        let port = primary.port().to_string();
        let replica = RedisServer::start_with(&[
            "--dir",
            &node_dir("replica"),
            "--replicaof",
            "127.0.0.1",
            &port,
        ]);
        let mut set = SentinelSet {
            primary,
            replica,
            sentinels: Vec::new(),
            dir,
        };
        wait_until(Duration::from_secs(10), "the replica in sync", || {
            info(set.replica.port(), "replication")
                .get("master_link_status")
                .is_some_and(|s| s == "up")
        });
        for _ in 0..3 {
            let (port, child) = set.spawn_sentinel();
            set.sentinels.push((port, child));
        }
        // Sentinels find each other through the primary's hello channel
        // (every 2 s) and the replica through its INFO: wait until each one
        // sees the other two and the replica, or a failover could not
        // reach its quorum.
        wait_until(
            Duration::from_secs(20),
            "sentinels that know each other",
            || {
                set.sentinels.iter().all(|(port, _)| {
                    let m = set.master_state(*port);
                    m.get("num-other-sentinels").map(String::as_str) == Some("2")
                        && m.get("num-slaves").map(String::as_str) == Some("1")
                        && m.get("flags").map(String::as_str) == Some("master")
                })
            },
        );
        set
    }

    fn spawn_sentinel(&self) -> (u16, Child) {
        for _ in 0..5 {
            let port = free_port();
            let conf = self.dir.join(format!("sentinel-{port}.conf"));
            let text = format!(
                "port {port}\n\
                 bind 127.0.0.1\n\
                 daemonize no\n\
                 loglevel warning\n\
                 logfile \"\"\n\
                 dir {dir}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n\
                 sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n\
                 sentinel parallel-syncs {MASTER} 1\n",
                dir = self.dir.display(),
                primary = self.primary.port(),
            );
            std::fs::write(&conf, text).expect("sentinel config");
            let mut child = spawn_sentinel_process(&conf);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // port taken between probe and bind
                }
                let ping: redis::RedisResult<String> =
                    connect(port).and_then(|mut c| redis::cmd("PING").query(&mut c));
                if ping.is_ok() {
                    return (port, child);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("could not start a sentinel on a free port after 5 tries");
    }

    /// The sentinels' URLs, for `RedisBackend::sentinel`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|(port, _)| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    /// `SENTINEL MASTER <MASTER>` on the sentinel at `port` as field →
    /// value (empty when it cannot answer).
    pub fn master_state(&self, port: u16) -> HashMap<String, String> {
        connect(port)
            .and_then(|mut c| command(&["SENTINEL", "MASTER", MASTER]).query(&mut c))
            .unwrap_or_default()
    }

    /// The sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|(port, _)| *port).collect()
    }

    /// The primary's port as the first sentinel names it now.
    pub fn named_primary(&self) -> Option<u16> {
        named_primary(*self.sentinel_ports().first()?)
    }
}

/// The primary's port as the sentinel on `port` names it now.
pub fn named_primary(port: u16) -> Option<u16> {
    let addr: Vec<String> = connect(port)
        .and_then(|mut c| command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER]).query(&mut c))
        .ok()?;
    addr.get(1)?.parse().ok()
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for (_, child) in &mut self.sentinels {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-sentinel <conf>` if the Debian package is installed, else
/// `redis-server <conf> --sentinel` (the same program).
fn spawn_sentinel_process(conf: &std::path::Path) -> Child {
    let quiet = |c: &mut Command| {
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
    };
    let mut c = Command::new("redis-sentinel");
    c.arg(conf);
    quiet(&mut c);
    match c.spawn() {
        Ok(child) => return child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("cannot start redis-sentinel: {e}"),
    }
    let mut c = Command::new("redis-server");
    c.arg(conf).arg("--sentinel");
    quiet(&mut c);
    c.spawn().unwrap_or_else(|e| {
        panic!(
            "cannot start redis-server --sentinel ({e}): install the Debian packages \
             `redis-server` and `redis-sentinel`"
        )
    })
}

/// `INFO <section>` (sections may be several, space-separated) of the node
/// on `port` as field → value (empty when it cannot answer).
pub fn info(port: u16, sections: &str) -> HashMap<String, String> {
    let mut args = vec!["INFO"];
    args.extend(sections.split_whitespace());
    let text: String = connect(port)
        .and_then(|mut c| command(&args).query(&mut c))
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// Polls `ok` every 50 ms until it holds; panics naming `what` after `within`.
fn wait_until(within: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "no {what} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
