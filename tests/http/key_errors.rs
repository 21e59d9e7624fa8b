//! A misconfigured extractor never looks like success: the app served
//! without connect info over real TCP, its `ip` tier skipped while the
//! `user` tier still limits, one ERROR line saying what to change, and a
//! counter of every such request. Alone in its binary: it installs a
//! thread-local subscriber and recorder (see tests/http/tracing_span.rs).

use crate::support::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tiered_ratelimit::{
    key::{ClientIp, KeyError, User},
    Quota, Tier,
};

/// The value of counter `name` with exactly these labels (sorted `k=v`).
fn counter(
    snap: &[(
        metrics_util::CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )],
    name: &str,
    labels: &str,
) -> Option<u64> {
    snap.iter().find_map(|(key, _, _, value)| {
        let mut l = metric_labels(key.key());
        l.sort();
        match value {
            DebugValue::Counter(c) if key.key().name() == name && l.join(",") == labels => Some(*c),
            _ => None,
        }
    })
}

#[test]
fn missing_connect_info_is_logged_once_counted_and_skips_only_its_tier() {
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let rt = current_thread_runtime();
            rt.block_on(async {
                let env = Env::memory();
                let layer = env
                    .builder()
                    .tier(Tier::new("ip", ClientIp::default(), Quota::per_minute(1)))
                    .tier(Tier::new("user", User, Quota::per_minute(2)))
                    .build()
                    .unwrap();
                let addr = serve_without_connect_info(app(layer)).await;
                let url = format!("http://{addr}/");
                let c = client();
                let alice = || c.get(&url).header("authorization", "Bearer alice").send();
                assert_eq!(limits(&alice().await.unwrap()), ok(2, 1, T0_S + 30));
                assert_eq!(limits(&alice().await.unwrap()), ok(2, 0, T0_S + 60));
                for _ in 0..8 {
                    assert_eq!(limits(&alice().await.unwrap()), denied(2, 0, T0_S + 30, 30));
                }
            });
        });
    });
    let out = buf.text();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    let line = lines[0];
    assert!(line.contains(" ERROR "), "{line}");
    assert!(
        line.contains(
            "rate limiter misconfigured: tier \"ip\" cannot compute its key, skipping this tier; \
             the other tiers still apply: ClientIp needs the peer address: serve the app with \
             `into_make_service_with_connect_info::<SocketAddr>()`"
        ),
        "{line}"
    );
    assert!(line.contains("tier=ip"), "{line}");
    assert!(line.contains("extractor=\"ClientIp\""), "{line}");
    assert!(line.contains("reason=\"missing_connect_info\""), "{line}");
    assert!(line.contains("suppressed=0"), "{line}");

    let snap = snapshotter.snapshot().into_vec();
    assert_eq!(
        counter(
            &snap,
            "tiered_ratelimit_key_errors_total",
            "reason=missing_connect_info,tier=ip"
        ),
        Some(10)
    );
    assert_eq!(
        counter(&snap, "tiered_ratelimit_requests_total", "decision=allowed"),
        Some(2)
    );
    assert_eq!(
        counter(&snap, "tiered_ratelimit_requests_total", "decision=limited"),
        Some(8)
    );
    // Nothing was a failure-policy decision.
    assert_eq!(
        counter(
            &snap,
            "tiered_ratelimit_requests_total",
            "decision=fail_open"
        )
        .unwrap_or(0),
        0
    );
    assert_eq!(
        counter(
            &snap,
            "tiered_ratelimit_backend_errors_total",
            "backend=memory,kind=key"
        ),
        None
    );
}

#[test]
fn key_errors_classify_configuration() {
    assert!(KeyError::MissingConnectInfo.is_configuration());
    assert!(KeyError::Configuration("add the tenant layer".into()).is_configuration());
    assert!(!KeyError::Request("bad token".into()).is_configuration());
    assert_eq!(KeyError::Request("x".into()).reason(), "request");
}

/// A denylist with IP entries cannot match without the peer address: the
/// request is not silently treated as unlisted: one ERROR line with the fix,
/// and every such request counted.
#[test]
fn an_ip_list_without_peer_address_is_logged_and_counted() {
    use tiered_ratelimit::rollout::{AccessList, DenyStatus};
    let buf = LogBuf::default();
    let subscriber = buf.subscriber(tracing::Level::WARN);
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let rt = current_thread_runtime();
            rt.block_on(async {
                let env = Env::memory();
                let layer = env
                    .builder()
                    .denylist(
                        AccessList::new().ip("127.0.0.0/8".parse().unwrap()),
                        DenyStatus::Forbidden,
                    )
                    .tier(Tier::new("user", User, Quota::per_minute(2)))
                    .build()
                    .unwrap();
                let addr = serve_without_connect_info(app(layer)).await;
                let url = format!("http://{addr}/");
                let c = client();
                for _ in 0..3 {
                    let res = c
                        .get(&url)
                        .header("authorization", "Bearer bob")
                        .send()
                        .await
                        .unwrap();
                    // The list cannot see the address: not denied, but said.
                    assert_ne!(res.status(), 403);
                }
            });
        });
    });
    let out = buf.text();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(lines[0].contains(" ERROR "), "{out}");
    assert!(
        lines[0].contains(
            "an allow- or denylist has IP entries but the request has no peer address, so they \
             cannot match; serve the app with into_make_service_with_connect_info::<SocketAddr>()"
        ),
        "{out}"
    );
    let snap = snapshotter.snapshot().into_vec();
    assert_eq!(
        counter(
            &snap,
            "tiered_ratelimit_key_errors_total",
            "reason=missing_connect_info,tier=access_list"
        ),
        Some(3)
    );
}
