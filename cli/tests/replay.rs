//! `tiered-ratelimit replay`: a generated log replayed through the binary
//! and checked against an independent model of the limits; a golden JSON
//! report; the direct engine against the layer engine (a real axum Router)
//! request by request, for every algorithm, modes, lists and plans; inputs
//! (gzip, JSON lines, stdin, malformed lines); the chart.

// The workspace's one seeded generator (the root crate's test support).
#[allow(dead_code)]
#[path = "../../tests/support/rng.rs"]
mod rng;

use rng::Rng;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tiered_ratelimit::policy::Policy;
use tiered_ratelimit_cli::replay::{
    Admission, Engine, Input, LineOutcome, Modes, ReplayOptions, Replayer, Target,
};

const BIN: &str = env!("CARGO_BIN_EXE_tiered-ratelimit");
/// 2024-03-01T00:00:00Z.
const T0: u64 = 1_709_251_200;

// ---------------------------------------------------------------------------
// The generated log

/// One request of the generated log.
#[derive(Debug, Clone)]
struct Req {
    /// Seconds since T0.
    t: u64,
    ip: String,
    method: &'static str,
    path: String,
    user: Option<String>,
    key: Option<String>,
    status: u16,
}

const ABUSER: &str = "203.0.113.7";

/// Two hours of traffic: ~120 ordinary clients (a few busy, most quiet),
/// one abusive IP hammering for 20 minutes, and a 2-second burst from 40
/// addresses at t = 3600 s.
fn generate() -> Vec<Req> {
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    for t in 0..7200u64 {
        // Ordinary clients: 0-3 requests a second, skewed to low numbers.
        for _ in 0..rng.below(4) {
            let c = (rng.below(120) * rng.below(120)) / 120;
            let p = rng.below(100);
            let (method, path) = match p {
                0..=44 => ("GET", format!("/users/{}", rng.below(5000))),
                45..=64 => (
                    "GET",
                    format!("/items/{}?page={}", rng.below(300), rng.below(5)),
                ),
                65..=74 => ("POST", "/login".to_owned()),
                75..=89 => ("GET", "/".to_owned()),
                _ => ("GET", format!("/nope/{}", rng.below(50))),
            };
            out.push(Req {
                t,
                ip: format!("10.0.{}.{}", c / 250, c % 250 + 1),
                method,
                path,
                user: (rng.below(3) == 0).then(|| format!("user{}", rng.below(40))),
                key: (rng.below(5) == 0).then(|| format!("sk_live_{:04}", rng.below(30))),
                status: if rng.below(20) == 0 { 404 } else { 200 },
            });
        }
        // The abusive client: 3 requests a second for 20 minutes.
        if (1200..2400).contains(&t) {
            for _ in 0..3 {
                out.push(Req {
                    t,
                    ip: ABUSER.to_owned(),
                    method: "POST",
                    path: "/login".to_owned(),
                    user: None,
                    key: None,
                    status: 401,
                });
            }
        }
        // The burst: 40 addresses, 15 requests each, in each of 2 seconds.
        if t == 3600 || t == 3601 {
            for i in 1..=40 {
                for _ in 0..15 {
                    out.push(Req {
                        t,
                        ip: format!("198.51.100.{i}"),
                        method: "GET",
                        path: "/".to_owned(),
                        user: None,
                        key: None,
                        status: 200,
                    });
                }
            }
        }
    }
    out
}

fn clf_time(t: u64) -> String {
    // Two hours into 2024-03-01: the date never changes.
    format!(
        "01/Mar/2024:{:02}:{:02}:{:02} +0000",
        t / 3600,
        t % 3600 / 60,
        t % 60
    )
}

/// The combined format with the API key as one more quoted field.
fn combined(reqs: &[Req]) -> String {
    let mut s = String::new();
    for r in reqs {
        s.push_str(&format!(
            "{} - {} [{}] \"{} {} HTTP/1.1\" {} {} \"-\" \"test-agent/1.0\" \"{}\"\n",
            r.ip,
            r.user.as_deref().unwrap_or("-"),
            clf_time(r.t),
            r.method,
            r.path,
            r.status,
            100 + r.t % 900,
            r.key.as_deref().unwrap_or("-"),
        ));
    }
    s
}

fn jsonl(reqs: &[Req]) -> String {
    let mut s = String::new();
    for r in reqs {
        let mut o = serde_json::Map::new();
        o.insert("ts".into(), Value::from(T0 + r.t));
        o.insert(
            "client".into(),
            serde_json::json!({ "ip": r.ip, "port": 40000 }),
        );
        o.insert(
            "request".into(),
            Value::from(format!("{} {} HTTP/1.1", r.method, r.path)),
        );
        o.insert("status".into(), Value::from(r.status));
        if let Some(u) = &r.user {
            o.insert("user_id".into(), Value::from(u.clone()));
        }
        if let Some(k) = &r.key {
            o.insert("api_key".into(), Value::from(k.clone()));
        }
        s.push_str(&Value::Object(o).to_string());
        s.push('\n');
    }
    s
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "tiered-ratelimit-replay-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    fn file(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, contents).unwrap();
        p
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary; returns stdout (asserting success).
fn run(dir: &Path, args: &[&str], stdin: Option<&[u8]>) -> String {
    let mut child = Command::new(BIN)
        .arg("replay")
        .args(args)
        .current_dir(dir)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the binary");
    if let Some(input) = stdin {
        let mut s = child.stdin.take().unwrap();
        s.write_all(input).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "replay {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(dir: &Path, args: &[&str]) -> Value {
    let out = run(dir, args, None);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn tier<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tier {name}"))
}

// ---------------------------------------------------------------------------
// The independent model: a per-IP token bucket and a global fixed window,
// all or nothing, the binding tier being the denying one with the longest
// wait (the first on a tie). Written from the documented semantics, in
// token·microsecond units rather than the crate's reduced integer units.

const IP_LIMIT: u128 = 60; // per minute, burst 60
const IP_PERIOD_US: u128 = 60_000_000;
const GLOBAL_LIMIT: u64 = 40; // per second, fixed window
const SIMPLE_POLICY: &str = r#"
[[tier]]
name = "ip"
key = "ip"
limit = 60
period = "1m"

[[tier]]
name = "global"
key = "global"
limit = 40
period = "1s"
algorithm = "fixed_window"
"#;

#[derive(Default, Debug)]
struct Expected {
    requests: u64,
    rejected: u64,
    by_tier: BTreeMap<&'static str, u64>,
    /// Per tier, per key: (rejected, requests from the first 429 on).
    keys: BTreeMap<&'static str, HashMap<String, (u64, u64)>>,
    /// Per tier: 429s per minute (minute index from T0).
    minutes: BTreeMap<&'static str, BTreeMap<u64, u64>>,
    all_minutes: BTreeMap<u64, u64>,
}

fn model(reqs: &[Req]) -> Expected {
    // Bucket level in token·µs, capacity 60 tokens.
    let cap = IP_LIMIT * IP_PERIOD_US;
    let mut buckets: HashMap<&str, (u128, u128)> = HashMap::new(); // ip -> (level, at_us)
    let mut window: (u64, u64) = (u64::MAX, 0); // (second, count)
    let mut e = Expected::default();
    for r in reqs {
        let now = u128::from(r.t) * 1_000_000;
        e.requests += 1;
        let (level, at) = buckets.get(r.ip.as_str()).copied().unwrap_or((cap, now));
        let level = (level + (now - at) * IP_LIMIT).min(cap);
        let ip_ok = level >= IP_PERIOD_US;
        let count = if window.0 == r.t { window.1 } else { 0 };
        let global_ok = count < GLOBAL_LIMIT;
        for (tier, key) in [("ip", r.ip.clone()), ("global", "all".to_owned())] {
            if let Some(k) = e.keys.entry(tier).or_default().get_mut(&key) {
                k.1 += 1;
            }
        }
        if ip_ok && global_ok {
            buckets.insert(&r.ip, (level - IP_PERIOD_US, now));
            window = (r.t, count + 1);
            continue;
        }
        let ip_wait = (!ip_ok).then(|| (IP_PERIOD_US - level).div_ceil(IP_LIMIT));
        let global_wait = (!global_ok).then_some(1_000_000u128); // whole seconds
        let tier = match (ip_wait, global_wait) {
            (Some(a), Some(b)) if b > a => "global",
            (Some(_), _) => "ip",
            _ => "global",
        };
        let key = if tier == "ip" {
            r.ip.clone()
        } else {
            "all".to_owned()
        };
        e.rejected += 1;
        *e.by_tier.entry(tier).or_default() += 1;
        e.keys
            .entry(tier)
            .or_default()
            .entry(key)
            .and_modify(|k| k.0 += 1)
            .or_insert((1, 1));
        *e.minutes
            .entry(tier)
            .or_default()
            .entry(r.t / 60)
            .or_default() += 1;
        *e.all_minutes.entry(r.t / 60).or_default() += 1;
    }
    e
}

fn minute_name(m: u64) -> String {
    format!("2024-03-01T{:02}:{:02}Z", m / 60, m % 60)
}

fn peak(m: &BTreeMap<u64, u64>) -> Option<(String, u64)> {
    let mut best: Option<(u64, u64)> = None;
    for (&k, &v) in m {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((k, v));
        }
    }
    best.map(|(k, v)| (minute_name(k), v))
}

#[test]
fn report_matches_an_independent_model() {
    let reqs = generate();
    let e = model(&reqs);
    // The scenario exercises what it should.
    assert!(e.by_tier["ip"] > 1000, "{e:?}");
    assert!(e.by_tier["global"] > 100, "{e:?}");

    let dir = TempDir::new("model");
    dir.file("policy.toml", SIMPLE_POLICY);
    dir.file("access.log", combined(&reqs));
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);

    assert_eq!(r["input"]["lines"], reqs.len() as u64);
    assert_eq!(r["input"]["malformed"], 0);
    assert_eq!(r["totals"]["requests"], e.requests);
    assert_eq!(r["totals"]["rejected"], e.rejected);
    assert_eq!(r["totals"]["allowed"], e.requests - e.rejected);
    for name in ["ip", "global"] {
        let t = tier(&r, name);
        assert_eq!(t["requests"], e.requests, "{name}");
        assert_eq!(t["rejected"], e.by_tier[name], "{name}");
        assert_eq!(
            t["distinct_keys_blocked"],
            e.keys[name].len() as u64,
            "{name}"
        );
        let (minute, n) = peak(&e.minutes[name]).unwrap();
        assert_eq!(t["peak_minute"]["minute"], minute.as_str(), "{name}");
        assert_eq!(t["peak_minute"]["rejected"], n, "{name}");
        // The top keys, in order, with their counts.
        let mut keys: Vec<(&String, &(u64, u64))> = e.keys[name].iter().collect();
        keys.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(b.0)));
        let top = t["top_blocked_keys"].as_array().unwrap();
        assert_eq!(top.len(), keys.len().min(10));
        for (got, (key, (rejected, since))) in top.iter().zip(keys) {
            assert_eq!(got["key"], key.as_str());
            assert_eq!(got["rejected"], *rejected);
            assert_eq!(got["requests_since_first_429"], *since);
        }
    }
    // The abusive IP is the top blocked key of the ip tier; the burst binds
    // on the global tier, at 01:00.
    assert_eq!(tier(&r, "ip")["top_blocked_keys"][0]["key"], ABUSER);
    assert_eq!(
        tier(&r, "global")["peak_minute"]["minute"],
        "2024-03-01T01:00Z"
    );
    let (minute, n) = peak(&e.all_minutes).unwrap();
    assert_eq!(r["peak_minute"]["minute"], minute.as_str());
    assert_eq!(r["peak_minute"]["rejected"], n);
    assert_eq!(r["input"]["first"], "2024-03-01T00:00:00Z");
    let span = reqs.last().unwrap().t - reqs[0].t;
    #[allow(clippy::cast_precision_loss)]
    let span = span as f64;
    assert_eq!(r["input"]["span_seconds"], span);
}

#[test]
fn the_same_report_from_gzip_json_lines_and_stdin() {
    let reqs = generate();
    let dir = TempDir::new("inputs");
    dir.file("policy.toml", SIMPLE_POLICY);
    let text = combined(&reqs);
    dir.file("access.log", &text);
    let base = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);

    // gzip, detected by its magic bytes (the name does not say so), split
    // in two members as logrotate + cat makes.
    let half = text.len() / 2;
    let cut = text[..half].rfind('\n').unwrap() + 1;
    let mut gz = Vec::new();
    for part in [&text[..cut], &text[cut..]] {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(part.as_bytes()).unwrap();
        gz.extend(enc.finish().unwrap());
    }
    dir.file("access.log.1", &gz);
    let from_gz = json(
        &dir.0,
        &["-p", "policy.toml", "--json", "-q", "access.log.1"],
    );
    assert_eq!(from_gz, base);

    // stdin
    let out = run(
        &dir.0,
        &["-p", "policy.toml", "--json", "-q", "-"],
        Some(text.as_bytes()),
    );
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), base);

    // JSON lines with other field names (nested ip, epoch seconds, a whole
    // request line, the API key as a header).
    dir.file("app.jsonl", jsonl(&reqs));
    let from_json = json(
        &dir.0,
        &[
            "-p",
            "policy.toml",
            "--json",
            "-q",
            "--field",
            "time=ts",
            "--field",
            "ip=client.ip",
            "--field",
            "user=user_id",
            "--field",
            "header:x-api-key=api_key",
            "app.jsonl",
        ],
    );
    assert_eq!(from_json["totals"], base["totals"]);
    assert_eq!(from_json["tiers"], base["tiers"]);
    assert_eq!(from_json["timeline"], base["timeline"]);
}

#[test]
fn malformed_lines_are_counted_with_line_numbers_and_never_abort() {
    let dir = TempDir::new("malformed");
    dir.file("policy.toml", SIMPLE_POLICY);
    let good = |t: u64| {
        format!(
            "192.0.2.1 - - [{}] \"GET / HTTP/1.1\" 200 5 \"-\" \"ua\"\n",
            clf_time(t)
        )
    };
    let mut log = String::new();
    log.push_str(&good(0));
    log.push_str("this is not a log line\n"); // 2
    log.push('\n'); // 3: empty, not counted
    log.push_str(&good(1));
    log.push_str("host.example - - [01/Mar/2024:00:00:02 +0000] \"GET / HTTP/1.1\" 200 1\n"); // 5
    log.push_str("192.0.2.1 - - [01/Mar/2024:00:00:02 +0000] \"-\" 400 0 \"-\" \"-\"\n"); // 6
    log.push_str(
        "192.0.2.1 - - [01/Mar/2024:00:00:02 +0000] \"\\x16\\x03\\x01\" 400 0 \"-\" \"-\"\n",
    ); // 7
    log.push_str("192.0.2.1 - - [31/Feb/2024:99:00:02 +0000] \"GET / HTTP/1.1\" 200 1\n"); // 8
    log.push_str(&good(3)); // 9
    log.push_str("192.0.2.1 - - [01/Mar/2024:00:00:02 +0000] \"GET /a b HTTP/1.1\" 200 1\r\n"); // 10
    log.push_str(&good(4).replace('\n', "")); // 11, no final newline
    dir.file("access.log", &log);
    // A second input that is named .gz but is not gzip, then a good one:
    // the error is recorded and the run goes on.
    dir.file("broken.gz", "not gzip at all\n");
    dir.file("more.log", good(5));
    let r = json(
        &dir.0,
        &[
            "-p",
            "policy.toml",
            "--json",
            "-q",
            "access.log",
            "broken.gz",
            "more.log",
        ],
    );
    let i = &r["input"];
    assert_eq!(i["lines"], 11, "{i}");
    assert_eq!(r["totals"]["requests"], 5, "{i}");
    assert_eq!(i["malformed"], 3, "{i}");
    assert_eq!(i["unreplayable"], 3, "{i}");
    assert_eq!(i["first_malformed"]["input"], "access.log", "{i}");
    assert_eq!(i["first_malformed"]["line"], 2, "{i}");
    let lines: Vec<(String, u64)> = i["examples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["input"].as_str().unwrap().to_owned(),
                e["line"].as_u64().unwrap(),
            )
        })
        .collect();
    let expect: Vec<(String, u64)> = [2, 5, 6, 7, 8, 10]
        .into_iter()
        .map(|l| ("access.log".to_owned(), l))
        .collect();
    assert_eq!(lines, expect);
    assert_eq!(i["errors"][0]["input"], "broken.gz");
    assert!(i["errors"][0]["reason"]
        .as_str()
        .unwrap()
        .contains("not gzip"));
    // The text report lists them too.
    let text = run(&dir.0, &["-p", "policy.toml", "-q", "access.log"], None);
    assert!(text.contains("access.log:2: "), "{text}");
    assert!(text.contains("Lines not replayed (6 of 10"), "{text}");
}

/// The first malformed line's number is reported even when unreplayable
/// lines come before it, in the JSON report and in the text report; a clean
/// log reports `null`.
#[test]
fn first_malformed_line_number_in_json_and_text() {
    let dir = TempDir::new("first_malformed");
    dir.file("policy.toml", SIMPLE_POLICY);
    let good = |t: u64| {
        format!(
            "192.0.2.1 - - [{}] \"GET / HTTP/1.1\" 200 5 \"-\" \"ua\"\n",
            clf_time(t)
        )
    };
    let mut log = String::new();
    log.push_str(&good(0)); // 1
    log.push_str("192.0.2.1 - - [01/Mar/2024:00:00:01 +0000] \"-\" 400 0 \"-\" \"-\"\n"); // 2: unreplayable
    log.push_str(&good(2)); // 3
    log.push_str("not a log line at all\n"); // 4: malformed
    log.push_str("nor this one\n"); // 5: malformed
    dir.file("access.log", &log);
    dir.file("clean.log", good(0));
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);
    let i = &r["input"];
    assert_eq!(i["malformed"], 2, "{i}");
    assert_eq!(i["unreplayable"], 1, "{i}");
    assert_eq!(i["examples"][0]["line"], 2, "{i}");
    assert_eq!(i["first_malformed"]["input"], "access.log", "{i}");
    assert_eq!(i["first_malformed"]["line"], 4, "{i}");
    let reason = i["first_malformed"]["reason"].as_str().unwrap().to_owned();
    assert!(!reason.is_empty());
    let text = run(&dir.0, &["-p", "policy.toml", "-q", "access.log"], None);
    assert!(
        text.contains(&format!("First malformed line: access.log:4: {reason}\n")),
        "{text}"
    );
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "clean.log"]);
    assert!(r["input"]["first_malformed"].is_null(), "{}", r["input"]);
    let text = run(&dir.0, &["-p", "policy.toml", "-q", "clean.log"], None);
    assert!(!text.contains("First malformed line"), "{text}");
}

#[test]
fn out_of_order_lines_replay_at_the_latest_time() {
    let dir = TempDir::new("order");
    dir.file(
        "policy.toml",
        "[[tier]]\nname='ip'\nkey='ip'\nlimit=1\nperiod='10s'\n",
    );
    let line = |t: u64| format!("192.0.2.1 - - [{}] \"GET / HTTP/1.1\" 200 5\n", clf_time(t));
    // 10 s, then a line 8 s back: replayed at 10 s, so denied.
    let log = format!("{}{}{}", line(0), line(10), line(2));
    dir.file("access.log", log);
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);
    assert_eq!(r["input"]["out_of_order"], 1);
    assert_eq!(r["input"]["max_step_back_seconds"], 8.0);
    assert_eq!(r["totals"]["rejected"], 1);
}

// ---------------------------------------------------------------------------
// The golden report

const GOLDEN_POLICY: &str = r#"
[client_ip]
trusted_proxies = ["10.9.0.0/16"]

[allowlist]
ips = ["10.0.0.5"]

[[tier]]
name = "ip"
key = "ip"
limit = 90
period = "1m"
burst = 120

[[tier]]
name = "user"
key = "user"
limit = 6
period = "10m"
algorithm = "sliding_window_counter"

[[tier]]
name = "api_key"
key = { header = "x-api-key" }
limit = 6
period = "10m"
algorithm = "sliding_window_log"

[[tier]]
name = "login"
key = "endpoint"
limit = 30
period = "10s"
algorithm = "fixed_window"
methods = ["POST"]

[[tier]]
name = "global"
key = "global"
limit = 30
period = "1s"
burst = 60
algorithm = "leaky_bucket"
"#;

#[test]
fn golden_report() {
    let reqs = generate();
    let dir = TempDir::new("golden");
    dir.file("policy.toml", GOLDEN_POLICY);
    dir.file("access.log", combined(&reqs));
    let args = [
        "-p",
        "policy.toml",
        "--json",
        "-q",
        "--route",
        "/users/{id}",
        "--route",
        "/items/{id}",
        "--route",
        "/login",
        "--route",
        "/",
        "--extra-field",
        "header:x-api-key",
        "--top",
        "3",
        "access.log",
    ];
    let got = json(&dir.0, &args);
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/replay_report.json");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        let mut s = serde_json::to_string_pretty(&got).unwrap();
        s.push('\n');
        std::fs::write(&golden, s).unwrap();
    }
    let want: Value = serde_json::from_str(
        &std::fs::read_to_string(&golden)
            .expect("tests/golden/replay_report.json (UPDATE_GOLDEN=1 writes it)"),
    )
    .unwrap();
    assert_eq!(
        got, want,
        "the report changed; if that is intended, rerun with UPDATE_GOLDEN=1 and review the diff"
    );
    // The same with the layer engine (a real axum Router per request).
    let mut layer_args = args.to_vec();
    layer_args.extend(["--engine", "layer"]);
    let mut via_layer = json(&dir.0, &layer_args);
    assert_eq!(via_layer["engine"], "layer");
    via_layer["engine"] = want["engine"].clone();
    // Only the direct engine tells shadow-limited counts per tier.
    for t in via_layer["tiers"].as_array_mut().unwrap() {
        t["shadow_limited"] = Value::from(0);
    }
    assert_eq!(via_layer, want);
}

// ---------------------------------------------------------------------------
// The direct engine decides exactly as the layer, request by request.

fn replay_all(policy: &str, engine: Engine, modes: Modes, lines: &[String]) -> Vec<LineOutcome> {
    let policy = Policy::from_toml_str(policy).unwrap();
    let mut options = ReplayOptions::default();
    options.engine = engine;
    options.modes = modes;
    options.routes = vec![
        "/users/{id}".into(),
        "/items/{id}".into(),
        "/login".into(),
        "/".into(),
    ];
    options.extra_fields = vec![
        Target::Header(http::HeaderName::from_static("x-api-key")),
        Target::Plan,
    ];
    let mut r = Replayer::new(&policy, options).unwrap();
    r.start_input("generated");
    lines
        .iter()
        .map(|l| r.replay_line(l.as_bytes()).unwrap())
        .collect()
}

fn agree(name: &str, policy: &str, modes: Modes, lines: &[String]) {
    let direct = replay_all(policy, Engine::Direct, modes, lines);
    let layer = replay_all(policy, Engine::Layer, modes, lines);
    let mut rejected = 0;
    for (i, (d, l)) in direct.iter().zip(&layer).enumerate() {
        assert_eq!(d, l, "{name}: line {} ({})", i + 1, lines[i]);
        if matches!(d, LineOutcome::Replayed(Admission::Rejected { .. })) {
            rejected += 1;
        }
    }
    assert!(rejected > 0, "{name}: the scenario rejects nothing");
}

/// Log lines with a plan as one more field (`free` / `pro`), and a few
/// lines arriving through a trusted proxy with X-Forwarded-For.
fn lines_with_plans(reqs: &[Req]) -> Vec<String> {
    combined(reqs)
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let plan = if i % 3 == 0 { "pro" } else { "free" };
            format!("{l} \"{plan}\"")
        })
        .collect()
}

#[test]
fn direct_engine_decides_as_the_layer_for_every_algorithm() {
    // Every 7th request only, to keep the layer engine quick.
    let reqs: Vec<Req> = generate().into_iter().step_by(7).collect();
    let lines = lines_with_plans(&reqs);
    for algorithm in [
        "token_bucket",
        "fixed_window",
        "sliding_window_log",
        "sliding_window_counter",
        "leaky_bucket",
    ] {
        let policy = format!(
            r#"
            [[tier]]
            name = "ip"
            key = "ip"
            limit = 20
            period = "1m"
            algorithm = "{algorithm}"
            [[tier]]
            name = "endpoint"
            key = "endpoint"
            limit = 12
            period = "10s"
            algorithm = "{algorithm}"
            [[tier]]
            name = "global"
            key = "global"
            limit = 5
            period = "1s"
            algorithm = "{algorithm}"
            "#
        );
        agree(algorithm, &policy, Modes::Enforce, &lines);
    }
    // Shaping: delayed requests pass.
    let shape = r#"
        [[tier]]
        name = "ip"
        key = "ip"
        limit = 10
        period = "1m"
        algorithm = "leaky_bucket_shape"
        max_delay = "3s"
        [[tier]]
        name = "global"
        key = "global"
        limit = 6
        period = "1s"
        burst = 8
    "#;
    agree("shape", shape, Modes::Enforce, &lines);
    let direct = replay_all(shape, Engine::Direct, Modes::Enforce, &lines);
    assert!(direct.iter().any(|o| matches!(
        o,
        LineOutcome::Replayed(Admission::Allowed { delayed: true, .. })
    )));
}

#[test]
fn direct_engine_decides_as_the_layer_with_lists_plans_methods_costs_and_modes() {
    let reqs: Vec<Req> = generate().into_iter().step_by(5).collect();
    let lines = lines_with_plans(&reqs);
    let policy = r#"
        [allowlist]
        ips = ["10.0.0.1", "10.0.0.2"]
        [denylist]
        ips = ["198.51.100.7"]
        users = ["user13"]
        status = 429

        [[tier]]
        name = "ip"
        key = "ip"
        limit = 30
        period = "1m"
        mode = "canary"
        canary_percent = 50

        [[tier]]
        name = "user"
        key = "user"
        limit = 4
        period = "1m"
        cost = 2
        burst = 6
        [tier.plans.pro]
        limit = 40
        period = "1m"

        [[tier]]
        name = "key"
        key = { header = "x-api-key" }
        limit = 1
        period = "10m"
        mode = "shadow"

        [[tier]]
        name = "login"
        key = "endpoint"
        limit = 3
        period = "10s"
        methods = ["POST"]
        algorithm = "sliding_window_log"

        [[tier]]
        name = "off"
        key = "global"
        limit = 1
        period = "1h"
        mode = "off"
    "#;
    agree("enforce", policy, Modes::Enforce, &lines);
    agree("as-configured", policy, Modes::AsConfigured, &lines);
    let outcomes = replay_all(policy, Engine::Direct, Modes::AsConfigured, &lines);
    let count = |f: &dyn Fn(&Admission) -> bool| {
        outcomes
            .iter()
            .filter(|o| matches!(o, LineOutcome::Replayed(d) if f(d)))
            .count()
    };
    assert!(count(&|d| matches!(d, Admission::Allowlisted)) > 0);
    assert!(count(&|d| matches!(d, Admission::Denylisted)) > 0);
    assert!(
        count(&|d| matches!(
            d,
            Admission::Allowed {
                shadow_limited: true,
                ..
            }
        )) > 0
    );
    // The `off` tier never rejects, even with every tier enforced.
    let enforced = replay_all(policy, Engine::Direct, Modes::Enforce, &lines);
    assert!(!enforced.iter().any(
        |o| matches!(o, LineOutcome::Replayed(Admission::Rejected { tier }) if &**tier == "off")
    ));
}

// ---------------------------------------------------------------------------
// The chart

#[test]
fn plots_render_as_svg_and_png() {
    let reqs = generate();
    let dir = TempDir::new("plot");
    dir.file("policy.toml", SIMPLE_POLICY);
    dir.file("access.log", combined(&reqs));
    run(
        &dir.0,
        &["-p", "policy.toml", "-q", "--plot", "out.svg", "access.log"],
        None,
    );
    let svg = std::fs::read_to_string(dir.0.join("out.svg")).unwrap();
    // The root element is <svg> with the chart's size, closed at the end,
    // with one polyline per tier plus the total.
    let root = svg.trim_start().trim_start_matches(|c| c != '<');
    assert!(root.starts_with("<svg "), "{}", &svg[..200.min(svg.len())]);
    assert!(root.contains("width=\"1200\"") && root.contains("height=\"640\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    // A line and a legend entry per tier (in the palette's first colours)
    // and for all requests (grey).
    for stroke in ["stroke=\"#1F77B4\"", "stroke=\"#D62728\""] {
        let lines = svg
            .matches("<polyline")
            .zip(svg.split("<polyline").skip(1))
            .filter(|(_, rest)| rest.split('>').next().unwrap_or("").contains(stroke))
            .count();
        assert_eq!(lines, 2, "{stroke}");
    }
    assert!(svg.contains("<polyline fill=\"none\" opacity=\"0.6\" stroke=\"#000000\""));
    let texts: Vec<&str> = svg
        .split("<text")
        .skip(1)
        .filter_map(|t| t.split_once('>').and_then(|(_, r)| r.split_once("</text>")))
        .map(|(t, _)| t.trim())
        .collect();
    for label in ["ip", "global", "all requests", "time (UTC)"] {
        assert!(texts.contains(&label), "{label}: {texts:?}");
    }
    assert_eq!(svg.matches("<svg").count(), 1);
    // The legend never covers the data: its entries sit in a strip below
    // the x axis's title (itself below the plot), not in the plot area.
    let y_of = |label: &str| -> f64 {
        svg.split("<text")
            .skip(1)
            .find(|t| {
                t.split_once('>')
                    .and_then(|(_, r)| r.split_once("</text>"))
                    .is_some_and(|(t, _)| t.trim() == label)
            })
            .and_then(|t| t.split(" y=\"").nth(1))
            .and_then(|y| y.split('"').next())
            .and_then(|y| y.parse().ok())
            .unwrap_or_else(|| panic!("no y for {label}"))
    };
    let axis = y_of("time (UTC)");
    for label in ["ip", "global", "all requests"] {
        assert!(
            y_of(label) > axis,
            "{label} at y {} above the axis title at {axis}",
            y_of(label)
        );
    }

    run(
        &dir.0,
        &["-p", "policy.toml", "-q", "--plot", "out.png", "access.log"],
        None,
    );
    let png = std::fs::read(dir.0.join("out.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    assert_eq!(u32::from_be_bytes(png[16..20].try_into().unwrap()), 1200);
    assert_eq!(u32::from_be_bytes(png[20..24].try_into().unwrap()), 640);

    // An unknown extension is an error, not a silent success.
    let out = Command::new(BIN)
        .args([
            "replay",
            "-p",
            "policy.toml",
            "-q",
            "--plot",
            "out.gif",
            "access.log",
        ])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(".svg or .png"));
}

#[test]
fn bad_routes_and_policies_are_reported() {
    let dir = TempDir::new("errors");
    dir.file("policy.toml", SIMPLE_POLICY);
    dir.file("access.log", "");
    for (routes, msg) in [
        (&["/users/:id"][..], "`{name}`"),
        (&["users"][..], "start with"),
        (&["/a/{x}", "/a/{y}"][..], "conflict"),
    ] {
        let mut args = vec!["replay", "-p", "policy.toml"];
        for r in routes {
            args.extend(["--route", r]);
        }
        args.push("access.log");
        let out = Command::new(BIN)
            .args(&args)
            .current_dir(&dir.0)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{routes:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(msg), "{routes:?}: {err}");
    }
    dir.file(
        "bad.toml",
        "[[tier]]\nname='a'\nkey='ip'\nlimit=1\nperiod='1s'\nburts=2\n",
    );
    let out = Command::new(BIN)
        .args(["replay", "-p", "bad.toml", "access.log"])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("burts"));
    // An empty log is a valid, empty report.
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);
    assert_eq!(r["totals"]["requests"], 0);
    assert!(r["peak_minute"].is_null());
}

#[test]
fn input_from_arg() {
    assert_eq!(Input::from_arg("-"), Input::Stdin);
    assert_eq!(Input::from_arg("a.log").name(), "a.log");
}

/// Inputs a review threw at the replay: a line over 16 MiB (skipped to its
/// newline, counted once, nothing inside it replayed), a timestamp from
/// the far future (malformed, not moving the clock for the lines after
/// it), an impossible date, JSON lines behind a byte order mark or a
/// partial first line (detected as JSON anyway).
#[test]
fn hostile_lines_are_counted_not_replayed() {
    let dir = TempDir::new("hostile");
    dir.file("policy.toml", SIMPLE_POLICY);
    let good = |t: u64, ip: &str| {
        format!(
            "{ip} - - [{}] \"GET / HTTP/1.1\" 200 5 \"-\" \"ua\"\n",
            clf_time(t)
        )
    };
    let mut log = good(0, "192.0.2.1").into_bytes();
    // 17 MiB of padding whose last bytes look like a whole request line.
    let mut long = vec![b'x'; 17 << 20];
    long.extend_from_slice(good(1, "6.6.6.6").trim_end().as_bytes());
    long.push(b'\n');
    log.extend_from_slice(&long); // 2
    log.extend_from_slice(good(2, "192.0.2.1").as_bytes()); // 3
    log.extend_from_slice(
        b"198.18.0.1 - - [01/Jan/9999:00:00:00 +0000] \"GET / HTTP/1.1\" 200 1 \"-\" \"x\"\n",
    ); // 4
    log.extend_from_slice(
        b"198.18.0.1 - - [31/Feb/2024:00:00:00 +0000] \"GET / HTTP/1.1\" 200 1 \"-\" \"x\"\n",
    ); // 5
    log.extend_from_slice(good(3, "192.0.2.2").as_bytes()); // 6
    dir.file("access.log", &log);
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);
    let i = &r["input"];
    assert_eq!(i["lines"], 6, "{i}");
    assert_eq!(i["malformed"], 3, "{i}");
    assert_eq!(r["totals"]["requests"], 3, "{i}");
    let examples: Vec<(u64, String)> = i["examples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["line"].as_u64().unwrap(),
                e["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(examples[0], (2, "line longer than 16 MiB (skipped)".into()));
    assert_eq!(
        examples[1],
        (4, "timestamp more than a day in the future".into())
    );
    assert_eq!(examples[2].0, 5);
    // The clock did not jump to 9999: the log spans 3 s, in order.
    assert_eq!(i["out_of_order"], 0, "{i}");
    assert_eq!(i["span_seconds"], 3.0, "{i}");

    // JSON lines behind a byte order mark, and after a partial line.
    let jl = |t: u64| {
        format!(
            "{{\"time\":\"{}\",\"remote_addr\":\"192.0.2.9\",\"method\":\"GET\",\"path\":\"/\"}}\n",
            clf_time(t)
        )
    };
    let mut bom = b"\xEF\xBB\xBF".to_vec();
    bom.extend_from_slice((jl(0) + &jl(1)).as_bytes());
    dir.file("bom.jsonl", &bom);
    dir.file("partial.jsonl", format!("th\":\"/\"}}\n{}{}", jl(0), jl(1)));
    for (file, requests) in [("bom.jsonl", 2), ("partial.jsonl", 2)] {
        let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", file]);
        assert_eq!(r["totals"]["requests"], requests, "{file}: {}", r["input"]);
    }
}

/// A chart that cannot be written fails before the replay, naming the
/// flag; a run in which no input could be read exits non-zero.
#[test]
fn unwritable_plot_and_unreadable_inputs_fail_the_run() {
    let dir = TempDir::new("failing");
    dir.file("policy.toml", SIMPLE_POLICY);
    dir.file(
        "access.log",
        "192.0.2.1 - - [01/Mar/2024:00:00:00 +0000] \"GET / HTTP/1.1\" 200 5\n",
    );
    let out = Command::new(BIN)
        .args([
            "replay",
            "-p",
            "policy.toml",
            "--plot",
            "no/such/dir/x.svg",
            "access.log",
        ])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--plot no/such/dir/x.svg"), "{err}");
    let out = Command::new(BIN)
        .args(["replay", "-p", "policy.toml", "-q", "missing.log"])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert!(!out.status.success());
    // The report still says why.
    assert!(String::from_utf8_lossy(&out.stdout).contains("missing.log"));
}

// ---------------------------------------------------------------------------
// The sample docs/replay.md ships and the one command it gives to replay it.

/// The replay command's arguments (after `replay`) as docs/replay.md gives
/// them for the shipped sample: the first line of a code block that names
/// `docs/samples/access.log`.
fn documented_sample_command(replay_md: &str) -> Vec<String> {
    let line = replay_md
        .lines()
        .find(|l| l.contains("replay") && l.contains("docs/samples/access.log"))
        .expect("docs/replay.md gives a command that replays docs/samples/access.log");
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "replay")
        .expect("`replay` in the command");
    words[at + 1..].iter().map(|w| (*w).to_owned()).collect()
}

#[test]
fn the_shipped_sample_replays_as_documented() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/replay.md")).unwrap();
    let args = documented_sample_command(&doc);
    assert_eq!(
        args,
        [
            "-p",
            "docs/samples/policy.toml",
            "--routes-file",
            "docs/samples/routes.txt",
            "docs/samples/access.log"
        ]
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    // The text report, as the command prints it from the repository's root.
    let text = run(&root, &args, None);
    assert!(
        text.contains("Would be rejected (429): 174 (36.55%)"),
        "{text}"
    );

    // The same run's numbers, exactly (five minutes, 476 lines: an address
    // hammering POST /login, bob's script over the user tier).
    let mut with_json = args.clone();
    with_json.extend(["--json", "-q"]);
    let report = json(&root, &with_json);
    assert_eq!(report["input"]["lines"], 476);
    assert_eq!(report["input"]["replayed"], 476);
    assert_eq!(report["input"]["malformed"], 0);
    assert_eq!(report["input"]["unreplayable"], 0);
    assert_eq!(report["totals"]["allowed"], 302);
    assert_eq!(report["totals"]["rejected"], 174);
    for (name, requests, rejected, top) in [
        ("ip", 476, 97, "203.0.113.7"),
        ("user", 126, 22, "bob"),
        ("login", 198, 55, "POST /login"),
    ] {
        let t = tier(&report, name);
        assert_eq!(t["requests"], requests, "{name}");
        assert_eq!(t["rejected"], rejected, "{name}");
        assert_eq!(t["distinct_keys_blocked"], 1, "{name}");
        assert_eq!(t["top_blocked_keys"][0]["key"], top, "{name}");
    }
    assert_eq!(report["peak_minute"]["minute"], "2024-03-04T14:02Z");
    assert_eq!(report["peak_minute"]["rejected"], 90);
}

// ---------------------------------------------------------------------------
// Candidate quotas: the report of a policy's candidates equals, for each,
// the report of a replay with it as the tier's quota.

/// The generated log through a one-tier policy with three candidates; then
/// once per candidate through the same tier with the candidate as its
/// quota: each candidate's `requests`, `would_deny` and `keys_denied` are
/// that replay's `requests`, `rejected` and `distinct_keys_blocked`, and
/// the live quota's those of the first replay (docs/rollout.md,
/// "Candidate quotas").
#[test]
fn candidates_agree_with_replays_of_their_quotas() {
    let reqs = generate();
    let dir = TempDir::new("candidates");
    dir.file("access.log", combined(&reqs));
    let tier_toml = |quota: &str, extra: &str| {
        format!("[[tier]]\nname = \"ip\"\nkey = \"ip\"\n{quota}\n{extra}\n")
    };
    let quotas = [
        ("30/1m", "limit = 30\nperiod = \"1m\""),
        ("120/1m", "limit = 120\nperiod = \"1m\""),
        ("40/1m,burst=80", "limit = 40\nperiod = \"1m\"\nburst = 80"),
    ];
    dir.file(
        "policy.toml",
        tier_toml(
            "limit = 60\nperiod = \"1m\"",
            "candidates = [{ limit = 30, period = \"1m\" }, { limit = 120, period = \"1m\" }, { limit = 40, period = \"1m\", burst = 80 }]",
        ),
    );
    let r = json(&dir.0, &["-p", "policy.toml", "--json", "-q", "access.log"]);
    let report = &r["candidates"][0];
    assert_eq!(report["tier"], "ip");
    assert_eq!(report["window_secs"], 0);
    let live = tier(&r, "ip");
    assert_eq!(report["live"]["quota"], "60/1m");
    assert_eq!(report["live"]["requests"], live["requests"]);
    assert_eq!(report["live"]["would_deny"], live["rejected"]);
    assert_eq!(report["live"]["keys_denied"], live["distinct_keys_blocked"]);
    let mut denied = Vec::new();
    for (j, (label, quota)) in quotas.iter().enumerate() {
        dir.file(&format!("policy{j}.toml"), tier_toml(quota, ""));
        let alone = json(
            &dir.0,
            &[
                "-p",
                &format!("policy{j}.toml"),
                "--json",
                "-q",
                "access.log",
            ],
        );
        let t = tier(&alone, "ip");
        let c = &report["candidates"][j];
        assert_eq!(c["quota"], *label);
        assert_eq!(c["requests"], t["requests"], "{label}");
        assert_eq!(c["would_deny"], t["rejected"], "{label}");
        assert_eq!(c["keys_denied"], t["distinct_keys_blocked"], "{label}");
        denied.push(c["would_deny"].as_u64().unwrap());
    }
    // The scenario tells the quotas apart.
    assert!(
        denied[0] > denied[2] && denied[2] > denied[1] && denied[1] > 0,
        "{denied:?}"
    );
    // The text report lists them.
    let text = run(&dir.0, &["-p", "policy.toml", "-q", "access.log"], None);
    assert!(
        text.contains("60/1m (live)") && text.contains("40/1m,burst=80"),
        "{text}"
    );
}
