//! The server `benches/load.sh` puts under load: a trivial `GET /` handler
//! behind one of several rate limiters, so that their costs can be compared
//! request for request (`docs/performance.md`).
//!
//! ```text
//! bench_server <mode> [deny]
//!
//!   bare      axum alone
//!   mem1      RateLimitLayer, memory backend, 1 tier: ip (ClientIp)
//!   mem4      RateLimitLayer, memory backend, 4 tiers: global, ip, user
//!             (an `x-user` header turned into a UserId by a middleware),
//!             endpoint
//!   governor  tower_governor's per-IP governor (PeerIpKeyExtractor)
//!   redis1    RateLimitLayer on Redis (REDIS_URL), 1 tier: ip
//!   redis4    RateLimitLayer on Redis, the 4 tiers of mem4
//!   minimal   an axum::middleware::from_fn doing one EVALSHA of a plain
//!             token-bucket script per request on one MultiplexedConnection
//!             (the floor any Redis limiter pays)
//!   minimal_pool  the same with a deadpool-redis checkout per request (a
//!             pool of 32), the other way to share connections
//!
//!   deny      the per-IP limit is DENY_RATE per second (default 10; burst
//!             the same), so under load nearly every request is denied.
//!             Without it no limiter denies during a run: burst 10^9,
//!             refilled at 1000 per second (keys persist, as busy ones do).
//! ```
//!
//! Environment: `LISTEN_ADDR` (default `127.0.0.1:3000`), `REDIS_URL`
//! (redis1, redis4, minimal), `DENY_RATE`, `DENY_CACHE` (the layer's deny
//! cache capacity; 0 disables it), `OTHER_RATE` (the per-second limit of the
//! global, user and endpoint tiers; default a billion),
//! `USER_QUOTA_PER_MINUTE=N` (mem4, redis4: the `user` tier is
//! `Quota::per_minute(N)` instead, so a user's key lives only until its
//! bucket is full again, as under a real quota: `benches/scale.sh`; unset =
//! the `OTHER_RATE` quota), `USER_BURST=B` (with `USER_QUOTA_PER_MINUTE`:
//! `.burst(B)`, so a few hot users are never denied while the refill rate,
//! and with it every key's TTL, stays the quota's), `PROMETHEUS=1` (install
//! a Prometheus metrics recorder, without its HTTP listener, to count what
//! metrics cost), `HEADERS=none` (our layer sends no rate-limit headers, as
//! tower_governor by default: what the headers cost).
//! Prints `listening on <addr>` once it accepts connections.
//! `bench_server minimal-lua` prints the minimal limiter's script,
//! `bench_server script-sha` the SHA1 of the layer's script.

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
use tiered_ratelimit::key::{ClientIp, Endpoint, Global, User};
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
    /// The `user` tier's burst with `user_per_minute` (default: the limit).
    user_burst: Option<u64>,
    /// Send no rate-limit headers.
    no_headers: bool,
}

fn usage() -> Box<dyn Error + Send + Sync> {
    "usage: bench_server <bare|mem1|mem4|governor|redis1|redis4|minimal|minimal_pool> [deny]".into()
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
        user_burst: env_u64("USER_BURST")?,
        no_headers: std::env::var("HEADERS").as_deref() == Ok("none"),
    };
    if std::env::var("PROMETHEUS").as_deref() == Ok("1") {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        metrics::set_global_recorder(recorder).map_err(|e| e.to_string())?;
    }
    let app = app(&config).await?;
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

async fn app(c: &Config) -> Res<Router> {
    let router = Router::new().route("/", get(|| async { "hello" }));
    let redis_url = || {
        c.redis_url
            .clone()
            .ok_or_else(|| format!("mode {} needs REDIS_URL", c.mode))
    };
    Ok(match c.mode.as_str() {
        "bare" => router,
        "mem1" => router.layer(ours(MemoryBackend::new().into(), 1, c)?),
        "mem4" => router
            .layer(ours(MemoryBackend::new().into(), 4, c)?)
            .layer(middleware::from_fn(auth)),
        "redis1" => router.layer(ours(RedisBackend::from_url(&redis_url()?)?.into(), 1, c)?),
        "redis4" => router
            .layer(ours(RedisBackend::from_url(&redis_url()?)?.into(), 4, c)?)
            .layer(middleware::from_fn(auth)),
        "governor" => {
            let mut b = GovernorConfigBuilder::default();
            match c.deny_rate {
                Some(rate) => b
                    .period(Duration::from_secs(1) / u32::try_from(rate)?)
                    .burst_size(u32::try_from(rate)?),
                None => b
                    .period(Duration::from_secs(1) / u32::try_from(NEVER_RATE)?)
                    .burst_size(u32::MAX),
            };
            let conf = b.finish().ok_or("invalid governor quota")?;
            router.layer(GovernorLayer::new(conf))
        }
        "minimal" | "minimal_pool" => {
            let pooled = c.mode == "minimal_pool";
            let state = Minimal::connect(&redis_url()?, c.deny_rate, pooled).await?;
            router.layer(middleware::from_fn_with_state(state, minimal))
        }
        _ => return Err(usage()),
    })
}

/// Our layer: the `ip` tier alone, or `global`, `ip`, `user`, `endpoint`.
fn ours(backend: Backend, tiers: usize, c: &Config) -> Res<RateLimitLayer> {
    let ip = match c.deny_rate {
        Some(rate) => Quota::per_second(rate),
        None => huge(),
    };
    let other = c.other_rate.map_or_else(huge, Quota::per_second);
    let user = match (c.user_per_minute, c.user_burst) {
        (Some(n), Some(burst)) => Quota::per_minute(n).burst(burst),
        (Some(n), None) => Quota::per_minute(n),
        (None, _) => other,
    };
    let mut b = RateLimitLayer::builder().backend(backend);
    if let Some(n) = c.deny_cache {
        b = b.deny_cache(n);
    }
    if c.no_headers {
        b = b.headers(tiered_ratelimit::response::HeaderStyle::None);
    }
    if tiers == 1 {
        b = b.tier(Tier::new("ip", ClientIp::default(), ip));
    } else {
        b = b
            .tier(Tier::new("global", Global, other))
            .tier(Tier::new("ip", ClientIp::default(), ip))
            .tier(Tier::new("user", User, user))
            .tier(Tier::new("endpoint", Endpoint, other));
    }
    Ok(b.build()?)
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
