//! Measures every algorithm on a real Redis and prints the comparison table
//! of `docs/algorithms.md` (markdown, on stdout).
//!
//! ```text
//! perf/algorithm_table.sh                      # starts its own redis-server
//! REDIS_URL=redis://127.0.0.1:6390/ cargo run --release -p tiered-ratelimit-perf --bin algorithm_table
//! ```
//!
//! `REDIS_URL` is required. **Use a throwaway Redis**: the run calls
//! `CONFIG RESETSTAT`, sets the slow log to record every command (restored at
//! the end) and writes keys named `rl:user:<15 characters>` and
//! `rl:burst:<…>` (deleted at the end).
//!
//! Everything goes through the public `Backend::check` of a `RedisBackend`
//! (the one-script path the layer uses), without HTTP:
//!
//! * **memory per key**: one key filled with `limit` admitted requests of
//!   cost 1 (window 60 s), then `MEMORY USAGE <key> SAMPLES 0`;
//! * **Redis calls per request**: `CONFIG RESETSTAT`, the checks, then the
//!   `EVALSHA`/`EVAL`/`SCRIPT LOAD` calls of `INFO commandstats` ÷ checks
//!   (and the commands the script runs inside, per check);
//! * **script time**: `usec` ÷ `calls` of `cmdstat_evalsha`, while filling a
//!   key and then for 1 000 checks against the full key, plus percentiles
//!   from `SLOWLOG` (`slowlog-log-slower-than 0`);
//! * **burst precision**: limit 100 per 1 s, driven by a `ManualClock` (the
//!   script then uses the given time instead of Redis `TIME`) through three
//!   adversarial patterns over two windows; the most requests admitted within
//!   any 1 s span (for the shaping leaky bucket, the instants the requests are
//!   *passed*, i.e. decision time + delay).
//!
//! These measurements use Redis's own clock (`TIME`) except the burst
//! patterns, which need exact instants.

use std::collections::HashMap;
use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use redis::Value;
use tiered_ratelimit::algorithm::{Gcra, Limit, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, RedisBackend, TierCheck};
use tiered_ratelimit::{Algorithm, LeakyBucket};

type Res<T> = Result<T, Box<dyn Error>>;

const S: u64 = 1_000_000;
const MS: u64 = 1_000;
/// Window of the memory and script-time measurements.
const WINDOW_US: u64 = 60 * S;
/// The two limits of the memory and script-time columns.
const LIMITS: [u64; 2] = [100, 10_000];
/// Checks against a full key, for the script time at a full key.
const FULL_CHECKS: usize = 1_000;
/// The shaping leaky bucket's `max_delay` (the policy file's example, "2s").
const MAX_DELAY_US: u64 = 2 * S;
/// Burst precision: `BURST_LIMIT` per `BURST_WINDOW_US`.
const BURST_LIMIT: u64 = 100;
const BURST_WINDOW_US: u64 = S;
/// 2023-11-14T22:13:20Z, a whole second: window 1 is `[T0, T0 + 1 s)`.
const T0_US: u64 = 1_700_000_000 * S;

/// One row of the table: a name, the policy-file spelling ([`Algorithm::name`]) and how to build
/// its `Limit` for `limit` per `window_us` (burst = limit).
struct Algo {
    name: &'static str,
    policy: &'static str,
    state: &'static str,
    make: fn(u64, u64) -> Limit,
}

fn bucket(limit: u64, window_us: u64) -> TokenBucket {
    TokenBucket::new(limit, window_us, limit).expect("a small quota")
}

const ALGOS: [Algo; 6] = [
    Algo {
        name: "token bucket",
        policy: Algorithm::TokenBucket.name(),
        state: "string `units:updated_us:unit`",
        make: |l, w| Limit::TokenBucket(bucket(l, w)),
    },
    Algo {
        name: "fixed window",
        policy: Algorithm::FixedWindow.name(),
        state: "string `start_us:count`",
        make: |limit, window_us| Limit::FixedWindow(Window { limit, window_us }),
    },
    Algo {
        name: "sliding window log",
        policy: Algorithm::SlidingWindowLog.name(),
        state: "sorted set, 1 member per admitted request",
        make: |limit, window_us| Limit::SlidingWindowLog(Window { limit, window_us }),
    },
    Algo {
        name: "sliding window counter",
        policy: Algorithm::SlidingWindowCounter.name(),
        state: "string `start_us:current:previous`",
        make: |limit, window_us| Limit::SlidingWindowCounter(Window { limit, window_us }),
    },
    Algo {
        name: "leaky bucket, police (GCRA)",
        policy: Algorithm::LeakyBucket(LeakyBucket::Police).name(),
        state: "string `tat_us:frac_ticks:rate`",
        make: |l, w| {
            Limit::LeakyBucket(Gcra {
                bucket: bucket(l, w),
                max_delay_us: None,
            })
        },
    },
    Algo {
        name: "leaky bucket, shape (GCRA, max_delay 2 s)",
        policy: Algorithm::LeakyBucket(LeakyBucket::Shape {
            max_delay: Duration::from_micros(MAX_DELAY_US),
        })
        .name(),
        state: "string `tat_us:frac_ticks:rate`",
        make: |l, w| {
            Limit::LeakyBucket(Gcra {
                bucket: bucket(l, w),
                max_delay_us: Some(MAX_DELAY_US),
            })
        },
    },
];

/// A shaping leaky bucket with a burst of 1: the classic smoothing queue.
/// Only in the burst-precision table.
fn shape_burst_1(limit: u64, window_us: u64) -> Limit {
    Limit::LeakyBucket(Gcra {
        bucket: TokenBucket::new(limit, window_us, 1).expect("a small quota"),
        max_delay_us: Some(MAX_DELAY_US),
    })
}

/// One `INFO commandstats` line: calls, usec, failed calls.
#[derive(Debug, Default, Clone, Copy)]
struct Stat {
    calls: u64,
    usec: u64,
    failed: u64,
}

async fn commandstats(conn: &mut MultiplexedConnection) -> Res<HashMap<String, Stat>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut out = HashMap::new();
    for line in info.lines() {
        let Some((name, fields)) = line.trim().split_once(':') else {
            continue;
        };
        let Some(name) = name.strip_prefix("cmdstat_") else {
            continue;
        };
        let mut s = Stat::default();
        for kv in fields.split(',') {
            match kv.split_once('=') {
                Some(("calls", v)) => s.calls = v.parse()?,
                Some(("usec", v)) => s.usec = v.parse()?,
                Some(("failed_calls", v)) => s.failed = v.parse()?,
                _ => {}
            }
        }
        out.insert(name.to_owned(), s);
    }
    Ok(out)
}

/// What one measured phase cost, from `INFO commandstats` and `SLOWLOG`.
#[derive(Debug, Default, Clone)]
struct Phase {
    checks: usize,
    admitted: usize,
    /// EVALSHA + EVAL + SCRIPT LOAD calls.
    script_calls: u64,
    evalsha_failed: u64,
    /// Commands run inside the script (GET, SET, TIME, Z*, PEXPIRE, ...).
    inner: u64,
    inner_by_name: Vec<(String, u64)>,
    usec_per_call: f64,
    slow_p50: u64,
    slow_p99: u64,
    slow_max: u64,
    rtt_p50_us: u64,
    /// Redis main-thread CPU time per check (µs): unlike the wall-clock
    /// `usec`, not inflated when other processes take the CPU.
    cpu_us_per_check: f64,
}

/// The client-side commands this program itself sends between RESETSTAT and
/// INFO (excluded from "commands inside the script").
fn is_client_side(name: &str) -> bool {
    name == "info"
        || name == "hello"
        || name == "ping"
        || name.starts_with("config")
        || name.starts_with("slowlog")
        || name.starts_with("client")
        || name.starts_with("script")
        || name.starts_with("eval")
}

/// CPU seconds of Redis's main thread (user + system), from `INFO cpu`.
async fn redis_cpu_s(conn: &mut MultiplexedConnection) -> Res<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| -> Option<f64> {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':')?.parse().ok())
    };
    let main = field("used_cpu_user_main_thread")
        .zip(field("used_cpu_sys_main_thread"))
        .map(|(u, s)| u + s);
    let all = field("used_cpu_user")
        .zip(field("used_cpu_sys"))
        .map(|(u, s)| u + s);
    main.or(all)
        .ok_or_else(|| "INFO cpu: no used_cpu_user/used_cpu_sys".into())
}

async fn reset_stats(conn: &mut MultiplexedConnection) -> Res<()> {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(conn)
        .await?;
    redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async::<()>(conn)
        .await?;
    Ok(())
}

/// EVALSHA durations (µs) recorded in the slow log since the last reset.
async fn slowlog_evalsha(conn: &mut MultiplexedConnection) -> Res<Vec<u64>> {
    let v: Value = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(conn)
        .await?;
    let mut out = Vec::new();
    if let Value::Array(entries) = v {
        for e in entries {
            let Value::Array(fields) = e else { continue };
            let (Some(Value::Int(d)), Some(Value::Array(args))) = (fields.get(2), fields.get(3))
            else {
                continue;
            };
            let is_evalsha = match args.first() {
                Some(Value::BulkString(b)) => b.eq_ignore_ascii_case(b"evalsha"),
                Some(Value::SimpleString(s)) => s.eq_ignore_ascii_case("evalsha"),
                _ => false,
            };
            if is_evalsha {
                out.push(u64::try_from(*d)?);
            }
        }
    }
    Ok(out)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn finish_phase(
    conn: &mut MultiplexedConnection,
    cpu_before_s: f64,
    checks: usize,
    admitted: usize,
    mut rtts: Vec<u64>,
) -> Res<Phase> {
    let cpu_s = redis_cpu_s(conn).await? - cpu_before_s;
    let stats = commandstats(conn).await?;
    let mut slow = slowlog_evalsha(conn).await?;
    slow.sort_unstable();
    rtts.sort_unstable();
    let get = |n: &str| stats.get(n).copied().unwrap_or_default();
    let evalsha = get("evalsha");
    let script_calls = evalsha.calls + get("eval").calls + get("script|load").calls;
    let mut inner_by_name: Vec<(String, u64)> = stats
        .iter()
        .filter(|(n, _)| !is_client_side(n))
        .map(|(n, s)| (n.clone(), s.calls))
        .collect();
    inner_by_name.sort();
    Ok(Phase {
        checks,
        admitted,
        script_calls,
        evalsha_failed: evalsha.failed,
        inner: inner_by_name.iter().map(|(_, c)| c).sum(),
        inner_by_name,
        usec_per_call: if evalsha.calls == 0 {
            0.0
        } else {
            evalsha.usec as f64 / evalsha.calls as f64
        },
        slow_p50: percentile(&slow, 0.5),
        slow_p99: percentile(&slow, 0.99),
        slow_max: slow.last().copied().unwrap_or(0),
        rtt_p50_us: percentile(&rtts, 0.5),
        cpu_us_per_check: if checks == 0 {
            0.0
        } else {
            cpu_s * 1e6 / checks as f64
        },
    })
}

/// `n` checks of cost 1 on `key`, one after the other, each `clock` (if
/// given) 1 µs after the last; returns the number admitted and each round
/// trip (µs, client side).
async fn run_checks(
    backend: &Backend,
    key: &str,
    limit: Limit,
    n: usize,
    clock: Option<&ManualClock>,
) -> Res<(usize, Vec<u64>)> {
    let mut admitted = 0;
    let mut rtts = Vec::with_capacity(n);
    for i in 0..n {
        if let (Some(c), true) = (clock, i > 0) {
            c.advance(Duration::from_micros(1));
        }
        let started = Instant::now();
        let v = backend
            .check(vec![TierCheck {
                key: key.to_owned(),
                limit,
                cost: 1,
                home: None,
            }])
            .await?;
        rtts.push(u64::try_from(started.elapsed().as_micros())?);
        if v.allowed() {
            admitted += 1;
        }
    }
    Ok((admitted, rtts))
}

/// The memory/time measurement of one algorithm at one limit.
struct Costs {
    memory: Option<i64>,
    encoding: String,
    /// ZCARD of a sorted set, STRLEN of a string.
    size: String,
    fill: Phase,
    full: Phase,
}

fn epoch_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Fills a key with `limit` requests, 1 µs apart, then knocks
/// [`FULL_CHECKS`] times on the full key at the next microsecond.
///
/// On a manual clock anchored at the start of the next (epoch-aligned)
/// window: at limit 10 000 the sliding log's fill takes longer in real time
/// than its 60 s window, so Redis `TIME` would expire the first entries
/// before the last are in. The script is the same but for reading its clock
/// from ARGV instead of `TIME` (see [`measure_production`] for that path).
async fn measure_costs(
    url: &str,
    conn: &mut MultiplexedConnection,
    algo_index: usize,
    limit_n: u64,
) -> Res<Costs> {
    let algo = &ALGOS[algo_index];
    let limit = (algo.make)(limit_n, WINDOW_US);
    // Same-length key names for every row (23 bytes), like `rl:user:alice`.
    let key = format!(
        "rl:user:{:08x}{algo_index:02}{limit_n:05}",
        std::process::id()
    );
    let start = (epoch_us() / WINDOW_US + 1) * WINDOW_US;
    let clock = ManualClock::new(start);
    let backend: Backend = RedisBackend::from_url(url)?
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    // Connect (and check the script is loaded) outside the measurement.
    run_checks(&backend, &format!("{key}:warm"), limit, 1, None).await?;
    redis::cmd("DEL")
        .arg(format!("{key}:warm"))
        .query_async::<()>(conn)
        .await?;
    let n = usize::try_from(limit_n)?;

    reset_stats(conn).await?;
    let cpu = redis_cpu_s(conn).await?;
    let (admitted, rtts) = run_checks(&backend, &key, limit, n, Some(&clock)).await?;
    let fill = finish_phase(conn, cpu, n, admitted, rtts).await?;

    let memory: Option<i64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(conn)
        .await?;
    let encoding: Option<String> = redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(&key)
        .query_async(conn)
        .await?;
    let size = if matches!(limit, Limit::SlidingWindowLog(_)) {
        let n: i64 = redis::cmd("ZCARD").arg(&key).query_async(conn).await?;
        format!("{n} members")
    } else {
        let n: i64 = redis::cmd("STRLEN").arg(&key).query_async(conn).await?;
        format!("{n}-byte value")
    };

    clock.set(start + limit_n);
    reset_stats(conn).await?;
    let cpu = redis_cpu_s(conn).await?;
    let (admitted, rtts) = run_checks(&backend, &key, limit, FULL_CHECKS, None).await?;
    let full = finish_phase(conn, cpu, FULL_CHECKS, admitted, rtts).await?;

    redis::cmd("DEL").arg(&key).query_async::<()>(conn).await?;
    Ok(Costs {
        memory,
        encoding: encoding.unwrap_or_else(|| "(none)".into()),
        size,
        fill,
        full,
    })
}

/// The production path (Redis `TIME`, no manual clock) at limit 100 per
/// 60 s: `limit` admitted requests, then `limit` denied ones.
async fn measure_production(
    backend: &Backend,
    conn: &mut MultiplexedConnection,
    algo_index: usize,
) -> Res<(Phase, Phase)> {
    let limit_n = LIMITS[0];
    let limit = (ALGOS[algo_index].make)(limit_n, WINDOW_US);
    let key = format!("rl:user:{:08x}{algo_index:02}{:05}", std::process::id(), 0);
    // Windows are epoch-aligned: keep the run inside one.
    let left = WINDOW_US - epoch_us() % WINDOW_US;
    if left < 5 * S {
        tokio::time::sleep(Duration::from_micros(left + 100 * MS)).await;
    }
    let n = usize::try_from(limit_n)?;
    reset_stats(conn).await?;
    let cpu = redis_cpu_s(conn).await?;
    let (admitted, rtts) = run_checks(backend, &key, limit, n, None).await?;
    let allowed = finish_phase(conn, cpu, n, admitted, rtts).await?;
    reset_stats(conn).await?;
    let cpu = redis_cpu_s(conn).await?;
    let (admitted, rtts) = run_checks(backend, &key, limit, n, None).await?;
    let denied = finish_phase(conn, cpu, n, admitted, rtts).await?;
    redis::cmd("DEL").arg(&key).query_async::<()>(conn).await?;
    Ok((allowed, denied))
}

/// One adversarial pattern: the instants (epoch µs) requests arrive at.
struct Pattern {
    name: &'static str,
    arrivals: fn() -> Vec<u64>,
}

const PATTERNS: [Pattern; 3] = [
    Pattern {
        // One request every millisecond through windows 1 and 2.
        name: "flood 1/ms over 2 windows",
        arrivals: || (0..2_000).map(|k| T0_US + k * MS).collect(),
    },
    Pattern {
        // 300 at the last µs of window 1, 300 at the first µs of window 2.
        name: "300 at end of window 1 + 300 at start of window 2",
        arrivals: || {
            let mut v = vec![T0_US + BURST_WINDOW_US - 1; 300];
            v.extend(std::iter::repeat_n(T0_US + BURST_WINDOW_US, 300));
            v
        },
    },
    Pattern {
        // 300 at the last µs of window 1, then 1/ms through window 2.
        name: "300 at end of window 1, then flood 1/ms through window 2",
        arrivals: || {
            let mut v = vec![T0_US + BURST_WINDOW_US - 1; 300];
            v.extend((0..1_000).map(|k| T0_US + BURST_WINDOW_US + k * MS));
            v
        },
    },
];

/// The result of one pattern on one algorithm.
struct Burst {
    admitted: usize,
    /// Admitted with no delay at the pattern's first instant.
    first_instant_now: usize,
    /// Admitted with a delay at the pattern's first instant (shaping only).
    first_instant_delayed: usize,
    /// Most requests passed within any span of one window.
    worst_span: usize,
    max_delay_us: u64,
}

/// The largest number of `times` within any half-open span of `span` µs
/// (an entry at `u` counts for the span ending at `t` if `t - span < u <= t`,
/// the sliding log's own definition).
fn worst_span(times: &mut [u64], span: u64) -> usize {
    times.sort_unstable();
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= span {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

async fn measure_burst(url: &str, key: &str, limit: Limit, pattern: &Pattern) -> Res<Burst> {
    let arrivals = (pattern.arrivals)();
    let clock = ManualClock::new(arrivals[0]);
    let backend: Backend = RedisBackend::from_url(url)?
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(600))
        .into();
    let mut passed = Vec::new();
    let (mut first_now, mut first_delayed, mut max_delay) = (0, 0, 0);
    for &t in &arrivals {
        clock.set(t);
        let v = backend
            .check(vec![TierCheck {
                key: key.to_owned(),
                limit,
                cost: 1,
                home: None,
            }])
            .await?;
        if v.now_us != t {
            return Err(format!(
                "the script used {} instead of the manual clock {t}",
                v.now_us
            )
            .into());
        }
        if v.allowed() {
            let d = v.decisions[0].delay_us;
            passed.push(t + d);
            max_delay = max_delay.max(d);
            if t == arrivals[0] {
                if d == 0 {
                    first_now += 1;
                } else {
                    first_delayed += 1;
                }
            }
        }
    }
    Ok(Burst {
        admitted: passed.len(),
        first_instant_now: first_now,
        first_instant_delayed: first_delayed,
        worst_span: worst_span(&mut passed, BURST_WINDOW_US),
        max_delay_us: max_delay,
    })
}

fn kib(bytes: Option<i64>) -> String {
    match bytes {
        None => "(no key)".into(),
        Some(b) if b < 10_000 => format!("{b} B"),
        Some(b) => format!("{b} B ({:.0} KiB)", b as f64 / 1024.0),
    }
}

fn per(n: u64, d: usize) -> String {
    if d == 0 {
        return "-".into();
    }
    let r = n as f64 / d as f64;
    if (r - r.round()).abs() < 0.0005 {
        format!("{r:.0}")
    } else {
        format!("{r:.3}")
    }
}

async fn config_get(conn: &mut MultiplexedConnection, name: &str) -> Res<String> {
    let v: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query_async(conn)
        .await?;
    v.get(1)
        .cloned()
        .ok_or_else(|| format!("CONFIG GET {name}: no value").into())
}

async fn config_set(conn: &mut MultiplexedConnection, name: &str, value: &str) -> Res<()> {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async::<()>(conn)
        .await?;
    Ok(())
}

async fn run(url: &str) -> Res<()> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .arg("memory")
        .query_async(&mut conn)
        .await?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')))
            .unwrap_or("?")
            .trim()
            .to_owned()
    };
    let server = format!(
        "Redis {} ({}, zset-max-listpack-entries {})",
        field("redis_version"),
        field("mem_allocator"),
        config_get(&mut conn, "zset-max-listpack-entries").await?
    );

    let slower_than = config_get(&mut conn, "slowlog-log-slower-than").await?;
    let max_len = config_get(&mut conn, "slowlog-max-len").await?;
    config_set(&mut conn, "slowlog-log-slower-than", "0").await?;
    config_set(&mut conn, "slowlog-max-len", "20000").await?;

    let result = measure_all(url, &mut conn, &server).await;

    config_set(&mut conn, "slowlog-log-slower-than", &slower_than).await?;
    config_set(&mut conn, "slowlog-max-len", &max_len).await?;
    redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async::<()>(&mut conn)
        .await?;
    result
}

/// `"3: 1 GET, 1 SET, 1 TIME"`: commands inside the script per check.
fn inner(p: &Phase) -> String {
    let names = p
        .inner_by_name
        .iter()
        .map(|(n, k)| format!("{} {}", per(*k, p.checks), n.to_uppercase()))
        .collect::<Vec<_>>()
        .join(", ");
    format!("{} ({names})", per(p.inner, p.checks))
}

async fn measure_all(url: &str, conn: &mut MultiplexedConnection, server: &str) -> Res<()> {
    // The production path: Redis TIME, no manual clock.
    let backend: Backend = RedisBackend::from_url(url)?.into();
    // Load the script (EVALSHA → NOSCRIPT → SCRIPT LOAD) before measuring.
    let warm = format!("rl:warmup:{:08x}", std::process::id());
    run_checks(&backend, &warm, (ALGOS[0].make)(1, S), 1, None).await?;
    redis::cmd("DEL").arg(&warm).query_async::<()>(conn).await?;

    let mut production = Vec::new();
    let mut costs: Vec<Vec<Costs>> = Vec::new();
    for (i, a) in ALGOS.iter().enumerate() {
        eprintln!("measuring {}: production path", a.name);
        production.push(measure_production(&backend, conn, i).await?);
        let mut row = Vec::new();
        for limit in LIMITS {
            eprintln!("measuring {} at limit {limit} per 60 s", a.name);
            row.push(measure_costs(url, conn, i, limit).await?);
        }
        costs.push(row);
    }

    let mut bursts: Vec<(String, Vec<Burst>)> = Vec::new();
    let mut burst_limits: Vec<(String, Limit)> = ALGOS
        .iter()
        .map(|a| (a.name.to_owned(), (a.make)(BURST_LIMIT, BURST_WINDOW_US)))
        .collect();
    burst_limits.push((
        "leaky bucket, shape, **burst 1** (max_delay 2 s)".to_owned(),
        shape_burst_1(BURST_LIMIT, BURST_WINDOW_US),
    ));
    for (i, (name, limit)) in burst_limits.iter().enumerate() {
        eprintln!("burst patterns: {name}");
        let mut row = Vec::new();
        for (p, pattern) in PATTERNS.iter().enumerate() {
            let key = format!("rl:burst:{:08x}{i:02}{p}", std::process::id());
            row.push(measure_burst(url, &key, *limit, pattern).await?);
            redis::cmd("DEL").arg(&key).query_async::<()>(conn).await?;
        }
        bursts.push((name.clone(), row));
    }

    // ---- the tables ----
    println!("{server}, one client, loopback, keys of 23 bytes (`rl:user:` + 15 characters).\n");
    println!(
        "| algorithm | `algorithm =` | memory/key, limit 100 | memory/key, limit 10 000 | \
         Redis calls/request | script µs/call, limit 100 | script µs/call, limit 10 000 | \
         burst from idle | worst 1 s span |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for (i, a) in ALGOS.iter().enumerate() {
        let [c100, c10k] = [&costs[i][0], &costs[i][1]];
        let (pa, pd) = &production[i];
        let b = &bursts[i].1;
        let worst = b.iter().map(|r| r.worst_span).max().unwrap_or(0);
        let idle = &b[1];
        let idle = if idle.first_instant_delayed > 0 {
            format!(
                "{} + {} delayed",
                idle.first_instant_now, idle.first_instant_delayed
            )
        } else {
            idle.first_instant_now.to_string()
        };
        println!(
            "| {} | `\"{}\"` | {} | {} | {} | {:.1} | {:.1} | {} | {} |",
            a.name,
            a.policy,
            kib(c100.memory),
            kib(c10k.memory),
            per(pa.script_calls + pd.script_calls, pa.checks + pd.checks),
            c100.full.usec_per_call,
            c10k.full.usec_per_call,
            idle,
            worst,
        );
    }
    println!(
        "\n* Memory/key: `MEMORY USAGE <key> SAMPLES 0` after `limit` admitted requests \
         (cost 1, window 60 s, burst = limit).\n\
         * Redis calls/request: (`EVALSHA` + `EVAL` + `SCRIPT LOAD` calls in `INFO commandstats`) \
         ÷ checks, on the production path (Redis `TIME`), over {} admitted and {} denied checks per \
         algorithm.\n\
         * Script µs/call: `INFO commandstats` usec ÷ calls of `evalsha`, over {FULL_CHECKS} checks \
         against the full key (a client that keeps knocking; the worst case for the log).\n\
         * Burst from idle: admitted at one instant out of 300 on a fresh key (limit 100 per 1 s).\n\
         * Worst 1 s span: the most requests admitted (shaping: passed) within any 1 s span, limit \
         100 per 1 s, worst of the three adversarial patterns below.\n",
        LIMITS[0], LIMITS[0]
    );

    println!("Memory and script time in detail (window 60 s, manual clock: fill 1 µs apart, then the full key):\n");
    println!(
        "| algorithm | limit | stored as | size | `MEMORY USAGE` | admitted (fill) | \
         script µs/call, fill | script µs/call, full key: mean / p50 / p99 / max | \
         Redis CPU µs/check, fill / full key | admitted of {FULL_CHECKS} (full key) | \
         client round trip p50, µs |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, a) in ALGOS.iter().enumerate() {
        for (j, limit) in LIMITS.iter().enumerate() {
            let c = &costs[i][j];
            println!(
                "| {} | {} | {} ({}) | {} | {} | {} / {} | {:.1} | {:.1} / {} / {} / {} | {:.1} / {:.1} | {} | {} |",
                a.name,
                limit,
                a.state,
                c.encoding,
                c.size,
                kib(c.memory),
                c.fill.admitted,
                c.fill.checks,
                c.fill.usec_per_call,
                c.full.usec_per_call,
                c.full.slow_p50,
                c.full.slow_p99,
                c.full.slow_max,
                c.fill.cpu_us_per_check,
                c.full.cpu_us_per_check,
                c.full.admitted,
                c.full.rtt_p50_us,
            );
        }
    }

    println!(
        "\nThe production path (Redis `TIME`), limit 100 per 60 s: {} checks admitted, then {} \
         denied:\n",
        LIMITS[0], LIMITS[0]
    );
    println!(
        "| algorithm | calls/request | failed `EVALSHA` | commands inside the script per \
         admitted check | per denied check | script µs/call, admitted / denied | \
         client round trip p50 µs, admitted / denied |"
    );
    println!("|---|---:|---:|---|---|---:|---:|");
    for (i, a) in ALGOS.iter().enumerate() {
        let (pa, pd) = &production[i];
        println!(
            "| {} | {} | {} | {} | {} | {:.1} / {:.1} | {} / {} |",
            a.name,
            per(pa.script_calls + pd.script_calls, pa.checks + pd.checks),
            pa.evalsha_failed + pd.evalsha_failed,
            inner(pa),
            inner(pd),
            pa.usec_per_call,
            pd.usec_per_call,
            pa.rtt_p50_us,
            pd.rtt_p50_us,
        );
    }
    let odd: Vec<String> = ALGOS
        .iter()
        .zip(&production)
        .filter(|(_, (pa, pd))| pa.admitted != pa.checks || pd.admitted != 0)
        .map(|(a, (pa, pd))| {
            format!(
                "{}: {} of the first {}, {} of the next {}",
                a.name, pa.admitted, pa.checks, pd.admitted, pd.checks
            )
        })
        .collect();
    if !odd.is_empty() {
        println!(
            "\nAdmitted other than all of the first {0} and none of the next {0} (shaping admits \
             up to max_delay × rate more, delayed): {1}.",
            LIMITS[0],
            odd.join("; ")
        );
    }
    println!(
        "\nBurst precision in detail: limit {BURST_LIMIT} per 1 s (burst = limit unless said), \
         window 1 = [T0, T0 + 1 s), window 2 = [T0 + 1 s, T0 + 2 s), manual clock; cells are \
         admitted / **most admitted within any 1 s span** (shaping: of the instants the requests \
         are passed, decision + delay):\n"
    );
    print!("| algorithm |");
    for p in &PATTERNS {
        print!(" {} |", p.name);
    }
    println!(" worst | longest delay |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, row) in &bursts {
        print!("| {name} |");
        for r in row {
            print!(" {} / **{}** |", r.admitted, r.worst_span);
        }
        let worst = row.iter().map(|r| r.worst_span).max().unwrap_or(0);
        let delay = row.iter().map(|r| r.max_delay_us).max().unwrap_or(0);
        println!(" {worst} | {} ms |", delay as f64 / 1000.0);
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let Ok(url) = std::env::var("REDIS_URL") else {
        eprintln!(
            "REDIS_URL is required (a throwaway Redis: the run resets its stats), \
             e.g. REDIS_URL=redis://127.0.0.1:6390/; or run perf/algorithm_table.sh"
        );
        return ExitCode::from(2);
    };
    match run(&url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("algorithm_table: {e}");
            ExitCode::FAILURE
        }
    }
}
