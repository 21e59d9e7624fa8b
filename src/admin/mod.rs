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
//! [`ControlKey`](crate::handle::ControlKey) on a Redis backend), `POST /mode` and
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
//! | `POST /key` | the page's buttons on a top blocked key (`action` = `reset` or `lift`, `tier`, `key`): [`RateLimitHandle::reset`] / [`RateLimitHandle::lift`]; and its per-key override form (`action` = `override`, `tier`, `key`, `rule` = `unlimited` / `blocked` / `<limit>/<period>`, optional `ttl`) and remove buttons (`action` = `remove_override`), logged with `by="admin page"`; `303` back to the page |
//! | `GET /?peek_tier=ip&peek_key=…` | the page with that key's numbers ([`RateLimitHandle::peek`]) |
//! | `GET /api/status` | global mode, circuit state, where mode changes apply (`mode_changes_apply_to`: `all instances` or `this instance (host:pid)`; `control_key`), counts, every tier's mode and quota, the anomaly series |
//! | `GET /api/top/{tier}?n=10&window=1h&kind=blocked` | top-N keys of a tier: `kind=blocked` (the default) the keys it refused (429), `kind=shadow_limited` the keys it would have refused but let through (a shadow tier, or a canary not enforced for the key), `kind=near_limit` keys allowed with < 20 % left; `window` in humantime, rounded up to hours, at most 24 h |
//! | `GET /api/candidates/{tier}?window=1h&n=10` | the tier's candidate quotas beside its live one ([`RateLimitHandle::candidates`], this process): `{"tier","window_secs","live":{...},"candidates":[{"quota","requests","would_deny","keys_denied","top":[{"key","count"}]}]}` (`live`: the live quota's counts on the same requests); `window` in humantime, rounded up to hours, at most 24 h |
//! | `GET /api/history/{tier}` | the tier's last hour of closed buckets (`start`, `requests`, `limited`, `shadow_limited`, `fail_open`: passed unchecked, the backend failed), and `current`: the bucket still open, `"partial": true` (`null` before the first request) |
//! | `GET /api/anomalies` | the 429-rate anomaly series and their alerts; per guarded tier (`[tier.guard]`), the fall back guard's last judged fleet bucket and its `cause` (`limiter`, `abuse`, `surge`, `unknown`) with its numbers |
//! | `POST /api/mode` | `{"mode":"shadow"}` (global) or `{"tier":"ip","mode":"canary:10"}`; answers like `/api/status` |
//! | `GET /api/peek/{tier}?key=203.0.113.7` | one key's numbers, nothing charged ([`RateLimitHandle::peek`]): `{"tier","key","allowed","limit","remaining","reset_after_us","retry_after_us","now_us"}`; `key` as the page shows it or as stored ([`handle`](crate::handle#peek-reset-and-lift)), the answer's `key` the stored form; `400` `invalid_key` for an empty key, `503` `backend_failed` |
//! | `POST /api/reset` | `{"tier":"ip","key":"203.0.113.7"}`: the key starts fresh ([`RateLimitHandle::reset`]), its penalty box included; answers `{"tier","key","existed"}` |
//! | `POST /api/lift` | `{"tier":"login","key":"203.0.113.7"}`: lifts the key's penalty-box block, its rate state untouched ([`RateLimitHandle::lift`]); `404` for a tier without a penalty box |
//! | `GET /api/overrides/{tier}` | the tier's per-key overrides not expired ([`RateLimitHandle::overrides`]): `{"tier","overrides":[{"key","rule","expires_at_us"}]}`, `rule` `"unlimited"`, `"blocked"` or `{"limit","period_ms","burst"}`; `404` for a tier that takes no overrides |
//! | `POST /api/overrides` | `{"tier":"ip","key":"203.0.113.7","rule":{"limit":1000,"period":"1m"},"ttl":"7d"}` (`rule` `"unlimited"`, `"blocked"` or a quota with an optional `burst`; `ttl` humantime, optional): sets the key's override ([`RateLimitHandle::set_override`], logged at `info` naming the admin API); answers like `GET /api/overrides/{tier}`; `400` `invalid_quota` for a quota the tier cannot take |
//! | `GET /api/suggest/{tier}?target=0.001&window=24h&plan=…` | the limit that would have denied at most `target` of the tier's (or plan's) keys over `window` (humantime, whole hours, at most 7 days), from every instance's per-key demand ([`RateLimitHandle::suggest`]): `{"tier","plan","period_s","target","window_s","percentiles":{"p50","p90","p99","p99.9"},"suggested":{"limit","period_s"}` (token and leaky buckets: `{"rate","period_s","burst"}`)`,"applied":false,"curve":[{"limit","keys_denied","requests_denied"}],"left_out":[{"key","demand","reason"}],"keys","sampled","estimated_keys","requests","unsampled_requests"}`; below 50 distinct keys `422` `{"error":"not_enough_data","keys","needed":50}`; `409` `demand_off` while the instance does not record demand ([`RateLimitHandle::set_demand`]); nothing is applied |
//! | `POST /api/overrides/remove` | `{"tier":"ip","key":"203.0.113.7"}`: removes it ([`RateLimitHandle::remove_override`]); answers `{"tier","key","existed"}` |
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
//! * The cookie [`COOKIE_NAME`]: only on `GET /` and the forms' `POST /mode`
//!   and `POST /key`.
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

mod actions;
mod api;
mod auth;
mod candidates;
mod chart;
mod form;
mod html;
mod keys;
mod mode;
mod overrides;
mod page;
mod plan;
mod reply;
mod settings;
mod suggest;

use crate::handle::RateLimitHandle;
use actions::form_mode;
use api::{api_anomalies, api_history, api_mode, api_status, api_top};
use auth::authorize;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use page::page;
use reply::not_found;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The cookie the page sets after a `?token=` load (see the module docs).
pub const COOKIE_NAME: &str = "tiered_ratelimit_admin";

/// The most keys a top-N query returns.
pub(crate) const MAX_TOP_N: usize = 1000;

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
    /// `n` (default 10, at most 1000).
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
            .route("/key", post(actions::form_key))
            .route("/api/status", get(api_status))
            .route("/api/top/{tier}", get(api_top))
            .route("/api/candidates/{tier}", get(candidates::api_candidates))
            .route("/api/history/{tier}", get(api_history))
            .route("/api/anomalies", get(api_anomalies))
            .route("/api/mode", post(api_mode))
            .route("/api/peek/{tier}", get(keys::api_peek))
            .route("/api/reset", post(keys::api_reset))
            .route("/api/lift", post(keys::api_lift))
            .route("/api/overrides/{tier}", get(overrides::api_list))
            .route("/api/overrides", post(overrides::api_set))
            .route("/api/overrides/remove", post(overrides::api_remove))
            .route("/settings", post(settings::form_settings))
            .route("/api/quota", post(settings::api_quota))
            .route("/api/quota/reset", post(settings::api_quota_reset))
            .route("/plan", post(plan::form_plan))
            .route("/api/plan", post(plan::api_plan))
            .route("/api/plan/{tier}", get(plan::api_plan_status))
            .route("/api/rollout/log", get(plan::api_rollout_log))
            .route("/api/suggest/{tier}", get(suggest::api_suggest))
            .route(
                "/api/lists",
                get(settings::api_lists).post(settings::api_lists_change),
            )
            .fallback(not_found)
            .layer(middleware::from_fn_with_state(admin.clone(), authorize))
            .with_state(admin)
    }
}
