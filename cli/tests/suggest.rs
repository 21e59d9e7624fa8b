//! `tiered-ratelimit suggest` (the offline twin of the admin API's
//! `GET /api/suggest/{tier}`): the same traffic sent live to a real server
//! over TCP (a layer from the same policy, its clock following the
//! requests' times) and written to a log replayed by the binary; the two
//! suggestions agree (here exactly: the same per-key peaks), and both
//! match the generator's demand to within one bucket.

use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;
use tiered_ratelimit::backend::{ManualClock, MemoryBackend};
use tiered_ratelimit::policy::Policy;
use tiered_ratelimit::RateLimitLayer;

const BIN: &str = env!("CARGO_BIN_EXE_tiered-ratelimit");
/// 2024-03-01T00:00:00Z: an hour's start.
const T0: u64 = 1_709_251_200;

const POLICY: &str = r#"
[[tier]]
name = "api"
key = { header = "x-api-key" }
limit = 20
period = "1m"
algorithm = "fixed_window"
"#;

/// The generator: 60 keys over three minutes; key `i` sends
/// `1 + (i² + 7·m·i) mod 37` requests in minute `m`, one a second.
/// Answers `(time s, key)` in time order and each key's peak minute.
fn traffic() -> (Vec<(u64, String)>, Vec<u64>) {
    let mut reqs = Vec::new();
    let mut peaks = Vec::new();
    for i in 0..60u64 {
        let mut peak = 0;
        for m in 0..3u64 {
            let n = 1 + (i * i + 7 * m * i) % 37;
            peak = peak.max(n);
            for j in 0..n {
                reqs.push((T0 + m * 60 + j, format!("key-{i:02}")));
            }
        }
        peaks.push(peak);
    }
    reqs.sort();
    peaks.sort_unstable();
    (reqs, peaks)
}

/// One HTTP/1.1 request on its own connection; the status.
fn get(addr: SocketAddr, key: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: test\r\nX-Api-Key: {key}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split(' ').nth(1).unwrap().parse().unwrap()
}

fn within_a_bucket(got: &Value, want: u64, what: &str) {
    let got = got.as_u64().unwrap_or_else(|| panic!("{what}: {got}"));
    assert!(
        got >= want && (got - want <= 1 || got * 50 <= want * 51),
        "{what}: {got}, exactly {want}"
    );
}

#[test]
fn offline_and_live_suggestions_agree_on_the_same_traffic() {
    let (reqs, peaks) = traffic();
    let policy = Policy::from_toml_str(POLICY).unwrap();

    // Live: a real server; the layer's clock set to each request's time.
    let clock = ManualClock::new(T0 * 1_000_000);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layer =
        RateLimitLayer::from_policy(&policy, MemoryBackend::with_manual_clock(clock.clone()))
            .unwrap();
    let handle = layer.handle();
    handle.set_demand(true);
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut limited = 0;
    for (t, key) in &reqs {
        clock.set(t * 1_000_000);
        match get(addr, key) {
            200 => {}
            429 => limited += 1,
            s => panic!("{s}"),
        }
    }
    assert!(limited > 0, "the limit of 20 a minute denied some");
    let live = rt
        .block_on(handle.suggest("api", None, 0.05, Duration::from_secs(3600)))
        .unwrap()
        .to_json();

    // Offline: the same requests as a log, through the binary.
    let dir = std::env::temp_dir().join(format!("tiered-ratelimit-suggest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log: String = reqs
        .iter()
        .map(|(t, key)| {
            format!(
                "{{\"time\":{t},\"remote_addr\":\"192.0.2.1\",\"method\":\"GET\",\"path\":\"/\",\"status\":200,\"api_key\":\"{key}\"}}\n"
            )
        })
        .collect();
    std::fs::write(dir.join("policy.toml"), POLICY).unwrap();
    std::fs::write(dir.join("access.jsonl"), log).unwrap();
    let out = Command::new(BIN)
        .current_dir(&dir)
        .args([
            "suggest",
            "-p",
            "policy.toml",
            "--field",
            "header:x-api-key=api_key",
            "--time-format",
            "epoch",
            "--target",
            "0.05",
            "--window",
            "1h",
            "-q",
            "access.jsonl",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let offline: Value = serde_json::from_slice(&out.stdout).unwrap();
    let offline = &offline.as_array().unwrap()[0];

    assert_eq!(offline, &live);
    assert_eq!(live["keys"], 60);
    assert_eq!(live["requests"], reqs.len() as u64);
    assert_eq!(live["period_s"], 60);
    let exact = |p: u64| peaks[usize::try_from((p * 60).div_ceil(1000) - 1).unwrap()];
    for (name, p) in [("p50", 500), ("p90", 900), ("p99", 990), ("p99.9", 999)] {
        within_a_bucket(&live["percentiles"][name], exact(p), name);
    }
    // 5 % of 60 keys may be denied: the 57th smallest peak.
    within_a_bucket(&live["suggested"]["limit"], peaks[56], "suggested");
}

#[test]
fn an_empty_log_gets_not_enough_data_for_every_tier() {
    let dir = std::env::temp_dir().join(format!(
        "tiered-ratelimit-suggest-empty-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("policy.toml"), POLICY).unwrap();
    std::fs::write(dir.join("empty.log"), "").unwrap();
    let out = Command::new(BIN)
        .current_dir(&dir)
        .args(["suggest", "-p", "policy.toml", "-q", "empty.log"])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        answer,
        serde_json::json!([{"error": "not_enough_data", "keys": 0, "needed": 50, "tier": "api", "plan": null}])
    );
}
