//! A concurrency slot never leaks: a client that disconnects at any moment
//! frees its slot at once (not after its TTL), on memory and on a real
//! Redis. The moments: before the script call that takes the slot has
//! answered (Redis only: the memory backend decides synchronously; the
//! reply held back by a TCP forwarder, `tests/support/forward.rs`), after
//! the answer but before the handler runs (a shaping delay of a leaky
//! bucket tier), and while the body is streaming. (During the handler:
//! `tests/concurrency/concurrency.rs`, `cancelled_client_frees_the_slot_*`.) The test
//! clock stands still, so the slot (60 s TTL) never lapses: only a release
//! frees a slot. Slot counts are read from a peek and, on Redis, `ZCARD`.

use crate::support::forward::Forwarder;
use crate::support::*;
use axum::body::Body;
use axum::response::Response;
use axum::{extract::State, routing::get, Router};
use bytes::Bytes;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::key::Global;
use tiered_ratelimit::{Algorithm, LeakyBucket, Quota, RateLimitHandle, RateLimitLayer, Tier};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

const SLOTS: u64 = 2;

/// What the handlers see: how many started, and the gate they wait at.
#[derive(Clone)]
struct Probe {
    started: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
}

/// A body that sends what its channel gives, and ends when it closes.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|o| o.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// Waits at the gate, then answers.
async fn slow(State(p): State<Probe>) -> &'static str {
    p.started.fetch_add(1, Ordering::SeqCst);
    let mut gate = p.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    "done"
}

/// Answers at once with a body that sends `first` and ends when the gate
/// opens.
async fn streaming(State(p): State<Probe>) -> Response {
    p.started.fetch_add(1, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel(1);
    tx.send(Bytes::from_static(b"first")).await.unwrap();
    let mut gate = p.gate.clone();
    tokio::spawn(async move {
        let _ = gate.wait_for(|open| *open).await;
        drop(tx);
    });
    Response::new(Body::new(ChannelBody(rx)))
}

struct Setup {
    addr: SocketAddr,
    handle: RateLimitHandle,
    probe: Probe,
    _open: watch::Sender<bool>,
    /// Clients that stay connected until the test ends.
    clients: Vec<TcpStream>,
}

/// `SLOTS` requests in flight on one key, and `extra` tiers before it.
async fn setup(backend: Backend, extra: Option<Tier>) -> Setup {
    let (open, gate) = watch::channel(false);
    let probe = Probe {
        started: Arc::default(),
        gate,
    };
    let mut b = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(30));
    if let Some(t) = extra {
        b = b.tier(t);
    }
    let layer = b
        .tier(Tier::concurrency("inflight", Global, SLOTS))
        .build()
        .unwrap();
    let handle = layer.handle();
    let app = Router::new()
        .route("/slow", get(slow))
        .route("/streaming", get(streaming))
        .layer(layer)
        .with_state(probe.clone());
    Setup {
        addr: serve(app).await,
        handle,
        probe,
        _open: open,
        clients: Vec::new(),
    }
}

/// The slots in use now, by a peek.
async fn in_use(h: &RateLimitHandle) -> u64 {
    let s = h.peek("inflight", "all").await.unwrap();
    if s.allowed {
        SLOTS - s.remaining - 1
    } else {
        SLOTS
    }
}

/// Waits (5 s at most; the slot TTL is 60 s on a clock that stands still)
/// until `n` slots are in use.
async fn until_in_use(h: &RateLimitHandle, n: u64, what: &str) {
    for _ in 0..2500 {
        if in_use(h).await == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("{what}: {} slots in use, not {n}", in_use(h).await);
}

/// A raw HTTP/1.1 client: sends `GET path`, the socket closed when dropped.
async fn raw_get(addr: SocketAddr, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    s
}

fn zcard(redis: &RedisServer) -> i64 {
    redis.cmd(&["ZCARD", "rl:inflight:all"])
}

/// After the answer, before the handler: a leaky bucket tier that shapes
/// (one request a minute, delays up to two minutes) delays the second
/// request 60 s while it holds its slot; its client leaves meanwhile.
async fn leaving_during_the_shaping_delay(backend: Backend) -> Setup {
    let shape = Tier::new("shape", Global, Quota::per_minute(1).burst(1)).algorithm(
        Algorithm::LeakyBucket(LeakyBucket::Shape {
            max_delay: Duration::from_secs(120),
        }),
    );
    let mut s = setup(backend, Some(shape)).await;
    let first = raw_get(s.addr, "/slow").await;
    s.clients.push(first);
    until_in_use(&s.handle, 1, "the first request runs").await;
    let second = raw_get(s.addr, "/slow").await;
    until_in_use(&s.handle, 2, "the second request is delayed with its slot").await;
    assert_eq!(s.probe.started.load(Ordering::SeqCst), 1);
    drop(second);
    until_in_use(&s.handle, 1, "the delayed request's slot is released").await;
    assert_eq!(
        s.probe.started.load(Ordering::SeqCst),
        1,
        "its handler never ran"
    );
    s
}

/// During the body: the response's headers and first chunk have arrived,
/// the body is still open; the client leaves.
async fn leaving_during_the_body(backend: Backend) -> Setup {
    let s = setup(backend, None).await;
    let mut c = raw_get(s.addr, "/streaming").await;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(5).any(|w| w == b"first") {
        let n = c.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed the connection");
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(in_use(&s.handle).await, 1);
    drop(c);
    until_in_use(&s.handle, 0, "the streaming response's slot is released").await;
    s
}

fn memory() -> Backend {
    MemoryBackend::with_manual_clock(ManualClock::new(T0_US)).into()
}

fn redis_backend(url: &str) -> Backend {
    RedisBackend::from_url(url)
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US))
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_during_the_shaping_delay_frees_the_slot_in_memory() {
    leaving_during_the_shaping_delay(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_during_the_shaping_delay_frees_the_slot_on_redis() {
    let redis = RedisServer::start();
    let _held = leaving_during_the_shaping_delay(redis_backend(&redis.url())).await;
    // The first request's slot, still running.
    assert_eq!(zcard(&redis), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_during_the_body_frees_the_slot_in_memory() {
    leaving_during_the_body(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_during_the_body_frees_the_slot_on_redis() {
    let redis = RedisServer::start();
    let _held = leaving_during_the_body(redis_backend(&redis.url())).await;
    assert_eq!(zcard(&redis), 0);
}

/// Before the call answers: the script ran on Redis and took the slot, but
/// the forwarder holds its reply back; the client leaves while the check
/// is in flight. The slot is released at once (a `ZREM` of the check's
/// slot id, sent after the script on the same connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_before_the_call_answers_frees_the_slot_on_redis() {
    let redis = RedisServer::start();
    let fwd = Forwarder::start(redis.port()).await;
    let s = setup(redis_backend(&fwd.url()), None).await;
    // Connect the backend (and load the script) with one whole request.
    let _ = client()
        .get(format!("http://{}/streaming", s.addr))
        .send()
        .await
        .unwrap();
    for _ in 0..2500 {
        if zcard(&redis) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(zcard(&redis), 0);
    fwd.hold_replies(true);
    let c = raw_get(s.addr, "/slow").await;
    for _ in 0..2500 {
        if zcard(&redis) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(zcard(&redis), 1, "the script took the slot");
    assert_eq!(s.probe.started.load(Ordering::SeqCst), 1);
    drop(c);
    for _ in 0..2500 {
        if zcard(&redis) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(zcard(&redis), 0, "the in-flight request's slot leaked");
    assert_eq!(s.probe.started.load(Ordering::SeqCst), 1, "no handler ran");
    fwd.hold_replies(false);
    // And the layer's own view agrees.
    until_in_use(&s.handle, 0, "free after the replies flow again").await;
}
