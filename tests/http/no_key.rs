//! A tier that never applies does not look like success: with the auth
//! middleware placed INSIDE the limiter (the wrong side), the `user` tier
//! finds no `UserId` on any request; every such request is counted in
//! `tiered_ratelimit_tier_no_key_total{tier}` (registered at 0 when the
//! layer is built), and after the first N keyless requests one WARN names
//! the tier and the likely cause. Over real TCP with reqwest. Alone in its
//! binary: it installs a thread-local subscriber and recorder (see
//! tests/http/tracing_span.rs).

use crate::support::*;
use axum::{middleware, routing::get, Router};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tiered_ratelimit::policy::Policy;

/// The values of counter `name` by exactly these label sets (sorted `k=v`),
/// from one snapshot (a snapshot drains the debugging recorder's counters).
fn counters<const N: usize>(
    recorder: &DebuggingRecorder,
    name: &str,
    labels: [&str; N],
) -> [Option<u64>; N] {
    let snap = recorder.snapshotter().snapshot().into_vec();
    labels.map(|labels| counter(&snap, name, labels))
}

type Snap = [(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)];

fn counter(snap: &Snap, name: &str, labels: &str) -> Option<u64> {
    snap.iter().find_map(|(key, _, _, value)| {
        let mut l = metric_labels(key.key());
        l.sort();
        match value {
            DebugValue::Counter(c) if key.key().name() == name && l.join(",") == labels => Some(*c),
            _ => None,
        }
    })
}

const NO_KEY: &str = "tiered_ratelimit_tier_no_key_total";

#[test]
fn auth_inside_the_limiter_is_counted_and_warned_once() {
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let recorder = DebuggingRecorder::new();
    let policy = Policy::from_toml_str(
        r#"
        no_key_warn_after = 5
        [[tier]]
        name = "user"
        key = "user"
        limit = 5
        period = "1m"
        "#,
    )
    .unwrap();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let rt = current_thread_runtime();
            rt.block_on(async {
                let env = Env::memory();
                let layer = policy
                    .builder(env.backend.clone())
                    .unwrap()
                    .build()
                    .unwrap();
                // Registered at build, before any request.
                assert_eq!(counters(&recorder, NO_KEY, ["tier=user"]), [Some(0)]);
                // The wrong side: the limiter wraps the auth middleware, so
                // it runs before the UserId exists.
                let app = Router::new()
                    .route("/", get(|| async { "hello" }))
                    .layer(middleware::from_fn(auth))
                    .layer(layer);
                let addr = serve(app).await;
                let c = client();
                for i in 0..7 {
                    let res = c
                        .get(format!("http://{addr}/"))
                        .header("authorization", "Bearer alice")
                        .send()
                        .await
                        .unwrap();
                    // Seven of one user against 5/min all pass: the tier never applied.
                    assert_eq!(res.status(), 200, "request {i}");
                    let warned = buf.text().lines().filter(|l| l.contains(" WARN ")).count();
                    assert_eq!(warned, usize::from(i >= 4), "after request {i}");
                }
            });
        });
    });
    assert_eq!(counters(&recorder, NO_KEY, ["tier=user"]), [Some(7)]);
    let out = buf.text();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    let line = lines[0];
    assert!(line.contains(" WARN "), "{line}");
    assert!(
        line.contains(
            "rate limiter: tier \"user\" had no key on every one of its first 5 requests, so it \
             never applied (each is counted in tiered_ratelimit_tier_no_key_total); no request \
             carried a `UserId`: the auth middleware that inserts it must run BEFORE the \
             limiter, so it must wrap it (with axum, add the auth layer after the limiter's: \
             `.layer(limiter).layer(auth)`); placed inside the limiter it runs too late (if \
             the requests so far were all anonymous, this is expected: raise or turn off the \
             warning with `no_key_warning_after`)"
        ),
        "{line}"
    );
    assert!(line.contains("tier=user"), "{line}");
    assert!(line.contains("extractor=\"User\""), "{line}");
    assert!(line.contains("requests=5"), "{line}");
}

/// The right side: the same requests are keyed, limited at the sixth, and
/// nothing is counted or logged; an `ApiKey` tier no client feeds names
/// its header.
#[test]
fn auth_outside_the_limiter_is_silent_and_a_missing_header_is_named() {
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let recorder = DebuggingRecorder::new();
    let policy = Policy::from_toml_str(
        r#"
        no_key_warn_after = 3
        [[tier]]
        name = "user"
        key = "user"
        limit = 5
        period = "1m"
        [[tier]]
        name = "partner"
        key = { header = "x-partner-key" }
        limit = 100
        period = "1m"
        "#,
    )
    .unwrap();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let rt = current_thread_runtime();
            rt.block_on(async {
                let env = Env::memory();
                let layer = policy
                    .builder(env.backend.clone())
                    .unwrap()
                    .build()
                    .unwrap();
                let addr = serve(app(layer)).await;
                let c = client();
                let mut statuses = Vec::new();
                for _ in 0..7 {
                    let res = c
                        .get(format!("http://{addr}/"))
                        .header("authorization", "Bearer alice")
                        .send()
                        .await
                        .unwrap();
                    statuses.push(res.status().as_u16());
                }
                assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
            });
        });
    });
    assert_eq!(
        counters(&recorder, NO_KEY, ["tier=user", "tier=partner"]),
        [Some(0), Some(7)]
    );
    let out = buf.text();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(
        lines[0].contains(
            "rate limiter: tier \"partner\" had no key on every one of its first 3 requests, so \
             it never applied (each is counted in tiered_ratelimit_tier_no_key_total); no \
             request carried a non-empty `x-partner-key` header: check the header's name, and \
             that no proxy in front of the app strips it"
        ),
        "{}",
        lines[0]
    );
}
