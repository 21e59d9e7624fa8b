//! Test support: real `redis-server` processes on free loopback ports
//! ([`redis_server`], [`cluster`]) and a real axum server over TCP; seeded
//! randomness ([`rng`]), the shared algorithm tables and oracle
//! ([`algorithms`]) and the per-algorithm HTTP scenarios
//! ([`algorithms_http`]).
#![allow(dead_code)]

pub mod algorithms;
pub mod algorithms_http;
pub mod cluster;
pub mod forward;
pub mod priced;
pub mod redis_server;
pub mod rng;
pub mod sentinel;

pub use redis_server::RedisServer;

use axum::{
    extract::Request,
    http::StatusCode,
    middleware::{self, Next},
    response::Response,
    routing::{get, post},
    Router,
};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend};
use tiered_ratelimit::{key::UserId, RateLimitLayer};

/// 2023-11-14T22:13:20Z: a whole second, so test clocks give exact headers.
pub const T0_S: u64 = 1_700_000_000;
pub const T0_US: u64 = T0_S * 1_000_000;

/// Demo auth: `Authorization: Bearer <id>` becomes `UserId(<id>)`, and
/// `x-test-plan: <plan>` becomes `Plan(<plan>)`.
pub async fn auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|id| UserId(id.to_owned()));
    if let Some(u) = user {
        req.extensions_mut().insert(u);
    }
    // Test-only: the plan comes from a header the "auth layer" trusts.
    let plan = req
        .headers()
        .get("x-test-plan")
        .and_then(|v| v.to_str().ok())
        .map(|p| tiered_ratelimit::rollout::Plan(p.to_owned()));
    if let Some(p) = plan {
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

/// The app under test: a few routes, the limiter, auth outside it.
pub fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/users/{id}", get(|| async { "user" }))
        .route("/login", post(|| async { "welcome" }))
        .route(
            "/boom",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        )
        .layer(layer)
        .layer(middleware::from_fn(auth))
}

/// Serves `app` on a free loopback port with `ConnectInfo<SocketAddr>`.
pub async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("serve");
    });
    addr
}

/// Serves `app` WITHOUT `ConnectInfo` (a misconfigured deployment).
pub async fn serve_without_connect_info(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    addr
}

/// The tests' HTTP client settings (a 10 s timeout), to add to.
pub fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().timeout(Duration::from_secs(10))
}

pub fn client() -> reqwest::Client {
    client_builder().build().expect("client")
}

/// A tier cost read from request header `name` (1 when absent or not a
/// number), for `Tier::cost_fn`.
pub fn cost_from_header(
    name: impl Into<String>,
) -> impl Fn(&http::request::Parts) -> u64 + Send + Sync + 'static {
    let name = name.into();
    move |p: &http::request::Parts| {
        p.headers
            .get(&name)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    }
}

/// A current-thread runtime with time and I/O, for tests that drive async
/// code from a plain `#[test]` (thread-local subscribers and recorders).
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A two-worker runtime with time and I/O, for a plain `#[test]`.
pub fn multi_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A metric's labels as `key=value`, in the order they were recorded.
pub fn metric_labels(key: &metrics::Key) -> Vec<String> {
    key.labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect()
}

/// The rate-limit headers of a response, as numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub status: u16,
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    pub reset: Option<u64>,
    pub retry_after: Option<u64>,
}

pub fn limits(res: &reqwest::Response) -> Limits {
    let h = |name: &str| -> Option<u64> {
        let all: Vec<_> = res.headers().get_all(name).iter().collect();
        assert!(all.len() <= 1, "header {name} sent {} times", all.len());
        all.first().map(|v| {
            v.to_str()
                .expect("ascii header")
                .parse()
                .expect("integer header")
        })
    };
    Limits {
        status: res.status().as_u16(),
        limit: h("x-ratelimit-limit"),
        remaining: h("x-ratelimit-remaining"),
        reset: h("x-ratelimit-reset"),
        retry_after: h("retry-after"),
    }
}

/// An allowed response's expected limits.
pub fn ok(limit: u64, remaining: u64, reset: u64) -> Limits {
    Limits {
        status: 200,
        limit: Some(limit),
        remaining: Some(remaining),
        reset: Some(reset),
        retry_after: None,
    }
}

/// A denied response's expected limits.
pub fn denied(limit: u64, remaining: u64, reset: u64, retry_after: u64) -> Limits {
    Limits {
        status: 429,
        limit: Some(limit),
        remaining: Some(remaining),
        reset: Some(reset),
        retry_after: Some(retry_after),
    }
}

pub const NO_LIMITS: Limits = Limits {
    status: 200,
    limit: None,
    remaining: None,
    reset: None,
    retry_after: None,
};

/// A layer on a real Redis (`redis`, a server of the test's own) whose
/// scripts read the manual `clock`: add tiers and settings, then build.
pub fn redis_layer(
    redis: &RedisServer,
    clock: &ManualClock,
) -> tiered_ratelimit::RateLimitLayerBuilder {
    RateLimitLayer::builder().backend(redis.backend_on(clock))
}

/// A backend on a manual clock, plus the Redis server behind it (if any).
pub struct Env {
    pub clock: ManualClock,
    pub backend: Backend,
    pub redis: Option<RedisServer>,
}

impl Env {
    pub fn memory() -> Self {
        let clock = ManualClock::new(T0_US);
        Env {
            backend: MemoryBackend::with_manual_clock(clock.clone()).into(),
            clock,
            redis: None,
        }
    }

    pub fn redis() -> Self {
        let clock = ManualClock::new(T0_US);
        let server = RedisServer::start();
        let backend = server.backend_on(&clock);
        Env {
            clock,
            backend: backend.into(),
            redis: Some(server),
        }
    }

    /// On `cluster` (a Redis Cluster of the test's own), on a manual clock.
    pub fn cluster(cluster: &cluster::RedisCluster) -> Self {
        let clock = ManualClock::new(T0_US);
        let backend = tiered_ratelimit::backend::RedisBackend::cluster(cluster.urls())
            .expect("cluster urls")
            .with_manual_clock(clock.clone())
            .with_test_ttl_slack(Duration::from_secs(600));
        Env {
            clock,
            backend: backend.into(),
            redis: None,
        }
    }

    pub fn builder(&self) -> tiered_ratelimit::RateLimitLayerBuilder {
        RateLimitLayer::builder()
            .backend(self.backend.clone())
            .docs_url("https://example.com/docs/rate-limits")
            .backend_timeout(Duration::from_secs(2))
    }
}

/// Runs each named `async fn(Env)` scenario on the memory backend and on a
/// Redis of the test's own.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Env::memory()).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Env::redis()).await;
                }
            )*
        }
    };
}

/// What a `tracing` subscriber wrote, for tests that assert the layer's log
/// lines (plain text, no colours).
#[derive(Clone, Default)]
pub struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A global dispatcher interested in every callsite, installed before the
/// first capture. A test captures its logs with a thread-scoped subscriber
/// (`tracing::subscriber::set_default`) while other tests of its binary run
/// on other threads: with no global subscriber, a callsite that one of them
/// registered at the same moment could keep the no-subscriber's "never"
/// interest, and the capturing test then missed that event (seen once in
/// six runs once the tests of a topic shared one binary). With this one,
/// every callsite's interest includes a dispatcher that wants it.
fn ensure_global_dispatcher() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
    });
}

impl LogBuf {
    /// A subscriber writing events up to `level` here.
    pub fn subscriber(&self, level: tracing::Level) -> impl tracing::Subscriber + Send + Sync {
        ensure_global_dispatcher();
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    /// The same, also writing a line when each span closes (with its fields).
    pub fn subscriber_with_spans(
        &self,
        level: tracing::Level,
    ) -> impl tracing::Subscriber + Send + Sync {
        ensure_global_dispatcher();
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}
