//! The inner service's readiness is not held through a shaping delay: a
//! request a shaping tier queues drops the readied service (releasing what
//! its readiness reserved, as a concurrency limit's permit or a buffer's
//! slot) and readies a clone when its wait is over, as a tower caller would.

use crate::support::*;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tiered_ratelimit::backend::{ManualClock, MemoryBackend};
use tiered_ratelimit::key::Global;
use tiered_ratelimit::{Algorithm, LeakyBucket, Quota, RateLimitLayerBuilder, Tier};
use tower::{Layer, Service, ServiceExt};

/// An inner service whose readiness is a counted reservation: `held` counts
/// the instances readied and neither called nor dropped yet.
struct Gate {
    held: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
    readied: bool,
}

impl Gate {
    fn new() -> Self {
        Self {
            held: Arc::default(),
            calls: Arc::default(),
            readied: false,
        }
    }
}

impl Clone for Gate {
    fn clone(&self) -> Self {
        Self {
            held: self.held.clone(),
            calls: self.calls.clone(),
            readied: false,
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if self.readied {
            self.held.fetch_sub(1, SeqCst);
        }
    }
}

impl<B> Service<http::Request<B>> for Gate {
    type Response = http::Response<String>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.readied {
            self.readied = true;
            self.held.fetch_add(1, SeqCst);
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<B>) -> Self::Future {
        assert!(self.readied, "called without poll_ready");
        self.readied = false;
        self.held.fetch_sub(1, SeqCst);
        self.calls.fetch_add(1, SeqCst);
        std::future::ready(Ok(http::Response::new("ok".to_owned())))
    }
}

/// One request a `period`, the next queued up to two minutes.
fn shaped(builder: RateLimitLayerBuilder, period: Duration) -> RateLimitLayerBuilder {
    builder.tier(
        Tier::new("shape", Global, Quota::new(1, period).burst(1)).algorithm(
            Algorithm::LeakyBucket(LeakyBucket::Shape {
                max_delay: Duration::from_secs(120),
            }),
        ),
    )
}

fn req() -> http::Request<String> {
    http::Request::get("/").body(String::new()).unwrap()
}

/// Memory backend (the decision is known at once): the queued request's
/// future holds no readied service while it waits 60 s (tokio's clock is
/// paused and jumps when the runtime idles).
#[tokio::test(start_paused = true)]
async fn a_queued_request_holds_no_readiness_while_it_waits() {
    let clock = ManualClock::new(T0_US);
    let layer = shaped(
        tiered_ratelimit::RateLimitLayer::builder()
            .backend(MemoryBackend::with_manual_clock(clock.clone())),
        Duration::from_secs(60),
    )
    .build()
    .unwrap();
    let gate = Gate::new();
    let (held, calls) = (gate.held.clone(), gate.calls.clone());
    let mut svc = layer.layer(gate);
    let first = ServiceExt::<http::Request<String>>::ready(&mut svc)
        .await
        .unwrap()
        .call(req())
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!((held.load(SeqCst), calls.load(SeqCst)), (0, 1));

    let queued = tokio::spawn(
        ServiceExt::<http::Request<String>>::ready(&mut svc)
            .await
            .unwrap()
            .call(req()),
    );
    tokio::task::yield_now().await;
    assert!(!queued.is_finished());
    assert_eq!(
        held.load(SeqCst),
        0,
        "a readied service held through the delay"
    );
    let second = queued.await.unwrap().unwrap();
    assert_eq!(second.status(), 200);
    assert_eq!((held.load(SeqCst), calls.load(SeqCst)), (0, 2));
}

/// Redis (the decision is awaited, holding the readied service as tower's
/// async checks do): once the answer says "wait 1 s", the readied service
/// is dropped until the wait is over.
#[tokio::test]
async fn a_queued_request_on_redis_holds_no_readiness_while_it_waits() {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    // A loaded host's slack: the backend timeout is about liveness here.
    let builder = redis_layer(&redis, &clock).backend_timeout(Duration::from_secs(30));
    let layer = shaped(builder, Duration::from_secs(1)).build().unwrap();
    let gate = Gate::new();
    let (held, calls) = (gate.held.clone(), gate.calls.clone());
    let mut svc = layer.layer(gate);
    let first = ServiceExt::<http::Request<String>>::ready(&mut svc)
        .await
        .unwrap()
        .call(req())
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!((held.load(SeqCst), calls.load(SeqCst)), (0, 1));

    // The manual clock stands still: Redis answers "in 1 s" whatever the
    // time it took, and the request then sleeps 1 s of real time.
    let queued = tokio::spawn(
        ServiceExt::<http::Request<String>>::ready(&mut svc)
            .await
            .unwrap()
            .call(req()),
    );
    let mut seen_released = false;
    while !queued.is_finished() {
        if held.load(SeqCst) == 0 && calls.load(SeqCst) == 1 {
            seen_released = true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(seen_released, "a readied service held through the delay");
    let second = queued.await.unwrap().unwrap();
    assert_eq!(second.status(), 200);
    assert_eq!((held.load(SeqCst), calls.load(SeqCst)), (0, 2));
}
