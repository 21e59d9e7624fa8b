//! A primary demoted behind a plain `REDIS_URL` (a proxy or a DNS name
//! that moves to the new primary, as managed Redis services do on
//! failover): the old node answers `READONLY` on the connection the layer
//! already holds. That connection is dropped like a broken one, and the
//! next request connects through the proxy to the new primary: limiting
//! resumes at once, not after a restart. A real TCP forwarder
//! (`tests/support/forward.rs`) in front of two real Redis nodes, the old
//! one made a replica of the new one (`REPLICAOF`).

use crate::support::forward::Forwarder;
use crate::support::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tiered_ratelimit::backend::{ManualClock, RedisBackend};
use tiered_ratelimit::key::Global;
use tiered_ratelimit::{FailurePolicy, Quota, RateLimitLayer, Tier};

/// The node that will be demoted: as a replica it loads the primary's data
/// in memory and writes no `dump.rdb` into the working directory.
fn replica_to_be() -> RedisServer {
    RedisServer::start_with(&["--repl-diskless-load", "swapdb"])
}

/// Makes `old` a replica of `new` and waits until it has synced (its data
/// is then `new`'s: empty).
fn demote(old: &RedisServer, new: &RedisServer) {
    let _: String = old.cmd(&["REPLICAOF", "127.0.0.1", &new.port().to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = old.cmd(&["INFO", "replication"]);
        if info.contains("master_link_status:up") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the replica did not sync: {info}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn get(addr: SocketAddr) -> Limits {
    limits(
        &client()
            .get(format!("http://{addr}/"))
            .send()
            .await
            .unwrap(),
    )
}

/// Through `backend` (its connections made through the forwarder): one
/// request on the old primary, the failover, then the request that meets
/// `READONLY` (503: fail closed) and the next one, decided by the new
/// primary.
async fn limiting_follows_the_proxy(
    backend: impl FnOnce(&Forwarder) -> RedisBackend,
    old: RedisServer,
    new: RedisServer,
    fwd: Forwarder,
) {
    let clock = ManualClock::new(T0_US);
    let layer = RateLimitLayer::builder()
        .backend(backend(&fwd).with_manual_clock(clock.clone()))
        .backend_timeout(Duration::from_secs(2))
        .failure_policy(FailurePolicy::Closed)
        .tier(Tier::new("global", Global, Quota::per_hour(100)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    assert_eq!(get(addr).await, ok(100, 99, T0_S + 36));
    assert_eq!(get(addr).await, ok(100, 98, T0_S + 72));
    assert_eq!(old.keys(), vec!["rl:global:all".to_owned()]);

    // The failover: the proxy names the new primary, the old one follows it.
    fwd.switch_to(new.port());
    demote(&old, &new);
    let readonly = |n: &RedisServer| -> u64 {
        let s: String = n.cmd(&["INFO", "errorstats"]);
        s.lines()
            .find_map(|l| l.strip_prefix("errorstat_READONLY:count="))
            .map_or(0, |c| c.parse().unwrap())
    };
    assert_eq!(readonly(&old), 0);
    // The request on the old connection is refused (fail closed)...
    assert_eq!(get(addr).await.status, 503);
    // (Redis counts a refused FCALL's READONLY more than once.)
    let refused = readonly(&old);
    assert!(refused >= 1);
    // ...and the next one is decided by the new primary, a fresh bucket
    // there (the state on the old primary was never replicated).
    assert_eq!(get(addr).await, ok(100, 99, T0_S + 36));
    assert_eq!(new.keys(), vec!["rl:global:all".to_owned()]);
    assert_eq!(get(addr).await, ok(100, 98, T0_S + 72));
    assert_eq!(
        readonly(&old),
        refused,
        "no request went to the old node again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_behind_a_proxy_follows_a_failover() {
    let (old, new) = (
        replica_to_be(),
        RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]),
    );
    let fwd = Forwarder::start(old.port()).await;
    limiting_follows_the_proxy(|f| RedisBackend::from_url(&f.url()).unwrap(), old, new, fwd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_behind_a_proxy_follows_a_failover() {
    let (old, new) = (
        replica_to_be(),
        RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]),
    );
    let fwd = Forwarder::start(old.port()).await;
    limiting_follows_the_proxy(
        |f| {
            let pool = deadpool_redis::Config::from_url(f.url())
                .create_pool(Some(deadpool_redis::Runtime::Tokio1))
                .unwrap();
            RedisBackend::from_pool(pool)
        },
        old,
        new,
        fwd,
    )
    .await;
}
