//! Requests priced by their response: an LLM-like app (`/llm?tokens=N`
//! answers `x-usage-tokens: N`; `/stream` hands the test a [`Stream`] it
//! drives frame by frame; `/report?tokens=N` reports through `Usage`) and
//! the priced tier the tests share.

use axum::body::Body;
use axum::extract::Query;
use axum::response::Response;
use axum::{routing::get, Extension, Router};
use bytes::Bytes;
use http_body::Frame;
use std::pin::Pin;
use std::task::{Context, Poll};
use tiered_ratelimit::priced::{Actual, Estimate, Usage};
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::sync::{mpsc, oneshot};

/// 1 000 tokens per minute (one every 60 ms), burst 1 000; the estimate
/// from `x-max-tokens` (100 by default, at most 500), the actual from
/// `x-usage-tokens`.
pub fn tokens() -> Tier {
    Tier::new("tokens", Global, Quota::per_minute(1000)).priced(
        Estimate::header("x-max-tokens", 100, 500),
        Actual::header("x-usage-tokens"),
    )
}

/// A streamed response the test drives: frames sent through `frames`; the
/// body's drop signalled on `dropped`.
pub struct Stream {
    pub frames: mpsc::UnboundedSender<Frame<Bytes>>,
    pub dropped: oneshot::Receiver<()>,
    pub usage: Option<Usage>,
}

pub struct ChanBody {
    rx: mpsc::UnboundedReceiver<Frame<Bytes>>,
    _dropped: oneshot::Sender<()>,
}

impl http_body::Body for ChanBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|f| f.map(Ok))
    }
}

#[derive(serde::Deserialize)]
pub struct Llm {
    pub tokens: u64,
}

/// `GET /llm?tokens=N` answers `x-usage-tokens: N`; `GET /stream` hands
/// the test a [`Stream`]; `GET /report?tokens=N` reports N through the
/// `Usage` handle and answers without the header.
pub fn llm_app(layer: RateLimitLayer, streams: mpsc::UnboundedSender<Stream>) -> Router {
    Router::new()
        .route(
            "/llm",
            get(|Query(q): Query<Llm>| async move {
                Response::builder()
                    .header("x-usage-tokens", q.tokens)
                    .body(Body::from("ok"))
                    .unwrap()
            }),
        )
        .route(
            "/report",
            get(
                |Query(q): Query<Llm>, Extension(u): Extension<Usage>| async move {
                    u.report(q.tokens);
                    "ok"
                },
            ),
        )
        .route(
            "/stream",
            get(move |usage: Option<Extension<Usage>>| {
                let streams = streams.clone();
                async move {
                    let (tx, rx) = mpsc::unbounded_channel();
                    let (dtx, drx) = oneshot::channel();
                    streams
                        .send(Stream {
                            frames: tx,
                            dropped: drx,
                            usage: usage.map(|Extension(u)| u),
                        })
                        .unwrap();
                    Response::new(Body::new(ChanBody { rx, _dropped: dtx }))
                }
            }),
        )
        .layer(layer)
}

pub async fn get_with(url: impl reqwest::IntoUrl, max_tokens: Option<u64>) -> reqwest::Response {
    let mut r = super::client().get(url);
    if let Some(m) = max_tokens {
        r = r.header("x-max-tokens", m);
    }
    r.send().await.unwrap()
}

/// The layer of a policy file's text, on `backend`.
pub fn policy_layer(toml: &str, backend: tiered_ratelimit::backend::Backend) -> RateLimitLayer {
    tiered_ratelimit::policy::Policy::from_toml_str(toml)
        .unwrap()
        .builder(backend)
        .unwrap()
        .build()
        .unwrap()
}

/// The issue's TOML, exactly as written.
pub const TOKENS_POLICY: &str = r#"
[[tier]]
name = "tokens"
key = "global"
limit = 1000
period = "1m"

[tier.priced]
estimate = { header = "x-max-tokens", default = 1000, max = 32000 }
actual = { header = "x-usage-tokens" }
"#;

/// A layer of `tiers` on `env`'s backend in front of [`llm_app`], served:
/// its base URL, the layer, and the streams `/stream` hands over.
pub async fn start(
    env: &super::Env,
    tiers: Vec<Tier>,
) -> (String, RateLimitLayer, mpsc::UnboundedReceiver<Stream>) {
    let mut b = env.builder();
    for t in tiers {
        b = b.tier(t);
    }
    let layer = b.build().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let addr = super::serve(llm_app(layer.clone(), tx)).await;
    (format!("http://{addr}"), layer, rx)
}

/// What the tier holds now: tokens left (a peek of cost 1 shows what one
/// more token would leave).
pub async fn left(layer: &RateLimitLayer) -> (bool, u64) {
    let s = layer.handle().peek("tokens", "all").await.unwrap();
    (s.allowed, s.remaining + u64::from(s.allowed))
}

/// Waits (at most 2 s) until the tier holds `want`: at the end of a stream
/// the settle is sent to Redis in a task of its own.
pub async fn until_left(layer: &RateLimitLayer, want: (bool, u64)) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let got = left(layer).await;
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tier never held {want:?}; holds {got:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
