//! The admin router over real HTTP: the token (header, cookie, query), the
//! JSON API, mode changes and the kill switch, HTML escaping, and the page
//! rendered by headless Chromium.

use crate::support::*;
use reqwest::{redirect, StatusCode};
use serde_json::{json, Value};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tiered_ratelimit::{
    admin::{self, Admin, COOKIE_NAME},
    key::{ClientIp, Endpoint, User},
    rollout::Mode,
    Quota, RateLimitHandle, RateLimitLayer, Tier,
};

const TOKEN: &str = "test-admin-token-0123456789";
const BASE: &str = "/admin/ratelimit";

both_backends!(
    mode_change_applies_to_next_request,
    kill_switch,
    top_history_and_anomalies_json,
    top_keys_refused_apart_from_would_be_refused,
);

/// The test app with the admin router mounted at [`BASE`].
async fn start(layer: RateLimitLayer) -> (RateLimitHandle, SocketAddr) {
    let h = layer.handle();
    let router = admin::router(h.clone(), TOKEN);
    (h, serve(app(layer).nest(BASE, router)).await)
}

/// A client that does not follow redirects.
fn raw_client() -> reqwest::Client {
    client_builder()
        .redirect(redirect::Policy::none())
        .build()
        .unwrap()
}

fn user_tier(limit: u64) -> Tier {
    Tier::new("user", User, Quota::per_minute(limit))
}

async fn as_user(addr: SocketAddr, user: &str) -> reqwest::Response {
    client()
        .get(format!("http://{addr}/"))
        .header("authorization", format!("Bearer {user}"))
        .send()
        .await
        .unwrap()
}

async fn api_get(addr: SocketAddr, path: &str) -> (StatusCode, Value) {
    let res = client()
        .get(format!("http://{addr}{BASE}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let status = res.status();
    (status, res.json().await.unwrap())
}

async fn api_mode(addr: SocketAddr, body: Value) -> (StatusCode, Value) {
    let res = client()
        .post(format!("http://{addr}{BASE}/api/mode"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = res.status();
    (status, res.json().await.unwrap())
}

async fn assert_unauthorized(res: reqwest::Response, what: &str) {
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{what}");
    assert_eq!(
        res.headers()["content-type"],
        "application/json",
        "{what}: 401 is JSON"
    );
    assert!(res.headers().contains_key("www-authenticate"), "{what}");
    assert_eq!(res.headers()["cache-control"], "no-store", "{what}");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"], "unauthorized", "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_wants_the_token() {
    let env = Env::memory();
    let (h, addr) = start(env.builder().tier(user_tier(5)).build().unwrap()).await;
    let c = raw_client();
    let routes = [
        ("GET", ""),
        ("GET", "/api/status"),
        ("GET", "/api/top/user"),
        ("GET", "/api/history/user"),
        ("GET", "/api/anomalies"),
        ("GET", "/api/top/nope"),
        ("GET", "/no/such/route"),
        ("POST", "/api/mode"),
        ("POST", "/mode"),
    ];
    let wrong = [
        None,
        Some("Bearer wrong"),
        Some("Bearer test-admin-token-012345678"), // a prefix
        Some("Bearer test-admin-token-0123456789x"),
        Some("Basic dGVzdC1hZG1pbi10b2tlbi0wMTIzNDU2Nzg5"),
        Some("test-admin-token-0123456789"),
    ];
    for (method, path) in routes {
        for auth in wrong {
            let url = format!("http://{addr}{BASE}{path}");
            let mut req = if method == "GET" {
                c.get(&url)
            } else {
                c.post(&url)
                    .header("content-type", "application/json")
                    .body(r#"{"mode":"off"}"#)
            };
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let res = req.send().await.unwrap();
            assert_unauthorized(res, &format!("{method} {path} with {auth:?}")).await;
        }
    }
    // The query token is for the page only; the cookie for the page and its form.
    let real_cookie = {
        let res = c
            .get(format!("http://{addr}{BASE}?token={TOKEN}"))
            .send()
            .await
            .unwrap();
        let set = res.headers()["set-cookie"].to_str().unwrap().to_owned();
        set.split(';').next().unwrap().to_owned()
    };
    for path in ["/api/status", "/api/anomalies", "/api/history/user"] {
        let res = c
            .get(format!("http://{addr}{BASE}{path}?token={TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_unauthorized(res, &format!("{path}?token=")).await;
        let res = c
            .get(format!("http://{addr}{BASE}{path}"))
            .header("cookie", real_cookie.clone())
            .send()
            .await
            .unwrap();
        assert_unauthorized(res, &format!("{path} with the cookie")).await;
    }
    for target in ["/api/mode", "/mode"] {
        let res = c
            .post(format!("http://{addr}{BASE}{target}?token={TOKEN}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("mode=off")
            .send()
            .await
            .unwrap();
        assert_unauthorized(res, &format!("POST {target}?token=")).await;
    }
    // A cookie holding the wrong token, not hex, or the token itself (or
    // its hex, the old format) is no token.
    for cookie in [hex("wrong"), "zz".to_owned(), TOKEN.to_owned()] {
        let res = c
            .get(format!("http://{addr}{BASE}"))
            .header("cookie", format!("{COOKIE_NAME}={cookie}"))
            .send()
            .await
            .unwrap();
        assert_unauthorized(res, &format!("page with cookie {cookie}")).await;
    }
    assert_eq!(h.mode(), Mode::Enforce, "no unauthorized change applied");
    // The right token, any case of the scheme.
    let res = c
        .get(format!("http://{addr}{BASE}/api/status"))
        .header("authorization", format!("bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // An unknown admin route, authorized: 404 JSON.
    let (status, body) = api_get(addr, "/no/such/route").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"], "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_token_accepts_nothing() {
    let env = Env::memory();
    let layer = env.builder().tier(user_tier(5)).build().unwrap();
    let router = admin::router(layer.handle(), "");
    let addr = serve(app(layer).nest(BASE, router)).await;
    let c = raw_client();
    for auth in ["Bearer ", "Bearer  ", "Bearer"] {
        let res = c
            .get(format!("http://{addr}{BASE}/api/status"))
            .header("authorization", auth)
            .send()
            .await
            .unwrap();
        assert_unauthorized(res, auth).await;
    }
    let res = c
        .get(format!("http://{addr}{BASE}?token="))
        .send()
        .await
        .unwrap();
    assert_unauthorized(res, "?token=").await;
}

async fn mode_change_applies_to_next_request(env: Env) {
    let redis = env.redis.is_some();
    let (h, addr) = start(env.builder().tier(user_tier(1)).build().unwrap()).await;
    assert_eq!(as_user(addr, "alice").await.status(), 200);
    assert_eq!(as_user(addr, "alice").await.status(), 429);

    // The tier to shadow: the very next request passes, counted as shadow_limited.
    let (status, body) = api_mode(addr, json!({"tier": "user", "mode": "shadow"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["tiers"][0]["name"], "user");
    assert_eq!(body["tiers"][0]["mode"], "shadow");
    assert_eq!(body["mode"], "enforce");
    let before = h.counts().shadow_limited;
    assert_eq!(as_user(addr, "alice").await.status(), 200);
    assert_eq!(h.counts().shadow_limited, before + 1);

    // Back to enforce: the next request is refused again.
    let (status, _) = api_mode(addr, json!({"tier": "user", "mode": "enforce"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(as_user(addr, "alice").await.status(), 429);

    // A global canary at 0 % enforces nobody.
    let (status, body) = api_mode(addr, json!({"mode": "canary:0"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["mode"], "canary:0");
    assert_eq!(body["tiers"][0]["effective_mode"], "canary:0");
    assert_eq!(h.mode(), Mode::Canary { percent: 0 });
    assert_eq!(as_user(addr, "alice").await.status(), 200);
    let (status, _) = api_mode(addr, json!({"mode": "canary:100"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(as_user(addr, "alice").await.status(), 429);

    // What the status route reports.
    let (_, s) = api_get(addr, "/api/status").await;
    assert_eq!(s["mode"], "canary:100");
    assert_eq!(s["effective_mode"], "canary:100");
    assert_eq!(s["circuit_state"], "closed");
    assert_eq!(s["tiers"][0]["quota"]["limit"], 1);
    assert_eq!(s["tiers"][0]["quota"]["period"], "1m");
    assert_eq!(s["tiers"][0]["algorithm"], "token_bucket");
    // Three refusals, all `limited`: on Redis the first, right after the
    // admission that emptied the bucket, is answered by the deny cache
    // (primed by that admission) but is the key's first denial; the two
    // others by Redis.
    let refused = |k: &str| s["counts"][k].as_u64().unwrap();
    assert_eq!(
        (refused("cache_blocked"), refused("limited")),
        (0, 3),
        "redis: {redis}, {s}"
    );

    // Refused changes change nothing.
    for (body, status, error) in [
        (
            json!({"mode": "bogus"}),
            StatusCode::BAD_REQUEST,
            "invalid_mode",
        ),
        (
            json!({"mode": "canary:101"}),
            StatusCode::BAD_REQUEST,
            "invalid_mode",
        ),
        (
            json!({"tier": "nope", "mode": "off"}),
            StatusCode::NOT_FOUND,
            "unknown_tier",
        ),
        (
            json!({"mode": "off", "extra": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            json!({"tier": "user"}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (json!("off"), StatusCode::BAD_REQUEST, "invalid_body"),
    ] {
        let (got, res) = api_mode(addr, body.clone()).await;
        assert_eq!(
            (got, res["error"].as_str()),
            (status, Some(error)),
            "{body}"
        );
    }
    assert_eq!(h.mode(), Mode::Canary { percent: 100 });
    assert_eq!(h.tiers()[0].mode, Mode::Enforce);
}

async fn kill_switch(env: Env) {
    let (h, addr) = start(env.builder().tier(user_tier(1)).build().unwrap()).await;
    assert_eq!(as_user(addr, "mallory").await.status(), 200);
    assert_eq!(as_user(addr, "mallory").await.status(), 429);
    let (status, body) = api_mode(addr, json!({"mode": "off"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["mode"], "off");
    assert_eq!(body["tiers"][0]["effective_mode"], "off");
    assert_eq!(h.mode(), Mode::Off);
    let skipped = h.counts().skipped;
    for _ in 0..5 {
        let res = as_user(addr, "mallory").await;
        assert_eq!(limits(&res), NO_LIMITS, "off: no limiting, no headers");
    }
    assert_eq!(h.counts().skipped, skipped + 5);
    let (status, _) = api_mode(addr, json!({"mode": "enforce"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(as_user(addr, "mallory").await.status(), 429);
}

async fn top_history_and_anomalies_json(env: Env) {
    let (_h, addr) = start(env.builder().tier(user_tier(2)).build().unwrap()).await;
    for _ in 0..7 {
        as_user(addr, "mallory").await;
    }
    for _ in 0..3 {
        as_user(addr, "eve").await;
    }
    let (status, top) = api_get(addr, "/api/top/user").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(top["kind"], "blocked");
    assert_eq!(top["window_secs"], 3600);
    assert_eq!(
        top["keys"],
        json!([
            {"key": "mallory", "count": 5, "error": 0},
            {"key": "eve", "count": 1, "error": 0},
        ])
    );
    let (_, top) = api_get(addr, "/api/top/user?n=1&window=3h").await;
    assert_eq!(top["window_secs"], 3 * 3600);
    assert_eq!(top["keys"].as_array().unwrap().len(), 1);
    let (_, near) = api_get(addr, "/api/top/user?kind=near_limit").await;
    assert_eq!(near["kind"], "near_limit");
    let mut near: Vec<&str> = near["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    near.sort_unstable();
    assert_eq!(near, ["eve", "mallory"]);
    for (q, error) in [
        ("?n=x", "invalid_n"),
        ("?window=soon", "invalid_window"),
        ("?kind=all", "invalid_kind"),
    ] {
        let (status, body) = api_get(addr, &format!("/api/top/user{q}")).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some(error))
        );
    }
    let (status, body) = api_get(addr, "/api/top/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body, json!({"error": "unknown_tier", "tier": "nope"}));

    // The minute closes with the first request of the next one.
    env.clock.advance(Duration::from_secs(60));
    as_user(addr, "bob").await;
    let (status, hist) = api_get(addr, "/api/history/user").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        hist["buckets"],
        json!([{"start": T0_S - T0_S % 60, "requests": 10, "limited": 6, "shadow_limited": 0, "fail_open": 0}])
    );
    let (status, _) = api_get(addr, "/api/history/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, a) = api_get(addr, "/api/anomalies").await;
    assert_eq!(status, StatusCode::OK);
    // Fewer than min_requests (20) in the bucket: no baseline yet.
    // No tier is guarded: no guards.
    assert_eq!(a, json!({"anomalies": [], "guards": []}));
}

/// At a 10 % canary, the keys the tier refused and the keys it would have
/// refused but let through (outside the canary) are two lists, with exact
/// counts: in `/api/top` (`kind=blocked`, `kind=shadow_limited`), on the
/// page (two tables), and on Redis in the fleet-wide hourly sets
/// (`rl:blocked:<hour>`, `rl:shadow_limited:<hour>`). Ten users outside the
/// canary that only ever got 200 must not lead the refused keys.
async fn top_keys_refused_apart_from_would_be_refused(env: Env) {
    let canary = Mode::Canary { percent: 10 };
    let (inside, outside): (Vec<String>, Vec<String>) = (0..400)
        .map(|u| format!("u{u}"))
        .partition(|id| canary.enforces("user", id));
    let (refused, passed) = (&inside[..3], &outside[..10]);
    let (h, addr) = start(
        env.builder()
            .tier(user_tier(1).mode(canary))
            .build()
            .unwrap(),
    )
    .await;
    // Outside the canary: 6 requests each, all 200, 5 of them over the quota.
    for id in passed {
        for _ in 0..6 {
            assert_eq!(as_user(addr, id).await.status(), 200, "{id}");
        }
    }
    // Inside: 3 requests each, 200 then two 429s.
    for id in refused {
        let got: Vec<u16> = statuses(addr, id, 3).await;
        assert_eq!(got, [200, 429, 429], "{id}");
    }
    let keys = |v: &Value| -> Vec<(String, u64)> {
        let mut k: Vec<(String, u64)> = v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| {
                assert_eq!(k["error"], 0);
                (
                    k["key"].as_str().unwrap().to_owned(),
                    k["count"].as_u64().unwrap(),
                )
            })
            .collect();
        k.sort();
        k
    };
    let want = |ids: &[String], n: u64| -> Vec<(String, u64)> {
        let mut w: Vec<(String, u64)> = ids.iter().map(|id| (id.clone(), n)).collect();
        w.sort();
        w
    };
    let (status, blocked) = api_get(addr, "/api/top/user?n=50").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(blocked["kind"], "blocked");
    assert_eq!(keys(&blocked), want(refused, 2));
    let (status, shadow) = api_get(addr, "/api/top/user?n=50&kind=shadow_limited").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(shadow["kind"], "shadow_limited");
    assert_eq!(keys(&shadow), want(passed, 5));
    let c = h.counts();
    assert_eq!((c.limited + c.cache_blocked, c.shadow_limited), (6, 50));

    // The page: one table each.
    let html = page_html(addr).await;
    let table = |id: &str| -> String {
        let start = html.find(&format!(r#"<table id="{id}">"#)).unwrap();
        let end = start + html[start..].find("</table>").unwrap();
        html[start..end].to_owned()
    };
    let (top, would) = (table("top-blocked"), table("top-shadow-limited"));
    for id in refused {
        let row = format!(r#"title="{id}">{id}</code></td><td class="n">2</td>"#);
        let cell = format!(r#"title="{id}""#);
        assert!(top.contains(&row) && !would.contains(&cell), "{id}: {html}");
    }
    for id in passed {
        let row = format!(r#"title="{id}">{id}</code></td><td class="n">5</td>"#);
        let cell = format!(r#"title="{id}""#);
        assert!(would.contains(&row) && !top.contains(&cell), "{id}: {html}");
    }

    // Fleet-wide, on Redis: the same split, in two hourly sets.
    if let Some(redis) = &env.redis {
        let hour = T0_S / 3600;
        let zrange = |set: String| -> Vec<(String, u64)> {
            let mut v: Vec<(String, u64)> = redis.cmd(&["ZRANGE", &set, "0", "-1", "WITHSCORES"]);
            for (k, _) in &mut v {
                *k = k.strip_prefix("rl:user:").unwrap().to_owned();
            }
            v.sort();
            v
        };
        assert_eq!(zrange(format!("rl:shadow_limited:{hour}")), want(passed, 5));
        // The second 429 of each refused key may come from the deny cache,
        // added by the once-a-second flush.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while zrange(format!("rl:blocked:{hour}")) != want(refused, 2) {
            assert!(
                std::time::Instant::now() < deadline,
                "{:?}",
                zrange(format!("rl:blocked:{hour}"))
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let fleet = |top: Vec<tiered_ratelimit::observe::BlockedKey>| -> Vec<(String, u64)> {
            let mut v: Vec<(String, u64)> = top.into_iter().map(|b| (b.key, b.count)).collect();
            v.sort();
            v
        };
        let window = Duration::from_secs(3600);
        assert_eq!(
            fleet(h.top_blocked_fleet("user", 50, window).await.unwrap()),
            want(refused, 2)
        );
        assert_eq!(
            fleet(
                h.top_shadow_limited_fleet("user", 50, window)
                    .await
                    .unwrap()
            ),
            want(passed, 5)
        );
    }
}

/// `n` requests in a row as user `id`: their statuses.
async fn statuses(addr: SocketAddr, id: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(as_user(addr, id).await.status().as_u16());
    }
    out
}

/// The page as the bearer token sees it.
async fn page_html(addr: SocketAddr) -> String {
    let res = client()
        .get(format!("http://{addr}{BASE}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.text().await.unwrap()
}

/// Right after a start, before any bucket closed, the history API and the
/// chart show the bucket still open, marked partial, with the requests
/// made so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_bucket_right_after_start() {
    let env = Env::memory();
    let (h, addr) = start(env.builder().tier(user_tier(2)).build().unwrap()).await;
    let (status, hist) = api_get(addr, "/api/history/user").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        hist,
        json!({"tier": "user", "buckets": [], "current": null})
    );
    assert!(
        page_html(addr).await.contains(r#"id="rate-chart-empty""#),
        "nothing checked yet"
    );
    env.clock.advance(Duration::from_secs(7));
    for _ in 0..3 {
        as_user(addr, "mallory").await;
    }
    let (_, hist) = api_get(addr, "/api/history/user").await;
    let start = T0_S - T0_S % 60;
    assert_eq!(
        hist,
        json!({"tier": "user", "buckets": [], "current":
            {"start": start, "requests": 3, "limited": 1, "shadow_limited": 0, "fail_open": 0, "partial": true}})
    );
    assert_eq!(h.history("user").unwrap(), []);
    let html = page_html(addr).await;
    assert!(!html.contains("rate-chart-empty"), "{html}");
    assert!(html.contains(r#"<svg id="rate-chart""#), "{html}");
    assert_eq!(
        html.matches(r#"<circle class="partial" data-tier="user""#)
            .count(),
        1,
        "{html}"
    );
    assert!(
        html.contains("1 of 3 limited (33.3 %) so far (partial: bucket still open)"),
        "{html}"
    );
    // Once it closes, it is history, and the next one is the open one.
    env.clock.advance(Duration::from_secs(60));
    as_user(addr, "bob").await;
    let (_, hist) = api_get(addr, "/api/history/user").await;
    assert_eq!(
        hist["buckets"],
        json!([{"start": start, "requests": 3, "limited": 1, "shadow_limited": 0, "fail_open": 0}])
    );
    assert_eq!(
        hist["current"],
        json!({"start": start + 60, "requests": 1, "limited": 0, "shadow_limited": 0, "fail_open": 0, "partial": true})
    );
}

/// The host name and pid the page names without a control key.
fn this_instance() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    format!("this instance ({}:{})", host.trim(), std::process::id())
}

/// Without a control key the page's buttons switch this process, and the
/// page says so beside each of them; it shows when it was rendered (the
/// layer's clock) and reloads itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_without_control_key_names_this_instance() {
    let env = Env::memory();
    let layer = env
        .builder()
        .tier(user_tier(5))
        .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(100)))
        .build()
        .unwrap();
    let (h, addr) = start(layer).await;
    env.clock.advance(Duration::from_secs(65));
    let html = page_html(addr).await;
    let scope = format!(r#"<span class="scope">{}</span>"#, this_instance());
    // Kill switch, global mode, one per tier, the quota and list forms.
    assert_eq!(html.matches(&scope).count(), 6, "{html}");
    assert!(!html.contains("all instances"), "{html}");
    assert!(
        html.contains(r#"<meta http-equiv="refresh" content="15">"#),
        "{html}"
    );
    assert!(
        html.contains(
            r#"<span id="rendered" class="muted">rendered 2023-11-14T22:14:25Z, refreshes every 15 s</span>"#
        ),
        "{html}"
    );
    let (_, status) = api_get(addr, "/api/status").await;
    assert_eq!(status["mode_changes_apply_to"], this_instance());
    assert_eq!(status["control_key"], Value::Null);
    // The kill switch switches this process.
    let res = raw_client()
        .post(format!("http://{addr}{BASE}/mode"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("mode=off")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(h.mode(), Mode::Off);
}

/// With a control key the page's buttons (and the API) write the fleet-wide
/// control hash, apply it here at once, and say "all instances".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_with_control_key_switches_all_instances() {
    use tiered_ratelimit::handle::ControlKey;
    let env = Env::redis();
    let redis = env.redis.as_ref().unwrap();
    let layer = env
        .builder()
        .control_key(ControlKey::new("rl:control").poll_interval(Duration::from_secs(3600)))
        .tier(user_tier(5))
        .build()
        .unwrap();
    let (h, addr) = start(layer).await;
    let html = page_html(addr).await;
    let scope = r#"<span class="scope">all instances (control key <code>rl:control</code>)</span>"#;
    // The kill switch, the global mode, the tier's mode, the quota form
    // and the list form.
    assert_eq!(html.matches(scope).count(), 5, "{html}");
    assert!(!html.contains("this instance"), "{html}");
    let (_, status) = api_get(addr, "/api/status").await;
    assert_eq!(status["mode_changes_apply_to"], "all instances");
    assert_eq!(status["control_key"], "rl:control");

    let post = |body: &'static str| {
        raw_client()
            .post(format!("http://{addr}{BASE}/mode"))
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
    };
    // The kill switch: the hash says off; this instance is off at once,
    // its own configured mode untouched (the override is the fleet's).
    assert_eq!(
        post("mode=off").await.unwrap().status(),
        StatusCode::SEE_OTHER
    );
    let mode: Option<String> = redis.cmd(&["HGET", "rl:control", "mode"]);
    assert_eq!(mode.as_deref(), Some("off"));
    assert_eq!((h.mode(), h.effective_mode()), (Mode::Enforce, Mode::Off));
    assert!(page_html(addr).await.contains(r#"id="override""#));
    // A tier's button writes its field.
    assert_eq!(
        post("tier=user&mode=shadow").await.unwrap().status(),
        StatusCode::SEE_OTHER
    );
    let fields: Vec<String> = redis.cmd(&["HGETALL", "rl:control"]);
    assert_eq!(fields, ["mode", "off", "tier:user", "shadow"]);
    // The API too.
    let (status, body) = api_mode(addr, json!({"mode": "enforce"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["effective_mode"], "enforce");
    let mode: Option<String> = redis.cmd(&["HGET", "rl:control", "mode"]);
    assert_eq!(mode.as_deref(), Some("enforce"));
    // Unknown tier: nothing written.
    assert_eq!(
        post("tier=nope&mode=off").await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
    let fields: Vec<String> = redis.cmd(&["HGETALL", "rl:control"]);
    assert_eq!(fields, ["mode", "enforce", "tier:user", "shadow"]);
}

/// `?token=` → 303 without it + the cookie; the cookie opens the page and
/// its form, not the API; a cross-site form post is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_cookie_and_form() {
    let env = Env::memory();
    let (h, addr) = start(env.builder().tier(user_tier(5)).build().unwrap()).await;
    let c = raw_client();
    let res = c
        .get(format!("http://{addr}{BASE}?token={TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(res.headers()["location"], BASE, "the token leaves the URL");
    let set_cookie = res.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attr in [
        "HttpOnly",
        "SameSite=Strict",
        "Secure",
        "Path=/admin/ratelimit",
        "Max-Age=",
    ] {
        assert!(set_cookie.contains(attr), "{set_cookie}: {attr}");
    }
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    // An HMAC of the token: neither the token nor any encoding of it.
    assert!(
        !cookie.contains(TOKEN) && !cookie.contains(&hex(TOKEN)),
        "the cookie must not carry the token: {cookie}"
    );
    assert_eq!(cookie.len(), COOKIE_NAME.len() + 1 + 64, "{cookie}");

    let res = c
        .get(format!("http://{addr}{BASE}"))
        .header("cookie", format!("other=1; {cookie}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "text/html; charset=utf-8");
    let csp = res.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    assert_eq!(res.headers()["x-frame-options"], "DENY");
    assert!(res.headers().get("set-cookie").is_none());
    let html = res.text().await.unwrap();
    assert!(html.contains(r#"action="/admin/ratelimit/mode""#), "{html}");
    assert!(html.contains(r#"id="kill-switch""#));

    let form = |body: &'static str, site: Option<&'static str>| {
        let mut req = c
            .post(format!("http://{addr}{BASE}/mode"))
            .header("cookie", cookie.clone())
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(s) = site {
            req = req.header("sec-fetch-site", s);
        }
        req.send()
    };
    // Cross-site: refused even with the cookie.
    let res = form("mode=off", Some("cross-site")).await.unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    assert_eq!(h.mode(), Mode::Enforce);
    // The kill switch button.
    let res = form("mode=off", Some("same-origin")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(res.headers()["location"], BASE);
    assert_eq!(h.mode(), Mode::Off);
    let html = c
        .get(format!("http://{addr}{BASE}"))
        .header("cookie", cookie.clone())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(html.contains(r#"id="resume""#), "off: the button resumes");
    let res = form("mode=enforce", None).await.unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(h.mode(), Mode::Enforce);
    // A tier's form.
    let res = form("tier=user&mode=canary%3A10", None).await.unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(h.tiers()[0].mode, Mode::Canary { percent: 10 });
    let res = form("tier=user&mode=nope", None).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let res = form("tier=nope&mode=off", None).await.unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    let res = form("tier=user", None).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(h.tiers()[0].mode, Mode::Canary { percent: 10 });

    // With the query token turned off, only the header opens the page.
    let layer = env.builder().tier(user_tier(5)).build().unwrap();
    let router = Admin::new(layer.handle(), TOKEN)
        .query_token(false)
        .secure_cookie(false)
        .router();
    let addr = serve(app(layer).nest(BASE, router)).await;
    let res = c
        .get(format!("http://{addr}{BASE}?token={TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_unauthorized(res, "query token off").await;
    let res = c
        .get(format!("http://{addr}{BASE}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        res.headers().get("set-cookie").is_none(),
        "a header-authenticated load sets no cookie"
    );
}

/// Mounted at the root with `merge`, the page and its form live at `/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mounted_at_the_root() {
    let env = Env::memory();
    let layer = env.builder().tier(user_tier(5)).build().unwrap();
    let addr = serve(admin::router(layer.handle(), TOKEN)).await;
    let c = raw_client();
    let res = c
        .get(format!("http://{addr}/?token={TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SEE_OTHER);
    assert_eq!(res.headers()["location"], "/");
    assert!(res.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .contains("Path=/;"));
    let html = c
        .get(format!("http://{addr}/"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(html.contains(r#"action="/mode""#));
}

/// Keys and endpoints are written into the page HTML-escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_escapes_what_clients_sent() {
    let env = Env::memory();
    let (_h, addr) = start(env.builder().tier(user_tier(1)).build().unwrap()).await;
    let evil = r#"<script>alert(1)</script>"#;
    for _ in 0..3 {
        as_user(addr, evil).await;
        // (the space is percent-escaped in the storage key part)
        as_user(addr, r#"x" onmouseover="alert(2)"#).await;
    }
    let html = client()
        .get(format!("http://{addr}{BASE}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{html}"
    );
    assert!(
        html.contains("x&quot;%20onmouseover=&quot;alert(2)"),
        "{html}"
    );
    assert!(!html.contains("<script"), "{html}");
    assert!(!html.contains(r#""%20onmouseover"#), "{html}");
}

/// Keys are shown as people read them (decoded), their stored form as the
/// tooltip, both HTML-escaped: markup and quotes a client chose stay text.
/// Peek, reset and the page's lookup take a key in either form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_shown_as_read_and_typed_in_either_form() {
    let env = Env::redis();
    let (h, addr) = start(env.builder().tier(user_tier(1)).build().unwrap()).await;
    let endpoint = Tier::new("endpoint", Endpoint, Quota::per_minute(1));
    let (he, addr_e) = start(env.builder().tier(endpoint).build().unwrap()).await;
    let c = client();
    // Two requests on GET /users/{id}, the second refused by `endpoint`.
    for status in [200, 429] {
        let res = c
            .get(format!("http://{addr_e}/users/7"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), status);
    }
    // Users whose ids hold markup, quotes and ampersands: 2 requests each
    // against 1 a minute (their second is refused).
    let users = [
        "<script>alert(1)</script>",
        r#"x" onmouseover="alert(2)"#,
        "it's & <b>",
    ];
    for u in users {
        for _ in 0..2 {
            as_user(addr, u).await;
        }
    }
    let html = page_html(addr).await + &page_html(addr_e).await;
    for (shown, stored) in [
        ("GET /users/{id}", "GET%20/users/%7Bid%7D"),
        (
            "&lt;script&gt;alert(1)&lt;/script&gt;",
            "&lt;script&gt;alert(1)&lt;/script&gt;",
        ),
        (
            "x&quot; onmouseover=&quot;alert(2)",
            "x&quot;%20onmouseover=&quot;alert(2)",
        ),
        ("it&#39;s &amp; &lt;b&gt;", "it&#39;s%20&amp;%20&lt;b&gt;"),
    ] {
        let cell = format!(r#"<code class="key" title="{stored}">{shown}</code>"#);
        assert!(html.contains(&cell), "{cell} missing:\n{html}");
    }
    assert!(!html.contains("<script"), "{html}");
    assert!(!html.contains("<b>"), "{html}");
    assert!(!html.contains(r#"" onmouseover"#), "{html}");
    // Three 429s on the users' page, one on the endpoint's: each key's
    // first.
    assert!(
        html.contains(r#"<tr id="count-429s"><th>429s</th><th class="n">3</th></tr>"#),
        "{html}"
    );
    assert!(
        html.contains(r#"<tr id="count-429s"><th>429s</th><th class="n">1</th></tr>"#),
        "{html}"
    );

    // Peek by the API: the key as shown, or as stored.
    let api = |path: String| {
        c.get(format!("http://{addr_e}{BASE}{path}"))
            .bearer_auth(TOKEN)
            .send()
    };
    for typed in ["GET%20%2Fusers%2F%7Bid%7D", "GET%2520/users/%257Bid%257D"] {
        let res = api(format!("/api/peek/endpoint?key={typed}"))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{typed}");
        let v: Value = res.json().await.unwrap();
        assert_eq!(
            (
                v["key"].as_str(),
                v["allowed"].as_bool(),
                v["remaining"].as_u64()
            ),
            (Some("GET%20/users/%7Bid%7D"), Some(false), Some(0)),
            "{typed}: {v}"
        );
    }
    // The page's lookup, with the key as shown.
    let res = c
        .get(format!(
            "http://{addr}{BASE}?peek_tier=user&peek_key=it%27s+%26+%3Cb%3E"
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let page = res.text().await.unwrap();
    assert!(
        page.contains(r#"<table id="lookup"><tr><th>next request</th><td>denied</td>"#),
        "{page}"
    );
    assert!(
        page.contains(r#"value="it&#39;s &amp; &lt;b&gt;""#),
        "{page}"
    );
    // Reset by the API with the key as shown; by the page's form with the
    // stored form its button posts.
    let res = c
        .post(format!("http://{addr_e}{BASE}/api/reset"))
        .bearer_auth(TOKEN)
        .json(&json!({"tier": "endpoint", "key": "GET /users/{id}"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let v: Value = res.json().await.unwrap();
    assert_eq!(
        v,
        json!({"tier": "endpoint", "key": "GET%20/users/%7Bid%7D", "existed": true})
    );
    assert!(
        he.peek("endpoint", "GET /users/{id}")
            .await
            .unwrap()
            .allowed
    );
    assert!(h.reset("user", "it's%20&%20<b>").await.unwrap());
    assert!(h.peek("user", "it's & <b>").await.unwrap().allowed);
}

/// A layer on a Redis nobody listens on (failure policy open, manual
/// clock): 3 requests in one minute, 2 in the next, all passed unchecked.
async fn fail_open_minutes() -> SocketAddr {
    use tiered_ratelimit::{backend::ManualClock, backend::RedisBackend, FailurePolicy};
    let clock = ManualClock::new(T0_US);
    let dead = crate::support::redis_server::free_port();
    let layer = RateLimitLayer::builder()
        .backend(
            RedisBackend::from_url(&format!("redis://127.0.0.1:{dead}/"))
                .unwrap()
                .with_manual_clock(clock.clone()),
        )
        .key_prefix("fail-open")
        .failure_policy(FailurePolicy::Open)
        .tier(user_tier(5))
        .build()
        .unwrap();
    let (_h, addr) = start(layer).await;
    for n in [3, 2] {
        for _ in 0..n {
            assert_eq!(as_user(addr, "alice").await.status(), 200);
        }
        if n == 3 {
            clock.advance(Duration::from_secs(60));
        }
    }
    addr
}

/// A young process's chart spans its own buckets (at least 4), not the
/// whole hour: its points are not crowded against the right edge. A
/// fail-open period is shaded, with how many requests passed unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_spans_a_young_process_and_shades_fail_open() {
    let addr = fail_open_minutes().await;
    let html = page_html(addr).await;
    // Two buckets (one closed, one open) on a 4-bucket axis: the first
    // starts half-way across the 1036 px plot (52 + 1036 × 2/4).
    for (x, n) in [("570.0", 3), ("829.0", 2)] {
        let rect = format!(
            r##"<rect class="fail-open" x="{x}" y="10" width="259.0" height="196.0" fill="#fbe0c8"><title>"##
        );
        assert!(html.contains(&rect), "{rect} missing:\n{html}");
        let title =
            format!("{n} requests passed unchecked (the backend failed; failure policy open)</title></rect>");
        assert!(html.contains(&title), "{title} missing:\n{html}");
    }
    assert!(
        html.contains("shaded: the backend failed and requests passed unchecked (fail open)"),
        "{html}"
    );
    let (_, v) = api_get(addr, "/api/history/user").await;
    assert_eq!(v["buckets"][0]["fail_open"], 3, "{v}");
    assert_eq!(v["buckets"][0]["requests"], 0, "{v}");
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

// ------------------------------------------------------------ headless Chromium

/// Written to stderr directly, so it shows without `--nocapture`.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let d = std::env::temp_dir().join(format!(
        "tiered-ratelimit-{tag}-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs headless Chromium on `url` with a fresh profile; returns stdout.
async fn chromium(bin: &Path, url: &str, extra: &[String]) -> String {
    let profile = temp_dir("chromium");
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(url)
    .stdin(std::process::Stdio::null())
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("chromium finished within 2 minutes")
        .expect("chromium ran");
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_page_in_headless_chromium() {
    let Some(bin) = on_path("chromium") else {
        say(
            "SKIPPED admin_page_in_headless_chromium: `chromium` is not on PATH \
             (Debian: apt-get install chromium)",
        );
        return;
    };
    let env = Env::memory();
    let layer = env
        .builder()
        .tier(Tier::new(
            "ip",
            ClientIp::default(),
            Quota::per_minute(10_000),
        ))
        .tier(user_tier(5))
        .tier(Tier::new("endpoint", Endpoint, Quota::per_minute(15)).mode(Mode::Shadow))
        .build()
        .unwrap();
    let (h, addr) = start(layer).await;

    // 15 minutes of traffic on the manual clock: 20 well-behaved users a
    // minute, mallory sending more and more, and a hostile-looking user id.
    let evil = "<script>alert(1)</script>";
    let c = client();
    for minute in 0..15u64 {
        for i in 0..20 {
            c.get(format!("http://{addr}/users/{i}"))
                .header("authorization", format!("Bearer u{minute}-{i}"))
                .send()
                .await
                .unwrap();
        }
        for _ in 0..3 + minute {
            as_user(addr, "mallory").await;
        }
        if minute >= 8 {
            for _ in 0..7 {
                as_user(addr, evil).await;
            }
        }
        env.clock.advance(Duration::from_secs(60));
    }
    as_user(addr, "bob").await; // closes the last minute
    assert_eq!(h.history("user").unwrap().len(), 15);
    let top = h
        .top_blocked("user", 10, Duration::from_secs(3600))
        .unwrap();
    assert_eq!(top[0].key, "mallory");
    assert!(h.counts().limited > 0 && h.counts().shadow_limited > 0);

    // Chromium loads the page with ?token=, follows the 303 with the cookie.
    let url = format!("http://{addr}{BASE}?token={TOKEN}");
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("admin-page.png");
    let _ = std::fs::remove_file(&shot);
    chromium(
        &bin,
        &url,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1200,900".to_owned(),
        ],
    )
    .await;
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert!(width >= 1000 && height >= 700, "{width}x{height}");
    assert!(
        png.len() > 20_000,
        "a real page, not a blank: {} bytes",
        png.len()
    );
    say(&format!(
        "admin page screenshot ({width}x{height}, {} bytes): {}",
        png.len(),
        shot.display()
    ));

    let dom = chromium(&bin, &url, &["--dump-dom".to_owned()]).await;
    assert!(
        !dom.contains("unauthorized"),
        "the cookie opened the page after the redirect: {dom}"
    );
    for needle in [
        r#"<svg id="rate-chart""#,
        "<polyline",
        r#"data-tier="user""#,
        r#"stroke-dasharray"#, // the shadow tier's would-block line
        "<code>ip</code>",
        "<code>user</code>",
        "<code>endpoint</code>",
        r#"<code class="key" title="mallory">mallory</code>"#,
        "&lt;script&gt;alert(1)&lt;/script&gt;",
        r#"id="kill-switch""#,
        r#"id="top-blocked""#,
        // bob's request: the bucket still open, drawn as partial.
        r#"<circle class="partial" data-tier="user""#,
        r#"<meta http-equiv="refresh" content="15">"#,
        r#"id="rendered""#,
        &this_instance(),
    ] {
        assert!(
            dom.contains(needle),
            "{needle} missing from the DOM:\n{dom}"
        );
    }
    assert!(!dom.contains("<script"), "no script element: {dom}");

    // Right after a start: no bucket closed, the chart shows the open one.
    let env = Env::memory();
    let (_h, addr) = start(env.builder().tier(user_tier(2)).build().unwrap()).await;
    for _ in 0..3 {
        as_user(addr, "mallory").await;
    }
    let url = format!("http://{addr}{BASE}?token={TOKEN}");
    let dom = chromium(&bin, &url, &["--dump-dom".to_owned()]).await;
    assert!(!dom.contains("rate-chart-empty"), "{dom}");
    assert!(
        dom.contains(r#"<circle class="partial" data-tier="user""#),
        "{dom}"
    );
    assert!(
        dom.contains("1 of 3 limited (33.3 %) so far (partial: bucket still open)"),
        "{dom}"
    );
    // ... on a 4-bucket axis: the dot sits in the last of 4 slots (52 +
    // 1036 × 3.5/4), not crowded against the edge of a 60-bucket hour.
    assert!(
        dom.contains(r#"<circle class="partial" data-tier="user" cx="958.5""#),
        "{dom}"
    );

    // A fail-open period is shaded.
    let addr = fail_open_minutes().await;
    let url = format!("http://{addr}{BASE}?token={TOKEN}");
    let dom = chromium(&bin, &url, &["--dump-dom".to_owned()]).await;
    for x in ["570.0", "829.0"] {
        let rect = format!(r#"<rect class="fail-open" x="{x}" y="10" width="259.0""#);
        assert!(dom.contains(&rect), "{rect} missing:\n{dom}");
    }
    assert!(
        dom.contains("3 requests passed unchecked (the backend failed; failure policy open)"),
        "{dom}"
    );
}
