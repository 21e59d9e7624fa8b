//! The per-meter header style (`HeaderStyle::PerMeter`, OpenAI's names and
//! formats; issue 29) through real HTTP on both backends, on a manual
//! clock: a requests tier and a priced tokens tier, each meter's exact
//! values on allowed and denied requests, the tokens meter after a settle
//! in the head, and the style chosen in a policy file.

use crate::support::priced::*;
use crate::support::*;
use tiered_ratelimit::response::HeaderStyle;
use tiered_ratelimit::{key::Global, Quota, RateLimitLayer, Tier};
use tokio::sync::mpsc;

both_backends!(
    meters_on_allowed_and_denied_requests,
    a_policy_file_picks_the_style,
    the_reset_is_after_the_settle_in_the_head,
    a_priced_tier_counts_tokens
);

const NAMES: [&str; 7] = [
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "retry-after",
];

/// The response's status and per-meter headers (`-` when absent), and
/// whether any single-tier header was sent.
fn meters(r: &reqwest::Response) -> (u16, [String; 7], bool) {
    let h = |n: &str| {
        r.headers()
            .get(n)
            .map_or("-".to_owned(), |v| v.to_str().unwrap().to_owned())
    };
    let single = ["x-ratelimit-limit", "x-ratelimit-remaining", "ratelimit"]
        .iter()
        .any(|n| r.headers().contains_key(*n));
    (r.status().as_u16(), NAMES.map(h), single)
}

fn want(status: u16, v: [&str; 7]) -> (u16, [String; 7], bool) {
    (status, v.map(str::to_owned), false)
}

async fn start(layer: &RateLimitLayer) -> String {
    let (tx, _streams) = mpsc::unbounded_channel();
    format!("http://{}", serve(llm_app(layer.clone(), tx)).await)
}

async fn meters_on_allowed_and_denied_requests(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::PerMeter)
        .tier(Tier::new("requests", Global, Quota::per_minute(60)))
        .tier(tokens())
        .build()
        .unwrap();
    let base = start(&layer).await;
    // Reserve 300, use 100: 900 tokens left after the settle, and full
    // again once the 100 used are back (100 tokens at 60 ms each); 1
    // request at 1 s each.
    let r = get_with(format!("{base}/llm?tokens=100"), Some(300)).await;
    assert_eq!(
        meters(&r),
        want(200, ["60", "59", "1s", "1000", "900", "6s", "-"])
    );
    // Reserve 500 (the cap), use 500: 400 left, 600 tokens short of full.
    let r = get_with(format!("{base}/llm?tokens=500"), Some(9000)).await;
    assert_eq!(
        meters(&r),
        want(200, ["60", "58", "2s", "1000", "400", "36s", "-"])
    );
    // 500 more does not fit the 400: 429 after 100 tokens (6 s).
    let r = get_with(format!("{base}/llm?tokens=1"), Some(500)).await;
    assert_eq!(
        meters(&r),
        want(429, ["60", "58", "2s", "1000", "400", "36s", "6"])
    );
    // 1.5 s later: 1.5 requests and 25 tokens refilled, 25 used.
    env.clock.advance(std::time::Duration::from_millis(1500));
    let r = get_with(format!("{base}/llm?tokens=25"), Some(25)).await;
    assert_eq!(
        meters(&r),
        want(200, ["60", "58", "1.5s", "1000", "400", "36s", "-"])
    );
}

/// A requests tier, then the issue's tokens tier, per meter.
fn policy(style: &str) -> String {
    format!(
        "headers = \"{style}\"\n\n[[tier]]\nname = \"requests\"\nkey = \"global\"\n\
         limit = 60\nperiod = \"1m\"\n{TOKENS_POLICY}"
    )
}

async fn a_policy_file_picks_the_style(env: Env) {
    let layer = policy_layer(&policy("per-meter"), env.backend.clone());
    let base = start(&layer).await;
    let r = get_with(format!("{base}/llm?tokens=40"), None).await;
    assert_eq!(
        meters(&r),
        want(200, ["60", "59", "1s", "1000", "960", "2.4s", "-"])
    );
    let layer = policy_layer(&policy("openai"), env.backend.clone());
    let r = get_with(format!("{}/llm?tokens=1", start(&layer).await), Some(1)).await;
    assert_eq!(meters(&r).0, 200);
    assert_eq!(meters(&r).1[3], "1000");
}

/// The single-tier headers after a settle in the head: `X-RateLimit-Reset`
/// moves with what the settle gave back or charged, as `Remaining` does.
async fn the_reset_is_after_the_settle_in_the_head(env: Env) {
    let layer = env.builder().tier(tokens()).build().unwrap();
    let base = start(&layer).await;
    let now = env.clock.now_us() / 1_000_000;
    let head = |r: &reqwest::Response| {
        ["x-ratelimit-remaining", "x-ratelimit-reset"]
            .map(|n| r.headers()[n].to_str().unwrap().parse::<u64>().unwrap())
    };
    // Reserve 500, use 100: 900 left, full again in 100 × 60 ms = 6 s.
    let r = get_with(format!("{base}/llm?tokens=100"), Some(500)).await;
    assert_eq!(head(&r), [900, now + 6]);
    // Reserve 100, use 300: 200 more charged, 600 left, full in 24 s.
    let r = get_with(format!("{base}/llm?tokens=300"), Some(100)).await;
    assert_eq!(head(&r), [600, now + 24]);
}

/// The IETF fields of a priced tier say its unit, `tokens` (the draft's
/// default, `requests`, would be wrong); the requests tier beside it says
/// none. Both listed whichever binds.
async fn a_priced_tier_counts_tokens(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("requests", Global, Quota::per_minute(60)))
        .tier(tokens())
        .build()
        .unwrap();
    let base = start(&layer).await;
    let r = get_with(format!("{base}/llm?tokens=100"), Some(300)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["ratelimit-policy"],
        r#""requests";q=60;w=60, "tokens";q=1000;qu="tokens";w=60"#
    );
}
