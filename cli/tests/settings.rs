//! `tiered-ratelimit quota` and `lists` against a real Redis: what the
//! command writes is what a layer built from the same policy applies.

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
fn sets_and_resets_quotas_and_lists_in_the_control_hash() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("trl-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(
        &policy,
        "backend_timeout_ms = 2000\n[control]\nredis_key = 'rl:control'\n\
         [[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 3\nperiod = '1m'\n\
         [tier.plans]\npro = { limit = 30, period = '1m' }\n\
         [[tier]]\nname = 'monthly'\nkey = { header = 'x-api-key' }\nlimit = 1000\nperiod = 'month'\n",
    )
    .unwrap();
    let url = redis.url();
    let p = policy.to_str().unwrap();
    let with = |cmd: &[&str], more: &[&str]| {
        let mut a = cmd.to_vec();
        a.extend_from_slice(&["-p", p, "--redis", url.as_str()]);
        a.extend_from_slice(more);
        run(&a)
    };
    let (ok, out, err) = with(
        &["quota", "set"],
        &[
            "--tier", "ip", "--limit", "10", "--period", "1m", "--by", "alice",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out, "settings version 1\n");
    let (ok, out, err) = with(
        &["quota", "set"],
        &["--tier", "monthly", "--limit", "5000", "--period", "month"],
    );
    assert!(ok, "{err}");
    assert_eq!(out, "settings version 2\n");
    let (ok, _, err) = with(
        &["quota", "set"],
        &["--tier", "ip", "--limit", "0", "--period", "1m"],
    );
    assert!(!ok);
    assert!(
        err.contains("limit: tier \"ip\": limit: must be greater than 0"),
        "{err}"
    );
    let (ok, _, err) = with(
        &["quota", "set"],
        &["--tier", "ip", "--limit", "5", "--period", "week"],
    );
    assert!(!ok);
    assert!(
        err.starts_with("tiered-ratelimit quota: period: \"week\" is a calendar period"),
        "{err}"
    );
    let (ok, out, err) = with(
        &["lists", "add"],
        &["--list", "deny", "--ip", "203.0.113.7", "--user", "mallory"],
    );
    assert!(ok, "{err}");
    assert_eq!(out, "settings version 3\n");
    let (ok, out, err) = with(&["quota", "reset"], &["--tier", "ip"]);
    assert!(ok, "{err}");
    assert_eq!(out, "settings version 4\n");
    let (ok, out, _) = with(&["lists", "show"], &[]);
    assert!(ok);
    assert_eq!(
        out,
        "{\"allow\":{},\"deny\":{\"ips\":[\"203.0.113.7/32\"],\"users\":[\"mallory\"]},\"settings_version\":4}\n"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&redis.cmd::<String>(&["HGET", "rl:control", "settings"])).unwrap();
    assert_eq!(
        doc,
        serde_json::json!({
            "tiers": {"monthly": {"quota": {"limit": 5000, "period": "month"}}},
            "deny": {"ips": ["203.0.113.7/32"], "users": ["mallory"]},
            "by": "cli",
        })
    );
    // Without a [control] key there is no fleet to write to.
    std::fs::write(
        &policy,
        "[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 3\nperiod = '1m'\n",
    )
    .unwrap();
    let (ok, _, err) = with(&["lists", "show"], &[]);
    assert!(!ok);
    assert!(err.contains("no [control] key"), "{err}");
}
