//! A priced tier on a tonic server (feature `grpc`, issue 29), through a
//! real tonic client over TCP, on both backends: the estimate from request
//! metadata, the actual from the response's initial metadata (settled
//! before it goes out, so its `x-ratelimit-remaining` is after the settle)
//! or from its trailers (settled when the call's body ends, after
//! `grpc-status`). The service is tonic-health's, wrapped by a layer that
//! reports usage where the call's `x-usage-in` metadata says.

use crate::support::priced::{left, tokens, until_left};
use crate::support::Env;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use http_body::Frame;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use tiered_ratelimit::RateLimitLayer;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

both_backends!(
    usage_in_metadata_settles_before_the_head,
    usage_in_trailers_settles_when_the_call_ends,
);

const USAGE: HeaderName = HeaderName::from_static("x-usage-tokens");

/// Adds `x-usage-tokens: <x-usage>` to the response's initial metadata
/// (`x-usage-in: header`) or to its trailers (`x-usage-in: trailer`).
#[derive(Clone)]
struct Report<S>(S);

impl<S> tower::Service<http::Request<tonic::body::Body>> for Report<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let at = req.headers().get("x-usage-in").cloned();
        let usage = req.headers().get("x-usage").cloned();
        let clone = self.0.clone();
        let mut inner = std::mem::replace(&mut self.0, clone);
        Box::pin(async move {
            let mut res = inner.call(req).await?;
            match (at.as_ref().map(|v| v.as_bytes()), usage) {
                (Some(b"header"), Some(n)) => {
                    res.headers_mut().insert(USAGE, n);
                }
                (Some(b"trailer"), Some(n)) => {
                    res = res.map(|body| tonic::body::Body::new(AddTrailer(body, Some(n))));
                }
                _ => {}
            }
            Ok(res)
        })
    }
}

/// A body whose trailers gain `x-usage-tokens`.
struct AddTrailer(tonic::body::Body, Option<HeaderValue>);

impl http_body::Body for AddTrailer {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let frame = std::task::ready!(Pin::new(&mut self.0).poll_frame(cx));
        Poll::Ready(frame.map(|f| {
            f.map(|f| match f.into_trailers() {
                Ok(mut t) => {
                    if let Some(n) = self.1.take() {
                        t.insert(USAGE, n);
                    }
                    Frame::trailers(t)
                }
                Err(f) => f,
            })
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }
}

async fn serve(layer: RateLimitLayer) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        let _reporter = reporter;
        tonic::transport::Server::builder()
            .layer(layer)
            .layer(tower::layer::layer_fn(Report))
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    addr
}

async fn start(env: &Env) -> (HealthClient<tonic::transport::Channel>, RateLimitLayer) {
    let layer = env.builder().tier(tokens()).build().unwrap();
    let addr = serve(layer.clone()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (HealthClient::new(channel), layer)
}

/// A `Check` call reserving `max` tokens, reporting `usage` `at`.
fn call(max: u64, at: &str, usage: u64) -> tonic::Request<HealthCheckRequest> {
    let mut req = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    let md = req.metadata_mut();
    md.insert("x-max-tokens", max.to_string().parse().unwrap());
    md.insert("x-usage-in", at.parse().unwrap());
    md.insert("x-usage", usage.to_string().parse().unwrap());
    req
}

fn remaining(md: &tonic::metadata::MetadataMap) -> Option<u64> {
    md.get("x-ratelimit-remaining")
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

async fn usage_in_metadata_settles_before_the_head(env: Env) {
    let (mut client, layer) = start(&env).await;
    // Reserve 300, use 100: the head shows 1000 − 100.
    let res = client.check(call(300, "header", 100)).await.unwrap();
    assert_eq!(remaining(res.metadata()), Some(900));
    assert_eq!(left(&layer).await, (true, 900));
    // Reserve 200, use 450: 900 − 450.
    let res = client.check(call(200, "header", 450)).await.unwrap();
    assert_eq!(remaining(res.metadata()), Some(450));
    // 500 (the cap) does not fit the 450 left: RESOURCE_EXHAUSTED, nothing
    // reserved.
    let err = client.check(call(9000, "header", 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(left(&layer).await, (true, 450));
}

async fn usage_in_trailers_settles_when_the_call_ends(env: Env) {
    let (mut client, layer) = start(&env).await;
    // Reserve 300, use 50 (in the trailers): the head shows the
    // reservation, the tier the settle once the call ended.
    let res = client.check(call(300, "trailer", 50)).await.unwrap();
    assert_eq!(remaining(res.metadata()), Some(700));
    until_left(&layer, (true, 950)).await;
    // Reserve 100, use 400: 950 − 400.
    let res = client.check(call(100, "trailer", 400)).await.unwrap();
    assert_eq!(remaining(res.metadata()), Some(850));
    until_left(&layer, (true, 550)).await;
}
