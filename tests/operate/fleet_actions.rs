//! Operator actions reach every instance: two layers (two app instances)
//! on one real Redis, a key denied and held in both deny caches; a lift, a
//! reset, an override set or removed through one instance, and the other
//! admits the key's next request within one control-key poll interval
//! (the `generation` field of the control hash, `src/engine/watch.rs`).
//! Time on the Redis side is the test's `ManualClock`; the only wait is
//! one poll interval plus a margin for the poll's round trip.

use crate::support::*;
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::backend::{ManualClock, RedisBackend};
use tiered_ratelimit::handle::ControlKey;
use tiered_ratelimit::handle::Override;
use tiered_ratelimit::key::ClientIp;
use tiered_ratelimit::{Penalty, Quota, RateLimitHandle, RateLimitLayer, Tier};

/// The control key's poll interval in these tests.
const POLL: Duration = Duration::from_millis(200);
/// The most a poll may take on loopback before the bound is exceeded.
const MARGIN: Duration = Duration::from_millis(300);
const IP: &str = "127.0.0.1";

struct Fleet {
    a: SocketAddr,
    b: SocketAddr,
    ha: RateLimitHandle,
    hb: RateLimitHandle,
    redis: RedisServer,
    clock: ManualClock,
}

async fn fleet(tier: impl Fn() -> Tier) -> Fleet {
    let redis = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let mk = || {
        RateLimitLayer::builder()
            .backend(
                RedisBackend::from_url(&redis.url())
                    .unwrap()
                    .with_manual_clock(clock.clone()),
            )
            .backend_timeout(Duration::from_secs(2))
            .control_key(ControlKey::new("rl:control").poll_interval(POLL))
            .tier(tier())
            .build()
            .unwrap()
    };
    let (la, lb) = (mk(), mk());
    let (ha, hb) = (la.handle(), lb.handle());
    let a = serve(app(la)).await;
    let b = serve(app(lb)).await;
    Fleet {
        a,
        b,
        ha,
        hb,
        redis,
        clock,
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

impl Fleet {
    /// Instance B's next request is answered by its deny cache: a 429 and
    /// no script call.
    async fn b_answers_from_its_cache(&self) {
        let calls = self.redis.script_calls();
        let before = self.hb.counts().cache_blocked;
        assert_eq!(get(self.b).await.status, 429);
        assert_eq!(self.redis.script_calls(), calls, "B asked Redis");
        assert_eq!(self.hb.counts().cache_blocked, before + 1);
    }

    /// Waits one poll interval (and the poll's round trip): the bound the
    /// docs promise.
    async fn one_poll(&self) {
        tokio::time::sleep(POLL + MARGIN).await;
    }
}

/// A reset through A: B's cached 429 (an hour's wait) is dropped within
/// one poll, and B's next request is admitted by Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_through_one_instance_reaches_the_others_deny_cache() {
    let f = fleet(|| Tier::new("ip", ClientIp::default(), Quota::per_hour(1))).await;
    assert_eq!(get(f.a).await, ok(1, 0, T0_S + 3600));
    assert_eq!(get(f.a).await, denied(1, 0, T0_S + 3600, 3600));
    assert_eq!(get(f.b).await, denied(1, 0, T0_S + 3600, 3600));
    f.b_answers_from_its_cache().await;
    // Both watchers have read the hash once (the first request started
    // them) before the action.
    f.one_poll().await;
    assert!(f.ha.reset("ip", IP).await.unwrap());
    assert_eq!(
        f.redis
            .cmd::<Option<String>>(&["HGET", "rl:control", "generation"])
            .as_deref(),
        Some("1")
    );
    f.one_poll().await;
    let calls = f.redis.script_calls();
    assert_eq!(get(f.b).await, ok(1, 0, T0_S + 3600));
    assert_eq!(f.redis.script_calls(), calls + 1);
    assert_eq!(get(f.a).await, denied(1, 0, T0_S + 3600, 3600));
}

/// A lift of the penalty box through A: B's cached 429 (the block's 15
/// minutes) is dropped within one poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lift_through_one_instance_reaches_the_others_deny_cache() {
    let f = fleet(|| {
        Tier::new("ip", ClientIp::default(), Quota::per_minute(1)).penalty(Penalty::new(
            1,
            Duration::from_secs(600),
            Duration::from_secs(900),
        ))
    })
    .await;
    assert_eq!(get(f.a).await.status, 200);
    // The 429 is the offence: blocked 15 minutes.
    assert_eq!(get(f.a).await.status, 429);
    // The rate would admit the key now; the block does not.
    f.clock.advance(Duration::from_secs(61));
    assert_eq!(get(f.b).await.retry_after, Some(839));
    f.b_answers_from_its_cache().await;
    f.one_poll().await;
    assert!(f.ha.lift("ip", IP).await.unwrap());
    f.one_poll().await;
    let calls = f.redis.script_calls();
    assert_eq!(get(f.b).await.status, 200);
    assert_eq!(f.redis.script_calls(), calls + 1);
}

/// An override set through A (unlimited) reaches B's cached 429 within one
/// poll; its removal through A gives B the tier's quota back within one
/// poll too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_through_one_instance_reaches_the_others_deny_cache() {
    let f =
        fleet(|| Tier::new("ip", ClientIp::default(), Quota::per_hour(1)).overrides(true)).await;
    assert_eq!(get(f.a).await.status, 200);
    assert_eq!(get(f.b).await, denied(1, 0, T0_S + 3600, 3600));
    f.b_answers_from_its_cache().await;
    f.one_poll().await;
    f.ha.set_override("ip", IP, Override::Unlimited, None, "ops")
        .await
        .unwrap();
    f.one_poll().await;
    for _ in 0..3 {
        assert_eq!(get(f.b).await.status, 200);
    }
    assert!(f.ha.remove_override("ip", IP, "ops").await.unwrap());
    f.one_poll().await;
    assert_eq!(get(f.b).await.status, 429);
    // And a blocked override, removed: B admits the key again within a
    // poll (here after an hour, when the tier's own state allows it).
    f.clock.advance(Duration::from_secs(3600));
    f.ha.set_override("ip", IP, Override::Blocked, None, "ops")
        .await
        .unwrap();
    assert_eq!(get(f.b).await.status, 429);
    assert!(f.ha.remove_override("ip", IP, "ops").await.unwrap());
    f.one_poll().await;
    assert_eq!(get(f.b).await.status, 200);
    assert_eq!(
        f.redis
            .cmd::<Option<String>>(&["HGET", "rl:control", "generation"])
            .as_deref(),
        Some("4")
    );
}
