//! A request that can never fit (its cost above the tier's capacity) is
//! answered as what it is, over real HTTP with reqwest, on memory and on a
//! real Redis: 429 without `Retry-After` (a client would retry for ever),
//! a distinct body (`cost_exceeds_capacity`, in the JSON and the problem
//! body), counted in `tiered_ratelimit_cost_exceeds_capacity_total{tier}`
//! and logged once per tier as a likely misconfiguration; nothing charged.
//! Alone in its binary: it installs a thread-local subscriber and recorder
//! (see tests/http/tracing_span.rs).

use crate::support::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tiered_ratelimit::{key::Global, response::RejectionBody, Quota, Tier};

const NEVER: &str = "tiered_ratelimit_cost_exceeds_capacity_total";

fn never_fits_count(recorder: &DebuggingRecorder) -> Option<u64> {
    let snap = recorder.snapshotter().snapshot().into_vec();
    snap.iter().find_map(|(key, _, _, value)| match value {
        DebugValue::Counter(c)
            if key.key().name() == NEVER && metric_labels(key.key()) == ["tier=global"] =>
        {
            Some(*c)
        }
        _ => None,
    })
}

fn header<'r>(res: &'r reqwest::Response, name: &str) -> Option<&'r str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

fn scenario(env: Env) {
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let recorder = DebuggingRecorder::new();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let rt = current_thread_runtime();
            rt.block_on(async {
                let tier = || {
                    Tier::new("global", Global, Quota::per_minute(5))
                        .cost_fn(cost_from_header("x-cost"))
                };
                let json = env.builder().tier(tier()).build().unwrap();
                assert_eq!(never_fits_count(&recorder), Some(0), "registered at build");
                let addr = serve(app(json)).await;
                let c = client();
                let send = |cost: u64| {
                    c.get(format!("http://{addr}/"))
                        .header("x-cost", cost.to_string())
                        .send()
                };
                for _ in 0..2 {
                    let res = send(6).await.unwrap();
                    // Full bucket: 5 left, full now; no Retry-After.
                    assert_eq!(
                        limits(&res),
                        Limits {
                            status: 429,
                            limit: Some(5),
                            remaining: Some(5),
                            reset: Some(T0_S),
                            retry_after: None,
                        }
                    );
                    // SDKs that retry every 429 stop on it.
                    assert_eq!(header(&res, "x-should-retry"), Some("false"));
                    assert_eq!(
                        res.text().await.unwrap(),
                        r#"{"error":"cost_exceeds_capacity","limit":5,"docs":"https://example.com/docs/rate-limits"}"#
                    );
                }
                // A request that fits is answered as before, and the big
                // ones charged nothing.
                let res = send(5).await.unwrap();
                assert_eq!(limits(&res), ok(5, 0, T0_S + 60));
                assert_eq!(header(&res, "x-should-retry"), None);
                let res = send(1).await.unwrap();
                assert_eq!(limits(&res), denied(5, 0, T0_S + 12, 12));
                // A 429 a wait lifts may be retried.
                assert_eq!(header(&res, "x-should-retry"), None);
                assert_eq!(
                    res.text().await.unwrap(),
                    r#"{"error":"rate_limit_exceeded","retry_after":12,"docs":"https://example.com/docs/rate-limits"}"#
                );
                // The problem body names the reason (a fresh key prefix).
                let problem = env
                    .builder()
                    .key_prefix("problem")
                    .on_rejection(RejectionBody::Problem)
                    .tier(tier())
                    .build()
                    .unwrap();
                let addr = serve(app(problem)).await;
                let res = c
                    .get(format!("http://{addr}/"))
                    .header("x-cost", "9")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(limits(&res).retry_after, None);
                assert_eq!(header(&res, "x-should-retry"), Some("false"));
                assert_eq!(
                    res.text().await.unwrap(),
                    r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"detail":"This request costs more than the capacity of 5 of \"global\": it can never pass. Send a smaller request.","violated-policies":["global"],"reason":"cost_exceeds_capacity","docs":"https://example.com/docs/rate-limits"}"#
                );
            });
        });
    });
    // Both layers' tier is named "global": one series, 3 requests.
    assert_eq!(never_fits_count(&recorder), Some(3));
    let out = buf.text();
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains("rate limiter: tier"))
        .collect();
    // Once per tier: one for each layer's tier.
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].contains(
            "rate limiter: tier \"global\" denied a request whose cost exceeds its capacity of \
             5: it can never pass, answered 429 without Retry-After (counted in \
             tiered_ratelimit_cost_exceeds_capacity_total); likely a misconfiguration: a burst \
             below the largest cost a client may send, or a cost function returning more than \
             the burst (logged once per tier)"
        ),
        "{out}"
    );
    assert!(lines[1].contains("cost exceeds its capacity of 5"), "{out}");
}

#[test]
fn cost_above_capacity_in_memory() {
    scenario(Env::memory());
}

#[test]
fn cost_above_capacity_on_redis() {
    scenario(Env::redis());
}
