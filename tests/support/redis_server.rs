//! A `redis-server` of our own per test: started on a free loopback port,
//! killed on drop; and the plumbing support/cluster.rs shares with it.

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `redis-server` on loopback `port`, in the foreground, keeping nothing on
/// disk, logging warnings only, its output discarded (add arguments, spawn).
pub(crate) fn redis_server(port: u16) -> Command {
    let mut c = Command::new("redis-server");
    c.args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    c
}

/// A connection to the redis-server on loopback `port` (2 s timeout).
pub(crate) fn connect(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
        .get_connection_with_timeout(Duration::from_secs(2))
}

/// `args` as one command (`args[0]` the command's name).
pub(crate) fn command(args: &[&str]) -> redis::Cmd {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd
}

/// Field `field` of `command` in an `INFO commandstats` reply, summed over
/// its lines (0 if the command was never called).
pub(crate) fn commandstat(info: &str, command: &str, field: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:");
    let field = format!("{field}=");
    info.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|v| v.trim().split(',').find_map(|kv| kv.strip_prefix(&field)))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// A `redis-server` of our own on a free loopback port, killed on drop.
pub struct RedisServer {
    port: u16,
    /// More `redis-server` arguments (e.g. `--replicaof`).
    args: Vec<String>,
    child: Option<Child>,
}

/// A free loopback port for a server of a test.
pub(crate) fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free loopback ports, below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`) and never handed out twice in
/// this process. A port the kernel hands out for `bind(0)` is an ephemeral
/// one: once its server is killed (a restart test), any outgoing
/// connection on the host may take it as its source port, and the server
/// cannot come back on it (a whole-cluster restart failed so on a host
/// busy with other connections). Below that range only a listener takes a
/// port.
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (lo, hi) = (10_000u32, u32::from(ephemeral_low.max(10_001)) - 1);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    // A small xorshift seeded by the process and the time: tests of one
    // binary take distinct ports through `given`, binaries run one after
    // another, and a port in use fails the bind below.
    let mut x = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
        | 1;
    let mut held = Vec::with_capacity(n);
    let mut ports = Vec::with_capacity(n);
    for _ in 0..100_000 {
        if ports.len() == n {
            break;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = (lo + (x % u64::from(hi - lo + 1)) as u32) as u16;
        if given.contains(&port) {
            continue;
        }
        if let Ok(l) = StdListener::bind(("127.0.0.1", port)) {
            given.insert(port);
            held.push(l);
            ports.push(port);
        }
    }
    assert_eq!(
        ports.len(),
        n,
        "{n} free loopback ports below {ephemeral_low}"
    );
    ports
}

impl RedisServer {
    /// A backend on this server whose scripts read `clock` instead of Redis
    /// `TIME`: the manual clock every exact test of a real Redis drives.
    pub fn backend_on(
        &self,
        clock: &tiered_ratelimit::backend::ManualClock,
    ) -> tiered_ratelimit::backend::RedisBackend {
        tiered_ratelimit::backend::RedisBackend::from_url(&self.url())
            .unwrap()
            .with_manual_clock(clock.clone())
    }

    /// A backend on this server and a memory backend, both on `clock`: the
    /// pair a model test compares. The Redis one with 600 s of TTL slack,
    /// so Redis's real-time expiry never runs ahead of the test's clock.
    pub fn redis_and_memory(
        &self,
        clock: &tiered_ratelimit::backend::ManualClock,
    ) -> (
        tiered_ratelimit::backend::Backend,
        tiered_ratelimit::backend::Backend,
    ) {
        let redis = self
            .backend_on(clock)
            .with_test_ttl_slack(Duration::from_secs(600));
        let memory = tiered_ratelimit::backend::MemoryBackend::with_manual_clock(clock.clone());
        (redis.into(), memory.into())
    }
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with more `redis-server` arguments (e.g.
    /// `["--replicaof", "127.0.0.1", "6379"]`).
    pub fn start_with(args: &[&str]) -> Self {
        for _ in 0..5 {
            let mut s = RedisServer {
                port: free_port(),
                args: args.iter().map(|a| (*a).to_owned()).collect(),
                child: None,
            };
            if s.spawn() {
                return s;
            }
        }
        panic!("could not start redis-server on a free port after 5 tries");
    }

    fn spawn(&mut self) -> bool {
        let child = redis_server(self.port).args(&self.args).spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server not found on PATH: the tests start their own Redis; \
                 install the Debian package `redis-server` (apt-get install redis-server)"
            ),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(_)) = c.try_wait() {
                    self.child = None;
                    return false; // port taken between probe and bind
                }
            }
            if self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
        connect(self.port)
    }

    pub fn ping(&self) -> bool {
        self.connection()
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    /// Runs a command and returns its reply.
    /// `calls=` of `command` in this server's `INFO commandstats` (0 if
    /// never called).
    pub fn calls(&self, command: &str) -> u64 {
        // Through `cmd`: a server that cannot answer fails the test, never
        // reads as 0 calls.
        let info: String = self.cmd(&["INFO", "commandstats"]);
        commandstat(&info, command, "calls")
    }

    /// Calls of `command` that ran without an error reply (`calls` minus
    /// `failed_calls`): e.g. an `FCALL` answered "Function not found" before
    /// the library was loaded does not count.
    pub fn succeeded(&self, command: &str) -> u64 {
        let info: String = self.cmd(&["INFO", "commandstats"]);
        commandstat(&info, command, "calls") - commandstat(&info, command, "failed_calls")
    }

    /// Script calls: `FCALL` (the check on Redis ≥ 7), `EVALSHA` (refunds,
    /// and checks where Functions are refused), plus `EVAL`.
    pub fn script_calls(&self) -> u64 {
        self.calls("fcall") + self.calls("evalsha") + self.calls("eval")
    }

    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.connection().expect("connect to test redis");
        command(args).query(&mut c).expect("redis command")
    }

    pub fn get(&self, key: &str) -> Option<String> {
        self.cmd(&["GET", key])
    }

    pub fn pttl(&self, key: &str) -> i64 {
        self.cmd(&["PTTL", key])
    }

    /// The limiter's bucket keys, sorted (the hourly fleet-wide top-N sets
    /// `<prefix>:blocked:<hour>` are left out; tests/operate/observability.rs checks them).
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.cmd(&["KEYS", "*"]);
        k.retain(|k| !k.contains(":blocked:"));
        k.sort();
        k
    }

    /// Kills the server (data is lost: it keeps nothing on disk).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn(),
            "redis-server did not come back on port {}",
            self.port
        );
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "kill {sig} failed");
        }
    }

    /// Freezes the process (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.stop();
    }
}
