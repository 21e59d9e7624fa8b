//! An unreachable Redis is said at start-up, not on the first request:
//! `Backend::ping` names the address, `build_checked` refuses to build
//! under `FailurePolicy::Closed` and logs one WARN under the others; a
//! running Redis answers. Alone in its binary: it installs a thread-local
//! subscriber (see tests/http/tracing_span.rs).

use crate::support::*;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, MemoryBackend, RedisBackend};
use tiered_ratelimit::{key::Global, ConfigError, FailurePolicy, Quota, RateLimitLayer, Tier};

fn wrong_url() -> (String, u16) {
    let port = crate::support::redis_server::free_port();
    (format!("redis://:secret@127.0.0.1:{port}/"), port)
}

#[test]
fn a_wrong_redis_url_is_named_at_start_up() {
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let (url, port) = wrong_url();
    let server = RedisServer::start();
    tracing::subscriber::with_default(subscriber, || {
        current_thread_runtime().block_on(async {
            let wrong: Backend = RedisBackend::from_url(&url).unwrap().into();
            let e = wrong.ping(Duration::from_secs(1)).await.unwrap_err();
            assert_eq!(e.backend, format!("redis at 127.0.0.1:{port}"));
            // The address, never the password.
            assert_eq!(
                e.to_string(),
                format!(
                    "backend redis at 127.0.0.1:{port} unreachable: backend connection error: Connection refused (os error 111)"
                )
            );
            // A running Redis and the memory backend answer.
            let right: Backend = RedisBackend::from_url(&server.url()).unwrap().into();
            right.ping(Duration::from_secs(2)).await.unwrap();
            Backend::from(MemoryBackend::new())
                .ping(Duration::from_secs(1))
                .await
                .unwrap();

            let builder = |policy| {
                RateLimitLayer::builder()
                    .backend(RedisBackend::from_url(&url).unwrap())
                    .key_prefix("startup")
                    .failure_policy(policy)
                    .tier(Tier::new("global", Global, Quota::per_second(10)))
            };
            // Closed: no layer, an error naming the address.
            let err = builder(FailurePolicy::Closed)
                .build_checked()
                .await
                .unwrap_err();
            assert!(matches!(err, ConfigError::BackendUnreachable(_)), "{err:?}");
            assert_eq!(
                err.to_string(),
                format!(
                    "failure_policy = \"closed\" and backend redis at 127.0.0.1:{port} \
                     unreachable: backend connection error: Connection refused (os error 111): refusing to start"
                )
            );
            assert_eq!(buf.text(), "");
            // Open: the layer, and one WARN saying what requests will get.
            let _open = builder(FailurePolicy::Open).build_checked().await.unwrap();
            // A reachable backend: no line.
            let _reachable = RateLimitLayer::builder()
                .backend(RedisBackend::from_url(&server.url()).unwrap())
                .key_prefix("startup")
                .tier(Tier::new("global", Global, Quota::per_second(10)))
                .build_checked()
                .await
                .unwrap();
        });
    });
    let out = buf.text();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(lines[0].contains(" WARN "), "{out}");
    assert!(
        lines[0].contains(&format!(
            "rate limiter backend unreachable at start-up: backend redis at 127.0.0.1:{port} \
             unreachable: backend connection error: Connection refused (os error 111); requests pass unlimited (failure_policy = \
             \"open\") until it answers"
        )),
        "{out}"
    );
    assert!(!out.contains("secret"), "{out}");
}
