//! The server `perf/load.sh` puts under load: a trivial `GET /` handler
//! behind one of several rate limiters, so that their costs can be compared
//! request for request (`perf/README.md`).
//!
//! ```text
//! bench_server <mode> [deny]
//!
//!   bare      axum alone
//!   bare_auth axum with the app's auth middleware of mem4 (`x-user` →
//!             UserId) and no limiter: the app mem4 limits, so mem4 −
//!             bare_auth is the limiter's own cost
//!   mem1      RateLimitLayer, memory backend, 1 tier: ip (ClientIp)
//!   mem4      RateLimitLayer, memory backend, 4 tiers: global, ip, user
//!             (an `x-user` header turned into a UserId by a middleware),
//!             endpoint
//!   governor  tower_governor's per-IP governor (PeerIpKeyExtractor)
//!   governor_headers  the same with its X-RateLimit headers on
//!             (`GovernorConfigBuilder::use_headers`)
//!   redis1    RateLimitLayer on Redis (REDIS_URL), 1 tier: ip
//!   redis4    RateLimitLayer on Redis, the 4 tiers of mem4
//!   minimal   an axum::middleware::from_fn doing one EVALSHA of a plain
//!             token-bucket script per request on one MultiplexedConnection
//!             (the floor any Redis limiter pays)
//!   minimal_pool  the same with a deadpool-redis checkout per request (a
//!             pool of 32), the other way to share connections
//!   minimal4  a from_fn middleware whose one EVALSHA checks redis4's four
//!             keys (same names, same quotas) all or nothing: Redis TIME,
//!             one MGET, one SET … PX per key, one integer per key (a GCRA
//!             theoretical arrival time in µs); 429 or the response, no
//!             rate-limit headers (the floor of redis4)
//!   minimal1  the same script on redis1's one key, `rl:ip:<ip>` (the
//!             floor of redis1)
//!
//!   redis4_lease  redis4 with the global and endpoint tiers in lease mode
//!             (`Tier::lease`, default settings): ip and user checked per
//!             request, in one script call with two keys
//!   redis4_lease_all  redis4 with all four tiers in lease mode (under wrk's
//!             one client, a hot key on every tier)
//!             Both lease modes answer `GET /_lease` (outside the limiter):
//!             "<lease calls> <tokens taken> <tokens returned> <requests
//!             admitted from leases>" since start (perf/load.sh reads it
//!             around each run).
//!
//!   (any mode of ours: `CANDIDATES=N` gives the `ip` tier N candidate
//!   quotas, never denying: what candidates cost)
//!
//!   deny      the per-IP limit is DENY_RATE per second (default 10; burst
//!             the same), so under load nearly every request is denied.
//!             Without it no limiter denies during a run: burst 10^9,
//!             refilled at 1000 per second (keys persist, as busy ones do).
//! ```
//!
//! Environment: `LISTEN_ADDR` (default `127.0.0.1:3000`), `REDIS_URL`
//! (redis1, redis4, minimal, minimal4), `DENY_RATE`, `DENY_CACHE` (the
//! layer's deny cache capacity; 0 disables it), `OTHER_RATE` (the per-second
//! limit of the global, user and endpoint tiers; default a billion),
//! `USER_QUOTA_PER_MINUTE=N` (mem4, redis4, minimal4: the `user` tier is
//! `Quota::per_minute(N)` instead, so a user's key lives only until its
//! bucket is full again, as under a real quota: `perf/scale.sh`; unset =
//! the `OTHER_RATE` quota), `USER_QUOTA_PER_HOUR=N` (the same with
//! `Quota::per_hour(N)`, when `USER_QUOTA_PER_MINUTE` is unset: a key lives
//! an hour a request, as perf/scale.sh's memory run needs), `USER_BURST=B`
//! (with either:
//! `.burst(B)`, so a few hot users are never denied while the refill rate,
//! and with it every key's TTL, stays the quota's), `PROMETHEUS=1` (install
//! a Prometheus metrics recorder, without its HTTP listener, to count what
//! metrics cost; with it `GET /_metrics`, outside the limiter, renders the
//! recorder's output, `tiered_ratelimit_check_duration_seconds` as a
//! histogram of [`check_buckets`], and in mem1 and mem4 the store's key
//! count as `bench_server_memory_keys`: perf/scale.sh diffs it between
//! phases; the recorder's upkeep runs every 5 s, as the exporter's own
//! listener runs it), `MAX_KEYS=N` (mem1, mem4: the store keeps at most
//! about N buckets, `MemoryBackend::max_keys`; unset = its default,
//! 10^6), `HEADERS=none` (our layer sends no rate-limit headers, as
//! tower_governor by default: what the headers cost), `IP_PER_HOUR=N` (the
//! `ip` tier is `Quota::per_hour(N)`: perf/redis_default.sh measures an
//! idle key of 100/hour), `PLAN=configured` (every tier of our layer has
//! a rollout plan, enforce for an hour then enforce, with a guard, and the
//! layer a control key `bench:control`: what a plan costs while it does
//! not run), `PLAN=running` (redis1, redis4: the `ip` tier's plan is also
//! started before serving, so its gates count every check).
//! Prints `listening on <addr>` once it accepts connections.
//! `bench_server minimal-lua` prints the minimal limiter's script,
//! `bench_server minimal4-lua` the four-key one,
//! `bench_server script-sha` the SHA1 of the layer's script, `check-lua` its
//! source, `library-lua` the same check as a Redis Functions library and
//! `function-name` the function's name (for perf/redis_cpu.sh).

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use redis::aio::MultiplexedConnection;
use tiered_ratelimit::backend::{Backend, MemoryBackend, RedisBackend};
use tiered_ratelimit::handle::ControlError;
use tiered_ratelimit::key::{storage_key_part, ClientIp, Endpoint, Global, User, UNMATCHED_ROUTE};
use tiered_ratelimit::rollout::{
    FallbackGuard, GuardVerdict, Mode, PlanAction, RolloutPlan, Stage,
};
use tiered_ratelimit::token_lease::TokenLease;
use tiered_ratelimit::{key::UserId, Quota, RateLimitLayer, Tier};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// The minimal limiter's script: a token bucket of `ARGV[2]` tokens refilled
/// at `ARGV[1]` per second, state `"tokens:updated_us"`, Redis `TIME`.
/// Returns `{allowed, remaining}`.
const MINIMAL_LUA: &str = r"
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local tokens = burst
local v = redis.call('GET', KEYS[1])
if v then
  local sep = string.find(v, ':', 1, true)
  local ts = tonumber(string.sub(v, sep + 1))
  tokens = math.min(burst, tonumber(string.sub(v, 1, sep - 1)) + (now - ts) * rate / 1000000)
end
if tokens < 1 then return {0, 0} end
tokens = tokens - 1
local ttl = math.ceil((burst - tokens) * 1000 / rate) + 1
redis.call('SET', KEYS[1], string.format('%.6f:%d', tokens, now), 'PX', ttl)
return {1, math.floor(tokens)}
";

/// The four-key minimal limiter's script (`minimal4`): GCRA on every key in
/// `KEYS`, all or nothing. `ARGV[2i-1]` is key i's emission interval and
/// `ARGV[2i]` its tolerance (burst × interval), both in µs; a key holds its
/// theoretical arrival time in µs since the epoch. Returns 1 (allowed: every
/// key written, `PX` until its bucket is full again) or 0 (denied: nothing
/// written).
const MINIMAL4_LUA: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local tats = redis.call('MGET', unpack(KEYS))
local new = {}
for i = 1, #KEYS do
  local tat = math.max(tonumber(tats[i]) or now, now) + tonumber(ARGV[2 * i - 1])
  if tat - now > tonumber(ARGV[2 * i]) then return 0 end
  new[i] = tat
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], string.format('%d', new[i]), 'PX', math.ceil((new[i] - now) / 1000))
end
return 1
";

/// A limit that never denies during a run yet keeps its keys, as busy keys
/// are in production: a burst of a billion, refilled at 1000 per second (a
/// bucket that is always full would expire its key between requests).
fn huge() -> Quota {
    Quota::per_second(NEVER_RATE).burst(NEVER_BURST)
}

const NEVER_RATE: u64 = 1000;
const NEVER_BURST: u64 = 1_000_000_000;

struct Config {
    mode: String,
    /// The per-IP limit per second when denying, else `None`.
    deny_rate: Option<u64>,
    redis_url: Option<String>,
    deny_cache: Option<u64>,
    /// The per-second limit of the global, user and endpoint tiers (default
    /// a billion).
    other_rate: Option<u64>,
    /// The `user` tier's limit per minute (default: the `other_rate` quota).
    user_per_minute: Option<u64>,
    /// The `user` tier's limit per hour, if not per minute.
    user_per_hour: Option<u64>,
    /// The `user` tier's burst with `user_per_minute` (default: the limit).
    user_burst: Option<u64>,
    /// Send no rate-limit headers.
    no_headers: bool,
    /// The `ip` tier's limit per hour (default: never denying, or `deny_rate`).
    ip_per_hour: Option<u64>,
    /// The memory store's `max_keys` (default: `MemoryBackend::new()`'s).
    max_keys: Option<u64>,
    /// `PLAN=configured`: every tier has a rollout plan (enforce for an
    /// hour, then enforce) with a guard, and the layer a control key
    /// `bench:control`; `PLAN=running` (Redis modes): the `ip` tier's plan
    /// is also started before serving (its gates count every check).
    plan: Option<String>,
    /// `CANDIDATES=N` (1-4): the `ip` tier has N candidate quotas, each of
    /// its quota's period and burst and a limit one above the last (never
    /// denying, as the tier's own).
    candidates: u64,
}

/// The upper bounds, in seconds, of the check-duration histogram's buckets
/// under `PROMETHEUS=1`: 2^-26 s (14.9 ns) to 2^-13 s (122 µs), eight a
/// doubling (each 9 % above the last), so a quantile read off the bucket
/// counts is within 9 % of the sample's.
fn check_buckets() -> Vec<f64> {
    (0..=13 * 8)
        .map(|i| 2f64.powf(-26.0 + f64::from(i) / 8.0))
        .collect()
}

/// The Prometheus recorder of `PROMETHEUS=1`: installed globally, its
/// upkeep run every 5 s; returns the handle `GET /_metrics` renders.
fn install_prometheus() -> Res<metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tiered_ratelimit_check_duration_seconds".to_owned()),
            &check_buckets(),
        )?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| e.to_string())?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

fn usage() -> Box<dyn Error + Send + Sync> {
    "usage: bench_server <bare|bare_auth|mem1|mem4|governor|governor_headers|redis1|redis4|\
     redis4_lease|redis4_lease_all|minimal|minimal_pool|minimal1|minimal4> [deny]"
        .into()
}

fn env_u64(name: &str) -> Res<Option<u64>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v.parse().map_err(|e| format!("{name}: {e}"))?)),
        Err(_) => Ok(None),
    }
}

#[tokio::main]
async fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().ok_or_else(usage)?;
    if mode == "minimal-lua" {
        // For `redis-cli SCRIPT LOAD` and redis-benchmark.
        print!("{MINIMAL_LUA}");
        return Ok(());
    }
    if mode == "minimal4-lua" {
        print!("{MINIMAL4_LUA}");
        return Ok(());
    }
    if mode == "check-lua" || mode == "library-lua" || mode == "function-name" {
        // The layer's check as a script (EVALSHA), as a Functions library
        // (FUNCTION LOAD) and its function's name (FCALL): for
        // perf/redis_cpu.sh.
        let b = RedisBackend::from_url("redis://127.0.0.1/")?;
        match mode.as_str() {
            "check-lua" => print!("{}", b.script_source()),
            "library-lua" => print!("{}", b.function_library()),
            _ => println!("{}", b.function_name()),
        }
        return Ok(());
    }
    if mode == "script-sha" {
        // The layer's script, for redis-benchmark (loaded by any redis run).
        println!(
            "{}",
            RedisBackend::from_url("redis://127.0.0.1/")?.script_sha()
        );
        return Ok(());
    }
    let deny = match args.next().as_deref() {
        None => false,
        Some("deny") => true,
        Some(_) => return Err(usage()),
    };
    let config = Config {
        mode,
        deny_rate: deny
            .then(|| env_u64("DENY_RATE"))
            .transpose()?
            .map(|r| r.unwrap_or(10)),
        redis_url: std::env::var("REDIS_URL").ok(),
        deny_cache: env_u64("DENY_CACHE")?,
        other_rate: env_u64("OTHER_RATE")?,
        user_per_minute: env_u64("USER_QUOTA_PER_MINUTE")?,
        user_per_hour: env_u64("USER_QUOTA_PER_HOUR")?,
        user_burst: env_u64("USER_BURST")?,
        no_headers: std::env::var("HEADERS").as_deref() == Ok("none"),
        candidates: env_u64("CANDIDATES")?.unwrap_or(0),
        ip_per_hour: env_u64("IP_PER_HOUR")?,
        max_keys: env_u64("MAX_KEYS")?,
        plan: std::env::var("PLAN").ok(),
    };
    let prometheus = if std::env::var("PROMETHEUS").as_deref() == Ok("1") {
        Some(install_prometheus()?)
    } else {
        None
    };
    let store = match config.max_keys {
        Some(n) => MemoryBackend::new().max_keys(usize::try_from(n)?),
        None => MemoryBackend::new(),
    };
    let held = matches!(config.mode.as_str(), "mem1" | "mem4").then(|| store.clone());
    let mut app = app(&config, store).await?;
    if let Some(handle) = prometheus {
        app = app.merge(Router::new().route(
            "/_metrics",
            get(move || {
                let mut out = handle.render();
                if let Some(store) = &held {
                    out.push_str(&format!("bench_server_memory_keys {}\n", store.len()));
                }
                async move { out }
            }),
        ));
    }
    let addr = std::env::var("LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

/// The mode's app; mem1 and mem4 keep their buckets in `store`.
async fn app(c: &Config, store: MemoryBackend) -> Res<Router> {
    let router = Router::new().route("/", get(|| async { "hello" }));
    let redis_url = || {
        c.redis_url
            .clone()
            .ok_or_else(|| format!("mode {} needs REDIS_URL", c.mode))
    };
    let redis_backend = || -> Res<RedisBackend> { Ok(RedisBackend::from_url(&redis_url()?)?) };
    Ok(match c.mode.as_str() {
        "bare" => router,
        "bare_auth" => router.layer(middleware::from_fn(auth)),
        "mem1" => router.layer(ours(store.into(), 1, c)?),
        "mem4" => router
            .layer(ours(store.into(), 4, c)?)
            .layer(middleware::from_fn(auth)),
        "redis1" => router.layer(started(ours(redis_backend()?.into(), 1, c)?, c).await?),
        "redis4" => router
            .layer(started(ours(redis_backend()?.into(), 4, c)?, c).await?)
            .layer(middleware::from_fn(auth)),
        "redis4_lease" | "redis4_lease_all" => {
            let leased: &[&str] = if c.mode == "redis4_lease" {
                &["global", "endpoint"]
            } else {
                &["global", "ip", "user", "endpoint"]
            };
            let layer = ours_leased(RedisBackend::from_url(&redis_url()?)?.into(), 4, c, leased)?;
            let handle = layer.handle();
            router
                .layer(layer)
                .layer(middleware::from_fn(auth))
                .merge(
                    Router::new().route(
                        "/_lease",
                        get(move || {
                            let n = handle.lease_counts();
                            async move {
                                format!("{} {} {} {}\n", n.calls, n.taken, n.returned, n.local)
                            }
                        }),
                    ),
                )
        }
        "governor" | "governor_headers" => {
            let mut b = GovernorConfigBuilder::default();
            match c.deny_rate {
                Some(rate) => b
                    .period(Duration::from_secs(1) / u32::try_from(rate)?)
                    .burst_size(u32::try_from(rate)?),
                None => b
                    .period(Duration::from_secs(1) / u32::try_from(NEVER_RATE)?)
                    .burst_size(u32::MAX),
            };
            if c.mode == "governor_headers" {
                let conf = b.use_headers().finish().ok_or("invalid governor quota")?;
                router.layer(GovernorLayer::new(conf))
            } else {
                let conf = b.finish().ok_or("invalid governor quota")?;
                router.layer(GovernorLayer::new(conf))
            }
        }
        "minimal" | "minimal_pool" => {
            let pooled = c.mode == "minimal_pool";
            let state = Minimal::connect(&redis_url()?, c.deny_rate, pooled).await?;
            router.layer(middleware::from_fn_with_state(state, minimal))
        }
        "minimal1" | "minimal4" => {
            let state = Minimal4::connect(&redis_url()?, c, c.mode == "minimal1").await?;
            router.layer(middleware::from_fn_with_state(state, minimal4))
        }
        _ => return Err(usage()),
    })
}

/// The quotas of the `ip` tier, of the `global` and `endpoint` tiers, and of
/// the `user` tier (shared by our layer and `minimal4`).
struct Quotas {
    ip: Quota,
    other: Quota,
    user: Quota,
}

impl Quotas {
    fn new(c: &Config) -> Self {
        let ip = match (c.ip_per_hour, c.deny_rate) {
            (Some(n), _) => Quota::per_hour(n),
            (None, Some(rate)) => Quota::per_second(rate),
            (None, None) => huge(),
        };
        let other = c.other_rate.map_or_else(huge, Quota::per_second);
        let user = match (c.user_per_minute.map(Quota::per_minute))
            .or_else(|| c.user_per_hour.map(Quota::per_hour))
        {
            Some(q) => c.user_burst.map_or(q, |burst| q.burst(burst)),
            None => other,
        };
        Self { ip, other, user }
    }
}

/// Our layer: the `ip` tier alone, or `global`, `ip`, `user`, `endpoint`.
fn ours(backend: Backend, tiers: usize, c: &Config) -> Res<RateLimitLayer> {
    ours_leased(backend, tiers, c, &[])
}

/// [`ours`] with the tiers named in `leased` in lease mode.
fn ours_leased(backend: Backend, tiers: usize, c: &Config, leased: &[&str]) -> Res<RateLimitLayer> {
    let Quotas { ip, other, user } = Quotas::new(c);
    let planned = c.plan.is_some();
    let candidates: Vec<Quota> = (1..=c.candidates)
        .map(|k| Quota::new(ip.limit() + k, ip.period()).burst(ip.burst_size()))
        .collect();
    let tier = |t: Tier| {
        let t = if planned {
            t.rollout(bench_plan()).guard(FallbackGuard::shadow())
        } else {
            t
        };
        let t = if t.name() == "ip" && !candidates.is_empty() {
            t.candidates(candidates.iter().copied())
        } else {
            t
        };
        if leased.contains(&t.name()) {
            t.lease(TokenLease::new())
        } else {
            t
        }
    };
    let mut b = RateLimitLayer::builder().backend(backend);
    if planned {
        b = b.control_key(tiered_ratelimit::handle::ControlKey::new("bench:control"));
    }
    if let Some(n) = c.deny_cache {
        b = b.deny_cache(n);
    }
    if c.no_headers {
        b = b.headers(tiered_ratelimit::response::HeaderStyle::None);
    }
    if tiers == 1 {
        b = b.tier(tier(Tier::new("ip", ClientIp::default(), ip)));
    } else {
        b = b
            .tier(tier(Tier::new("global", Global, other)))
            .tier(tier(Tier::new("ip", ClientIp::default(), ip)))
            .tier(tier(Tier::new("user", User, user)))
            .tier(tier(Tier::new("endpoint", Endpoint, other)));
    }
    Ok(b.build()?)
}

/// `layer`, its `ip` tier's plan started under `PLAN=running`.
async fn started(layer: RateLimitLayer, c: &Config) -> Res<RateLimitLayer> {
    if c.plan.as_deref() == Some("running") {
        // Already running: started by an earlier run on this Redis (the
        // gates count on every instance, leader or not).
        if let Err(e) = layer.handle().plan("ip", PlanAction::Start, "bench").await {
            if !matches!(&e, ControlError::Invalid { field, .. } if field == "action") {
                return Err(e.into());
            }
        }
    }
    Ok(layer)
}

/// `PLAN`'s plan: enforce for an hour, then enforce (the mode never
/// changes, so only the plan's own cost shows), with a guard.
fn bench_plan() -> RolloutPlan {
    RolloutPlan::new([
        Stage::new(Mode::Enforce).hold_for(Duration::from_secs(3600)),
        Stage::new(Mode::Enforce),
    ])
    .guard(|_| async { GuardVerdict::Healthy })
}

/// The app's "auth": the `x-user` header becomes the request's `UserId`.
async fn auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .map(|s| UserId(s.to_owned()));
    if let Some(u) = user {
        req.extensions_mut().insert(u);
    }
    next.run(req).await
}

/// The minimal Redis limiter's state: one multiplexed connection, the
/// script's SHA1, and its rate and burst.
#[derive(Clone)]
struct Minimal {
    conn: MinimalConn,
    sha: Arc<str>,
    rate: u64,
    burst: u64,
}

/// How the minimal middleware reaches Redis.
#[derive(Clone)]
enum MinimalConn {
    /// One multiplexed connection shared by every request.
    Shared(MultiplexedConnection),
    /// A `deadpool-redis` checkout per request (32 connections, one per wrk
    /// connection).
    Pool(deadpool_redis::Pool),
}

impl Minimal {
    async fn connect(url: &str, deny_rate: Option<u64>, pooled: bool) -> Res<Self> {
        let mut conn = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(MINIMAL_LUA)
            .query_async(&mut conn)
            .await?;
        let conn = if pooled {
            let mut cfg = deadpool_redis::Config::from_url(url);
            cfg.pool = Some(deadpool_redis::PoolConfig::new(32));
            MinimalConn::Pool(cfg.create_pool(Some(deadpool_redis::Runtime::Tokio1))?)
        } else {
            MinimalConn::Shared(conn)
        };
        Ok(Self {
            conn,
            sha: sha.into(),
            rate: deny_rate.unwrap_or(NEVER_RATE),
            burst: deny_rate.unwrap_or(NEVER_BURST),
        })
    }
}

async fn minimal(
    State(mut m): State<Minimal>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(&*m.sha)
        .arg(1)
        .arg(format!("min:{}", peer.ip()))
        .arg(m.rate)
        .arg(m.burst);
    let reply: Result<(i64, i64), redis::RedisError> = match &mut m.conn {
        MinimalConn::Shared(conn) => cmd.query_async(conn).await,
        MinimalConn::Pool(pool) => match pool.get().await {
            Ok(mut conn) => cmd.query_async(&mut conn).await,
            Err(e) => Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "pool",
                e.to_string(),
            ))),
        },
    };
    match reply {
        Ok((1, remaining)) => {
            let mut res = next.run(req).await;
            res.headers_mut()
                .insert("x-ratelimit-remaining", HeaderValue::from(remaining));
            res
        }
        Ok(_) => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1")],
            "rate limited",
        )
            .into_response(),
        // Fail open, like the layer's default.
        Err(_) => next.run(req).await,
    }
}

/// The four-key minimal limiter's state (`minimal4`, and `minimal1`: the
/// ip key alone): one multiplexed connection, the script's SHA1, and per
/// tier (global, ip, user, endpoint) the GCRA emission interval and
/// tolerance in µs.
#[derive(Clone)]
struct Minimal4 {
    conn: MultiplexedConnection,
    sha: Arc<str>,
    ip_only: bool,
    global: [u64; 2],
    ip: [u64; 2],
    user: [u64; 2],
    endpoint: [u64; 2],
}

/// A quota as GCRA parameters in µs: the emission interval (the period ÷
/// the limit, rounded up to a whole µs) and the tolerance (burst × the
/// interval).
fn gcra(q: Quota) -> [u64; 2] {
    let period = u64::try_from(q.period().as_micros()).unwrap_or(u64::MAX);
    let interval = period.div_ceil(q.limit()).max(1);
    [interval, interval.saturating_mul(q.burst_size())]
}

impl Minimal4 {
    async fn connect(url: &str, c: &Config, ip_only: bool) -> Res<Self> {
        let mut conn = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(MINIMAL4_LUA)
            .query_async(&mut conn)
            .await?;
        let q = Quotas::new(c);
        Ok(Self {
            conn,
            sha: sha.into(),
            ip_only,
            global: gcra(q.other),
            ip: gcra(q.ip),
            user: gcra(q.user),
            endpoint: gcra(q.other),
        })
    }
}

/// One EVALSHA over the keys our layer's redis4 would charge for this
/// request (`rl:global:all`, `rl:ip:<ip>`, `rl:user:<x-user>` when the
/// header is there, `rl:endpoint:<method route>`, parts escaped as the layer
/// escapes them).
async fn minimal4(
    State(mut m): State<Minimal4>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let user = req.headers().get("x-user").map(|v| v.as_bytes());
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or(UNMATCHED_ROUTE, |p| p.as_str());
    let endpoint = storage_key_part(format!("{} {route}", req.method()).as_bytes());
    let mut cmd = redis::cmd("EVALSHA");
    if m.ip_only {
        cmd.arg(&*m.sha).arg(1).arg(format!("rl:ip:{}", peer.ip()));
        cmd.arg(&m.ip[..]);
        return match cmd.query_async::<i64>(&mut m.conn).await {
            Ok(0) => StatusCode::TOO_MANY_REQUESTS.into_response(),
            _ => next.run(req).await,
        };
    }
    cmd.arg(&*m.sha).arg(3 + usize::from(user.is_some()));
    cmd.arg("rl:global:all").arg(format!("rl:ip:{}", peer.ip()));
    if let Some(u) = user {
        cmd.arg(format!("rl:user:{}", storage_key_part(u)));
    }
    cmd.arg(format!("rl:endpoint:{endpoint}"));
    cmd.arg(&m.global[..]).arg(&m.ip[..]);
    if user.is_some() {
        cmd.arg(&m.user[..]);
    }
    cmd.arg(&m.endpoint[..]);
    match cmd.query_async::<i64>(&mut m.conn).await {
        Ok(0) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        // Allowed, or fail open like the layer's default.
        _ => next.run(req).await,
    }
}
