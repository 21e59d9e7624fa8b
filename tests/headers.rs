//! Both header standards and both rejection bodies, exactly, through HTTP.

mod support;

use support::*;
use tiered_ratelimit::{
    key::Global, response::ProblemRejection, HeaderStyle, Policy, Quota, RateLimitLayer, Tier,
};

both_backends!(
    ietf_fields,
    both_styles_once_each,
    no_rate_limit_headers,
    problem_details_body
);

fn hdr(res: &reqwest::Response, name: &str) -> Vec<String> {
    res.headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

async fn ietf_fields(env: Env) {
    let layer = env
        .builder()
        .headers(HeaderStyle::Ietf)
        .tier(Tier::new("ip_tier", Global, Quota::per_minute(3)))
        .build()
        .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(hdr(&res, "ratelimit-policy"), [r#""ip_tier";q=3;w=60"#]);
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=2;t=20"#]);
    assert!(hdr(&res, "x-ratelimit-limit").is_empty());
    c.get(format!("http://{addr}/")).send().await.unwrap();
    c.get(format!("http://{addr}/")).send().await.unwrap();
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    // On a 429, t equals Retry-After: never earlier.
    assert_eq!(hdr(&res, "ratelimit"), [r#""ip_tier";r=0;t=20"#]);
    assert_eq!(hdr(&res, "retry-after"), ["20"]);
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
    let e = Policy::from_toml_str("headers = 'fancy'")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fancy") && e.contains("headers"), "{e}");
    let e = Policy::from_toml_str("body = 'xml'")
        .unwrap_err()
        .to_string();
    assert!(e.contains("xml"), "{e}");
}
