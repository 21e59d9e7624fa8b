//! Criterion micro-benchmarks of the per-request hot path, memory backend
//! only (no network): see `perf/README.md` for the numbers and
//! `perf/load.sh` for the HTTP load test.
//!
//! ```text
//! cargo bench --bench hot_path                  # everything (a few minutes)
//! cargo bench --bench hot_path -- layer/        # one group
//! cargo bench --bench hot_path -- --quick       # a fast, rougher pass
//! ```
//!
//! Groups:
//! * `backend_check/<algorithm>`: `Backend::check` of one tier on one key,
//!   memory backend, every algorithm, in steady state at half its rate (a
//!   `ManualClock` advanced 20 ms per check for a quota of 100 per second, so
//!   every check is allowed and the sliding log holds 50 entries).
//! * `backend_keys/<n>`: `Backend::check` of one token-bucket tier cycling
//!   through `n` = 1, 10, 10^4 or 10^6 existing keys (none denied, clock
//!   stopped); the caller's `Vec` and key (cloned outside the timing, freed
//!   inside) and the returned verdict's two vectors included.
//! * `memory_check/<n>`: the same check through
//!   `MemoryBackend::check_into` (checks borrowed, the verdict reused: no
//!   allocation, as the layer checks), for `n` = 10, 10^4 or 10^6 keys; and
//!   `memory_check/4_tiers`: four token-bucket tiers (a shared `global` key
//!   and three of 10^4 keys each) in one check. In the same group and run,
//!   on the same keys: `memory_check/governor/<n>` (governor's keyed
//!   limiter, its default DashMap store, on its fake clock) and
//!   `memory_check/pingora_rate/<n>` (pingora-limits' `Rate`, an estimator);
//!   and `memory_check/threads/<t>`: `t` = 1 or 2 threads, each cycling
//!   through its own 10^4 keys of one store (elements/s: the aggregate).
//! * `layer/...`: the whole `RateLimitLayer` (memory backend, default
//!   settings) around a trivial `tower::service_fn`, called with a freshly
//!   built request; `layer/baseline` is the same request through the bare
//!   service, to subtract. 1 tier (`ip`) and 4 tiers (`global`, `ip`,
//!   `user`, `endpoint`); 1 key and 10^6 keys (client IPs cycled through a
//!   table that was filled first: the check should stay flat as keys grow);
//!   and the 429 path (a tiny quota, every request denied).
//! * `key/...`: `storage_key_part` on typical and hostile inputs.
//! * `headers/...`: `RateLimitHeaders::write` in each style.

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use http::{HeaderMap, Request, Response};
use tiered_ratelimit::algorithm::{Gcra, Limit, TokenBucket, Window};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, TierCheck, Verdict};
use tiered_ratelimit::key::{storage_key_part, ClientIp, Endpoint, Global, User};
use tiered_ratelimit::response::{PolicyItem, QuotaUnit, RateLimitHeaders};
use tiered_ratelimit::{key::UserId, response::HeaderStyle, Quota, RateLimitLayer, Tier};
use tower::{Layer, Service};

/// Polls a future once: everything on the memory backend's path is ready at
/// once (no timer, no I/O), so no executor is needed and none is measured.
fn now<F: Future>(f: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(f).poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the memory backend's path is expected to be ready at once"),
    }
}

/// Calls `svc` with `req` and waits for the response (ready at once).
fn serve<S, B>(svc: &mut S, req: Request<B>) -> S::Response
where
    S: Service<Request<B>>,
    S::Error: std::fmt::Debug,
{
    let mut cx = Context::from_waker(Waker::noop());
    match svc.poll_ready(&mut cx) {
        Poll::Ready(r) => r.expect("ready"),
        Poll::Pending => panic!("service not ready"),
    }
    now(svc.call(req)).expect("infallible")
}

const S: u64 = 1_000_000;

// ---------------------------------------------------------------- backend

fn bucket(limit: u64, period_us: u64) -> TokenBucket {
    TokenBucket::new(limit, period_us, limit).expect("a small quota")
}

fn backend_check(c: &mut Criterion) {
    let window = Window {
        limit: 100,
        window_us: S,
    };
    let algorithms: [(&str, Limit); 5] = [
        ("token_bucket", Limit::TokenBucket(bucket(100, S))),
        ("fixed_window", Limit::FixedWindow(window)),
        ("sliding_window_log", Limit::SlidingWindowLog(window)),
        (
            "sliding_window_counter",
            Limit::SlidingWindowCounter(window),
        ),
        (
            "leaky_bucket_police",
            Limit::LeakyBucket(Gcra {
                bucket: bucket(100, S),
                max_delay_us: None,
            }),
        ),
    ];
    let mut g = c.benchmark_group("backend_check");
    g.throughput(Throughput::Elements(1));
    for (name, limit) in algorithms {
        let clock = ManualClock::new(1_700_000_000 * S);
        let backend: Backend = MemoryBackend::with_manual_clock(clock.clone()).into();
        let check = TierCheck {
            key: "rl:ip:198.51.100.7".to_owned(),
            limit,
            cost: 1,
            home: None,
        };
        // Fill the steady state first (the log holds a window of entries).
        for _ in 0..200 {
            clock.advance(Duration::from_millis(20));
            assert!(now(backend.check(vec![check.clone()])).unwrap().allowed());
        }
        g.bench_function(name, |b| {
            b.iter_batched(
                || vec![check.clone()],
                |checks| {
                    clock.advance(Duration::from_millis(20));
                    now(backend.check(checks))
                },
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

/// `Backend::check` of one token-bucket tier per call, cycling through 1,
/// 10 or 10^6 keys that exist (filled first, never denied: a burst of 10^9,
/// on a stopped clock): the check per key should stay flat as keys grow.
fn backend_keys(c: &mut Criterion) {
    let limit = Limit::TokenBucket(TokenBucket::new(1000, S, 1_000_000_000).expect("a quota"));
    let mut g = c.benchmark_group("backend_keys");
    g.throughput(Throughput::Elements(1));
    for (name, n) in [("1", 1u32), ("10", 10), ("1e4", 10_000), ("1e6", 1_000_000)] {
        let clock = ManualClock::new(1_700_000_000 * S);
        let backend: Backend = MemoryBackend::with_manual_clock(clock)
            .max_keys(4_000_000)
            .into();
        let checks: Vec<TierCheck> = (0..n)
            .map(|i| TierCheck {
                key: format!("rl:ip:{}", Ipv4Addr::from(0x0a00_0000 + i)),
                limit,
                cost: 1,
                home: None,
            })
            .collect();
        for check in &checks {
            assert!(now(backend.check(vec![check.clone()])).unwrap().allowed());
        }
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    i = (i + 1) % checks.len();
                    vec![checks[i].clone()]
                },
                |checks| now(backend.check(checks)),
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

/// `MemoryBackend::check_into` of one token-bucket tier per call, cycling
/// through `n` existing keys (as `backend_keys`, without the allocations of
/// the owned API), beside governor's keyed limiter (its default DashMap
/// store) and pingora-limits' `Rate` on the same keys in the same run; two
/// threads on distinct keys against one; and four tiers at once.
fn memory_check(c: &mut Criterion) {
    let limit = Limit::TokenBucket(TokenBucket::new(1000, S, 1_000_000_000).expect("a quota"));
    let mut g = c.benchmark_group("memory_check");
    g.throughput(Throughput::Elements(1));
    let store = || {
        MemoryBackend::with_manual_clock(ManualClock::new(1_700_000_000 * S)).max_keys(4_000_000)
    };
    let key = |tier: &str, i: u32| TierCheck {
        key: format!("rl:{tier}:{}", Ipv4Addr::from(0x0a00_0000 + i)),
        limit,
        cost: 1,
        home: None,
    };
    for (name, n) in [("10", 10u32), ("1e4", 10_000), ("1e6", 1_000_000)] {
        let checks: Vec<TierCheck> = (0..n).map(|i| key("ip", i)).collect();
        {
            let backend = store();
            let mut verdict = Verdict::default();
            for check in &checks {
                backend.check_into(std::slice::from_ref(check), &mut verdict);
                assert!(verdict.allowed());
            }
            let mut i = 0;
            g.bench_function(name, |b| {
                b.iter(|| {
                    i += 1;
                    if i == checks.len() {
                        i = 0;
                    }
                    backend.check_into(std::slice::from_ref(&checks[i]), &mut verdict);
                    black_box(&verdict);
                });
            });
        }
        {
            // governor's keyed limiter on its default store (DashMap), keyed
            // by the same strings; on its fake clock, as ours is on a manual
            // one (neither reads the system clock per check).
            let quota = governor::Quota::per_second(NonZeroU32::new(1000).expect("nonzero"))
                .allow_burst(NonZeroU32::new(1_000_000_000).expect("nonzero"));
            let limiter = governor::RateLimiter::dashmap_with_clock(
                quota,
                governor::clock::FakeRelativeClock::default(),
            );
            for check in &checks {
                assert!(limiter.check_key(&check.key).is_ok());
            }
            let mut i = 0;
            g.bench_function(format!("governor/{name}"), |b| {
                b.iter(|| {
                    i += 1;
                    if i == checks.len() {
                        i = 0;
                    }
                    black_box(limiter.check_key(&checks[i].key).is_ok())
                });
            });
        }
        {
            // pingora-limits' `Rate`: an estimator (count-min sketch of
            // fixed size), not a limiter; observing a key is its whole work.
            let rate = pingora_limits::rate::Rate::new(Duration::from_secs(1));
            for check in &checks {
                rate.observe(&check.key, 1);
            }
            let mut i = 0;
            g.bench_function(format!("pingora_rate/{name}"), |b| {
                b.iter(|| {
                    i += 1;
                    if i == checks.len() {
                        i = 0;
                    }
                    black_box(rate.observe(&checks[i].key, 1))
                });
            });
        }
    }
    // One thread, then two, each checking its own 10^4 keys of one store:
    // criterion's elements/s is the aggregate checks per second.
    for threads in [1u32, 2] {
        let backend = store();
        let mut verdict = Verdict::default();
        let sets: Vec<Vec<TierCheck>> = (0..threads)
            .map(|t| (0..10_000).map(|i| key("ip", t * 10_000 + i)).collect())
            .collect();
        for check in sets.iter().flatten() {
            backend.check_into(std::slice::from_ref(check), &mut verdict);
            assert!(verdict.allowed());
        }
        g.throughput(Throughput::Elements(u64::from(threads)));
        g.bench_function(format!("threads/{threads}"), |b| {
            b.iter_custom(|iters| {
                let start = std::sync::Barrier::new(sets.len());
                std::thread::scope(|scope| {
                    let runs: Vec<_> = sets
                        .iter()
                        .map(|checks| {
                            let (backend, start) = (&backend, &start);
                            scope.spawn(move || {
                                let mut verdict = Verdict::default();
                                start.wait();
                                let t0 = std::time::Instant::now();
                                let mut i = 0;
                                for _ in 0..iters {
                                    i += 1;
                                    if i == checks.len() {
                                        i = 0;
                                    }
                                    backend
                                        .check_into(std::slice::from_ref(&checks[i]), &mut verdict);
                                    black_box(&verdict);
                                }
                                t0.elapsed()
                            })
                        })
                        .collect();
                    runs.into_iter()
                        .map(|r| r.join().expect("a bench thread"))
                        .max()
                        .unwrap_or_default()
                })
            });
        });
    }
    g.throughput(Throughput::Elements(1));
    // One request's four tiers: a shared key and three of 10^4 keys each.
    let backend = store();
    let n = 10_000u32;
    let requests: Vec<[TierCheck; 4]> = (0..n)
        .map(|i| {
            [
                TierCheck {
                    key: "rl:global:all".to_owned(),
                    limit,
                    cost: 1,
                    home: None,
                },
                key("ip", i),
                key("user", i),
                key("endpoint", i),
            ]
        })
        .collect();
    let mut verdict = Verdict::default();
    for r in &requests {
        backend.check_into(r, &mut verdict);
        assert!(verdict.allowed());
    }
    let mut i = 0;
    g.bench_function("4_tiers", |b| {
        b.iter(|| {
            i += 1;
            if i == requests.len() {
                i = 0;
            }
            backend.check_into(&requests[i], &mut verdict);
            black_box(&verdict);
        });
    });
    g.finish();
}

// ------------------------------------------------------------------ layer

type Inner = tower::util::ServiceFn<
    fn(Request<()>) -> std::future::Ready<Result<Response<String>, Infallible>>,
>;

fn inner() -> Inner {
    fn hello(_: Request<()>) -> std::future::Ready<Result<Response<String>, Infallible>> {
        std::future::ready(Ok(Response::new(String::from("hello"))))
    }
    tower::service_fn(hello as fn(_) -> _)
}

/// A request as `axum::serve` + `Router` hand it to the layer: the peer
/// address (what `ClientIp` reads), the matched route and, for the `user`
/// tier, a `UserId` an auth middleware put there.
fn request(ip: u32) -> Request<()> {
    let mut req = Request::get("/users/42").body(()).expect("a valid request");
    let ext = req.extensions_mut();
    ext.insert(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), 40_000));
    ext.insert(UserId("user-4711".to_owned()));
    req
}

/// Never denies during a run, and the key stays (as a busy key does): a
/// burst of a billion, refilled at 1000 per second.
fn huge() -> Quota {
    Quota::per_second(1000).burst(1_000_000_000)
}

/// Never denies during a run and never expires (one token an hour, a million
/// of burst): the 10^6 keys all stay in the table.
fn sticky() -> Quota {
    Quota::new(1, Duration::from_secs(3600)).burst(1_000_000)
}

fn layer_with(tiers: usize, ip_quota: Quota) -> RateLimitLayer {
    let mut b = RateLimitLayer::builder().backend(MemoryBackend::new().max_keys(4_000_000));
    if tiers > 1 {
        b = b.tier(Tier::new("global", Global, huge()));
    }
    b = b.tier(Tier::new("ip", ClientIp::default(), ip_quota));
    if tiers > 1 {
        b = b
            .tier(Tier::new("user", User, huge()))
            .tier(Tier::new("endpoint", Endpoint, huge()));
    }
    b.build().expect("a valid layer")
}

fn layer(c: &mut Criterion) {
    const MANY: u32 = 1_000_000;
    let base_ip = u32::from(Ipv4Addr::new(10, 0, 0, 0));
    let mut g = c.benchmark_group("layer");
    g.throughput(Throughput::Elements(1));

    let mut bare = inner();
    g.bench_function("baseline", |b| {
        b.iter(|| serve(&mut bare, request(base_ip)));
    });

    for tiers in [1, 4] {
        let mut one = layer_with(tiers, huge()).layer(inner());
        g.bench_function(format!("{tiers}_tier/1_key"), |b| {
            b.iter(|| serve(&mut one, request(base_ip)));
        });

        let mut many = layer_with(tiers, sticky()).layer(inner());
        for i in 0..MANY {
            let res = serve(&mut many, request(base_ip + i));
            debug_assert_eq!(res.status(), 200);
        }
        let mut i = 0u32;
        g.bench_function(format!("{tiers}_tier/1e6_keys"), |b| {
            b.iter(|| {
                i = (i + 1) % MANY;
                serve(&mut many, request(base_ip + i))
            });
        });

        // The 429 path: one request a day, so all but the first are denied.
        let mut denied =
            layer_with(tiers, Quota::new(1, Duration::from_secs(86_400))).layer(inner());
        serve(&mut denied, request(base_ip));
        assert_eq!(serve(&mut denied, request(base_ip)).status(), 429);
        g.bench_function(format!("{tiers}_tier/denied"), |b| {
            b.iter(|| serve(&mut denied, request(base_ip)));
        });
    }
    g.finish();
}

// -------------------------------------------------------------------- keys

fn keys(c: &mut Criterion) {
    let long_header = "k".repeat(200);
    let inputs: [(&str, &[u8]); 5] = [
        ("ipv4", b"198.51.100.7"),
        ("ipv6_prefix", b"2001:db8:85a3::/64"),
        ("user_id", b"user-4711"),
        ("endpoint_escaped", b"GET /users/{id}"),
        ("hashed_200_bytes", long_header.as_bytes()),
    ];
    let mut g = c.benchmark_group("key");
    g.throughput(Throughput::Elements(1));
    for (name, bytes) in inputs {
        g.bench_function(name, |b| b.iter(|| storage_key_part(black_box(bytes))));
    }
    g.finish();
}

// ----------------------------------------------------------------- headers

fn headers(c: &mut Criterion) {
    let mut g = c.benchmark_group("headers");
    g.throughput(Throughput::Elements(1));
    let policy: Arc<str> = Arc::from("ip");
    for (name, style, retry_after) in [
        ("legacy_allowed", HeaderStyle::Legacy, None),
        ("legacy_denied", HeaderStyle::Legacy, Some(7)),
        ("ietf_allowed", HeaderStyle::IetfDraft11, None),
        ("both_denied", HeaderStyle::Both, Some(7)),
    ] {
        let h = RateLimitHeaders {
            limit: 300,
            remaining: 299,
            reset: 1_700_000_060,
            retry_after,
            reset_in: 60,
            window_in: 1,
            policy: policy.clone(),
            policies: vec![PolicyItem {
                name: policy.clone(),
                quota: 300,
                window: Some(60),
                unit: QuotaUnit::Requests,
            }],
            style,
            meters: None,
        };
        // Into the headers of a response that already has a few, as on the
        // way out of a handler.
        let mut base = HeaderMap::new();
        base.insert(http::header::CONTENT_TYPE, "text/plain".parse().unwrap());
        base.insert(http::header::CONTENT_LENGTH, "5".parse().unwrap());
        g.bench_function(name, |b| {
            b.iter_batched_ref(
                || base.clone(),
                |m| black_box(&h).write(m),
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

/// The same layer with a real metrics recorder installed (Prometheus), to
/// set against `layer/*` measured earlier in the same run, when no recorder
/// is installed (every `metrics::` call is then a no-op). Runs last: the
/// recorder is global from here on.
fn metrics_on(c: &mut Criterion) {
    let _handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("install the Prometheus recorder");
    let base_ip = u32::from(Ipv4Addr::new(10, 0, 0, 0));
    let mut g = c.benchmark_group("layer_metrics_on");
    g.throughput(Throughput::Elements(1));
    for tiers in [1, 4] {
        let mut one = layer_with(tiers, huge()).layer(inner());
        g.bench_function(format!("{tiers}_tier/1_key"), |b| {
            b.iter(|| serve(&mut one, request(base_ip)));
        });
        let mut denied =
            layer_with(tiers, Quota::new(1, Duration::from_secs(86_400))).layer(inner());
        serve(&mut denied, request(base_ip));
        g.bench_function(format!("{tiers}_tier/denied"), |b| {
            b.iter(|| serve(&mut denied, request(base_ip)));
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    backend_check,
    backend_keys,
    memory_check,
    layer,
    keys,
    headers,
    metrics_on
);
criterion_main!(benches);
