//! Limits suggested from real demand (`GET /api/suggest/{tier}`), over
//! HTTP: per-key demands known exactly (each key sends its number of
//! requests in one quota period, 429s included), the answer's percentiles
//! within one bucket (2 %) of the exact ones, the keys left out named, the
//! refusal below 50 keys, and fleet-wide on one Redis: two instances that
//! each saw half of every key's requests answer the same suggestion, from
//! the sums. Time is a `ManualClock` (every request in one period).

use crate::support::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::net::SocketAddr;
use tiered_ratelimit::rollout::AccessList;
use tiered_ratelimit::{admin, key::User, Algorithm, Quota, RateLimitHandle, RateLimitLayer, Tier};

const TOKEN: &str = "suggest-test-token";
const BASE: &str = "/admin/ratelimit";

async fn start(layer: RateLimitLayer) -> (RateLimitHandle, SocketAddr) {
    let h = layer.handle();
    let router = admin::router(h.clone(), TOKEN);
    (h, serve(app(layer).nest(BASE, router)).await)
}

async fn suggest(addr: SocketAddr, query: &str) -> (StatusCode, Value) {
    let res = client()
        .get(format!("http://{addr}{BASE}/api/suggest/user?{query}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let status = res.status();
    (status, res.json().await.unwrap())
}

/// Sends `n` requests as `user`, to each of `addrs` in turn; answers the 429s.
async fn send(addrs: Vec<SocketAddr>, user: String, n: u64) -> u64 {
    let c = client();
    let mut limited = 0;
    for i in 0..n {
        let addr = addrs[usize::try_from(i).unwrap() % addrs.len()];
        let res = c
            .get(format!("http://{addr}/"))
            .header("authorization", format!("Bearer {user}"))
            .send()
            .await
            .unwrap();
        match res.status() {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            s => panic!("{user}: {s}"),
        }
    }
    limited
}

/// Every `(user, n)` at once (each user's requests in sequence); the 429s.
async fn traffic(addrs: &[SocketAddr], users: &[(String, u64)]) -> u64 {
    let mut set = tokio::task::JoinSet::new();
    for (u, n) in users {
        set.spawn(send(addrs.to_vec(), u.clone(), *n));
    }
    let mut limited = 0;
    while let Some(r) = set.join_next().await {
        limited += r.unwrap();
    }
    limited
}

/// The generator: 60 keys, demands 1 ..= 45 (spread by a square).
fn demands() -> Vec<(String, u64)> {
    (0..60u64)
        .map(|i| (format!("u{i:02}"), 1 + i * i / 80))
        .collect()
}

/// The exact `⌈p·n⌉`-th smallest (p in thousandths).
fn exact(sorted: &[u64], p: u64) -> u64 {
    let n = sorted.len() as u64;
    sorted[usize::try_from((p * n).div_ceil(1000).max(1) - 1).unwrap()]
}

/// `got` is `want` to within one bucket: not below, at most 2 % (or one
/// request) above.
fn within_a_bucket(got: &Value, want: u64, what: &str) {
    let got = got.as_u64().unwrap_or_else(|| panic!("{what}: {got}"));
    assert!(
        got >= want && (got - want <= 1 || got * 50 <= want * 51),
        "{what}: {got}, exactly {want}"
    );
}

fn assert_percentiles(body: &Value, sorted: &[u64]) {
    for (name, p) in [("p50", 500), ("p90", 900), ("p99", 990), ("p99.9", 999)] {
        within_a_bucket(&body["percentiles"][name], exact(sorted, p), name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suggestion_from_known_demand_within_a_bucket_with_outliers_named() {
    let env = Env::memory();
    let layer = env
        .builder()
        .tier(Tier::new("user", User, Quota::per_minute(30)).algorithm(Algorithm::FixedWindow))
        .demand(true)
        .build()
        .unwrap();
    let (h, addr) = start(layer).await;
    let mut users = demands();
    let sorted: Vec<u64> = {
        let mut d: Vec<u64> = users.iter().map(|u| u.1).collect();
        d.sort_unstable();
        d
    };
    // One key far above the rest, one heavy key denylisted afterwards.
    users.push(("heavy".to_owned(), 500));
    users.push(("abuser".to_owned(), 40));
    let limited = traffic(&[addr], &users).await;
    // Enforcement denied some: they are demand all the same.
    let want_limited: u64 = users.iter().map(|u| u.1.saturating_sub(30)).sum();
    assert_eq!(limited, want_limited);
    h.set_denylist(AccessList::new().user("abuser")).unwrap();

    let (status, body) = suggest(addr, "target=0.05&window=1h").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["keys"], 60);
    assert_eq!(body["requests"], users.iter().map(|u| u.1).sum::<u64>());
    assert_eq!(body["unsampled_requests"], 0);
    assert_eq!(
        (body["period_s"].clone(), body["window_s"].clone()),
        (60.into(), 3600.into())
    );
    assert_eq!(body["applied"], false);
    assert_percentiles(&body, &sorted);
    // 5 % of 60 keys may be denied: the 57th smallest demand.
    within_a_bucket(&body["suggested"]["limit"], sorted[56], "suggested");
    assert_eq!(body["suggested"]["period_s"], 60);
    assert_eq!(
        body["left_out"],
        serde_json::json!([
            {"key": "heavy", "demand": 500, "reason": "outlier"},
            {"key": "abuser", "demand": 40, "reason": "denylisted"},
        ])
    );
    // The curve: at every bucket edge, the keys and requests above it.
    let curve = body["curve"].as_array().unwrap();
    for point in curve {
        let limit = point["limit"].as_u64().unwrap();
        let keys = sorted.iter().filter(|&&d| d > limit).count() as u64;
        let requests: u64 = sorted.iter().map(|&d| d.saturating_sub(limit)).sum();
        assert_eq!(point["keys_denied"], keys, "{point}");
        assert_eq!(point["requests_denied"], requests, "{point}");
    }
    assert_eq!(curve.last().unwrap()["keys_denied"], 0);
    // Buckets hold values 1..=45 one by one: one point per distinct demand.
    let mut distinct = sorted.clone();
    distinct.dedup();
    assert_eq!(curve.len(), distinct.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fewer_than_fifty_keys_get_no_suggestion() {
    let env = Env::memory();
    let layer = env
        .builder()
        .tier(
            Tier::new("user", User, Quota::per_minute(30))
                .algorithm(Algorithm::SlidingWindowCounter),
        )
        .demand(true)
        .build()
        .unwrap();
    let (h, addr) = start(layer).await;
    let users: Vec<(String, u64)> = (0..49).map(|i| (format!("k{i}"), 2)).collect();
    traffic(&[addr], &users).await;
    let (status, body) = suggest(addr, "").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        body,
        serde_json::json!({"error": "not_enough_data", "keys": 49, "needed": 50})
    );
    traffic(&[addr], &[("k49".to_owned(), 1)]).await;
    let (status, body) = suggest(addr, "target=0").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (body["keys"].clone(), body["requests"].clone()),
        (50.into(), 99.into())
    );
    assert_eq!(body["suggested"]["limit"], 2);
    let (status, body) = suggest(addr, "target=1").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"], "invalid_target");
    // Recording off (the default): no answer at all, not a misleading one.
    h.set_demand(false);
    let (status, body) = suggest(addr, "").await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["error"], "demand_off");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_redis_answer_the_same_from_summed_demand() {
    let redis = RedisServer::start();
    let clock = tiered_ratelimit::backend::ManualClock::new(T0_US);
    let tier = || Tier::new("user", User, Quota::per_minute(30));
    let a = crate::rollout_plan::node_with(&redis, &clock, tier()).await;
    let b = crate::rollout_plan::node_with(&redis, &clock, tier()).await;
    a.handle.set_demand(true);
    b.handle.set_demand(true);
    let users = demands();
    // Every key's requests alternate between the two instances.
    traffic(&[a.addr, b.addr], &users).await;
    let sorted: Vec<u64> = {
        let mut d: Vec<u64> = users.iter().map(|u| u.1).collect();
        d.sort_unstable();
        d
    };
    let get = |addr: SocketAddr| async move {
        let res = client()
            .get(format!(
                "http://{addr}{}/api/suggest/user?target=0.05&window=1h",
                crate::rollout_plan::BASE
            ))
            .bearer_auth(crate::rollout_plan::TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        res.json::<Value>().await.unwrap()
    };
    // Each answer flushes its own instance first: after both, both agree.
    let _ = get(a.addr).await;
    let from_b = get(b.addr).await;
    let from_a = get(a.addr).await;
    assert_eq!(from_a, from_b);
    assert_eq!(from_a["keys"], 60);
    assert_eq!(from_a["requests"], sorted.iter().sum::<u64>());
    assert_percentiles(&from_a, &sorted);
    // A token bucket: a rate per period and a burst, both the limit.
    within_a_bucket(&from_a["suggested"]["rate"], sorted[56], "rate");
    assert_eq!(from_a["suggested"]["burst"], from_a["suggested"]["rate"]);
    assert_eq!(from_a["suggested"]["period_s"], 60);
    // The period's totals and the hour's peaks live in one hash slot.
    let hour = T0_US / 3_600_000_000;
    let peaks: Vec<String> = redis.cmd(&["HVALS", &format!("rl:{{demand}}:user:-:{hour}:h")]);
    let mut peaks: Vec<u64> = peaks.iter().map(|p| p.parse().unwrap()).collect();
    peaks.sort_unstable();
    assert_eq!(peaks, sorted);
    a.stop().await;
    b.stop().await;
}

/// Sends `(user, plan, n)` requests in process (the app's router, no
/// socket: the same layer code, many requests fast).
async fn in_process(app: &axum::Router, users: &[(String, Option<&'static str>, u64)]) {
    use tower::ServiceExt as _;
    for (u, plan, n) in users {
        for _ in 0..*n {
            let mut req = http::Request::get("/").header("authorization", format!("Bearer {u}"));
            if let Some(p) = plan {
                req = req.header("x-test-plan", *p);
            }
            let res = app
                .clone()
                .oneshot(req.body(axum::body::Body::empty()).unwrap())
                .await
                .unwrap();
            assert!(
                matches!(res.status().as_u16(), 200 | 429),
                "{}",
                res.status()
            );
        }
    }
}

/// The model of the sample: the k keys of smallest hash (by the top 52
/// bits, then the whole hash) and the estimate of all keys from them.
fn bottom_k(users: &[(String, u64)]) -> (Vec<u64>, u64) {
    // An hour's sample: 1 024 keys (observe::demand's documented bound).
    let k = 1024;
    let mut by_hash: Vec<(u64, u64, u64)> = users
        .iter()
        .map(|(u, d)| {
            let h = xxhash_rust::xxh3::xxh3_64(u.as_bytes()) | 1;
            (h >> 12, h, *d)
        })
        .collect();
    by_hash.sort_unstable();
    by_hash.truncate(k);
    let hk = by_hash.last().unwrap().1;
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let est = ((k as f64 - 1.0) * 18_446_744_073_709_551_616.0 / (hk as f64 + 1.0)).round() as u64;
    let mut d: Vec<u64> = by_hash.iter().map(|x| x.2).collect();
    d.sort_unstable();
    (d, est)
}

/// Model = memory = Redis = Redis Cluster: the same traffic (more keys
/// than an hour's sample keeps, a plan's keys apart) through a layer on
/// each backend; the answers are the same JSON, and the model's bottom-k
/// sample gives their percentiles and estimate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_memory_redis_and_cluster_keep_the_same_bottom_k_sample() {
    let cluster = crate::support::cluster::RedisCluster::start(0);
    let mut rng = crate::support::rng::Rng::new(0x5eed_0045);
    let users: Vec<(String, u64)> = (0..1400)
        .map(|i| (format!("user-{i}"), 1 + rng.below(12)))
        .collect();
    let pro: Vec<(String, u64)> = (0..60)
        .map(|i| (format!("pro-{i}"), 1 + rng.below(40)))
        .collect();
    let traffic: Vec<(String, Option<&'static str>, u64)> = users
        .iter()
        .map(|(u, n)| (u.clone(), None, *n))
        .chain(pro.iter().map(|(u, n)| (u.clone(), Some("pro"), *n)))
        .collect();
    let tier = || {
        Tier::new("user", User, Quota::per_minute(10))
            .algorithm(Algorithm::FixedWindow)
            .plans([("pro", Quota::per_minute(30))])
    };
    let mut answers = Vec::new();
    for env in [Env::memory(), Env::redis(), Env::cluster(&cluster)] {
        let layer = env.builder().tier(tier()).demand(true).build().unwrap();
        let h = layer.handle();
        in_process(&app(layer), &traffic).await;
        let hour = std::time::Duration::from_secs(3600);
        let all = h.suggest("user", None, 0.01, hour).await.unwrap().to_json();
        let plan = h
            .suggest("user", Some("pro"), 0.01, hour)
            .await
            .unwrap()
            .to_json();
        answers.push((all, plan));
    }
    assert_eq!(answers[0], answers[1], "memory and Redis");
    assert_eq!(answers[0], answers[2], "memory and Redis Cluster");
    let (all, plan) = &answers[0];

    let (sample, est) = bottom_k(&users);
    assert_eq!(all["sampled"], true);
    assert_eq!(all["keys"], sample.len() as u64);
    assert_eq!(all["estimated_keys"], est);
    assert_eq!(all["requests"], users.iter().map(|u| u.1).sum::<u64>());
    assert_percentiles(all, &sample);

    // The plan's keys apart, all of them (fewer than the sample keeps).
    let mut exact_pro: Vec<u64> = pro.iter().map(|u| u.1).collect();
    exact_pro.sort_unstable();
    assert_eq!(plan["plan"], "pro");
    assert_eq!(plan["sampled"], false);
    assert_eq!(
        (plan["keys"].clone(), plan["estimated_keys"].clone()),
        (60.into(), 60.into())
    );
    assert_percentiles(plan, &exact_pro);
}

/// A flush on Redis is one script call, whatever it took: here three
/// groups (a tier's keys without a plan, its plan's keys, and a second
/// tier of another period), each added exactly. (The background flush,
/// once a second, may take the counts first: then the answer's own flush
/// has nothing to send. Either way, at most one call.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_of_several_tiers_and_plans_is_one_script_call() {
    let env = Env::redis();
    let redis = env.redis.as_ref().expect("a Redis of the test's own");
    let layer = env
        .builder()
        .tier(
            Tier::new("user", User, Quota::per_minute(10))
                .algorithm(Algorithm::FixedWindow)
                .plans([("pro", Quota::per_minute(30))]),
        )
        .tier(Tier::new("user_hour", User, Quota::per_hour(1000)))
        .demand(true)
        .build()
        .unwrap();
    let h = layer.handle();
    let traffic: Vec<(String, Option<&'static str>, u64)> = (0..60)
        .map(|i| (format!("user-{i}"), None, 1 + i % 7))
        .chain((0..60).map(|i| (format!("pro-{i}"), Some("pro"), 1 + i % 5)))
        .collect();
    in_process(&app(layer), &traffic).await;
    let _: String = redis.cmd(&["CONFIG", "RESETSTAT"]);
    let hour = std::time::Duration::from_secs(3600);
    // The first answer flushes what the background flush has not.
    let all = h.suggest("user", None, 0.01, hour).await.unwrap().to_json();
    let stats: String = redis.cmd(&["INFO", "commandstats"]);
    // Calls that ran: a first EVALSHA that met NOSCRIPT (the script not
    // yet loaded) failed, and the same call was sent again after SCRIPT LOAD.
    let ran = |cmd: &str| -> u64 {
        let Some(rest) = stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:")))
        else {
            return 0;
        };
        let field = |name: &str| -> u64 {
            rest.split(',')
                .find_map(|f| f.strip_prefix(&format!("{name}=")))
                .unwrap()
                .parse()
                .unwrap()
        };
        field("calls") - field("failed_calls")
    };
    assert!(ran("evalsha") + ran("eval") <= 1, "{stats}");
    let plan = h
        .suggest("user", Some("pro"), 0.01, hour)
        .await
        .unwrap()
        .to_json();
    let other = h
        .suggest("user_hour", None, 0.01, hour)
        .await
        .unwrap()
        .to_json();
    let sum = |f: &dyn Fn(&Option<&str>) -> bool| -> u64 {
        traffic.iter().filter(|t| f(&t.1)).map(|t| t.2).sum()
    };
    assert_eq!(all["requests"], sum(&|p| p.is_none()));
    assert_eq!(plan["requests"], sum(&|p| p.is_some()));
    assert_eq!(other["requests"], sum(&|_| true));
    assert_eq!(
        (all["keys"].clone(), plan["keys"].clone()),
        (60.into(), 60.into())
    );
    assert_eq!(other["keys"], 120);
}

/// An `ApiKey` tier keeps each key's hash (`key::ApiKey`), never its value:
/// a key denylisted by its value is still left out as `denylisted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denylisted_api_key_is_left_out_by_its_hash() {
    use tiered_ratelimit::key::ApiKey;
    use tower::ServiceExt as _;
    let env = Env::memory();
    let layer = env
        .builder()
        .tier(
            Tier::new("key", ApiKey::header("x-api-key"), Quota::per_minute(100))
                .algorithm(Algorithm::FixedWindow),
        )
        .demand(true)
        .build()
        .unwrap();
    let h = layer.handle();
    let app = app(layer);
    let mut keys: Vec<(String, u64)> = (0..60).map(|i| (format!("sk-{i}"), 1 + i % 9)).collect();
    // Above 32 in a period: its name is kept (lower keys are named by a hash).
    keys.push(("sk-abuser".to_owned(), 40));
    for (k, n) in &keys {
        for _ in 0..*n {
            let req = http::Request::get("/")
                .header("x-api-key", k.as_str())
                .body(axum::body::Body::empty())
                .unwrap();
            let res = app.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        }
    }
    h.set_denylist(AccessList::new().api_key("sk-abuser"))
        .unwrap();
    let hour = std::time::Duration::from_secs(3600);
    let body = h.suggest("key", None, 0.05, hour).await.unwrap().to_json();
    let hash = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(b"sk-abuser"));
    assert_eq!(
        body["left_out"],
        serde_json::json!([{"key": hash, "demand": 40, "reason": "denylisted"}])
    );
    assert_eq!(body["keys"], 60);
}
