//! `tiered-ratelimit override set / list / remove` against a real Redis:
//! what the command sets is what the library reads.

#[path = "../../tests/support/redis_server.rs"]
#[allow(dead_code)]
mod redis_server;

use redis_server::RedisServer;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tiered-ratelimit");

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn sets_lists_and_removes_an_override_in_redis() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("trl-override-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(
        &policy,
        "backend_timeout_ms = 2000\n[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 3\nperiod = '1m'\noverrides = true\n",
    )
    .unwrap();
    let url = redis.url();
    let p = policy.to_str().unwrap();
    let base = ["-p", p, "--redis", url.as_str(), "--tier", "ip"];
    let with = |cmd: &str, more: &[&str]| {
        let mut a = vec!["override", cmd];
        a.extend_from_slice(&base);
        a.extend_from_slice(more);
        run(&a)
    };
    let (ok, out, err) = with("set", &["--key", "203.0.113.7", "--rule", "1000/1m"]);
    assert!(ok, "{err}");
    assert_eq!(out, "set ip 203.0.113.7: 1000/60000ms burst 1000\n");
    // The value the check script reads (no expiry; token bucket parameters).
    let v = redis.get("rl:ip:203.0.113.7{ov}").unwrap();
    assert!(v.starts_with("0 0 "), "{v}");
    assert!(v.ends_with(" 1000"), "{v}");
    let (ok, out, _) = with("list", &[]);
    assert!(ok);
    assert_eq!(out, "203.0.113.7\t1000/60000ms burst 1000\n");
    let (ok, _, err) = with(
        "set",
        &["--key", "198.51.100.1", "--rule", "blocked", "--ttl", "1h"],
    );
    assert!(ok, "{err}");
    // Set by another process on the real clock a moment ago: 1 h, less
    // what has passed since (under 10 s on any machine).
    let pttl = redis.pttl("rl:ip:198.51.100.1{ov}");
    assert!((3_590_000..=3_600_000).contains(&pttl), "{pttl}");
    let (ok, out, _) = with("remove", &["--key", "203.0.113.7"]);
    assert!(ok);
    assert_eq!(out, "removed ip 203.0.113.7\n");
    assert_eq!(redis.get("rl:ip:203.0.113.7{ov}"), None);
    let (ok, out, _) = with("list", &[]);
    assert!(ok);
    assert!(
        out.starts_with("198.51.100.1\tblocked\texpires_at_us="),
        "{out}"
    );
    // A key typed as people read it (as the admin page shows it) or as
    // stored: one key.
    let (ok, _, err) = with("set", &["--key", "GET /users/{id}", "--rule", "blocked"]);
    assert!(ok, "{err}");
    assert!(redis.get("rl:ip:GET%20/users/%7Bid%7D{ov}").is_some());
    let (ok, out, _) = with("remove", &["--key", "GET%20/users/%7Bid%7D"]);
    assert!(ok);
    assert_eq!(out, "removed ip GET%20/users/%7Bid%7D\n");
    assert_eq!(redis.get("rl:ip:GET%20/users/%7Bid%7D{ov}"), None);
    // Bad input names the field.
    let (ok, _, err) = with("set", &["--key", "x", "--rule", "often"]);
    assert!(!ok);
    assert!(err.contains("--rule \"often\""), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
