//! A real Redis Cluster of our own: `redis-server --cluster-enabled yes`
//! processes on free loopback ports in a temporary directory, joined with
//! `redis-cli --cluster create`, all killed (and the directory removed) on
//! drop.

use super::redis_server::{command, commandstat, connect, redis_server};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Milliseconds before a silent node is marked failing (and its replica may
/// take over): short, so a killed primary is replaced in a few seconds.
pub const NODE_TIMEOUT_MS: u64 = 2000;

pub struct ClusterNode {
    pub port: u16,
    bus: u16,
    child: Option<Child>,
}

pub struct RedisCluster {
    dir: PathBuf,
    pub nodes: Vec<ClusterNode>,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Runs a command on one node.
pub fn node_cmd<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    command(args).query(&mut connect(port)?)
}

/// `INFO <section>` of one node as key → value.
pub fn info(port: u16, section: &str) -> HashMap<String, String> {
    let text: String = node_cmd(port, &["INFO", section]).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// `calls` of a command in `INFO commandstats` (0 if never called).
pub fn calls(port: u16, command: &str) -> u64 {
    stat(port, command, "calls")
}

/// `failed_calls` of a command in `INFO commandstats`.
pub fn failed_calls(port: u16, command: &str) -> u64 {
    stat(port, command, "failed_calls")
}

fn stat(port: u16, command: &str, field: &str) -> u64 {
    // A node that cannot answer reads as 0 calls (as `info` does).
    let text: String = node_cmd(port, &["INFO", "commandstats"]).unwrap_or_default();
    commandstat(&text, command, field)
}

impl RedisCluster {
    /// Three primaries, each with `replicas` replicas.
    pub fn start(replicas: usize) -> Self {
        for attempt in 0..3 {
            match Self::try_start(3, replicas) {
                Ok(c) => return c,
                Err(e) => eprintln!("cluster start attempt {attempt} failed: {e}"),
            }
        }
        panic!("could not start a Redis Cluster after 3 attempts");
    }

    fn try_start(primaries: usize, replicas: usize) -> Result<Self, String> {
        let n = primaries * (1 + replicas);
        let dir = std::env::temp_dir().join(format!(
            "tiered-ratelimit-cluster-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("temp dir: {e}"))?;
        let ports = super::redis_server::free_ports(2 * n);
        let mut cluster = RedisCluster {
            dir: dir.clone(),
            nodes: Vec::new(),
        };
        for i in 0..n {
            let (port, bus) = (ports[2 * i], ports[2 * i + 1]);
            let child = spawn_node(&dir, port, bus)?;
            cluster.nodes.push(ClusterNode {
                port,
                bus,
                child: Some(child),
            });
        }
        cluster.wait_pings()?;
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut create = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("redis-cli: {e}"))?;
        // `redis-cli --cluster create` sends each node one CLUSTER MEET and
        // then waits, with no deadline, until every node knows every other.
        // On a loaded machine a handshake can time out (a node forgets a
        // peer it was meeting) and the wait never ends: after ten seconds,
        // every node meets every other again, which completes the join.
        let started = Instant::now();
        let status = loop {
            if let Some(status) = create.try_wait().map_err(|e| format!("redis-cli: {e}"))? {
                break status;
            }
            if started.elapsed() > Duration::from_secs(120) {
                let _ = create.kill();
                return Err("redis-cli --cluster create: no join within 120 s".into());
            }
            // Well after its own MEETs (it sends them within a second or
            // two): ours must not precede its slot and epoch set-up.
            if started.elapsed() > Duration::from_secs(10) {
                cluster.meet_all();
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        let out = create
            .wait_with_output()
            .map_err(|e| format!("redis-cli: {e}"))?;
        if !status.success() {
            return Err(format!(
                "redis-cli --cluster create: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        cluster.wait_healthy(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// Every node meets every other (`CLUSTER MEET ip port bus-port`); a
    /// node that does not answer is skipped.
    fn meet_all(&self) {
        for a in &self.nodes {
            let Ok(mut c) = connect(a.port) else { continue };
            for b in self.nodes.iter().filter(|b| b.port != a.port) {
                let _: redis::RedisResult<()> = command(&[
                    "CLUSTER",
                    "MEET",
                    "127.0.0.1",
                    &b.port.to_string(),
                    &b.bus.to_string(),
                ])
                .query(&mut c);
            }
        }
    }

    fn wait_pings(&mut self) -> Result<(), String> {
        for node in &mut self.nodes {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                if let Some(c) = node.child.as_mut() {
                    if let Ok(Some(status)) = c.try_wait() {
                        return Err(format!("node {} exited: {status}", node.port));
                    }
                }
                if node.child.is_none() || node_cmd::<String>(node.port, &["PING"]).is_ok() {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("node {} did not answer PING", node.port));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// Kills every node, then starts them again on the same ports with their
    /// cluster config files (same node IDs and slots; the data is gone), and
    /// waits until the cluster is healthy.
    pub fn restart_all(&mut self) {
        self.stop_all();
        for n in &mut self.nodes {
            n.child = Some(spawn_node(&self.dir, n.port, n.bus).expect("restart a node"));
        }
        self.wait_pings().expect("nodes answer after a restart");
        self.wait_healthy(Duration::from_secs(30))
            .expect("healthy after a restart");
    }

    /// Kills every node (SIGKILL); [`RedisCluster::restart_all`] brings them back.
    pub fn stop_all(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Waits until every live node says `cluster_state:ok`, knows every
    /// live node, agrees on the slot owners, and every replica's link is up.
    pub fn wait_healthy(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.health() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("cluster not healthy after {within:?}: {last}"))
    }

    fn health(&self) -> Result<(), String> {
        let live: Vec<u16> = self.live_ports();
        let mut owners: Option<Vec<(u16, u16, u16)>> = None;
        for &p in &live {
            let ci = info_cluster(p)?;
            if ci.get("cluster_state").map(String::as_str) != Some("ok") {
                return Err(format!("{p}: cluster_state {:?}", ci.get("cluster_state")));
            }
            let nodes = cluster_nodes(p)?;
            let known = nodes
                .iter()
                .filter(|n| !n.flags.contains("fail") && !n.flags.contains("handshake"))
                .count();
            if known < live.len() {
                return Err(format!("{p}: knows {known} of {} nodes", live.len()));
            }
            let mut o: Vec<(u16, u16, u16)> = nodes
                .iter()
                .filter(|n| n.flags.contains("master") && !n.flags.contains("fail"))
                .flat_map(|n| n.slots.iter().map(move |&(a, b)| (a, b, n.port)))
                .collect();
            o.sort();
            match &owners {
                None => owners = Some(o),
                Some(prev) if *prev != o => return Err(format!("{p}: slot owners differ")),
                Some(_) => {}
            }
            let r = info(p, "replication");
            if r.get("role").map(String::as_str) == Some("slave")
                && r.get("master_link_status").map(String::as_str) != Some("up")
            {
                return Err(format!("{p}: replica link down"));
            }
        }
        match owners {
            Some(o) if o.iter().map(|(a, b, _)| u32::from(b - a) + 1).sum::<u32>() == 16384 => {
                Ok(())
            }
            _ => Err("not every slot is served".to_owned()),
        }
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// `redis://127.0.0.1:<port>` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// The slot of a Redis key, as the cluster computes it.
    pub fn keyslot(&self, key: &str) -> u16 {
        let p = self.live_ports()[0];
        let slot: i64 = node_cmd(p, &["CLUSTER", "KEYSLOT", key]).expect("CLUSTER KEYSLOT");
        u16::try_from(slot).expect("slot")
    }

    /// The port of the primary serving `key`'s slot, as the nodes see it now.
    pub fn primary_of(&self, key: &str) -> u16 {
        let slot = self.keyslot(key);
        let p = self.live_ports()[0];
        cluster_nodes(p)
            .expect("CLUSTER NODES")
            .into_iter()
            .find(|n| {
                n.flags.contains("master")
                    && !n.flags.contains("fail")
                    && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
            })
            .map(|n| n.port)
            .expect("a primary for the slot")
    }

    /// The ports of the replicas of the primary at `port`.
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        let p = self.live_ports()[0];
        let nodes = cluster_nodes(p).expect("CLUSTER NODES");
        let id = nodes
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.id.clone())
            .expect("primary id");
        nodes
            .into_iter()
            .filter(|n| n.master_id == id && !n.flags.contains("fail"))
            .map(|n| n.port)
            .collect()
    }

    /// The ports of the primaries.
    pub fn primaries(&self) -> Vec<u16> {
        let p = self.live_ports()[0];
        cluster_nodes(p)
            .expect("CLUSTER NODES")
            .into_iter()
            .filter(|n| n.flags.contains("master") && !n.flags.contains("fail"))
            .map(|n| n.port)
            .collect()
    }

    /// `GET key` on the node that serves its slot (no redirection: proves
    /// where the key lives).
    pub fn get(&self, key: &str) -> Option<String> {
        node_cmd(self.primary_of(key), &["GET", key]).expect("GET on the slot's primary")
    }

    /// `EXISTS key` on the node that serves its slot.
    pub fn exists(&self, key: &str) -> bool {
        node_cmd::<i64>(self.primary_of(key), &["EXISTS", key]).expect("EXISTS") == 1
    }

    /// Runs a command on the primary serving `key`.
    pub fn cmd_for_key<T: redis::FromRedisValue>(&self, key: &str, args: &[&str]) -> T {
        node_cmd(self.primary_of(key), args).expect("command on the slot's primary")
    }

    /// Every key of every primary, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut all: Vec<String> = self
            .primaries()
            .into_iter()
            .flat_map(|p| node_cmd::<Vec<String>>(p, &["KEYS", "*"]).expect("KEYS"))
            .collect();
        all.sort();
        all
    }

    /// `CLUSTER FAILOVER` on `replica` (a graceful, manual failover), then
    /// waits until it is a primary and the cluster is healthy again.
    pub fn failover(&self, replica: u16) {
        let ok: String =
            node_cmd(replica, &["CLUSTER", "FAILOVER"]).expect("CLUSTER FAILOVER accepted");
        assert_eq!(ok, "OK");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if info(replica, "replication").get("role").map(String::as_str) == Some("master") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{replica} did not become primary"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_healthy(Duration::from_secs(20))
            .expect("healthy after failover");
    }

    /// Kills the node at `port` (SIGKILL): its replica takes over after
    /// [`NODE_TIMEOUT_MS`] and an election.
    pub fn kill(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the node at `port`.
    pub fn signal(&self, port: u16, sig: &str) {
        if let Some(c) = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .and_then(|n| n.child.as_ref())
        {
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "kill {sig} failed");
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = Command::new("kill")
                    .args(["-CONT", &c.id().to_string()])
                    .status();
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn_node(dir: &std::path::Path, port: u16, bus: u16) -> Result<Child, String> {
    redis_server(port)
        .args([
            "--cluster-port",
            &bus.to_string(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &dir.join(format!("nodes-{port}.conf")).to_string_lossy(),
            "--cluster-node-timeout",
            &NODE_TIMEOUT_MS.to_string(),
            "--dir",
            &dir.to_string_lossy(),
            "--logfile",
            &dir.join(format!("redis-{port}.log")).to_string_lossy(),
        ])
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => "redis-server not found on PATH: the tests start \
                 their own Redis; install the Debian package `redis-server`"
                .to_owned(),
            _ => format!("cannot start redis-server: {e}"),
        })
}

fn info_cluster(port: u16) -> Result<HashMap<String, String>, String> {
    let text: String =
        node_cmd(port, &["CLUSTER", "INFO"]).map_err(|e| format!("{port}: CLUSTER INFO: {e}"))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect())
}

/// One line of `CLUSTER NODES`.
pub struct NodeLine {
    pub id: String,
    pub port: u16,
    pub flags: String,
    pub master_id: String,
    pub slots: Vec<(u16, u16)>,
}

pub fn cluster_nodes(port: u16) -> Result<Vec<NodeLine>, String> {
    let text: String =
        node_cmd(port, &["CLUSTER", "NODES"]).map_err(|e| format!("{port}: CLUSTER NODES: {e}"))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            continue;
        }
        // 127.0.0.1:7000@17000[,hostname]
        let node_port = f[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        let slots = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => {
                    let v = s.parse().ok()?;
                    Some((v, v))
                }
            })
            .collect();
        out.push(NodeLine {
            id: f[0].to_owned(),
            port: node_port,
            flags: f[2].to_owned(),
            master_id: f[3].to_owned(),
            slots,
        });
    }
    Ok(out)
}

impl RedisCluster {
    /// The node ID of the node at `port`.
    pub fn node_id(&self, port: u16) -> String {
        let p = self.live_ports()[0];
        cluster_nodes(p)
            .expect("CLUSTER NODES")
            .into_iter()
            .find(|n| n.port == port)
            .map(|n| n.id)
            .expect("a node on that port")
    }

    /// Moves `slot` to the primary at `to` exactly as `redis-cli --cluster
    /// reshard` does: `SETSLOT IMPORTING` on the target, `SETSLOT MIGRATING`
    /// on the source, then `CLUSTER GETKEYSINSLOT` + `MIGRATE` in batches of
    /// `batch` keys (`pause` between batches, so requests meet the slot
    /// half-moved), then `SETSLOT NODE` on the target, the source and every
    /// other primary. Returns the number of keys moved.
    pub fn migrate_slot(&self, slot: u16, to: u16, batch: usize, pause: Duration) -> usize {
        let slot_s = slot.to_string();
        let p = self.live_ports()[0];
        let nodes = cluster_nodes(p).expect("CLUSTER NODES");
        let from = nodes
            .iter()
            .find(|n| {
                n.flags.contains("master") && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
            })
            .map(|n| n.port)
            .expect("the slot's owner");
        assert_ne!(from, to, "slot {slot} is already on {to}");
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let ok = |port: u16, args: &[&str]| {
            let r: String =
                node_cmd(port, args).unwrap_or_else(|e| panic!("{args:?} on {port}: {e}"));
            assert_eq!(r, "OK", "{args:?} on {port}");
        };
        ok(to, &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &from_id]);
        ok(from, &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &to_id]);
        let mut moved = 0;
        loop {
            let keys: Vec<String> = node_cmd(
                from,
                &["CLUSTER", "GETKEYSINSLOT", &slot_s, &batch.to_string()],
            )
            .expect("CLUSTER GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let port = to.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            ok(from, &args);
            moved += keys.len();
            std::thread::sleep(pause);
        }
        ok(to, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &to_id]);
        ok(from, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &to_id]);
        for other in self.primaries() {
            if other != to && other != from {
                ok(other, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &to_id]);
            }
        }
        moved
    }
}
