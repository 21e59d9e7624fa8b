//! The admin surface: an axum [`Router`] over a [`RateLimitHandle`] with a
//! JSON API and one HTML page, for the operator who has to answer "who is
//! being limited, since when, and is it normal?" and sometimes pull the kill
//! switch.
//!
//! ```no_run
//! use axum::{routing::get, Router};
//! use tiered_ratelimit::{admin, key::Global, Quota, RateLimitLayer, Tier};
//!
//! let layer = RateLimitLayer::builder()
//!     .tier(Tier::new("global", Global, Quota::per_second(100)))
//!     .build()
//!     .unwrap();
//! let token = std::env::var("ADMIN_TOKEN").unwrap();
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(layer.clone())
//!     // Mounted after `.layer(..)`: the admin routes are not rate limited.
//!     // Put your own authentication in front of it as well.
//!     .nest("/admin/ratelimit", admin::router(layer.handle(), token));
//! ```
//!
//! Everything below is relative to where the router is mounted.
//!
//! **Where mode changes apply.** With a fleet control key (a
//! [`ControlKey`](crate::ControlKey) on a Redis backend), `POST /mode` and
//! `POST /api/mode` write the control hash
//! ([`RateLimitHandle::set_fleet_mode`]): every instance follows within its
//! poll interval, and the page says "all instances" beside every button.
//! Without one they change only the process that served the request
//! ([`RateLimitHandle::set_mode`]), and the page says "this instance
//! (host:pid)" beside every button. The page shows when it was rendered
//! (the layer's clock, UTC) and reloads itself ([`Admin::refresh`]).
//!
//! | method and path | answer |
//! |---|---|
//! | `GET /` | the HTML page |
//! | `POST /mode` | the page's form (`application/x-www-form-urlencoded`: `mode`, optional `tier`); answers `303` back to the page |
//! | `GET /api/status` | global mode, circuit state, where mode changes apply (`mode_changes_apply_to`: `all instances` or `this instance (host:pid)`; `control_key`), counts, every tier's mode and quota, the anomaly series |
//! | `GET /api/top/{tier}?n=10&window=1h&kind=blocked` | top-N keys of a tier (`kind=near_limit` for keys allowed with < 20 % left); `window` in humantime, rounded up to hours, at most 24 h |
//! | `GET /api/history/{tier}` | the tier's last hour of closed buckets, and `current`: the bucket still open, `"partial": true` (`null` before the first request) |
//! | `GET /api/anomalies` | the 429-rate anomaly series and their alerts |
//! | `POST /api/mode` | `{"mode":"shadow"}` (global) or `{"tier":"ip","mode":"canary:10"}`; answers like `/api/status` |
//!
//! # Authentication
//! The router wants a bearer token of its own **in addition to** whatever
//! protects the path it is mounted on. The token is compared in constant
//! time ([`subtle`]); an empty token accepts nothing. Every response to a
//! request without a valid token is `401` with
//! `{"error":"unauthorized"}`. Where the token is accepted:
//!
//! * `Authorization: Bearer <token>`: everywhere (the JSON API takes only
//!   this).
//! * The cookie [`COOKIE_NAME`]: only on `GET /` and the form's `POST /mode`.
//!   It is `HttpOnly; SameSite=Strict`, `Secure` unless
//!   [`Admin::secure_cookie`] is `false`, valid for 8 hours, and its `Path`
//!   is the page, so it goes nowhere else. A form post carrying only the
//!   cookie is also refused (`403`) if the browser marks it cross-site
//!   (`Sec-Fetch-Site`).
//! * `?token=<token>`: only on `GET /` (a browser cannot send a bearer
//!   header), unless [`Admin::query_token`] is `false`. The answer is a
//!   `303` to the page **without** the query, setting the cookie (an
//!   HMAC-SHA256 of the token, never the token itself), so the
//!   token leaves the address bar at once; but that first URL may still be
//!   written to access logs on the way. Where a reverse proxy can add the
//!   `Authorization` header itself, turn this off.
//!
//! The page is served with `Content-Security-Policy: default-src 'none'`
//! (inline styles only: no script at all, the chart is SVG rendered on the
//! server), `X-Frame-Options: DENY`, and every answer with
//! `Cache-Control: no-store`. Everything written into the page is
//! HTML-escaped: tier names, keys (storage key parts, already escaped for
//! storage but otherwise as clients sent them), endpoints.

use crate::observe::recorder::{AnomalyStatus, BucketCounts};
use crate::observe::topn::BlockedKey;
use crate::{Algorithm, DecisionCounts, LeakyBucket, Mode, RateLimitHandle, TierStatus};
use axum::body::{Body, Bytes};
use axum::extract::{NestedPath, Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use serde_json::{json, Value};
use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// The cookie the page sets after a `?token=` load (see the module docs).
pub const COOKIE_NAME: &str = "tiered_ratelimit_admin";

/// The most keys a top-N query returns.
pub const MAX_TOP_N: usize = 1000;

/// Request bodies larger than this are refused (`413`).
const BODY_LIMIT: usize = 16 * 1024;

/// How long the cookie lives.
const COOKIE_MAX_AGE_S: u64 = 8 * 3600;

/// The admin router with the defaults: see [`Admin`].
///
/// `token` is the bearer token every request must carry; an empty token
/// accepts no request at all.
pub fn router(handle: RateLimitHandle, token: impl Into<String>) -> Router {
    Admin::new(handle, token).router()
}

/// Builds the admin [`Router`] (see the [module docs](self)).
///
/// ```
/// use std::time::Duration;
/// use tiered_ratelimit::{admin::Admin, key::Global, Quota, RateLimitLayer, Tier};
///
/// let layer = RateLimitLayer::builder()
///     .tier(Tier::new("global", Global, Quota::per_second(100)))
///     .build()
///     .unwrap();
/// let admin: axum::Router = Admin::new(layer.handle(), "s3cret-token")
///     .top_n(20)
///     .window(Duration::from_secs(6 * 3600))
///     .query_token(false) // a proxy adds the Authorization header
///     .router();
/// ```
#[derive(Clone)]
#[must_use]
pub struct Admin {
    handle: RateLimitHandle,
    token: Arc<str>,
    top_n: usize,
    window: Duration,
    secure_cookie: bool,
    query_token: bool,
    refresh: Duration,
}

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin")
            .field("token", &"<redacted>")
            .field("top_n", &self.top_n)
            .field("window", &self.window)
            .field("secure_cookie", &self.secure_cookie)
            .field("query_token", &self.query_token)
            .field("refresh", &self.refresh)
            .finish_non_exhaustive()
    }
}

impl Admin {
    /// The admin surface of `handle`'s layer, guarded by `token`.
    pub fn new(handle: RateLimitHandle, token: impl Into<String>) -> Self {
        Self {
            handle,
            token: Arc::from(token.into()),
            top_n: 10,
            window: Duration::from_secs(3600),
            secure_cookie: true,
            query_token: true,
            refresh: Duration::from_secs(15),
        }
    }

    /// How often the page reloads itself (a `<meta http-equiv="refresh">`,
    /// no script; default 15 s, at least 1 s).
    pub fn refresh(mut self, every: Duration) -> Self {
        self.refresh = every.max(Duration::from_secs(1));
        self
    }

    /// Keys per tier in the page's top blocked table and the API's default
    /// `n` (default 10, at most [`MAX_TOP_N`]).
    pub fn top_n(mut self, n: usize) -> Self {
        self.top_n = n.clamp(1, MAX_TOP_N);
        self
    }

    /// The page's top-N window and the API's default `window` (default one
    /// hour; rounded up to whole hours, at most 24).
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window.clamp(Duration::from_secs(1), Duration::from_secs(24 * 3600));
        self
    }

    /// Whether the cookie is marked `Secure` (default `true`). Browsers
    /// accept `Secure` cookies over HTTPS and from `localhost` /
    /// `127.0.0.1`; set `false` only for plain HTTP on another host.
    pub fn secure_cookie(mut self, secure: bool) -> Self {
        self.secure_cookie = secure;
        self
    }

    /// Whether `GET /?token=<token>` is accepted (default `true`; see the
    /// module docs).
    pub fn query_token(mut self, accept: bool) -> Self {
        self.query_token = accept;
        self
    }

    /// The router, ready to `nest` (or `merge`) into your app.
    pub fn router(self) -> Router {
        let admin = Arc::new(self);
        Router::new()
            .route("/", get(page))
            .route("/mode", post(form_mode))
            .route("/api/status", get(api_status))
            .route("/api/top/{tier}", get(api_top))
            .route("/api/history/{tier}", get(api_history))
            .route("/api/anomalies", get(api_anomalies))
            .route("/api/mode", post(api_mode))
            .fallback(not_found)
            .layer(middleware::from_fn_with_state(admin.clone(), authorize))
            .with_state(admin)
    }

    fn token_matches(&self, candidate: &[u8]) -> bool {
        let token = self.token.as_bytes();
        // Lengths may differ in time; contents never do.
        !token.is_empty() && bool::from(token.ct_eq(candidate))
    }

    fn bearer_ok(&self, headers: &HeaderMap) -> bool {
        headers.get_all(header::AUTHORIZATION).iter().any(|v| {
            let v = v.as_bytes();
            v.len() > 7
                && v[..7].eq_ignore_ascii_case(b"bearer ")
                && self.token_matches(v[7..].trim_ascii())
        })
    }

    fn cookie_ok(&self, headers: &HeaderMap) -> bool {
        use subtle::ConstantTimeEq;
        let want = self.cookie_value();
        cookies(headers, COOKIE_NAME).any(|v| bool::from(v.as_bytes().ct_eq(want.as_bytes())))
    }

    /// The cookie's value: HMAC-SHA256 of a fixed label keyed by the token,
    /// in hex. It proves the token was given without carrying it (a cookie
    /// read off a browser does not reveal the token), every instance with
    /// the same token accepts it, and a new token voids old cookies.
    fn cookie_value(&self) -> String {
        use hmac::{KeyInit, Mac};
        let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(self.token.as_bytes()) else {
            // HMAC takes keys of any length; unreachable, and no cookie
            // matches an empty value.
            return String::new();
        };
        mac.update(b"tiered-ratelimit admin cookie v1");
        hex_encode(&mac.finalize().into_bytes())
    }

    fn query_ok(&self, query: Option<&str>) -> bool {
        query.is_some_and(|q| {
            form_pairs(q)
                .iter()
                .any(|(k, v)| k == "token" && self.token_matches(v.as_bytes()))
        })
    }

    fn cookie(&self, path: &str) -> HeaderValue {
        let mut c = format!(
            "{COOKIE_NAME}={}; Path={path}; Max-Age={COOKIE_MAX_AGE_S}; HttpOnly; SameSite=Strict",
            self.cookie_value()
        );
        if self.secure_cookie {
            c.push_str("; Secure");
        }
        HeaderValue::from_str(&c).unwrap_or_else(|_| HeaderValue::from_static(""))
    }
}

/// Where the router is mounted, without a trailing slash (`""` at the root).
fn base_of(req: &Request) -> String {
    req.extensions()
        .get::<NestedPath>()
        .map(|p| p.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default()
}

/// The page's own path.
fn page_path(base: &str) -> &str {
    if base.is_empty() {
        "/"
    } else {
        base
    }
}

async fn authorize(State(admin): State<Arc<Admin>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let page = req.method() == Method::GET && (path == "/" || path.is_empty());
    let form = req.method() == Method::POST && path == "/mode";
    let mut res = if admin.bearer_ok(req.headers()) {
        next.run(req).await
    } else if (page || form) && admin.cookie_ok(req.headers()) {
        let cross_site = req
            .headers()
            .get("sec-fetch-site")
            .is_some_and(|v| v.as_bytes() == b"cross-site" || v.as_bytes() == b"same-site");
        if form && cross_site {
            error(StatusCode::FORBIDDEN, "cross_site", "cross-site form post")
        } else {
            next.run(req).await
        }
    } else if page && admin.query_token && admin.query_ok(req.uri().query()) {
        // Trade the token in the URL for the cookie, and leave the URL.
        let base = base_of(&req);
        let mut res = see_other(page_path(&base));
        res.headers_mut()
            .insert(header::SET_COOKIE, admin.cookie(page_path(&base)));
        res
    } else {
        let mut res = error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid admin bearer token is required",
        );
        res.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"tiered-ratelimit admin\""),
        );
        res
    };
    let h = res.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    res
}

// ---------------------------------------------------------------- JSON API

async fn api_status(State(admin): State<Arc<Admin>>) -> Response {
    json_response(StatusCode::OK, &status_json(&admin.handle))
}

async fn api_anomalies(State(admin): State<Arc<Admin>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({ "anomalies": anomalies_json(&admin.handle.anomalies()) }),
    )
}

async fn api_history(State(admin): State<Arc<Admin>>, Path(tier): Path<String>) -> Response {
    match admin.handle.history(&tier) {
        Some(buckets) => json_response(
            StatusCode::OK,
            &json!({
                "tier": tier,
                "buckets": buckets.iter().map(bucket_json).collect::<Vec<_>>(),
                "current": admin.handle.open_bucket(&tier).map(|b| {
                    let mut v = bucket_json(&b);
                    v["partial"] = json!(true);
                    v
                }),
            }),
        ),
        None => unknown_tier(&tier),
    }
}

async fn api_top(
    State(admin): State<Arc<Admin>>,
    Path(tier): Path<String>,
    req: Request,
) -> Response {
    let mut n = admin.top_n;
    let mut window = admin.window;
    let mut near = false;
    for (k, v) in form_pairs(req.uri().query().unwrap_or("")) {
        match k.as_str() {
            "n" => match v.parse::<usize>() {
                Ok(x) => n = x.clamp(1, MAX_TOP_N),
                Err(_) => return error(StatusCode::BAD_REQUEST, "invalid_n", "n: an integer"),
            },
            "window" => match humantime::parse_duration(&v) {
                Ok(d) => window = d.min(Duration::from_secs(24 * 3600)),
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_window",
                        &format!("window: {e} (humantime: 30m, 1h, 24h)"),
                    )
                }
            },
            "kind" => match v.as_str() {
                "blocked" => near = false,
                "near_limit" => near = true,
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_kind",
                        "kind: blocked or near_limit",
                    )
                }
            },
            _ => {}
        }
    }
    let top = if near {
        admin.handle.top_near_limit(&tier, n, window)
    } else {
        admin.handle.top_blocked(&tier, n, window)
    };
    match top {
        Some(keys) => json_response(
            StatusCode::OK,
            &json!({
                "tier": tier,
                "kind": if near { "near_limit" } else { "blocked" },
                "window_secs": window_hours(window) * 3600,
                "keys": keys.iter().map(key_json).collect::<Vec<_>>(),
            }),
        ),
        None => unknown_tier(&tier),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ModeChange {
    mode: String,
    #[serde(default)]
    tier: Option<String>,
}

async fn api_mode(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(res) => return res,
    };
    let change: ModeChange = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_body",
                &format!("{e}; expected {{\"mode\":\"shadow\"}} or {{\"tier\":\"ip\",\"mode\":\"canary:10\"}}"),
            )
        }
    };
    match apply_mode(&admin.handle, change.tier.as_deref(), &change.mode, "api").await {
        Ok(()) => json_response(StatusCode::OK, &status_json(&admin.handle)),
        Err(e) => e.response(),
    }
}

async fn form_mode(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(res) => return res,
    };
    let Ok(body) = std::str::from_utf8(&body) else {
        return error(StatusCode::BAD_REQUEST, "invalid_body", "not UTF-8");
    };
    let (mut mode, mut tier) = (None, None);
    for (k, v) in form_pairs(body) {
        match k.as_str() {
            "mode" => mode = Some(v),
            "tier" => tier = Some(v),
            _ => {}
        }
    }
    let Some(mode) = mode else {
        return error(StatusCode::BAD_REQUEST, "invalid_body", "mode: missing");
    };
    match apply_mode(&admin.handle, tier.as_deref(), &mode, "page").await {
        Ok(()) => see_other(page_path(&base)),
        Err(e) => e.response(),
    }
}

/// Why a mode change was refused.
enum ModeError {
    Invalid(String),
    UnknownTier(String),
    /// The control key could not be written: nothing changed.
    Control(crate::control::ControlError),
}

impl ModeError {
    fn response(&self) -> Response {
        match self {
            ModeError::Invalid(e) => error(StatusCode::BAD_REQUEST, "invalid_mode", e),
            ModeError::UnknownTier(t) => unknown_tier(t),
            ModeError::Control(e) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "control_key_failed",
                &e.to_string(),
            ),
        }
    }
}

/// Where the router's mode changes apply: `all instances` (the control
/// key is written) or `this instance (host:pid)`.
fn scope(handle: &RateLimitHandle) -> String {
    if handle.fleet_control_key().is_some() {
        "all instances".to_owned()
    } else {
        static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let host = HOST.get_or_init(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "unknown-host".to_owned())
        });
        format!("this instance ({host}:{})", std::process::id())
    }
}

/// Sets the global mode (`tier` absent or empty) or a tier's, and logs it:
/// with a control key, on every instance through it; else in this process.
async fn apply_mode(
    handle: &RateLimitHandle,
    tier: Option<&str>,
    mode: &str,
    via: &'static str,
) -> Result<(), ModeError> {
    let mode: Mode = mode.parse().map_err(ModeError::Invalid)?;
    let tier = tier.filter(|t| !t.is_empty());
    if let Some(key) = handle.fleet_control_key().map(str::to_owned) {
        let from = match tier {
            None => handle.effective_mode(),
            Some(t) => {
                handle
                    .tiers()
                    .into_iter()
                    .find(|s| s.name == t)
                    .ok_or_else(|| ModeError::UnknownTier(t.to_owned()))?
                    .effective_mode
            }
        };
        handle
            .set_fleet_mode(tier, mode)
            .await
            .map_err(ModeError::Control)?;
        let tier = tier.unwrap_or("");
        if mode == Mode::Off && tier.is_empty() {
            tracing::warn!(%from, to = %mode, via, key, "rate limiter admin: kill switch, global mode off on all instances (control key)");
        } else {
            tracing::info!(tier, %from, to = %mode, via, key, "rate limiter admin: mode changed on all instances (control key)");
        }
        return Ok(());
    }
    match tier {
        None => {
            let from = handle.mode();
            handle.set_mode(mode);
            if mode == Mode::Off {
                tracing::warn!(%from, to = %mode, via, "rate limiter admin: kill switch, global mode off");
            } else {
                tracing::info!(%from, to = %mode, via, "rate limiter admin: global mode changed");
            }
            Ok(())
        }
        Some(t) => {
            let unknown = || ModeError::UnknownTier(t.to_owned());
            let from = handle
                .tiers()
                .into_iter()
                .find(|s| s.name == t)
                .ok_or_else(unknown)?;
            handle.set_tier_mode(t, mode).map_err(|_| unknown())?;
            tracing::info!(tier = t, from = %from.mode, to = %mode, via, "rate limiter admin: tier mode changed");
            Ok(())
        }
    }
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "not_found", "no such admin route")
}

fn status_json(h: &RateLimitHandle) -> Value {
    json!({
        "mode": h.mode().to_string(),
        "effective_mode": h.effective_mode().to_string(),
        "circuit_state": h.circuit_state(),
        "mode_changes_apply_to": scope(h),
        "control_key": h.fleet_control_key(),
        "counts": counts_json(&h.counts()),
        "tiers": h.tiers().iter().map(tier_json).collect::<Vec<_>>(),
        "anomalies": anomalies_json(&h.anomalies()),
    })
}

fn counts_json(c: &DecisionCounts) -> Value {
    json!({
        "allowed": c.allowed,
        "limited": c.limited,
        "shadow_limited": c.shadow_limited,
        "allowlisted": c.allowlisted,
        "denylisted": c.denylisted,
        "fail_open": c.fail_open,
        "fail_closed": c.fail_closed,
        "skipped": c.skipped,
        "cache_blocked": c.cache_blocked,
        "fallback": c.fallback,
    })
}

fn quota_json(q: &crate::Quota) -> Value {
    json!({
        "limit": q.limit(),
        "period": humantime::format_duration(q.period()).to_string(),
        "period_secs": q.period().as_secs_f64(),
        "burst": q.burst_size(),
    })
}

fn tier_json(t: &TierStatus) -> Value {
    let mut v = json!({
        "name": t.name,
        "mode": t.mode.to_string(),
        "effective_mode": t.effective_mode.to_string(),
        "algorithm": t.algorithm.name(),
        "quota": quota_json(&t.quota),
        "plans": t.plans.iter().map(|(p, q)| json!({ "plan": p, "quota": quota_json(q) })).collect::<Vec<_>>(),
    });
    if let Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) = t.algorithm {
        v["max_delay"] = json!(humantime::format_duration(max_delay).to_string());
    }
    v
}

fn anomalies_json(a: &[AnomalyStatus]) -> Vec<Value> {
    a.iter()
        .map(|a| {
            json!({
                "tier": a.tier,
                "endpoint": a.endpoint,
                "alerting": a.alerting,
                "rate": a.rate,
                "mean": a.mean,
                "sigma": a.sigma,
            })
        })
        .collect()
}

fn bucket_json(b: &BucketCounts) -> Value {
    json!({
        "start": b.start,
        "requests": b.requests,
        "limited": b.limited,
        "shadow_limited": b.shadow_limited,
    })
}

fn key_json(k: &BlockedKey) -> Value {
    json!({ "key": k.key, "count": k.count, "error": k.error })
}

/// Whole hours a top-N window covers, as the handle rounds it.
fn window_hours(window: Duration) -> u64 {
    window.as_secs().div_ceil(3600).clamp(1, 24)
}

// ---------------------------------------------------------------- responses

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut res = Response::new(Body::from(body.to_string()));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    json_response(status, &json!({ "error": code, "message": message }))
}

fn unknown_tier(tier: &str) -> Response {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({ "error": "unknown_tier", "tier": tier }),
    )
}

fn see_other(location: &str) -> Response {
    let mut res = Response::new(Body::empty());
    *res.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(v) = HeaderValue::from_str(location) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    res
}

async fn read_body(req: Request) -> Result<Bytes, Response> {
    axum::body::to_bytes(req.into_body(), BODY_LIMIT)
        .await
        .map_err(|_| {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "at most 16 KiB",
            )
        })
}

// ---------------------------------------------------------------- parsing

/// `application/x-www-form-urlencoded` pairs (also query strings).
fn form_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex_val(b[i + 1]), hex_val(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn hex_encode(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// Values of cookie `name` in the request's `Cookie` headers.
fn cookies<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(move |c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

// ---------------------------------------------------------------- the page

/// HTML-escapes its contents when displayed.
struct Esc<'a>(&'a str);

impl fmt::Display for Esc<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = 0;
        for (i, c) in self.0.char_indices() {
            let rep = match c {
                '&' => "&amp;",
                '<' => "&lt;",
                '>' => "&gt;",
                '"' => "&quot;",
                '\'' => "&#39;",
                _ => continue,
            };
            f.write_str(&self.0[last..i])?;
            f.write_str(rep)?;
            last = i + c.len_utf8();
        }
        f.write_str(&self.0[last..])
    }
}

const PALETTE: [&str; 8] = [
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#f6f7f9}\
header{background:#1d2733;color:#fff;padding:10px 20px;display:flex;gap:16px;align-items:center;flex-wrap:wrap}\
header h1{font-size:18px;margin:0 12px 0 0}\
main{padding:12px 20px;display:grid;grid-template-columns:1fr 1fr;gap:12px}\
section{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 14px}\
section.wide{grid-column:1/3}\
h2{font-size:15px;margin:2px 0 8px}\
table{border-collapse:collapse;width:100%}\
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top}\
th{font-weight:600;color:#556}\
td.n{text-align:right;font-variant-numeric:tabular-nums}\
code{font-size:13px;word-break:break-all}\
.badge{display:inline-block;padding:2px 8px;border-radius:10px;font-weight:600;font-size:13px}\
.enforce{background:#2e7d32;color:#fff}.shadow{background:#6a6f7a;color:#fff}\
.canary{background:#ef6c00;color:#fff}.off{background:#c62828;color:#fff}\
.closed{background:#2e7d32;color:#fff}.open{background:#c62828;color:#fff}.half_open{background:#ef6c00;color:#fff}\
.alert{background:#fdecea}\
form{display:inline;margin:0}\
button{font:inherit;padding:3px 10px;border-radius:4px;border:1px solid #889;background:#fff;cursor:pointer}\
button.kill{background:#c62828;color:#fff;border-color:#8e0000;font-weight:700}\
button.resume{background:#2e7d32;color:#fff;border-color:#1b5e20;font-weight:700}\
.muted{color:#778}.scope{font-size:12px;opacity:.85}header .muted{color:#aab}.sw{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;border-radius:2px}\
svg text{font:11px system-ui,sans-serif;fill:#556}";

async fn page(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let html = render_page(&admin, &base);
    let mut res = Response::new(Body::from(html));
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; img-src data:; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    res
}

fn mode_badge(m: Mode) -> String {
    format!(
        r#"<span class="badge {}">{}</span>"#,
        m.label(),
        Esc(&m.to_string())
    )
}

/// A `<select name="mode">` of the usual modes, `current` selected.
fn mode_select(current: Mode) -> String {
    let mut modes = vec![
        Mode::Enforce,
        Mode::Canary { percent: 50 },
        Mode::Canary { percent: 10 },
        Mode::Canary { percent: 1 },
        Mode::Shadow,
        Mode::Off,
    ];
    if !modes.contains(&current) {
        modes.insert(1, current);
    }
    let mut s = String::from(r#"<select name="mode">"#);
    for m in modes {
        let v = m.to_string();
        let sel = if m == current { " selected" } else { "" };
        let _ = write!(s, r#"<option value="{0}"{sel}>{0}</option>"#, Esc(&v));
    }
    s.push_str("</select>");
    s
}

fn render_page(admin: &Admin, base: &str) -> String {
    let h = &admin.handle;
    let mode = h.mode();
    let tiers = h.tiers();
    let counts = h.counts();
    let anomalies = h.anomalies();
    let action = format!("{base}/mode");
    // Beside every button: where it applies.
    let scope = match h.fleet_control_key() {
        Some(key) => format!(
            r#" <span class="scope">all instances (control key <code>{}</code>)</span>"#,
            Esc(key)
        ),
        None => format!(r#" <span class="scope">{}</span>"#, Esc(&scope(h))),
    };
    let rendered = h.now_s();
    let mut s = String::with_capacity(16 * 1024);
    let _ = write!(
        s,
        r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>rate limiter admin</title><meta name="viewport" content="width=device-width,initial-scale=1"><meta http-equiv="refresh" content="{}"><style>{CSS}</style></head><body>"#,
        admin.refresh.as_secs()
    );

    // Header: mode, circuit, kill switch.
    let circuit = h.circuit_state();
    let _ = write!(
        s,
        r#"<header><h1>tiered-ratelimit</h1><span id="mode">mode {}</span><span>circuit <span class="badge {c}" id="circuit">{c}</span></span>"#,
        mode_badge(mode),
        c = Esc(circuit),
    );
    let alerting = anomalies.iter().filter(|a| a.alerting).count();
    let _ = write!(
        s,
        r#"<span>anomalies <span class="badge {}" id="alerting">{alerting} alerting</span></span>"#,
        if alerting == 0 { "closed" } else { "open" }
    );
    let effective = h.effective_mode();
    if effective != mode {
        let _ = write!(
            s,
            r#"<span id="override">in force {} (the fleet control key overrides this page)</span>"#,
            mode_badge(effective)
        );
    }
    if mode == Mode::Off {
        let _ = write!(
            s,
            r#"<form method="post" action="{}"><input type="hidden" name="mode" value="enforce"><button class="resume" id="resume">Resume: enforce</button>{scope}</form>"#,
            Esc(&action)
        );
    } else {
        let _ = write!(
            s,
            r#"<form method="post" action="{}"><input type="hidden" name="mode" value="off"><button class="kill" id="kill-switch">Kill switch: mode off</button>{scope}</form>"#,
            Esc(&action)
        );
    }
    let _ = write!(
        s,
        r#"<form method="post" action="{}">{} <button>set global mode</button>{scope}</form><span id="rendered" class="muted">rendered {}, refreshes every {} s</span></header><main>"#,
        Esc(&action),
        mode_select(mode),
        humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs(rendered)),
        admin.refresh.as_secs()
    );

    // The chart.
    let series: Vec<Series> = tiers
        .iter()
        .map(|t| Series {
            name: t.name.clone(),
            closed: h.history(&t.name).unwrap_or_default(),
            open: h.open_bucket(&t.name),
        })
        .collect();
    s.push_str(r#"<section class="wide"><h2>429 rate per tier</h2>"#);
    s.push_str(&chart_svg(&series));
    s.push_str("</section>");

    // Tiers.
    s.push_str(r#"<section class="wide"><h2>Tiers</h2><table id="tiers"><tr><th>tier</th><th>mode</th><th>effective</th><th>algorithm</th><th>quota</th><th>plans</th><th>set mode</th></tr>"#);
    for t in &tiers {
        let plans: Vec<String> = t
            .plans
            .iter()
            .map(|(p, q)| format!("{}: {}", Esc(p), quota_text(q)))
            .collect();
        let _ = write!(
            s,
            r#"<tr><td><code>{name}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><form method="post" action="{action}"><input type="hidden" name="tier" value="{name}">{} <button>set</button>{scope}</form></td></tr>"#,
            mode_badge(t.mode),
            mode_badge(t.effective_mode),
            t.algorithm.name(),
            quota_text(&t.quota),
            if plans.is_empty() {
                "<span class=\"muted\">–</span>".to_owned()
            } else {
                plans.join("<br>")
            },
            mode_select(t.mode),
            name = Esc(&t.name),
            action = Esc(&action),
        );
    }
    s.push_str("</table></section>");

    // Top blocked keys.
    let hours = window_hours(admin.window);
    let _ = write!(
        s,
        r#"<section><h2>Top blocked keys, last {hours} h</h2><table id="top-blocked"><tr><th>tier</th><th>key</th><th class="n">blocked</th><th class="n">± error</th></tr>"#
    );
    let mut any = false;
    for t in &tiers {
        for k in h
            .top_blocked(&t.name, admin.top_n, admin.window)
            .unwrap_or_default()
        {
            any = true;
            let _ = write!(
                s,
                r#"<tr><td><code>{}</code></td><td><code>{}</code></td><td class="n">{}</td><td class="n">{}</td></tr>"#,
                Esc(&t.name),
                Esc(&k.key),
                k.count,
                k.error
            );
        }
    }
    if !any {
        s.push_str(r#"<tr><td colspan="4" class="muted">nothing blocked in this window</td></tr>"#);
    }
    s.push_str("</table></section>");

    // Counts and anomalies.
    s.push_str(r#"<section><h2>Requests since start</h2><table id="counts">"#);
    for (k, v) in [
        ("allowed", counts.allowed),
        ("limited", counts.limited),
        ("shadow_limited", counts.shadow_limited),
        ("cache_blocked", counts.cache_blocked),
        ("allowlisted", counts.allowlisted),
        ("denylisted", counts.denylisted),
        ("fail_open", counts.fail_open),
        ("fail_closed", counts.fail_closed),
        ("fallback", counts.fallback),
        ("skipped", counts.skipped),
    ] {
        let _ = write!(s, r#"<tr><td>{k}</td><td class="n">{v}</td></tr>"#);
    }
    s.push_str("</table>");
    let _ = write!(
        s,
        r#"<h2 style="margin-top:12px">429-rate anomalies: {alerting} alerting</h2><table id="anomalies"><tr><th>tier</th><th>endpoint</th><th class="n">rate</th><th class="n">baseline</th><th class="n">σ</th></tr>"#
    );
    if anomalies.is_empty() {
        s.push_str(r#"<tr><td colspan="5" class="muted">no baseline yet</td></tr>"#);
    }
    for a in &anomalies {
        let _ = write!(
            s,
            r#"<tr{}><td><code>{}</code></td><td><code>{}</code></td><td class="n">{:.1} %</td><td class="n">{:.1} %</td><td class="n">{:.1} %</td></tr>"#,
            if a.alerting { r#" class="alert""# } else { "" },
            Esc(&a.tier),
            Esc(&a.endpoint),
            a.rate * 100.0,
            a.mean * 100.0,
            a.sigma * 100.0
        );
    }
    s.push_str("</table></section>");

    let _ = write!(
        s,
        r#"<section class="wide muted">JSON: <code>{b}/api/status</code>, <code>{b}/api/top/&lt;tier&gt;</code>, <code>{b}/api/history/&lt;tier&gt;</code>, <code>{b}/api/anomalies</code>, <code>POST {b}/api/mode</code> (bearer token). Counts, history and top keys are this process's only.</section></main></body></html>"#,
        b = Esc(base)
    );
    s
}

fn quota_text(q: &crate::Quota) -> String {
    let mut s = format!("{} / {}", q.limit(), humantime::format_duration(q.period()));
    if q.burst_size() != q.limit() {
        let _ = write!(s, ", burst {}", q.burst_size());
    }
    s
}

/// `HH:MM` (UTC) of an epoch second, `HH:MM:SS` when `step` (the bucket
/// length) is under a minute.
fn clock(t: u64, step: u64) -> String {
    let (h, m, sec) = ((t / 3600) % 24, (t / 60) % 60, t % 60);
    if step < 60 {
        format!("{h:02}:{m:02}:{sec:02}")
    } else {
        format!("{h:02}:{m:02}")
    }
}

/// One tier's line on the chart: its closed buckets and the open one.
struct Series {
    name: String,
    closed: Vec<BucketCounts>,
    /// The bucket not closed yet: drawn as a hollow dot, marked partial.
    open: Option<BucketCounts>,
}

impl Series {
    /// Every bucket, oldest first, with whether it is the open one.
    fn points(&self) -> impl Iterator<Item = (&BucketCounts, bool)> + '_ {
        let open = self
            .open
            .as_ref()
            .filter(|o| self.closed.iter().all(|b| b.start < o.start));
        self.closed
            .iter()
            .map(|b| (b, false))
            .chain(open.map(|b| (b, true)))
    }
}

/// The 429 rate (solid) and shadow would-block rate (dashed) of each tier,
/// one point per history bucket and a hollow one for the bucket still open
/// (partial: its counts so far), as an inline SVG.
fn chart_svg(series: &[Series]) -> String {
    const W: f64 = 1100.0;
    const H: f64 = 230.0;
    const L: f64 = 52.0;
    const R: f64 = 12.0;
    const T: f64 = 10.0;
    const B: f64 = 24.0;
    let starts: Vec<u64> = series
        .iter()
        .flat_map(|s| s.points().map(|(b, _)| b.start))
        .collect();
    let Some(&last) = starts.iter().max() else {
        return r#"<p class="muted" id="rate-chart-empty">No request checked since the start: the chart shows the current bucket (partial) from the first one on.</p>"#.to_owned();
    };
    // The bucket length, from the closest two bucket starts (the history
    // skips buckets without traffic); a minute when there is one bucket.
    let mut sorted = starts.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let step = sorted
        .windows(2)
        .map(|w| w[1] - w[0])
        .min()
        .unwrap_or(60)
        .max(1);
    let buckets = crate::observe::recorder::HISTORY_BUCKETS as u64;
    let t_max = last + step;
    let t_min = t_max.saturating_sub(buckets * step);
    let rate = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
    let peak = series
        .iter()
        .flat_map(|s| s.points().map(|(b, _)| b))
        .map(|b| rate(b.limited, b.requests).max(rate(b.shadow_limited, b.requests)))
        .fold(0.0f64, f64::max);
    let y_max = [0.05, 0.1, 0.2, 0.5, 1.0]
        .into_iter()
        .find(|m| peak <= *m)
        .unwrap_or(1.0);
    let pw = W - L - R;
    let ph = H - T - B;
    let x = |t: u64| L + pw * (t.saturating_sub(t_min)) as f64 / (t_max - t_min).max(1) as f64;
    let y = |r: f64| T + ph * (1.0 - (r / y_max).min(1.0));
    let mut s = String::with_capacity(8 * 1024);
    let span_min = (t_max - t_min) / 60;
    let _ = write!(
        s,
        r#"<svg id="rate-chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="429 rate per tier, last {span_min} minutes">"#
    );
    // Grid and axes: five steps of y_max (1, 2, 4, 10 or 20 %).
    for i in 0..=5 {
        let r = y_max * f64::from(i) / 5.0;
        let yy = y(r);
        let _ = write!(
            s,
            r##"<line x1="{L}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="{}" stroke-width="1"/><text x="{}" y="{:.1}" text-anchor="end">{:.0}%</text>"##,
            W - R,
            if i == 0 { "#99a" } else { "#e4e6ea" },
            L - 6.0,
            yy + 4.0,
            r * 100.0
        );
    }
    for i in 0..=4u64 {
        let t = t_min + (t_max - t_min) * i / 4;
        let anchor = match i {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="{anchor}">{}</text>"#,
            x(t),
            H - 6.0,
            clock(t, step)
        );
    }
    // Series: runs of adjacent buckets as polylines, every bucket a dot.
    for (i, ser) in series.iter().enumerate() {
        let name = &ser.name;
        let color = PALETTE[i % PALETTE.len()];
        let mut pts: Vec<(&BucketCounts, bool)> =
            ser.points().filter(|(b, _)| b.start >= t_min).collect();
        pts.sort_by_key(|(b, _)| b.start);
        let shadow = pts.iter().any(|(b, _)| b.shadow_limited > 0);
        let lines: &[(bool, &str)] = if shadow {
            &[(false, ""), (true, r#" stroke-dasharray="5 3""#)]
        } else {
            &[(false, "")]
        };
        for &(is_shadow, dash) in lines {
            let value = |b: &BucketCounts| {
                rate(
                    if is_shadow {
                        b.shadow_limited
                    } else {
                        b.limited
                    },
                    b.requests,
                )
            };
            let mut run: Vec<String> = Vec::new();
            let mut prev: Option<u64> = None;
            let flush = |run: &mut Vec<String>, s: &mut String| {
                if run.len() > 1 {
                    let _ = write!(
                        s,
                        r#"<polyline class="series" data-tier="{}" fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                        Esc(name),
                        run.join(" ")
                    );
                }
                run.clear();
            };
            for (b, _) in &pts {
                if prev.is_some_and(|p| b.start - p > step) {
                    flush(&mut run, &mut s);
                }
                prev = Some(b.start);
                run.push(format!("{:.1},{:.1}", x(b.start + step / 2), y(value(b))));
            }
            flush(&mut run, &mut s);
            for &(b, partial) in &pts {
                let n = if is_shadow {
                    b.shadow_limited
                } else {
                    b.limited
                };
                // The open bucket: a hollow dot, its counts so far.
                let (attrs, fill, so_far) = if partial {
                    (
                        format!(r#" class="partial" data-tier="{}""#, Esc(name)),
                        "#fff",
                        " so far (partial: bucket still open)",
                    )
                } else {
                    (String::new(), color, "")
                };
                let _ = write!(
                    s,
                    r#"<circle{attrs} cx="{:.1}" cy="{:.1}" r="{}" fill="{fill}" stroke="{color}" stroke-width="1.5"><title>{} {} UTC: {} of {} {} ({:.1} %){so_far}</title></circle>"#,
                    x(b.start + step / 2),
                    y(value(b)),
                    if partial { "3.5" } else { "2.5" },
                    Esc(name),
                    clock(b.start, step),
                    n,
                    b.requests,
                    if is_shadow {
                        "would be limited (shadow)"
                    } else {
                        "limited"
                    },
                    value(b) * 100.0
                );
            }
        }
    }
    s.push_str("</svg><div class=\"legend\">");
    for (i, ser) in series.iter().enumerate() {
        let _ = write!(
            s,
            r#"<span class="sw" style="background:{}"></span>{}"#,
            PALETTE[i % PALETTE.len()],
            Esc(&ser.name)
        );
    }
    let _ = write!(
        s,
        r#" <span class="muted">— solid: limited / requests checked by the tier; dashed: shadow would-block; hollow dot: the bucket still open (partial, counts so far). {step} s buckets, last bucket starts {} UTC.</span></div>"#,
        clock(last, step)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_html() {
        assert_eq!(
            Esc(r#"<a href="x">'&'</a>"#).to_string(),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(Esc("plain ✓").to_string(), "plain ✓");
    }

    #[test]
    fn decodes_forms_and_hex() {
        assert_eq!(
            form_pairs("mode=canary%3A10&tier=ip&x=a+b&bad=%zz&t=%4"),
            [
                ("mode".into(), "canary:10".into()),
                ("tier".into(), "ip".into()),
                ("x".into(), "a b".into()),
                ("bad".into(), "%zz".into()),
                ("t".into(), "%4".into()),
            ]
        );
        assert_eq!(hex_encode(b"t0k;en ="), "74306b3b656e203d");
    }

    #[test]
    fn empty_token_matches_nothing() {
        let layer = crate::RateLimitLayer::builder()
            .tier(crate::Tier::new(
                "g",
                crate::key::Global,
                crate::Quota::per_second(1),
            ))
            .build()
            .unwrap();
        let a = Admin::new(layer.handle(), "");
        assert!(!a.token_matches(b""));
        let b = Admin::new(layer.handle(), "abc");
        assert!(b.token_matches(b"abc"));
        assert!(!b.token_matches(b"abd"));
        assert!(!b.token_matches(b"ab"));
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer abc"),
        );
        assert!(b.bearer_ok(&h));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert!(!b.bearer_ok(&h));
    }
}
