//! Observability, live: Prometheus metrics on `/metrics`, the admin router
//! (JSON API and HTML page) on `/admin/ratelimit`, and a traffic generator
//! with one abusive client, so there is something to look at.
//!
//! ```text
//! cargo run --example observability
//! # then open the admin URL it prints, and:
//! curl -s http://127.0.0.1:3002/metrics | grep '^tiered_ratelimit'
//! curl -s -H "Authorization: Bearer $ADMIN_TOKEN" http://127.0.0.1:3002/admin/ratelimit/api/status
//! ```
//!
//! Environment:
//! * `LISTEN_ADDR`: where to listen (default `127.0.0.1:3002`).
//! * `ADMIN_TOKEN`: the admin bearer token (default: a random one, printed).
//! * `RUN_SECS`: stop after this many seconds (default: run until Ctrl-C).
//! * `RUST_LOG`: log filter (default `info`: the anomaly warning and the
//!   admin's mode changes show; `tiered_ratelimit=debug` adds every 429).
//!
//! The traffic generator (a task in this process, on loopback) sends about
//! six requests a second from well-behaved users and an API-key client for
//! as long as the example runs; after 90 seconds `mallory` joins with 15
//! requests a second on `/search`. The `user` tier then answers 429 to most
//! of mallory's requests, the 429-rate baseline of (`user`, `GET /search`)
//! raises its alert two 10-second buckets later (a `WARN` line and
//! `tiered_ratelimit_anomaly = 1`), and the `endpoint` tier, in shadow mode,
//! counts would-be rejections on `/search`. Press the kill switch on the
//! page and the 429s stop at once.
//!
//! The latency histogram `tiered_ratelimit_check_duration_seconds` is
//! exported with buckets ([`LATENCY_BUCKETS`]), so Prometheus gets
//! `_bucket` series and `histogram_quantile` works (docs/grafana-dashboard.json
//! relies on it). Without `set_buckets*`, metrics-exporter-prometheus exports
//! histograms as summaries (quantiles computed in this process).

use axum::{
    extract::Request,
    http::header::AUTHORIZATION,
    middleware::{self, Next},
    response::Response,
    routing::get,
    Router,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::{error::Error, net::SocketAddr, time::Duration};
use tiered_ratelimit::{
    admin,
    key::{ApiKey, Endpoint, Global, User, UserId},
    observe::AnomalyConfig,
    rollout::Mode,
    Quota, RateLimitLayer, Tier,
};
use tracing_subscriber::EnvFilter;

/// Upper bounds (seconds) of the check latency histogram buckets: 50 µs to
/// 250 ms. The memory backend lands in the first buckets; Redis on a LAN in
/// the 0.25-2.5 ms ones.
const LATENCY_BUCKETS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    // The recorder first: the layer sets its mode gauges when it is built.
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tiered_ratelimit_check_duration_seconds".to_owned()),
            &LATENCY_BUCKETS,
        )?
        .install_recorder()?;
    // install_recorder() leaves upkeep (draining histograms) to the caller.
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });

    let layer = RateLimitLayer::builder()
        .tier(Tier::new("global", Global, Quota::per_second(200)))
        .tier(Tier::new("user", User, Quota::per_minute(120).burst(20)))
        .tier(Tier::new(
            "api_key",
            ApiKey::header("x-api-key"),
            Quota::per_minute(300),
        ))
        // Observed, never enforced: what would a per-route limit do?
        .tier(Tier::new("endpoint", Endpoint, Quota::per_second(5).burst(10)).mode(Mode::Shadow))
        // 10-second buckets so the demo alerts within minutes (default 60 s).
        .anomaly(AnomalyConfig {
            bucket_secs: 10,
            warmup: 6,
            ..AnomalyConfig::default()
        })
        .build()?;
    let handle = layer.handle();

    let token = std::env::var("ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(random_token);

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/users/{id}", get(|| async { "a user\n" }))
        .route("/search", get(|| async { "results\n" }))
        .layer(layer)
        .layer(middleware::from_fn(demo_auth))
        // Added after the layers: neither limited nor behind the demo auth.
        .route("/metrics", get(move || metrics(prometheus.clone())))
        .nest("/admin/ratelimit", admin::router(handle, token.clone()));

    let listen = std::env::var("LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:3002".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    println!("admin page:  http://{addr}/admin/ratelimit?token={token}");
    println!("  (the token in the URL is traded for a cookie at once; see docs/observability.md)");
    println!("metrics:     curl -s http://{addr}/metrics | grep '^tiered_ratelimit'");
    println!("admin API:   curl -s -H 'Authorization: Bearer {token}' http://{addr}/admin/ratelimit/api/status");
    println!("kill switch: curl -s -H 'Authorization: Bearer {token}' -d '{{\"mode\":\"off\"}}' http://{addr}/admin/ratelimit/api/mode");

    tokio::spawn(traffic(addr));

    let run_for = std::env::var("RUN_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok());
    let stop = async move {
        match run_for {
            Some(s) => {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(s)) => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    };
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(stop)
    .await?;
    Ok(())
}

async fn metrics(prometheus: PrometheusHandle) -> String {
    prometheus.render()
}

/// Demo authentication: `Authorization: Bearer <id>` makes the request user
/// `<id>`. It checks nothing.
async fn demo_auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|id| UserId(id.trim().to_owned()));
    if let Some(u) = user {
        req.extensions_mut().insert(u);
    }
    next.run(req).await
}

/// Loopback traffic for as long as the example runs: ~6 requests a second
/// from polite clients, and from 90 s on 15 a second from `mallory`.
async fn traffic(addr: SocketAddr) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client");
    let polite = {
        let client = client.clone();
        async move {
            let users = ["alice", "bob", "carol", "dave", "erin"];
            // Half on /search: the anomaly baseline of a (tier, endpoint) only
            // learns from buckets with at least 20 requests (min_requests).
            let paths = ["/search", "/", "/search", "/users/1"];
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            for i in 0usize.. {
                tick.tick().await;
                let user = users[i % users.len()];
                let path = paths[i % paths.len()];
                let _ = client
                    .get(format!("http://{addr}{path}"))
                    .bearer_auth(user)
                    .send()
                    .await;
                if i % 5 == 0 {
                    let _ = client
                        .get(format!("http://{addr}/users/{}", i % 50))
                        .header("x-api-key", "partner-key-1")
                        .send()
                        .await;
                }
            }
        }
    };
    let abusive = async move {
        tokio::time::sleep(Duration::from_secs(90)).await;
        tracing::info!("traffic: mallory starts flooding /search");
        let mut tick = tokio::time::interval(Duration::from_millis(1000 / 15));
        loop {
            tick.tick().await;
            let _ = client
                .get(format!("http://{addr}/search"))
                .bearer_auth("mallory")
                .send()
                .await;
        }
    };
    tokio::join!(polite, abusive);
}

/// 128 random bits in hex, from the standard library's per-process
/// `RandomState` keys. Demo only: take a real token from your secret store.
fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    (0..2)
        .map(|i| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(nanos);
            h.write_u8(i);
            format!("{:016x}", h.finish())
        })
        .collect()
}
