//! The `tiered-ratelimit-rls` binary as Envoy meets it: two server
//! processes sharing one Redis decide 200 concurrent two-descriptor calls
//! all or nothing; `grpc.health.v1` says SERVING; `GET /metrics` serves
//! Prometheus text; SIGTERM ends it cleanly (exit status 0).

mod support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::metrics as get_metrics;
use support::{free_port, rls_command, Killed, RedisServer};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// A server process, killed on drop if still running.
struct Server {
    child: Killed,
    grpc: u16,
    metrics: u16,
}

fn spawn(config: &std::path::Path) -> Server {
    let (grpc, metrics) = (free_port(), free_port());
    let child = rls_command()
        .arg("--config")
        .arg(config)
        .args(["--listen", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics", &format!("127.0.0.1:{metrics}")])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn tiered-ratelimit-rls");
    Server {
        child: Killed(child),
        grpc,
        metrics,
    }
}

/// A channel to `port` once the server's health says SERVING (10 s at most).
async fn ready(port: u16) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
        if let Ok(ch) = endpoint.connect().await {
            let status = HealthClient::new(ch.clone())
                .check(HealthCheckRequest {
                    service: "envoy.service.ratelimit.v3.RateLimitService".into(),
                })
                .await
                .map(|r| r.into_inner().status);
            if status.ok() == Some(ServingStatus::Serving as i32) {
                return ch;
            }
        }
        assert!(Instant::now() < deadline, "server on {port} never SERVING");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn both() -> RateLimitRequest {
    let d = |k: &str, v: &str| RateLimitDescriptor {
        entries: vec![Entry {
            key: k.into(),
            value: v.into(),
        }],
        ..Default::default()
    };
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![d("tenant", "t1"), d("plan", "gold")],
        hits_addend: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_redis_all_or_nothing_then_shut_down_cleanly() {
    let redis = RedisServer::start();
    let config =
        std::env::temp_dir().join(format!("rls-{}-{}.toml", std::process::id(), redis.port()));
    std::fs::write(
        &config,
        format!(
            r#"
domain = "edge"
key_prefix = "rls-proc"
# Generous: under a loaded machine the 100 ms default fails open, and
# this test counts exact admissions, not timeouts.
backend_timeout_ms = 5000
[redis]
url = "{}"
[[rule]]
name = "tenant"
match = [{{ key = "tenant" }}]
limit = 100
period = "1h"
[[rule]]
name = "plan"
match = [{{ key = "plan" }}]
limit = 60
period = "1h"
"#,
            redis.url()
        ),
    )
    .unwrap();
    let mut a = spawn(&config);
    let b = spawn(&config);
    let (ca, cb) = (ready(a.grpc).await, ready(b.grpc).await);
    let mut calls = Vec::new();
    for i in 0..200 {
        let ch = if i % 2 == 0 { ca.clone() } else { cb.clone() };
        calls.push(tokio::spawn(async move {
            RateLimitServiceClient::new(ch)
                .should_rate_limit(both())
                .await
                .expect("answered")
                .into_inner()
        }));
    }
    let mut allowed = 0;
    for c in calls {
        if c.await.unwrap().overall_code == Code::Ok as i32 {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 60);
    // `tenant` was charged for the 60 allowed calls only (100 an hour:
    // one more token takes 36 s, far longer than this test).
    let mut one = both();
    one.descriptors.truncate(1);
    let r = RateLimitServiceClient::new(ca.clone())
        .should_rate_limit(one)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 39);

    let m = get_metrics(a.metrics).await;
    assert!(
        m.starts_with("HTTP/1.0 200") || m.starts_with("HTTP/1.1 200"),
        "{m}"
    );
    assert!(m.contains("tiered_ratelimit_requests_total"), "{m}");

    // SIGTERM: a clean exit.
    let status = Command::new("kill")
        .args(["-TERM", &a.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(s) = a.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit 10 s after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(exit.success(), "{exit:?}");
    let _ = std::fs::remove_file(&config);
}

/// What an operator reads: the start line names the backend (password
/// redacted) and the rule count, the shutdown line the leased tokens
/// returned, and stdout, not a terminal here, carries no ANSI colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_name_backend_rules_and_returned_leases_without_colour() {
    let redis = RedisServer::start();
    let config = std::env::temp_dir().join(format!(
        "rls-logs-{}-{}.toml",
        std::process::id(),
        redis.port()
    ));
    std::fs::write(
        &config,
        format!(
            r#"
domain = "edge"
key_prefix = "rls-logs"
[redis]
url = "redis://user:secret@127.0.0.1:{}/"
[[rule]]
name = "tenant"
match = [{{ key = "tenant" }}]
limit = 100
period = "1h"
[[rule]]
name = "plan"
match = [{{ key = "plan" }}]
limit = 60
period = "1h"
sync = "lease"
"#,
            redis.port()
        ),
    )
    .unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let child = rls_command()
        .arg("--config")
        .arg(&config)
        .args(["--listen", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics", &format!("127.0.0.1:{metrics}")])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn tiered-ratelimit-rls");
    let _ch = ready(grpc).await;
    // Before any call, the scrape already has the series the limiter
    // registers when built (the recorder is installed first), each with
    // its HELP line.
    let scrape = get_metrics(metrics).await;
    let series: Vec<&str> = scrape
        .lines()
        .filter(|l| l.starts_with("tiered_ratelimit_"))
        .map(|l| l.split(['{', ' ']).next().unwrap())
        .collect();
    for s in [
        "tiered_ratelimit_mode",
        "tiered_ratelimit_lease_tokens_total",
    ] {
        assert!(series.contains(&s), "{s} missing:\n{scrape}");
    }
    for s in &series {
        assert!(
            scrape.contains(&format!("# HELP {s} ")),
            "no HELP for {s}:\n{scrape}"
        );
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(!stdout.contains('\x1b'), "ANSI codes in {stdout:?}");
    let start = stdout
        .lines()
        .find(|l| l.contains("serving envoy.service.ratelimit.v3.RateLimitService"))
        .unwrap_or_else(|| panic!("no start line in {stdout}"));
    assert!(
        start.ends_with(&format!(
            "serving envoy.service.ratelimit.v3.RateLimitService addr=127.0.0.1:{grpc} \
             domain=edge backend=redis at redis://***@127.0.0.1:{}/ rules=2",
            redis.port()
        )),
        "{start}"
    );
    assert!(!stdout.contains("secret"), "{stdout}");
    let stop = stdout
        .lines()
        .find(|l| l.contains("stopped"))
        .unwrap_or_else(|| panic!("no shutdown line in {stdout}"));
    assert!(
        stop.ends_with(
            "stopped: calls in flight answered, token leases returned leased_tokens_returned=0"
        ),
        "{stop}"
    );
    let _ = std::fs::remove_file(&config);
}

/// A misspelled field in a `[[rule]]` table stops the start with the file,
/// the rule's name, the line and the field (docs/envoy.md), exit code 1.
#[test]
fn a_misspelled_rule_field_names_the_rule() {
    let config = std::env::temp_dir().join(format!("rls-typo-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        r#"domain = "edge"
[[rule]]
name = "tenant"
match = [{ key = "tenant" }]
limit = 100
period = "1h"
[[rule]]
name = "plan"
match = [{ key = "plan" }]
limt = 60
period = "1h"
"#,
    )
    .unwrap();
    let out = rls_command()
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0", "--metrics", "none"])
        .output()
        .expect("run tiered-ratelimit-rls");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let first = stderr.lines().next().unwrap_or_default();
    assert_eq!(
        first,
        format!(
            "tiered-ratelimit-rls: {}: policy: rule \"plan\": TOML parse error at line 10, column 1",
            config.display()
        ),
        "{stderr}"
    );
    assert!(stderr.contains("unknown field `limt`"), "{stderr}");
    let _ = std::fs::remove_file(&config);
}

/// A rules file whose `[redis]` URL points where nothing listens.
fn unreachable_rules(failure_policy: &str) -> tempfile_path::Path {
    let port = free_port();
    tempfile_path::write(&format!(
        r#"
domain = "edge"
failure_policy = "{failure_policy}"
[redis]
url = "redis://127.0.0.1:{port}/"
[[rule]]
name = "per_ip"
match = [{{ key = "remote_address" }}]
limit = 2
period = "1m"
"#
    ))
}

/// Temporary rules files, removed on drop.
mod tempfile_path {
    pub struct Path(pub std::path::PathBuf);
    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    pub fn write(text: &str) -> Path {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "rls-unreachable-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, text).unwrap();
        Path(p)
    }
}

/// An unreachable Redis at start-up: under `closed` the service refuses
/// to start (exit 1, one line naming the address); under `open` it starts,
/// says so in one WARN line naming the address, and serves.
#[tokio::test]
async fn unreachable_redis_at_start_up_is_said_at_start_up() {
    let rules = unreachable_rules("closed");
    let mut child = rls_command()
        .arg("--config")
        .arg(&rules.0)
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--metrics", "none"])
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tiered-ratelimit-rls");
    // It must exit by itself (a service that starts would serve for ever).
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("started instead of refusing to start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = strip_ansi(&String::from_utf8(out.stderr).unwrap());
    let text = std::fs::read_to_string(&rules.0).unwrap();
    let port = text
        .split("127.0.0.1:")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    // A refused connect is tried six times over about 0.5 s, within the
    // ping's 1 s, and then named.
    assert_eq!(
        lines[0],
        format!(
            "tiered-ratelimit-rls: failure_policy = \"closed\" and backend redis at \
             127.0.0.1:{port} unreachable: backend connection error: Connection refused (os error 111): refusing to start"
        ),
    );

    let rules = unreachable_rules("open");
    let (grpc, metrics) = (free_port(), free_port());
    let mut child = rls_command()
        .arg("--config")
        .arg(&rules.0)
        .args(["--listen", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics", &format!("127.0.0.1:{metrics}")])
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tiered-ratelimit-rls");
    let ch = ready(grpc).await;
    // Open: a call of a limited rule is answered OK, without limits.
    let r = RateLimitServiceClient::new(ch)
        .should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "remote_address".into(),
                    value: "192.0.2.1".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses.len(), 1);
    assert_eq!(r.statuses[0].current_limit, None);
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let text = std::fs::read_to_string(&rules.0).unwrap();
    let port = text
        .split("127.0.0.1:")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap();
    let all = strip_ansi(&format!("{stdout}{stderr}"));
    let warned: Vec<&str> = all
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains("unreachable"))
        .collect();
    assert_eq!(warned.len(), 1, "{all}");
    assert!(
        warned[0].ends_with(&format!(
            "backend redis at 127.0.0.1:{port} unreachable: backend connection error: Connection refused (os error 111): calls \
             are answered OK (failure_policy = \"open\") until it answers"
        )),
        "{all}"
    );
}

/// `text` without ANSI colour sequences (`ESC [ ... m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
