//! The rollout runbook, live: a server whose tiers start in **shadow**, with
//! loopback-only control routes to move them to canary, enforce, and back,
//! and a kill switch. See `docs/rollout.md`.
//!
//! ```text
//! cargo run --example rollout
//! # other terminal:
//! for i in $(seq 1 30); do curl -s -o /dev/null -H 'Authorization: Bearer alice' localhost:3001/; done
//! curl -s localhost:3001/control                        # modes, quotas, would-block counts
//! curl -s -XPOST localhost:3001/control/tier/user/canary:10
//! curl -s -XPOST localhost:3001/control/tier/user/enforce
//! curl -s -XPOST localhost:3001/control/mode/off        # kill switch
//! curl -s -XPOST localhost:3001/control/mode/enforce
//! ```
//!
//! The control routes here have no authentication: they listen on loopback
//! only, for the demo. In production use the admin router behind your auth.

use axum::{
    extract::{Path, Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::Response,
    routing::{get, post},
    Json, Router,
};
use serde_json::{json, Value};
use std::{error::Error, net::SocketAddr};
use tiered_ratelimit::{
    key::{ClientIp, User, UserId},
    rollout::{AccessList, Mode},
    Quota, RateLimitHandle, RateLimitLayer, Tier,
};

async fn auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|id| UserId(id.to_owned()));
    if let Some(u) = user {
        req.extensions_mut().insert(u);
    }
    next.run(req).await
}

async fn status(State(h): State<RateLimitHandle>) -> Json<Value> {
    let c = h.counts();
    let tiers: Vec<Value> = h
        .tiers()
        .into_iter()
        .map(|t| {
            json!({
                "name": t.name,
                "mode": t.mode.to_string(),
                "effective_mode": t.effective_mode.to_string(),
                "limit": t.quota.limit(),
                "period_s": t.quota.period().as_secs_f64(),
                "burst": t.quota.burst_size(),
            })
        })
        .collect();
    Json(json!({
        "mode": h.mode().to_string(),
        "tiers": tiers,
        "counts": {
            "allowed": c.allowed,
            "limited": c.limited,
            "shadow_limited": c.shadow_limited,
            "allowlisted": c.allowlisted,
        },
    }))
}

async fn set_mode(
    State(h): State<RateLimitHandle>,
    Path(mode): Path<String>,
) -> (StatusCode, String) {
    match mode.parse::<Mode>() {
        Ok(m) => {
            h.set_mode(m);
            (StatusCode::OK, format!("global mode: {m}\n"))
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

async fn set_tier_mode(
    State(h): State<RateLimitHandle>,
    Path((tier, mode)): Path<(String, String)>,
) -> (StatusCode, String) {
    let mode = match mode.parse::<Mode>() {
        Ok(m) => m,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    match h.set_tier_mode(&tier, mode) {
        Ok(()) => (StatusCode::OK, format!("tier {tier}: {mode}\n")),
        Err(e) => (StatusCode::NOT_FOUND, format!("{e}\n")),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tiered_ratelimit=info".into()),
        )
        .init();
    let layer = RateLimitLayer::builder()
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(20)).mode(Mode::Shadow))
        .tier(Tier::new("user", User, Quota::per_minute(10)).mode(Mode::Shadow))
        .allowlist(AccessList::new().user("ops-bot"))
        .build()?;
    let handle = layer.handle();
    let api = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer)
        .layer(middleware::from_fn(auth));
    let control = Router::new()
        .route("/control", get(status))
        .route("/control/mode/{mode}", post(set_mode))
        .route("/control/tier/{tier}/{mode}", post(set_tier_mode))
        .with_state(handle);
    let app = api.merge(control);
    let addr: SocketAddr = std::env::var("LISTEN_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3001".into())
        .parse()?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("rollout demo on http://{addr}/ — tiers start in shadow; see docs/rollout.md");
    println!("  curl -s http://{addr}/control");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
