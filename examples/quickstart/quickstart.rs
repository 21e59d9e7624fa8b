//! A small axum server behind a five-tier rate limiter.
//!
//! ```text
//! cargo run --example quickstart                                   # in-memory buckets
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example quickstart # shared buckets in Redis
//! POLICY_FILE=my-policy.toml cargo run --example quickstart        # your own limits
//! ```
//!
//! Environment:
//! * `LISTEN_ADDR`: where to listen (default `127.0.0.1:3000`).
//! * `REDIS_URL`: unset = in-memory backend; set = Redis backend.
//! * `REDIS_CLUSTER_NODES`: comma-separated node URLs of a Redis Cluster
//!   (`redis://127.0.0.1:7000,redis://127.0.0.1:7001`); when set, it is used
//!   instead of `REDIS_URL`.
//! * `REDIS_SENTINELS` and `REDIS_MASTER_NAME`: comma-separated Redis
//!   Sentinel URLs (`redis://127.0.0.1:26379,redis://127.0.0.1:26380`) and
//!   the monitored master's name (default `mymaster`); when set, used
//!   instead of both above.
//! * None of these: the policy's `[redis]` table if it has one (`url`,
//!   `cluster_nodes`, or `sentinels` and `master_name`), else in memory.
//! * `POLICY_FILE`: a policy TOML file; unset = the built-in
//!   [`DEFAULT_POLICY`], printed at start-up.
//! * `RUST_LOG`: log filter (default `info`).
//! * `ADMIN_TOKEN`: when set (non-empty), the admin router
//!   ([`tiered_ratelimit::admin`]) is mounted at `/admin/ratelimit` and wants
//!   this bearer token; unset, it is not mounted at all.
//!
//! Routes: `GET /`, `GET /users/{id}`, `POST /login`, `GET /slow?ms=N`
//! (answers after N ms, at most 10 000: try it with the built-in policy's
//! commented concurrency tier), `GET /llm?tokens=N` (answers with
//! `x-usage-tokens: N`) and `GET /llm?tokens=N&stream_ms=M` (streams for M
//! ms, at most 10 000, and reports N in an `x-usage-tokens` trailer): try
//! them with the commented priced tier; plus `GET /metrics`
//! (Prometheus text format, not rate limited) and, with `ADMIN_TOKEN`, the
//! admin page and JSON API under `/admin/ratelimit` (see
//! `docs/observability.md`). A demo auth layer turns
//! `Authorization: Bearer <id>` into a [`UserId`] (no real authentication!),
//! so the `user` tier applies; anonymous requests skip it. The `api_key` tier
//! applies to requests with an `x-api-key` header.

use std::{error::Error, io::IsTerminal, net::SocketAddr, process::ExitCode};

use axum::{
    extract::{Path, RawQuery, Request},
    http::header::AUTHORIZATION,
    middleware::{self, Next},
    response::Response,
    routing::{get, post},
    Extension, Json, Router,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{json, Value};
use tiered_ratelimit::{
    admin,
    backend::{Backend, MemoryBackend, RedisBackend},
    key::UserId,
    policy::Policy,
    response::Rejection,
    RateLimitHandle, RateLimitLayer,
};
use tracing_subscriber::EnvFilter;

/// The policy used when `POLICY_FILE` is unset. Small on purpose: hit `/` a
/// dozen times within ten seconds and the `endpoint` tier answers 429.
const DEFAULT_POLICY: &str = r#"# tiered-ratelimit policy (TOML). Save a copy, edit it, run with POLICY_FILE=<path>.
key_prefix = "quickstart"          # storage keys are <prefix>:<tier>:<key part>; one prefix
                                   # per service sharing a Redis (default "rl")
failure_policy = "open"            # "open" (pass when the backend fails) | "closed" (503)
backend_timeout_ms = 100
docs_url = "https://example.com/docs/rate-limits"

[client_ip]
trusted_proxies = []               # CIDRs of your proxies; empty = trust no X-Forwarded-For
ipv6_prefix = 64

[control]                          # with REDIS_URL: `redis-cli HSET quickstart:control mode off` = kill switch
redis_key = "quickstart:control"
poll_interval = "5s"

# Tiers are checked in this order; a request must pass all that apply.
# key = "global" | "ip" | "user" | "endpoint" | { header = "<name>" }
[[tier]]
name = "global"                    # one bucket for the whole service
key = "global"
limit = 1000
period = "1s"
burst = 2000
# sync = "lease"                   # with REDIS_URL: lease mode, this hot key decided in
                                   # process from tokens leased out of Redis, never over
                                   # the quota (docs/redis.md, "Lease mode")

[[tier]]
name = "ip"                        # per client IP (TCP peer)
key = "ip"
limit = 60
period = "1m"
# A penalty box: uncomment, and an IP denied 3 times within 10 minutes is
# blocked for 15 minutes (doubled for each repeat within 24 h); the admin
# page (ADMIN_TOKEN) shows and lifts blocks.
# [tier.penalty]
# violations = 3
# window = "10m"
# block = "15m"
# backoff = 2
# memory = "24h"
# max_block = "24h"

[[tier]]
name = "api_key"                   # per x-api-key value (stored hashed)
key = { header = "x-api-key" }
limit = 10000
period = "1h"
# overrides = true                 # per-key quotas, unlimited or blocked, set at run
                                   # time (admin page, POST /api/overrides, the CLI)

[[tier]]
name = "user"                      # per UserId; anonymous requests skip it
key = "user"
limit = 100
period = "1m"

[[tier]]
name = "endpoint"                  # per method + route template, all clients together
key = "endpoint"
limit = 10
period = "10s"

# Requests in flight per client IP. Uncomment, restart, and run
# `curl localhost:3000/slow?ms=5000` in three terminals: the third gets 429
# (Retry-After: 1) until one of the first two has its answer.
# [[tier]]
# name = "ip_inflight"
# key = "ip"
# algorithm = "concurrency"
# limit = 2                        # at most 2 requests of one IP running at once
# lease = "60s"                    # a crashed instance's slots come back after this

# Tokens per minute per API key, priced by the response (an LLM API): each
# request reserves its estimate (x-max-tokens) and is settled with what it
# used (x-usage-tokens) when its response ends. Uncomment, restart, and run
# `curl -i -H 'x-api-key: k' -H 'x-max-tokens: 500' 'localhost:3000/llm?tokens=120'`
# (500 reserved, 120 charged: X-RateLimit-Remaining is after the settle), or
# add `&stream_ms=3000` to stream for 3 s with the usage in a trailer.
# [[tier]]
# name = "tokens"
# key = { header = "x-api-key" }
# limit = 10000
# period = "1m"
# [tier.priced]
# estimate = { header = "x-max-tokens", default = 1000, max = 8000 }
# actual = { header = "x-usage-tokens" }
"#;

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr; stdout carries the policy and the hints below.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Display, not Debug: configuration errors name the field and line.
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let listen_addr = env_or("LISTEN_ADDR", "127.0.0.1:3000");

    let mut policy = match std::env::var("POLICY_FILE") {
        Ok(path) if !path.is_empty() => {
            println!("policy: {path}");
            Policy::from_file(&path)?
        }
        _ => {
            println!("policy: built-in default (set POLICY_FILE=<path> to use your own):\n");
            println!("{DEFAULT_POLICY}");
            Policy::from_toml_str(DEFAULT_POLICY)?
        }
    };

    let sentinels = url_list("REDIS_SENTINELS");
    let cluster_nodes = url_list("REDIS_CLUSTER_NODES");
    let shown = |urls: &[String]| {
        urls.iter()
            .map(|u| redact(u))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let backend: Backend = match std::env::var("REDIS_URL") {
        _ if !sentinels.is_empty() => {
            let master = env_or("REDIS_MASTER_NAME", "mymaster");
            println!(
                "backend: redis primary of {master:?} via sentinels {}",
                shown(&sentinels)
            );
            RedisBackend::sentinel(&sentinels, &master)?.into()
        }
        _ if !cluster_nodes.is_empty() => {
            println!("backend: redis cluster at {}", shown(&cluster_nodes));
            RedisBackend::cluster(&cluster_nodes)?.into()
        }
        Ok(url) if !url.is_empty() => {
            println!("backend: redis at {}", redact(&url));
            RedisBackend::from_url(&url)?.into()
        }
        _ => match &policy.redis {
            Some(redis) => {
                println!("backend: the policy's [redis] table: {redis:?}");
                redis.backend()?.into()
            }
            None => {
                println!("backend: in-memory (set REDIS_URL to share buckets between processes)");
                // The control key lives in Redis: in memory it would not be
                // watched (the layer warns so), so this demo leaves it out.
                if policy.control.take().is_some() {
                    println!("[control]: needs Redis, not used in memory");
                }
                MemoryBackend::new().into()
            }
        },
    };

    // The metrics recorder before the layer: it sets gauges when built.
    let prometheus = prometheus()?;
    // build_checked: one PING first, so an unreachable Redis is said now
    // (one WARN under failure_policy = "open"; an error under "closed").
    let rate_limit = policy.builder(backend)?.build_checked().await?;
    // Same thing: RateLimitLayer::from_policy(&policy, backend)?
    let tiers: Vec<&str> = rate_limit.tier_names().collect();
    println!("tiers, in check order: {}", tiers.join(", "));

    let handle = rate_limit.handle();
    let leases = handle.clone();
    let admin_token = std::env::var("ADMIN_TOKEN").ok().filter(|t| !t.is_empty());
    let admin_mounted = admin_token.is_some();
    let app = app(rate_limit).merge(ops(prometheus, handle, admin_token));

    let shutdown = shutdown_signal()?;
    let listener = tokio::net::TcpListener::bind(&listen_addr).await?;
    let local = listener.local_addr()?;
    println!("\nlistening on http://{local}");
    println!("try:\n  for i in $(seq 1 12); do curl -s -o /dev/null -w '%{{http_code}} ' http://{local}/; done; echo");
    println!("  curl -i http://{local}/");
    println!("  curl -s http://{local}/metrics | grep '^tiered_ratelimit'");
    if admin_mounted {
        println!("admin page: http://{local}/admin/ratelimit?token=$ADMIN_TOKEN (JSON: .../api/status with Authorization: Bearer $ADMIN_TOKEN)\n");
    } else {
        println!("(set ADMIN_TOKEN=<secret> to mount the admin page at /admin/ratelimit)\n");
    }

    // ClientIp keys by the TCP peer address, which axum only provides with
    // connect info.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await?;
    // Lease mode: the unspent tokens go back to the shared buckets.
    let returned = leases.return_leases().await;
    tracing::info!(leased_tokens_returned = returned, "server stopped");
    Ok(())
}

fn app(rate_limit: RateLimitLayer) -> Router {
    // With `Router::layer(a).layer(b)`, `b` wraps `a`: requests go through
    // `log_rejections`, then `demo_auth`, then the rate limiter, then the
    // handler. The auth layer must run before the limiter so that `UserId`
    // is in the extensions; `Router::layer` (rather than wrapping the whole
    // Router) runs the limiter after routing, so the `endpoint` tier sees the
    // route template (`/users/{id}`) through `MatchedPath`.
    //
    // The explicit fallback matters: `Router::merge` keeps a router's own
    // fallback only if it set one, so without it the operator routes merged
    // below would bring back an unlayered default 404 and unknown paths would
    // skip every tier. With it, 404s are limited too (keyed `<unmatched>` by
    // the endpoint tier).
    Router::new()
        .route("/", get(index))
        .route("/users/{id}", get(user))
        .route("/login", post(login))
        .route("/slow", get(slow))
        .route("/llm", get(llm))
        .fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "not found\n") })
        .layer(rate_limit)
        .layer(middleware::from_fn(demo_auth))
        .layer(middleware::from_fn(log_rejections))
}

/// Upper bounds (seconds) of the check latency histogram: with buckets set,
/// `tiered_ratelimit_check_duration_seconds` is exported as a Prometheus
/// histogram (`_bucket` series) rather than a summary.
const LATENCY_BUCKETS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

/// Installs the Prometheus recorder (the `metrics` facade's global) and
/// drains its histograms every 5 s, as `install_recorder` leaves to us.
fn prometheus() -> Result<PrometheusHandle, Box<dyn Error>> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tiered_ratelimit_check_duration_seconds".to_owned()),
            &LATENCY_BUCKETS,
        )?
        .install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Operator routes, merged after the limiter's layers so they are neither
/// rate limited nor counted: `GET /metrics`, and the admin router at
/// `/admin/ratelimit` only when a token is configured. In production, put
/// both behind your own access control too (the admin router's token is a
/// second lock, not the only one).
fn ops(
    prometheus: PrometheusHandle,
    handle: RateLimitHandle,
    admin_token: Option<String>,
) -> Router {
    let router = Router::new().route(
        "/metrics",
        get(move || std::future::ready(prometheus.render())),
    );
    match admin_token {
        Some(token) => router.nest("/admin/ratelimit", admin::router(handle, token)),
        None => router,
    }
}

async fn index() -> &'static str {
    "hello from tiered-ratelimit\n"
}

async fn user(Path(id): Path<String>, caller: Option<Extension<UserId>>) -> Json<Value> {
    Json(json!({
        "id": id,
        "requested_by": caller.map(|Extension(UserId(u))| u),
    }))
}

/// `GET /slow?ms=N`: answers after N ms (default 1 000, at most 10 000), to
/// watch a concurrency tier work with curl.
async fn slow(RawQuery(query): RawQuery) -> String {
    let ms = query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1_000)
        .min(10_000);
    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    format!("slept {ms} ms\n")
}

/// `GET /llm?tokens=N[&stream_ms=M]`: an LLM-like answer that used N
/// tokens: with `x-usage-tokens: N`, or streamed for M ms (at most
/// 10 000), a chunk every 100 ms, with N in an `x-usage-tokens` trailer.
async fn llm(RawQuery(query): RawQuery) -> Response {
    let q = query.unwrap_or_default();
    let arg = |name: &str| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let tokens = arg("tokens").unwrap_or(0);
    let Some(ms) = arg("stream_ms").map(|m| m.min(10_000)) else {
        return Response::builder()
            .header("x-usage-tokens", tokens)
            .body(axum::body::Body::from(format!("used {tokens} tokens\n")))
            .unwrap_or_default();
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let mut n = 0u64;
        while start.elapsed().as_millis() < u128::from(ms) {
            n += 1;
            let chunk = http_body::Frame::data(bytes::Bytes::from(format!("chunk {n}\n")));
            if tx.send(chunk).await.is_err() {
                return; // the client went away
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let mut trailers = axum::http::HeaderMap::new();
        trailers.insert("x-usage-tokens", tokens.into());
        let _ = tx.send(http_body::Frame::trailers(trailers)).await;
    });
    // HTTP/1.1 sends a trailer only when the head announces it (RFC 9112
    // §7.1.2, and hyper does so); HTTP/2 sends it either way.
    Response::builder()
        .header(axum::http::header::TRAILER, "x-usage-tokens")
        .body(axum::body::Body::new(Frames(rx)))
        .unwrap_or_default()
}

/// A body of the frames a task sends.
struct Frames(tokio::sync::mpsc::Receiver<http_body::Frame<bytes::Bytes>>);

impl http_body::Body for Frames {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|f| f.map(Ok))
    }
}

async fn login() -> Json<Value> {
    Json(json!({
        "hint": "this demo has no real login: send `Authorization: Bearer <any id>` to be that user",
    }))
}

/// Demo authentication: `Authorization: Bearer <id>` makes the request user
/// `<id>`. It checks nothing; a real app verifies a token or a session here.
async fn demo_auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(|id| UserId(id.to_owned()));
    if let Some(user) = user {
        req.extensions_mut().insert(user);
    }
    next.run(req).await
}

/// The limiter puts a [`Rejection`] into the extensions of every 429 it
/// sends; outer layers can log or count it.
async fn log_rejections(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let res = next.run(req).await;
    if let Some(r) = res.extensions().get::<Rejection>() {
        tracing::info!(%method, %path, tier = &*r.tier, retry_after = r.retry_after, "rate limited");
    }
    res
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// The comma-separated URLs in environment variable `name` (none when unset).
fn url_list(name: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `redis://user:secret@host/` → `redis://***@host/`, so passwords stay out
/// of the terminal.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}***{}", &url[..scheme_end + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// Listens for Ctrl-C (SIGINT) and SIGTERM. The handlers are registered
/// here, before the port opens, so a signal sent as soon as the server
/// accepts connections is not lost; the returned future resolves on the
/// first one, and axum then stops accepting connections and lets in-flight
/// requests finish.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => tracing::info!("Ctrl-C received, shutting down"),
                _ = terminate.recv() => tracing::info!("SIGTERM received, shutting down"),
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            match tokio::signal::ctrl_c().await {
                Ok(()) => tracing::info!("Ctrl-C received, shutting down"),
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for Ctrl-C");
                    std::future::pending::<()>().await;
                }
            }
        })
    }
}
