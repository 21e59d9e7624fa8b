//! A priced tier estimating from a JSON request body field (OpenAI-style
//! `max_tokens`, issue 29) through real HTTP on both backends: the
//! companion layer reads the body up to its bound, the tier reserves the
//! field (default and cap as the header form), the handler gets the body
//! byte for byte, a body above the bound is a 413 that reserves nothing,
//! and without a JSON estimate the body is never read.

use crate::support::priced::{policy_layer, Llm};
use crate::support::*;
use axum::body::Bytes;
use axum::extract::Query;
use axum::response::Response;
use axum::{routing::post, Router};
use tiered_ratelimit::priced::{Actual, Estimate};
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

both_backends!(
    max_tokens_reserves_and_the_handler_gets_the_body_unchanged,
    a_body_above_the_bound_is_413_and_reserves_nothing,
    a_policy_file_estimates_from_the_body,
);

/// 1 000 tokens a minute; the estimate from `max_tokens` (100 by default,
/// at most 500), bodies up to 256 bytes; the actual from `x-usage-tokens`.
fn tokens() -> Tier {
    Tier::new("tokens", Global, Quota::per_minute(1000)).priced(
        Estimate::json("max_tokens", 100, 500).max_body_bytes(256),
        Actual::header("x-usage-tokens"),
    )
}

/// `POST /chat?tokens=N` answers the body it got, byte for byte (read
/// whole, without axum's 2 MB limit), with `x-usage-tokens: N`.
fn chat() -> Router {
    Router::new().route(
        "/chat",
        post(
            |Query(q): Query<Llm>, req: axum::extract::Request| async move {
                let body: Bytes = axum::body::to_bytes(req.into_body(), usize::MAX)
                    .await
                    .unwrap();
                Response::builder()
                    .header("x-usage-tokens", q.tokens)
                    .body(axum::body::Body::from(body))
                    .unwrap()
            },
        ),
    )
}

/// [`chat`] behind the rate-limit layer, its companion outside.
fn app(layer: &RateLimitLayer) -> Router {
    chat().layer(layer.clone()).layer(layer.json_body())
}

async fn start(layer: &RateLimitLayer) -> String {
    format!("http://{}", serve(app(layer)).await)
}

async fn post_body(url: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
    client().post(url).body(body).send().await.unwrap()
}

/// Tokens the tier holds (a peek of cost 1 shows what one more leaves).
async fn left(layer: &RateLimitLayer) -> u64 {
    let s = layer.handle().peek("tokens", "all").await.unwrap();
    s.remaining + u64::from(s.allowed)
}

async fn max_tokens_reserves_and_the_handler_gets_the_body_unchanged(env: Env) {
    let layer = env.builder().tier(tokens()).build().unwrap();
    let base = start(&layer).await;
    let url = |n: u64| format!("{base}/chat?tokens={n}");
    // Odd spacing, an escaped key, a nested decoy and non-ASCII text: the
    // handler must get exactly these bytes.
    let body =
        "{ \"model\" : \"m\",\n \"messages\":[{\"content\":\"h\u{e9}\\u00e9\",\"max_tokens\":9}],\
                \"max_tokens\" :300 }";
    let r = post_body(&url(50), body).await;
    let l = limits(&r);
    // Reserved 300, used 50: settled before the head, 1000 − 50.
    assert_eq!(
        (l.status, l.limit, l.remaining),
        (200, Some(1000), Some(950))
    );
    assert_eq!(r.bytes().await.unwrap(), body.as_bytes());
    // Above the cap: 500 reserved; used 500.
    let r = post_body(&url(500), r#"{"max_tokens":100000}"#).await;
    assert_eq!(limits(&r).remaining, Some(450));
    // Missing, not a whole number, or not JSON at all: the default (100).
    for (body, used) in [
        (r#"{"model":"m"}"#, 100),
        (r#"{"max_tokens":"400"}"#, 100),
        (r#"{"max_tokens":12.5}"#, 100),
        ("max_tokens=400", 100),
    ] {
        let before = left(&layer).await;
        let r = post_body(&url(used), body).await;
        assert_eq!(r.status(), 200, "{body}");
        assert_eq!(r.bytes().await.unwrap(), body.as_bytes());
        assert_eq!(left(&layer).await, before - used, "{body}");
    }
    assert_eq!(left(&layer).await, 50);
    // 100 by default does not fit the 50 left; 40 does, and the binary
    // body of a 429 never reached the handler.
    let r = post_body(&url(1), r#"{"stream":true}"#).await;
    let l = limits(&r);
    assert_eq!((l.status, l.remaining), (429, Some(50)));
    let r = post_body(&url(40), r#"{"max_tokens":40}"#).await;
    assert_eq!(limits(&r).remaining, Some(10));
}

async fn a_body_above_the_bound_is_413_and_reserves_nothing(env: Env) {
    let layer = env.builder().tier(tokens()).build().unwrap();
    let base = start(&layer).await;
    // 256 bytes exactly is read (and the body handed on whole).
    let pad = |n: usize| format!("{{\"max_tokens\":200,\"p\":\"{}\"}}", "x".repeat(n));
    // 25 bytes around the padding.
    let at_bound = pad(256 - 25);
    assert_eq!(at_bound.len(), 256);
    let r = post_body(&format!("{base}/chat?tokens=200"), at_bound.clone()).await;
    assert_eq!(limits(&r).remaining, Some(800));
    assert_eq!(r.bytes().await.unwrap(), at_bound.as_bytes());
    // 257 bytes with a Content-Length: 413 before reading, nothing reserved.
    let r = post_body(&format!("{base}/chat?tokens=1"), pad(256 - 24)).await;
    assert_eq!(r.status(), 413);
    assert_eq!(
        r.text().await.unwrap(),
        "request body above 256 bytes (the rate limiter reads at most this much)"
    );
    assert_eq!(left(&layer).await, 800);
    // Chunked (no length known up front): read up to the bound, then 413.
    let addr = base.trim_start_matches("http://");
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let chunk = pad(300);
    let req = format!(
        "POST /chat?tokens=1 HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\
         connection: close\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len()
    );
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    assert_eq!(left(&layer).await, 800);
}

/// The issue's TOML with the body form.
const POLICY: &str = r#"
[[tier]]
name = "tokens"
key = "global"
limit = 1000
period = "1m"

[tier.priced]
estimate = { json = "max_tokens", default = 1000, max = 32000, max_body_bytes = 4096 }
actual = { header = "x-usage-tokens" }
"#;

async fn a_policy_file_estimates_from_the_body(env: Env) {
    let layer = policy_layer(POLICY, env.backend.clone());
    let base = start(&layer).await;
    // 961 reserved (more than the 1000 − 40 left after the first) is denied.
    let r = post_body(&format!("{base}/chat?tokens=40"), r#"{"max_tokens":900}"#).await;
    assert_eq!(limits(&r).remaining, Some(960));
    let r = post_body(&format!("{base}/chat?tokens=1"), r#"{"max_tokens":961}"#).await;
    let l = limits(&r);
    assert_eq!((l.status, l.remaining), (429, Some(960)));
    // No field: the default, 1000, does not fit either.
    let r = post_body(&format!("{base}/chat?tokens=1"), "{}").await;
    assert_eq!(r.status(), 429);
    let r = post_body(&format!("{base}/chat?tokens=1"), "x".repeat(4097)).await;
    assert_eq!(r.status(), 413);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_json_estimate_the_body_is_never_read() {
    // A header estimate: the companion layer passes every body on unread,
    // whatever its size (no bound, no 413).
    let tier = Tier::new("tokens", Global, Quota::per_minute(1000)).priced(
        Estimate::header("x-max-tokens", 100, 500),
        Actual::header("x-usage-tokens"),
    );
    let layer = Env::memory().builder().tier(tier).build().unwrap();
    let base = start(&layer).await;
    let big = format!("{{\"max_tokens\":1,\"p\":\"{}\"}}", "x".repeat(3 << 20));
    let r = post_body(&format!("{base}/chat?tokens=100"), big.clone()).await;
    assert_eq!(limits(&r).remaining, Some(900));
    assert_eq!(r.bytes().await.unwrap().len(), big.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_companion_layer_the_estimate_is_its_max() {
    let layer = Env::memory().builder().tier(tokens()).build().unwrap();
    let app = chat().layer(layer.clone());
    let base = format!("http://{}", serve(app).await);
    // The body says 10, but it is not read: 500 (the max) reserved, of
    // which 10 used; the tier shows the settle.
    let r = post_body(&format!("{base}/chat?tokens=10"), r#"{"max_tokens":10}"#).await;
    assert_eq!(limits(&r).remaining, Some(990));
    // Two of 500 fit in 990, not a third.
    let r = post_body(&format!("{base}/chat?tokens=500"), "{}").await;
    assert_eq!(r.status(), 200);
    assert_eq!(left(&layer).await, 490);
    let r = post_body(&format!("{base}/chat?tokens=1"), "{}").await;
    assert_eq!(r.status(), 429);
}

#[test]
fn json_estimates_fail_at_build_naming_the_field() {
    use tiered_ratelimit::policy::Policy;
    let q = Quota::per_minute(1000);
    let build = |e: Estimate| {
        RateLimitLayer::builder()
            .tier(Tier::new("t", Global, q).priced(e, Actual::reported()))
            .build()
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        build(Estimate::json("", 1, 2)),
        "tier \"t\": priced.estimate.json: names no field (an empty name)"
    );
    assert_eq!(
        build(Estimate::json("max_tokens", 3, 2)),
        "tier \"t\": priced.estimate.default: default 3 must be at most max 2, and max above 0"
    );
    assert_eq!(
        build(Estimate::json("max_tokens", 1, 2).max_body_bytes(0)),
        "tier \"t\": priced.estimate.max_body_bytes: must be above 0 bytes"
    );
    assert_eq!(
        build(Estimate::fixed(1).max_body_bytes(10)),
        "tier \"t\": priced.estimate.max_body_bytes: goes with a json estimate only \
         (no other estimate reads the body)"
    );
    let policy = |estimate: &str| {
        let text = format!(
            "[[tier]]\nname = \"t\"\nkey = \"global\"\nlimit = 10\nperiod = \"1m\"\n\
             [tier.priced]\nestimate = {estimate}\n"
        );
        Policy::from_toml_str(&text)
            .unwrap()
            .builder(tiered_ratelimit::backend::MemoryBackend::new())
            .and_then(|b| b.build())
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        policy(r#"{ json = "max_tokens", default = 1 }"#),
        "tier \"t\": priced.estimate.max: required with priced.estimate.json"
    );
    assert_eq!(
        policy(r#"{ json = "max_tokens", header = "x-max", default = 1, max = 2 }"#),
        "tier \"t\": priced.estimate: json goes alone (with default and max), without header or fixed"
    );
    assert_eq!(
        policy(r#"{ header = "x-max", default = 1, max = 2, max_body_bytes = 9 }"#),
        "tier \"t\": priced.estimate.max_body_bytes: goes with json only (no other estimate reads the body)"
    );
}
