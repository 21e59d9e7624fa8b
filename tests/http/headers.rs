//! Both header standards and both rejection bodies, exactly, through HTTP.

use crate::support::*;
use std::time::Duration;
use tiered_ratelimit::{
    key::Global,
    policy::Policy,
    response::{HeaderStyle, ProblemRejection},
    Algorithm, Quota, RateLimitLayer, Tier,
};

both_backends!(
    ietf_draft11_fields,
    ietf_draft09_fields,
    ietf_draft11_fixed_window,
    problem_lists_violated_policies,
    both_styles_once_each,
    no_rate_limit_headers,
    problem_details_body,
    the_policy_field_lists_every_tier,
    a_weighted_tier_names_its_unit,
    numbers_stay_within_structured_fields
);

fn hdr(res: &reqwest::Response, name: &str) -> Vec<String> {
    res.headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

/// Draft-11 (`HeaderStyle::IetfDraft11`): `t` is the effective window. For
/// a token bucket of 3/min (one request refills every 20 s) that is the
/// time until one more request has refilled; for a fixed window, the time
/// until the window ends. On a 429 `t` is the wait and `Retry-After` is not
/// earlier.
async fn ietf_draft11_fields(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("ip_tier", Global, Quota::per_minute(3)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let get = || c.get(format!("http://{addr}/")).send();
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit-policy"), [r#""ip_tier";q=3;w=60"#]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=2;t=20"#]);
    assert!(hdr(&res, "x-ratelimit-limit").is_empty());
    // 2 of 3 used: full again in 40 s, but the next request refills in 20 s.
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=1;t=20"#]);
    env.clock.advance(Duration::from_secs(5));
    // 1.25 tokens, 0.25 left: full in 55 s, one more request in 15 s.
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=0;t=15"#]);
    assert!(hdr(&res, "retry-after").is_empty());
    let res = get().await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(hdr(&res, "ratelimit-policy"), [r#""ip_tier";q=3;w=60"#]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=0;t=15"#]);
    assert_eq!(hdr(&res, "retry-after"), ["15"]);
}

/// The same requests under draft-09 (`HeaderStyle::IetfDraft09`): `t` is the
/// time until the quota resets (the bucket is full again), and on a 429 it
/// equals `Retry-After`.
async fn ietf_draft09_fields(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft09)
        .tier(Tier::new("ip_tier", Global, Quota::per_minute(3)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let get = || c.get(format!("http://{addr}/")).send();
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit-policy"), [r#""ip_tier";q=3;w=60"#]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=2;t=20"#]);
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=1;t=40"#]);
    env.clock.advance(Duration::from_secs(5));
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=0;t=55"#]);
    let res = get().await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=0;t=15"#]);
    assert_eq!(hdr(&res, "retry-after"), ["15"]);
    assert!(hdr(&res, "x-ratelimit-limit").is_empty());
}

/// Draft-11 on a fixed window: quota only returns when the window ends, so
/// `t` is the rest of the window. T0 is 20 s into its minute.
async fn ietf_draft11_fixed_window(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("fw", Global, Quota::per_minute(3)).algorithm(Algorithm::FixedWindow))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit"), [r#""fw";r=2;t=40"#]);
    env.clock.advance(Duration::from_secs(5));
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit"), [r#""fw";r=1;t=35"#]);
}

/// Two tiers deny: the problem body lists both (tier order), the headers
/// describe the one with the longest wait, and `Retry-After` is that wait.
/// A tier that allowed is not listed.
async fn problem_lists_violated_policies(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .on_rejection(ProblemRejection)
        .tier(Tier::new("per_second", Global, Quota::per_second(1)))
        .tier(Tier::new("roomy", Global, Quota::per_hour(100)))
        .tier(Tier::new("per_minute", Global, Quota::per_minute(1)))
        // The deny cache would answer the second request from the first
        // one's `per_second` result alone, without asking Redis about the
        // other tiers: this test is about a full decision.
        .deny_cache(0)
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(hdr(&res, "content-type"), ["application/problem+json"]);
    // Every tier's policy, whichever binds.
    assert_eq!(
        hdr(&res, "ratelimit-policy"),
        [r#""per_second";q=1;w=1, "roomy";q=100;w=3600, "per_minute";q=1;w=60"#]
    );
    assert_eq!(hdr(&res, "ratelimit"), [r#""per_minute";r=0;t=60"#]);
    assert_eq!(hdr(&res, "retry-after"), ["60"]);
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"Retry in 60 seconds.","violated-policies":["per_second","per_minute"],"retry_after":60,"docs":"https://example.com/docs/rate-limits"}"#
    );
}

async fn both_styles_once_each(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::Both)
        .tier(Tier::new("g", Global, Quota::per_minute(1)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    // An error status from the inner service still gets the headers, once.
    let res = c.get(format!("http://{addr}/boom")).send().await.unwrap();
    assert_eq!(res.status(), 500);
    for (name, want) in [
        ("x-ratelimit-limit", "1"),
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", &(T0_S + 60).to_string()),
        ("ratelimit-policy", r#""g";q=1;w=60"#),
        ("ratelimit", r#""g";r=0;t=60"#),
    ] {
        assert_eq!(hdr(&res, name), [want], "{name}");
    }
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    for (name, want) in [
        ("x-ratelimit-remaining", "0"),
        ("ratelimit", r#""g";r=0;t=60"#),
        ("retry-after", "60"),
    ] {
        assert_eq!(hdr(&res, name), [want], "{name}");
    }
}

async fn no_rate_limit_headers(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::None)
        .tier(Tier::new("g", Global, Quota::per_minute(1)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(limits(&res), NO_LIMITS);
    assert!(hdr(&res, "ratelimit").is_empty());
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    // Retry-After is always sent on a 429.
    assert_eq!(hdr(&res, "retry-after"), ["60"]);
    assert!(hdr(&res, "x-ratelimit-limit").is_empty() && hdr(&res, "ratelimit").is_empty());
}

async fn problem_details_body(env: Env) {
    let layer = env
        .builder()
        .on_rejection(ProblemRejection)
        .tier(Tier::new("g", Global, Quota::per_minute(1)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    c.get(format!("http://{addr}/")).send().await.unwrap();
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(hdr(&res, "content-type"), ["application/problem+json"]);
    assert_eq!(limits(&res), denied(1, 0, T0_S + 60, 60));
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"Retry in 60 seconds.","violated-policies":["g"],"retry_after":60,"docs":"https://example.com/docs/rate-limits"}"#
    );
}

#[test]
fn policy_header_and_body_names() {
    let p = Policy::from_toml_str(
        "headers = 'both'\nbody = 'problem'\n[[tier]]\nname='g'\nkey='global'\nlimit=1\nperiod='1s'\n",
    )
    .unwrap();
    let _layer =
        RateLimitLayer::from_policy(&p, tiered_ratelimit::backend::MemoryBackend::new()).unwrap();
    for (name, style) in [
        ("legacy", HeaderStyle::Legacy),
        ("ietf", HeaderStyle::IetfDraft11),
        ("ietf-draft-11", HeaderStyle::IetfDraft11),
        ("ietf-draft-09", HeaderStyle::IetfDraft09),
        ("both", HeaderStyle::Both),
        ("none", HeaderStyle::None),
    ] {
        let p = Policy::from_toml_str(&format!("headers = '{name}'")).unwrap();
        assert_eq!(p.headers, style, "{name}");
    }
    let e = Policy::from_toml_str("headers = 'fancy'")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fancy") && e.contains("headers"), "{e}");
    let e = Policy::from_toml_str("body = 'xml'")
        .unwrap_err()
        .to_string();
    assert!(e.contains("xml"), "{e}");
}

/// `HeaderStyle::Ietf` is the deprecated name of the current draft.
#[test]
#[allow(deprecated)]
fn ietf_alias_is_the_current_draft() {
    assert_eq!(HeaderStyle::Ietf, HeaderStyle::IetfDraft11);
}

/// `RateLimit-Policy` lists every tier the request is checked by, in tier
/// order, and stays the same when the binding tier (`RateLimit`) changes
/// (draft-11 §3: "SHOULD remain consistent over a sequence of HTTP
/// responses"); on the 429 too. A shadow tier is not listed.
async fn the_policy_field_lists_every_tier(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("burst", Global, Quota::per_second(3)))
        .tier(Tier::new("hourly", Global, Quota::per_hour(4)))
        .tier(
            Tier::new("watching", Global, Quota::per_minute(1))
                .mode(tiered_ratelimit::rollout::Mode::Shadow),
        )
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let get = || c.get(format!("http://{addr}/")).send();
    let policy = r#""burst";q=3;w=1, "hourly";q=4;w=3600"#;
    // `burst` binds (2 left of 3, 3 of 4).
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit-policy"), [policy]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""burst";r=2;t=1"#]);
    let res = get().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit-policy"), [policy]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""burst";r=1;t=1"#]);
    // A second on, `burst` is full again: `hourly` binds (1 left), one
    // request refilling 900 s after the last 1 s of refill.
    env.clock.advance(Duration::from_secs(1));
    let res = get().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(hdr(&res, "ratelimit-policy"), [policy]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""hourly";r=1;t=899"#]);
    get().await.unwrap();
    let res = get().await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(hdr(&res, "ratelimit-policy"), [policy]);
}

/// A tier whose requests cost other than 1 does not claim the default
/// unit (`requests`): `cost-units` unless told, or the unit it is given;
/// a custom unit outside `[a-z0-9-]` is refused at build, naming the field.
async fn a_weighted_tier_names_its_unit(env: Env) {
    use tiered_ratelimit::response::QuotaUnit;
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("plain", Global, Quota::per_minute(60)))
        .tier(Tier::new("batch", Global, Quota::per_minute(60)).cost_fn(cost_from_header("x-cost")))
        .tier(
            Tier::new("bytes", Global, Quota::per_minute(100_000))
                .cost_fn(cost_from_header("x-cost"))
                .quota_unit(QuotaUnit::ContentBytes),
        )
        .tier(Tier::new("double", Global, Quota::per_minute(60)).cost(2))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let res = client()
        .get(format!("http://{addr}/"))
        .header("x-cost", "5")
        .send()
        .await
        .unwrap();
    assert_eq!(
        hdr(&res, "ratelimit-policy"),
        [concat!(
            r#""plain";q=60;w=60, "batch";q=60;qu="cost-units";w=60, "#,
            r#""bytes";q=100000;qu="content-bytes";w=60, "double";q=60;qu="cost-units";w=60"#
        )]
    );
    let err = env
        .builder()
        .tier(Tier::new("t", Global, Quota::per_minute(1)).quota_unit(QuotaUnit::named("Bad Unit")))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"tier "t": quota_unit: "Bad Unit" must be 1-32 characters of [a-z0-9-]"#
    );
    // A policy file names it too.
    let policy = Policy::from_toml_str(
        r#"
        headers = "ietf-draft-11"
        [[tier]]
        name = "upload"
        key = "global"
        limit = 1000000
        period = "1m"
        quota_unit = "content-bytes"
        "#,
    )
    .unwrap();
    let layer = policy
        .builder(env.backend.clone())
        .unwrap()
        .key_prefix("file")
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let res = client()
        .get(format!("http://{addr}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        hdr(&res, "ratelimit-policy"),
        [r#""upload";q=1000000;qu="content-bytes";w=60"#]
    );
}

/// Structured Fields integers have at most 15 digits (RFC 9651): with the
/// IETF fields a quota above 999 999 999 999 999 is refused at build,
/// naming the field (a plan's too); the same quota is fine with the legacy
/// headers, which are no Structured Field; the largest one that fits is
/// sent as is. (Fixed windows: the Redis script's 2^52 bounds already
/// refuse such quotas on a token bucket.)
/// T0 is 800 s into its hour.
async fn numbers_stay_within_structured_fields(env: Env) {
    const MAX: u64 = 999_999_999_999_999;
    let err = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("huge", Global, Quota::per_hour(MAX + 1)).algorithm(Algorithm::FixedWindow))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"tier "huge": limit: 1000000000000000 is above 999999999999999, the largest integer the IETF RateLimit fields can carry (RFC 9651 Structured Fields: 15 digits)"#
    );
    let err = env
        .builder()
        .headers(HeaderStyle::IetfDraft09)
        .tier(
            Tier::new("p", Global, Quota::per_hour(10))
                .algorithm(Algorithm::FixedWindow)
                .plans([("big", Quota::per_hour(MAX + 1))]),
        )
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with(r#"tier "p": plans.big.limit: 1000000000000000 is above"#),
        "{err}"
    );
    let _built = env
        .builder()
        .tier(Tier::new("huge", Global, Quota::per_hour(MAX + 1)).algorithm(Algorithm::FixedWindow))
        .build()
        .unwrap();
    let layer = env
        .builder()
        .headers(HeaderStyle::IetfDraft11)
        .tier(Tier::new("max", Global, Quota::per_hour(MAX)).algorithm(Algorithm::FixedWindow))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let res = client()
        .get(format!("http://{addr}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        hdr(&res, "ratelimit-policy"),
        [r#""max";q=999999999999999;w=3600"#]
    );
    assert_eq!(
        hdr(&res, "ratelimit"),
        [r#""max";r=999999999999998;t=2800"#]
    );
}
