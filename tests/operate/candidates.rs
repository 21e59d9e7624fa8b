//! Candidate quotas over real HTTP (docs/rollout.md, "Candidate quotas"):
//! the live answers with and without candidates are identical byte for
//! byte, and `GET /api/candidates/{tier}` reports exact would-deny counts,
//! distinct keys and heaviest keys for known per-key rates.

use crate::support::*;
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use tiered_ratelimit::{
    admin,
    key::{Global, User},
    Algorithm, Quota, RateLimitLayer, Tier,
};

const TOKEN: &str = "test-admin-token-0123456789";
const BASE: &str = "/admin/ratelimit";

both_backends!(
    live_answers_are_identical_with_and_without_candidates,
    would_deny_counts_are_exact_for_known_rates,
);

async fn start(layer: RateLimitLayer) -> SocketAddr {
    let router = admin::router(layer.handle(), TOKEN);
    serve(app(layer).nest(BASE, router)).await
}

async fn as_user(addr: SocketAddr, user: &str, path: &str) -> reqwest::Response {
    client()
        .get(format!("http://{addr}{path}"))
        .header("authorization", format!("Bearer {user}"))
        .send()
        .await
        .unwrap()
}

/// Status, headers (but `date`) and body of a response.
async fn answer(res: reqwest::Response) -> (StatusCode, Vec<(String, Vec<u8>)>, Vec<u8>) {
    let status = res.status();
    let mut headers: Vec<(String, Vec<u8>)> = res
        .headers()
        .iter()
        .filter(|(k, _)| *k != "date")
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect();
    headers.sort();
    (status, headers, res.bytes().await.unwrap().to_vec())
}

/// The same tiers, with candidates or without: a token bucket per user
/// (5/min), a global fixed window (30/min), and when `with`, two
/// candidates on each.
fn tiers(with: bool) -> Vec<Tier> {
    let user = Tier::new("user", User, Quota::per_minute(5));
    let global =
        Tier::new("global", Global, Quota::per_minute(30)).algorithm(Algorithm::FixedWindow);
    if with {
        vec![
            user.candidates([Quota::per_minute(3), Quota::per_minute(8).burst(10)]),
            global.candidates([Quota::per_minute(20), Quota::per_minute(40)]),
        ]
    } else {
        vec![user, global]
    }
}

/// One server with candidates and one without, on backends of their own
/// with one clock: 200 requests of five users, clock steps between them;
/// every answer (status, headers, body) is the same on both, 429s included.
async fn live_answers_are_identical_with_and_without_candidates(env: Env) {
    let other: tiered_ratelimit::backend::Backend = match &env.redis {
        Some(r) => r.backend_on(&env.clock).into(),
        None => {
            tiered_ratelimit::backend::MemoryBackend::with_manual_clock(env.clock.clone()).into()
        }
    };
    let mut with = env.builder();
    for t in tiers(true) {
        with = with.tier(t);
    }
    let mut without = env.builder().backend(other).key_prefix("bare");
    for t in tiers(false) {
        without = without.tier(t);
    }
    let (a, b) = (
        start(with.build().unwrap()).await,
        start(without.build().unwrap()).await,
    );
    let mut rng = crate::support::rng::Rng::new(0xC0FF_EE11);
    let (mut limited, mut passed) = (0, 0);
    for i in 0..200 {
        let user = format!("u{}", rng.next() % 5);
        let path = if rng.next().is_multiple_of(3) {
            "/users/7"
        } else {
            "/"
        };
        let x = answer(as_user(a, &user, path).await).await;
        let y = answer(as_user(b, &user, path).await).await;
        assert_eq!(x, y, "request {i} ({user} {path})");
        if x.0 == StatusCode::TOO_MANY_REQUESTS {
            limited += 1;
        } else {
            passed += 1;
        }
        env.clock.advance(Duration::from_millis(rng.next() % 4_000));
    }
    assert!(
        limited > 20 && passed > 20,
        "{limited} limited, {passed} passed"
    );
}

/// Known per-key rates inside one fixed minute: user `u<i>` sends
/// `RATES[i]` requests. The live quota (7/min) denies only u4's last two;
/// a candidate of L/min would deny `max(0, r - L)` of each key's (it is
/// charged as the tier's only quota: the live denials do not change it),
/// so its counts, distinct keys and heaviest keys are known in advance.
async fn would_deny_counts_are_exact_for_known_rates(env: Env) {
    const RATES: [u64; 5] = [1, 3, 4, 6, 9];
    let candidates = [3u64, 5, 10];
    let layer = env
        .builder()
        .tier(
            Tier::new("user", User, Quota::per_minute(7))
                .algorithm(Algorithm::FixedWindow)
                .candidates(candidates.map(Quota::per_minute)),
        )
        .tier(Tier::new("global", Global, Quota::per_minute(1_000)))
        .build()
        .unwrap();
    let addr = start(layer).await;
    // The window of T0 (T0 is 20 s into its minute): 40 s of room.
    let mut sent = Vec::new();
    for (u, &r) in RATES.iter().enumerate() {
        for _ in 0..r {
            sent.push(format!("u{u}"));
        }
    }
    // Interleaved: every key's requests spread over the window.
    let mut rng = crate::support::rng::Rng::new(7);
    for i in (1..sent.len()).rev() {
        sent.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut live_denied = 0;
    for user in &sent {
        if as_user(addr, user, "/").await.status() == StatusCode::TOO_MANY_REQUESTS {
            live_denied += 1;
        }
        env.clock.advance(Duration::from_millis(1_000));
    }
    assert_eq!(live_denied, 2);
    let total: u64 = RATES.iter().sum();
    let model = |limit: u64| {
        let mut over: Vec<(String, u64)> = RATES
            .iter()
            .enumerate()
            .filter(|(_, &r)| r > limit)
            .map(|(u, &r)| (format!("u{u}"), r - limit))
            .collect();
        over.sort_by_key(|o| std::cmp::Reverse(o.1));
        json!({
            "quota": format!("{limit}/1m"),
            "requests": total,
            "would_deny": over.iter().map(|o| o.1).sum::<u64>(),
            "keys_denied": over.len(),
            "top": over.iter().map(|(k, c)| json!({"key": k, "count": c})).collect::<Vec<_>>(),
        })
    };
    let res = client()
        .get(format!("http://{addr}{BASE}/api/candidates/user?window=1h"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(
        body,
        json!({
            "tier": "user",
            "window_secs": 3600,
            "live": {
                "quota": "7/1m",
                "requests": total,
                "would_deny": 2,
                "keys_denied": 1,
                "top": [{"key": "u4", "count": 2}],
            },
            "candidates": candidates.map(model).to_vec(),
        })
    );
    // The admin page's table: the live quota, then each candidate.
    let page = client()
        .get(format!("http://{addr}{BASE}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains(r#"<table id="candidates">"#), "{page}");
    for row in [
        r#"<tr class="live"><td><code>user</code></td><td>7/1m <span class="muted">live</span></td><td class="n">23</td><td class="n">2</td><td class="n">8.70%</td><td class="n">1</td><td><code>u4</code> 2</td></tr>"#,
        r#"<tr><td><code>user</code></td><td>3/1m</td><td class="n">23</td><td class="n">10</td><td class="n">43.48%</td><td class="n">3</td><td><code>u4</code> 6, <code>u3</code> 3, <code>u2</code> 1</td></tr>"#,
        r#"<tr><td><code>user</code></td><td>10/1m</td><td class="n">23</td><td class="n">0</td><td class="n">0.00%</td><td class="n">0</td><td><span class="muted">–</span></td></tr>"#,
    ] {
        assert!(page.contains(row), "{row} not in the page");
    }
    // A tier without candidates answers none; an unknown tier, 404.
    let res = client()
        .get(format!("http://{addr}{BASE}/api/candidates/global"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["candidates"], json!([]));
    let res = client()
        .get(format!("http://{addr}{BASE}/api/candidates/nope"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
}

/// Misconfiguration fails at build time naming the field.
#[test]
fn refused_candidates_name_their_field() {
    let build = |t: Tier| {
        RateLimitLayer::builder()
            .tier(t)
            .build()
            .unwrap_err()
            .to_string()
    };
    let user = || Tier::new("user", User, Quota::per_minute(10));
    assert_eq!(
        build(user().candidates([Quota::per_minute(5), Quota::per_minute(0)])),
        "tier \"user\": candidates[1].limit: must be greater than 0"
    );
    assert_eq!(
        build(user().candidates((1..=5).map(Quota::per_minute))),
        "tier \"user\": candidates: 5 candidates; a tier takes at most 4 (each is one more state read and written per request)"
    );
    assert!(
        build(Tier::concurrency("c", User, 4).candidates([Quota::per_minute(5)]))
            .starts_with("tier \"c\": candidates: a concurrency tier takes none")
    );
}

/// Two instances on one Redis, each user's requests alternating between
/// them: the fleet-wide counts (`?scope=fleet`), read from either
/// instance, are the per-process counts summed, and those of the known
/// rates as one process would count them (the counts arrive with the
/// next flush: polled, at most 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_wide_counts_are_equal_across_two_instances() {
    const RATES: [u64; 5] = [1, 3, 4, 6, 9];
    let redis = RedisServer::start();
    let clock = tiered_ratelimit::backend::ManualClock::new(T0_US);
    let layer = || {
        RateLimitLayer::builder()
            .backend(redis.backend_on(&clock))
            .fleet_top_n_flush(Duration::from_millis(50), 1000)
            .tier(
                Tier::new("user", User, Quota::per_minute(7))
                    .algorithm(Algorithm::FixedWindow)
                    .candidates([Quota::per_minute(3), Quota::per_minute(5)]),
            )
            .build()
            .unwrap()
    };
    let (a, b) = (start(layer()).await, start(layer()).await);
    let mut n = 0;
    for (u, &r) in RATES.iter().enumerate() {
        for _ in 0..r {
            let addr = if n % 2 == 0 { a } else { b };
            n += 1;
            as_user(addr, &format!("u{u}"), "/").await;
            clock.advance(Duration::from_millis(500));
        }
    }
    let total: u64 = RATES.iter().sum();
    let counts = |limit: u64| {
        let over: Vec<u64> = RATES
            .iter()
            .filter(|&&r| r > limit)
            .map(|r| r - limit)
            .collect();
        (
            format!("{limit}/1m"),
            total,
            over.iter().sum::<u64>(),
            over.len() as u64,
        )
    };
    let want = vec![counts(7), counts(3), counts(5)];
    let read = |addr: SocketAddr, scope: &'static str| async move {
        let body: Value = client()
            .get(format!(
                "http://{addr}{BASE}/api/candidates/user?window=1h&scope={scope}"
            ))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let one = |c: &Value| {
            (
                c["quota"].as_str().unwrap().to_owned(),
                c["requests"].as_u64().unwrap(),
                c["would_deny"].as_u64().unwrap(),
                c["keys_denied"].as_u64().unwrap(),
            )
        };
        let mut all = vec![one(&body["live"])];
        all.extend(body["candidates"].as_array().unwrap().iter().map(one));
        (all, body)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (fleet_a, body_a) = loop {
        let (got, body) = read(a, "fleet").await;
        if got == want || std::time::Instant::now() > deadline {
            break (got, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(fleet_a, want);
    let (fleet_b, body_b) = read(b, "fleet").await;
    assert_eq!(
        body_a, body_b,
        "the two instances read the same fleet-wide counts"
    );
    assert_eq!(fleet_b, want);
    // The per-process counts sum to them.
    let ((pa, _), (pb, _)) = (read(a, "process").await, read(b, "process").await);
    let summed: Vec<_> = pa
        .iter()
        .zip(&pb)
        .map(|(x, y)| (x.0.clone(), x.1 + y.1, x.2 + y.2))
        .collect();
    let fleet: Vec<_> = want.iter().map(|w| (w.0.clone(), w.1, w.2)).collect();
    assert_eq!(summed, fleet);
    assert!(pa[0].1 > 0 && pb[0].1 > 0, "both instances served requests");
    // The heaviest would-be-denied keys of 3/1m: u4 6, u3 3, u2 1.
    assert_eq!(
        body_a["candidates"][0]["top"],
        json!([{"key": "u4", "count": 6}, {"key": "u3", "count": 3}, {"key": "u2", "count": 1}])
    );
}

/// `POST /api/quota` with `"candidate"` promotes it: with a control key on
/// Redis the whole fleet (instance B within a poll of A's write) answers
/// under the candidate's quota, each key's count carried over; a name that
/// is not a candidate is refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_is_promoted_fleet_wide_with_usage_carried_over() {
    let redis = RedisServer::start();
    let clock = tiered_ratelimit::backend::ManualClock::new(T0_US);
    let poll = Duration::from_secs(1);
    let node = || async {
        let layer = RateLimitLayer::builder()
            .backend(redis.backend_on(&clock))
            .control_key(
                tiered_ratelimit::handle::ControlKey::new("rl:control").poll_interval(poll),
            )
            .tier(
                Tier::new("user", User, Quota::per_minute(7))
                    .algorithm(Algorithm::FixedWindow)
                    .candidates([Quota::per_minute(3), Quota::per_minute(5)]),
            )
            .build()
            .unwrap();
        let handle = layer.handle();
        let addr = start(layer).await;
        handle.ready().await;
        addr
    };
    let (a, b) = (node().await, node().await);
    let reset = T0_S - T0_S % 60 + 60;
    assert_eq!(limits(&as_user(a, "u0", "/").await), ok(7, 6, reset));
    assert_eq!(limits(&as_user(b, "u0", "/").await), ok(7, 5, reset));
    let post = |body: Value| async move {
        let res = client()
            .post(format!("http://{a}{BASE}/api/quota"))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        (res.status(), res.json::<Value>().await.unwrap())
    };
    let (status, body) = post(json!({"tier": "user", "candidate": "4/1m"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["field"], "candidate", "{body}");
    let (status, body) = post(json!({"tier": "user", "candidate": "3/1m"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["tiers"][0]["quota"]["limit"], 3);
    tokio::time::sleep(poll + Duration::from_millis(200)).await;
    // Two used of the window: one left under 3/1m, on either instance.
    assert_eq!(limits(&as_user(b, "u0", "/").await), ok(3, 0, reset));
    assert_eq!(
        as_user(a, "u0", "/").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}
