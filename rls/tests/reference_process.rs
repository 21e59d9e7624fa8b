//! The binary started the way the reference service's container is: no
//! flags, its environment variables only (RUNTIME_ROOT and
//! RUNTIME_SUBDIRECTORY with a `config/` directory of YAML files, REDIS_URL
//! as `host:port` over tcp, GRPC_HOST/GRPC_PORT, USE_PROMETHEUS,
//! CACHE_KEY_PREFIX, LIMIT_RESPONSE_HEADERS_ENABLED with a renamed header,
//! NEAR_LIMIT_RATIO); a variable it cannot honour refused at start by name;
//! and reload without a restart, of the reference's YAML and of our TOML
//! rules file.

mod support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::connect_when_listening as connect;
use support::metrics as scrape;
use support::{cluster, sentinel};
use support::{free_port, header, rls_command, Killed, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_environment_alone_starts_and_serves() {
    let redis = RedisServer::start();
    let root =
        std::env::temp_dir().join(format!("rls-env-{}-{}", std::process::id(), redis.port()));
    let config = root.join("ratelimit/config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: hour\n      requests_per_unit: 2\n",
    )
    .unwrap();
    std::fs::write(config.join(".edge.yaml.swp"), "\0 not yaml").unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let child = rls_command()
        .env_clear()
        .env("RUNTIME_ROOT", &root)
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_IGNOREDOTFILES", "true")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port()))
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        // The HTTP endpoints' default is 8080: a free port instead.
        .env("HOST", "127.0.0.1")
        .env("PORT", free_port().to_string())
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", format!("127.0.0.1:{metrics}"))
        .env("CACHE_KEY_PREFIX", "ref")
        .env("LIMIT_RESPONSE_HEADERS_ENABLED", "true")
        .env("LIMIT_REMAINING_HEADER", "X-Left")
        .env("LOG_LEVEL", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn");
    let _child = Killed(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let channel = loop {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}")).unwrap();
        if let Ok(ch) = endpoint.connect().await {
            break ch;
        }
        assert!(
            Instant::now() < deadline,
            "never listened on GRPC_PORT {grpc}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut c = RateLimitServiceClient::new(channel);
    let r = || RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: "t1".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(
            c.should_rate_limit(r())
                .await
                .expect("answered")
                .into_inner(),
        );
    }
    let codes: Vec<i32> = answers.iter().map(|a| a.overall_code).collect();
    assert_eq!(
        codes,
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );
    let remaining: Vec<u32> = answers
        .iter()
        .map(|a| a.statuses[0].limit_remaining)
        .collect();
    assert_eq!(remaining, [1, 0, 0]);
    // The reference's headers only, one renamed; the reset is the hour's
    // end on Redis' clock in whole seconds, rounded up (the status has µs).
    let until = answers[2].statuses[0].duration_until_reset.unwrap();
    let reset = until.seconds + i64::from(until.nanos > 0);
    assert!((1..=3600).contains(&reset), "{reset}");
    assert_eq!(
        answers[2].response_headers_to_add,
        vec![
            header("ratelimit-limit", "2"),
            header("x-left", "0"),
            header("ratelimit-reset", &reset.to_string()),
        ]
    );
    // CACHE_KEY_PREFIX and the domain lead the keys in REDIS_URL's Redis.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(keys.iter().all(|k| k.starts_with("ref:edge:")), "{keys:?}");
    assert!(keys.iter().any(|k| k == "ref:edge:tenant:t1"), "{keys:?}");
    // PROMETHEUS_ADDR serves /metrics.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", metrics))
        .await
        .unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.0 200"), "{body}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_reference_variable_that_cannot_be_honoured_stops_the_start() {
    let out = rls_command()
        .env_clear()
        .env("RUNTIME_ROOT", "/nonexistent")
        .env("USE_STATSD", "true")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "tiered-ratelimit-rls: USE_STATSD=true: statsd is not exported; metrics are Prometheus (USE_PROMETHEUS)\n"
    );
}

/// A descriptor on `tenant` with hits_addend 0: reads without charging.
fn peek_tenant() -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tenant".into(),
                value: "t1".into(),
            }],
            hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 }),
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// `n` an hour on `tenant`, in the reference's YAML.
fn tenant_yaml(n: u32) -> String {
    format!("domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: hour\n      requests_per_unit: {n}\n")
}

/// A fresh runtime root under the temporary directory, named `name` and a
/// free port, whose `config/edge.yaml` holds `yaml`: the root and the file.
fn runtime_root(name: &str, yaml: &str) -> (PathBuf, PathBuf) {
    let root =
        std::env::temp_dir().join(format!("rls-{name}-{}-{}", std::process::id(), free_port()));
    let config = root.join("config");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&config).unwrap();
    let file = config.join("edge.yaml");
    std::fs::write(&file, yaml).unwrap();
    (root, file)
}

/// The binary on the reference's variables alone: `RUNTIME_ROOT=root`,
/// gRPC, HTTP and Prometheus on free loopback ports, and `vars`. The
/// child (killed on drop), its gRPC port and its metrics port.
fn spawn_reference(root: &Path, vars: &[(&str, String)]) -> (Killed, u16, u16) {
    let (grpc, metrics) = (free_port(), free_port());
    let mut cmd = rls_command();
    cmd.env_clear()
        .env("RUNTIME_ROOT", root)
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        // The HTTP endpoints' default is 8080: a free port instead.
        .env("HOST", "127.0.0.1")
        .env("PORT", free_port().to_string())
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", format!("127.0.0.1:{metrics}"))
        .env("LOG_LEVEL", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    (Killed(cmd.spawn().expect("spawn")), grpc, metrics)
}

/// Reload without a restart: a valid change is served by the next calls
/// (the counters kept), an invalid one is counted and the previous
/// configuration keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_config_is_swapped_in_and_a_broken_one_refused() {
    let (root, file) = runtime_root("reload", &tenant_yaml(2));
    let (_child, grpc, metrics) = spawn_reference(&root, &[]);
    let mut c = connect(grpc).await;
    let mut charge = peek_tenant();
    charge.descriptors[0].hits_addend = None;
    let s = c
        .should_rate_limit(charge.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.statuses[0].limit_remaining, 1);
    // A valid change: 5 an hour, the one request already counted.
    std::fs::write(&file, tenant_yaml(5)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = c
            .should_rate_limit(peek_tenant())
            .await
            .unwrap()
            .into_inner();
        let limit = s.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit;
        if limit == 5 {
            assert_eq!(s.statuses[0].limit_remaining, 4);
            break;
        }
        assert_eq!(limit, 2);
        assert!(Instant::now() < deadline, "the change was never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // An invalid change: refused, counted, the 5-an-hour config still serves.
    std::fs::write(
        &file,
        "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: fortnight\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !scrape(metrics)
        .await
        .contains("tiered_ratelimit_rls_config_loads_total{result=\"error\"} 1")
    {
        assert!(
            Instant::now() < deadline,
            "the broken change was never counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = c.should_rate_limit(charge).await.unwrap().into_inner();
    assert_eq!(s.overall_code, Code::Ok as i32);
    assert_eq!(
        s.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        5
    );
    assert_eq!(s.statuses[0].limit_remaining, 3);
    let body = scrape(metrics).await;
    assert!(
        body.contains("tiered_ratelimit_rls_config_loads_total{result=\"success\"} 1"),
        "{body}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// One descriptor `tenant=t1` with `hits` (`None`: the request's 1).
fn tenant(hits: Option<u64>) -> RateLimitRequest {
    let mut r = peek_tenant();
    r.descriptors[0].hits_addend =
        hits.map(|value| envoy_types::pb::google::protobuf::UInt64Value { value });
    r
}

/// `NEAR_LIMIT_RATIO=0.7` on a limit of 10: the near-limit threshold is
/// 7 (8 under the default 0.8), and `near_limit` counts the hits past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_limit_ratio_moves_the_near_limit_threshold() {
    let (root, _) = runtime_root("near", &tenant_yaml(10));
    let (_child, grpc, metrics) = spawn_reference(&root, &[("NEAR_LIMIT_RATIO", "0.7".to_owned())]);
    let mut c = connect(grpc).await;
    let mut codes = Vec::new();
    // 8 single hits (counts 1..8: the 8th is past 7), then 3 more (11 >
    // 10: over, nothing charged), then 2 (8 → 10: both past 7).
    let hits = [None; 8].into_iter().chain([Some(3), Some(2)]);
    for h in hits {
        let a = c.should_rate_limit(tenant(h)).await.unwrap().into_inner();
        codes.push(a.overall_code);
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(codes, [ok, ok, ok, ok, ok, ok, ok, ok, over, ok]);
    let body = scrape(metrics).await;
    let mut series: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("ratelimit_service_rate_limit_"))
        .collect();
    series.sort_unstable();
    assert_eq!(
        series,
        [
            r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="tenant"} 3"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="tenant"} 3"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="tenant"} 13"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="tenant"} 10"#,
        ]
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// Our TOML rules file reloads as the reference's YAML does: a valid
/// change (a higher limit, a new rule) is served by the next calls with
/// the counters kept; an invalid one (an unknown field; a changed
/// `[redis]`, which is read at start only) is logged and counted, and the
/// previous rules keep serving. On a real Redis, over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_toml_rules_file_is_swapped_in_and_a_broken_one_refused() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("rls-toml-reload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rls.toml");
    let toml = |limit: u32, extra: &str| {
        format!(
            "domain = \"edge\"\n[redis]\nurl = \"{}\"\n[[rule]]\nname = \"per_tenant\"\nmatch = [{{ key = \"tenant\" }}]\nlimit = {limit}\nperiod = \"1h\"\nalgorithm = \"fixed_window\"\n{extra}",
            redis.url()
        )
    };
    std::fs::write(&file, toml(2, "")).unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let child = rls_command()
        .env_clear()
        .arg("--config")
        .arg(&file)
        .arg("--listen")
        .arg(format!("127.0.0.1:{grpc}"))
        .arg("--metrics")
        .arg(format!("127.0.0.1:{metrics}"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let _child = Killed(child);
    let mut c = connect(grpc).await;
    let s = c
        .should_rate_limit(tenant(None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.statuses[0].limit_remaining, 1);
    let limit_of = |s: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse| {
        s.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| (l.name.clone(), l.requests_per_unit))
    };
    assert_eq!(limit_of(&s), Some(("per_tenant".to_owned(), 2)));
    // A valid change: 5 an hour (the one request already counted), and a
    // new rule on `user`.
    let user_rule =
        "[[rule]]\nname = \"per_user\"\nmatch = [{ key = \"user\" }]\nlimit = 1\nperiod = \"1h\"\n";
    std::fs::write(&file, toml(5, user_rule)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = c
            .should_rate_limit(tenant(Some(0)))
            .await
            .unwrap()
            .into_inner();
        if limit_of(&s) == Some(("per_tenant".to_owned(), 5)) {
            assert_eq!(s.statuses[0].limit_remaining, 4);
            break;
        }
        assert_eq!(limit_of(&s), Some(("per_tenant".to_owned(), 2)));
        assert!(Instant::now() < deadline, "the change was never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut user = tenant(None);
    user.descriptors[0].entries[0].key = "user".into();
    let codes: Vec<i32> = [
        c.should_rate_limit(user.clone())
            .await
            .unwrap()
            .into_inner(),
        c.should_rate_limit(user.clone())
            .await
            .unwrap()
            .into_inner(),
    ]
    .iter()
    .map(|a| a.overall_code)
    .collect();
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
    // Two invalid changes, each refused and counted: an unknown field,
    // then another Redis.
    let broken = [
        toml(7, "limt = 3\n"),
        toml(7, "").replace(&redis.url(), "redis://127.0.0.1:1/"),
    ];
    for (n, text) in broken.iter().enumerate() {
        std::fs::write(&file, text).unwrap();
        let counted = format!(
            "tiered_ratelimit_rls_config_loads_total{{result=\"error\"}} {}",
            n + 1
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !scrape(metrics).await.contains(&counted) {
            assert!(Instant::now() < deadline, "change {n} was never counted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The 5-an-hour rules still serve, on the same counters.
    let s = c
        .should_rate_limit(tenant(None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.overall_code, Code::Ok as i32);
    assert_eq!(limit_of(&s), Some(("per_tenant".to_owned(), 5)));
    assert_eq!(s.statuses[0].limit_remaining, 3);
    let body = scrape(metrics).await;
    assert!(
        body.contains("tiered_ratelimit_rls_config_loads_total{result=\"success\"} 1"),
        "{body}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The binary on the reference's YAML (2 an hour on `tenant`) and its
/// Redis variables `vars`: three calls answer OK, OK, OVER_LIMIT with 1,
/// 0, 0 left, on the Redis those variables name.
async fn two_an_hour_on(vars: &[(&str, String)]) {
    let (root, _) = runtime_root("redis-forms", &tenant_yaml(2));
    let mut vars = vars.to_vec();
    // A cluster's first call may wait for its slots: not a fail-open.
    vars.push(("REDIS_TIMEOUT", "5s".to_owned()));
    let (_child, grpc, _) = spawn_reference(&root, &vars);
    let mut c = connect(grpc).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let a = c
            .should_rate_limit(tenant(None))
            .await
            .unwrap()
            .into_inner();
        seen.push((a.overall_code, a.statuses[0].limit_remaining));
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(seen, [(ok, 1), (ok, 0), (over, 0)], "{vars:?}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// `REDIS_SOCKET_TYPE`'s default, `unix`: `REDIS_URL` is a socket path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_url_as_a_unix_socket() {
    let socket = std::env::temp_dir().join(format!("rls-redis-{}.sock", std::process::id()));
    let socket_arg = socket.display().to_string();
    let redis = RedisServer::start_with(&["--unixsocket", &socket_arg, "--unixsocketperm", "700"]);
    two_an_hour_on(&[("REDIS_URL", socket_arg.clone())]).await;
    let exists: i64 = redis.cmd(&["EXISTS", "rls:edge:tenant:t1"]);
    assert_eq!(exists, 1);
}

/// `REDIS_TYPE=cluster`: `REDIS_URL` is the nodes, `host:port,host:port`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_type_cluster() {
    let cluster = cluster::RedisCluster::start(0);
    let nodes: Vec<String> = cluster
        .urls()
        .iter()
        .map(|u| {
            u.trim_start_matches("redis://")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect();
    two_an_hour_on(&[
        ("REDIS_TYPE", "cluster".to_owned()),
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", nodes.join(",")),
    ])
    .await;
    // On a cluster a key is its own hash tag (its checks go by slot).
    assert_eq!(cluster.keys(), ["{rls:edge:tenant:t1}"]);
}

/// `REDIS_TYPE=sentinel`: `REDIS_URL` is `master,host:port,…` of the
/// sentinels; the counter lives on the primary they name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_type_sentinel() {
    let set = sentinel::SentinelSet::start();
    let sentinels: Vec<String> = set
        .sentinel_ports()
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    two_an_hour_on(&[
        ("REDIS_TYPE", "sentinel".to_owned()),
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        (
            "REDIS_URL",
            format!("{},{}", sentinel::MASTER, sentinels.join(",")),
        ),
    ])
    .await;
    let exists: i64 = set.primary.cmd(&["EXISTS", "rls:edge:tenant:t1"]);
    assert_eq!(exists, 1);
}

/// Hostile YAML stops the binary's start with an error naming the file,
/// fast: an alias bomb, a tree nested past the parser's budget, a
/// duplicate key and a file over 4 MiB (never a hang or a panic).
#[test]
fn hostile_yaml_stops_the_start_naming_the_file() {
    // Under `metadata`, which is read (and ignored): the aliases expand.
    let mut bomb = String::from("domain: d\ndescriptors:\n  - key: k\n    metadata:\n");
    bomb.push_str(
        "      a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
    for w in names.windows(2) {
        let (prev, name) = (w[0], w[1]);
        let refs = vec![format!("*{prev}"); 9].join(",");
        bomb.push_str(&format!("      {name}: &{name} [{refs}]\n"));
    }
    let files = [
        bomb,
        format!(
            "domain: d\ndescriptors: {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        ),
        "domain: d\ndomain: e\n".to_owned(),
        format!("domain: d\n# {}\n", "x".repeat(5 << 20)),
    ];
    for (n, text) in files.iter().enumerate() {
        let (root, file) = runtime_root("hostile", text);
        let mut child = rls_command()
            .env_clear()
            .env("RUNTIME_ROOT", &root)
            .env("GRPC_HOST", "127.0.0.1")
            .env("GRPC_PORT", free_port().to_string())
            .env("HOST", "127.0.0.1")
            .env("PORT", free_port().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("file {n}: still starting after 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert_eq!(status.code(), Some(1), "file {n}: {stderr}");
        let expected = format!("tiered-ratelimit-rls: policy: {}: ", file.display());
        assert!(stderr.starts_with(&expected), "file {n}: {stderr}");
        if n == 0 {
            assert!(stderr.contains("alias replay limit exceeded"), "{stderr}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// Under the reference's configuration (YAML, `REDIS_URL`, no failure
/// setting of ours) a Redis failure is a gRPC error, as the reference
/// answers a Redis error: Envoy's own `failure_mode_deny` then decides.
/// Once Redis is back, calls are answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_failure_is_a_grpc_error_under_the_reference_config() {
    let mut redis = RedisServer::start();
    let (root, _) = runtime_root("redis-down", &tenant_yaml(2));
    let http = free_port();
    let (_child, grpc, _) = spawn_reference(
        &root,
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
            ("PORT", http.to_string()),
        ],
    );
    let mut c = connect(grpc).await;
    let ok = c
        .should_rate_limit(tenant(None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.overall_code, Code::Ok as i32);
    assert_eq!(ok.statuses[0].limit_remaining, 1);
    redis.stop();
    let err = c.should_rate_limit(tenant(None)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert_eq!(err.message(), "rate limiter unavailable");
    // `/json`: the reference's 400 for an error, saying which.
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{http}/json"))
        .body(r#"{"domain":"edge","descriptors":[{"entries":[{"key":"tenant","value":"t1"}]}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(
        r.text().await.unwrap(),
        "Bad Request: rate limiter unavailable\n"
    );
    // Redis back (empty: it keeps nothing on disk): answered again once the
    // circuit breaker's probe passes.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.should_rate_limit(tenant(None)).await {
            Ok(a) => {
                let a = a.into_inner();
                assert_eq!(a.overall_code, Code::Ok as i32);
                assert_eq!(a.statuses[0].limit_remaining, 1);
                break;
            }
            Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable),
        }
        assert!(
            Instant::now() < deadline,
            "never answered after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Waits (10 s at most) until `tenant=t1` is served with `limit` per unit,
/// and returns its remaining count (read without charging).
async fn served_limit(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    limit: u32,
) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = c
            .should_rate_limit(peek_tenant())
            .await
            .unwrap()
            .into_inner();
        let current = s.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit);
        if current == Some(limit) {
            return s.statuses[0].limit_remaining;
        }
        assert!(
            Instant::now() < deadline,
            "{limit} an hour never served (still {current:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `ln -s target link`, then renamed over `at`: the atomic swap a deploy
/// (and the kubelet) does.
fn swap_symlink(target: &Path, at: &Path) {
    let mut name = at.file_name().unwrap().to_owned();
    name.push("_tmp");
    let tmp = at.with_file_name(name);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).unwrap();
    std::fs::rename(&tmp, at).unwrap();
}

/// The reference's default reload trigger (`RUNTIME_WATCH_ROOT`):
/// `RUNTIME_ROOT` is a symlink swapped to another directory. The new
/// directory is served, a later edit inside it is seen (the watch follows
/// the new target), and so is a second swap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_runtime_root_symlink_is_reloaded() {
    let base =
        std::env::temp_dir().join(format!("rls-swap-{}-{}", std::process::id(), free_port()));
    let _ = std::fs::remove_dir_all(&base);
    let release = |name: &str, limit: u32| {
        let config = base.join(name).join("config");
        std::fs::create_dir_all(&config).unwrap();
        std::fs::write(config.join("edge.yaml"), tenant_yaml(limit)).unwrap();
        base.join(name)
    };
    let current = base.join("current");
    std::os::unix::fs::symlink(release("v1", 2), &current).unwrap();
    let (_child, grpc, _) = spawn_reference(&current, &[]);
    let mut c = connect(grpc).await;
    let charged = c
        .should_rate_limit(tenant(None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(charged.statuses[0].limit_remaining, 1);
    swap_symlink(&release("v2", 5), &current);
    // The counters carry over: 1 request counted.
    assert_eq!(served_limit(&mut c, 5).await, 4);
    std::fs::write(base.join("v2/config/edge.yaml"), tenant_yaml(7)).unwrap();
    assert_eq!(served_limit(&mut c, 7).await, 6);
    swap_symlink(&release("v3", 9), &current);
    std::fs::remove_dir_all(base.join("v1")).unwrap();
    assert_eq!(served_limit(&mut c, 9).await, 8);
    std::fs::remove_dir_all(&base).unwrap();
}

/// A Kubernetes ConfigMap mounted as the config directory: the files are
/// symlinks into `..data/`, itself a symlink to `..<timestamp>/`. Served
/// by default (no `RUNTIME_IGNOREDOTFILES`), each file read once; the
/// kubelet's update (a new `..<timestamp>`, `..data` swapped, the old one
/// removed) is reloaded, under either `RUNTIME_WATCH_ROOT`.
async fn a_config_map_mount_is_served_and_reloaded(watch_root: &str) {
    let root = std::env::temp_dir().join(format!(
        "rls-configmap-{}-{}",
        std::process::id(),
        free_port()
    ));
    let config = root.join("config");
    let _ = std::fs::remove_dir_all(&root);
    let version = |name: &str, limit: u32| {
        let dir = config.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("edge.yaml"), tenant_yaml(limit)).unwrap();
        std::path::PathBuf::from(name)
    };
    let first = version("..2026_12_04_20_00_00.000000001", 2);
    std::os::unix::fs::symlink(&first, config.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/edge.yaml", config.join("edge.yaml")).unwrap();
    let (_child, grpc, _) =
        spawn_reference(&root, &[("RUNTIME_WATCH_ROOT", watch_root.to_owned())]);
    let mut c = connect(grpc).await;
    let charged = c
        .should_rate_limit(tenant(None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(charged.statuses[0].limit_remaining, 1);
    // The kubelet's atomic update.
    let second = version("..2026_12_04_20_01_00.000000002", 5);
    swap_symlink(&second, &config.join("..data"));
    std::fs::remove_dir_all(config.join(&first)).unwrap();
    assert_eq!(served_limit(&mut c, 5).await, 4);
    std::fs::remove_dir_all(&root).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_map_mount_is_served_and_reloaded_watching_the_root() {
    a_config_map_mount_is_served_and_reloaded("true").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_map_mount_is_served_and_reloaded_watching_the_config_directory() {
    a_config_map_mount_is_served_and_reloaded("false").await;
}

/// The reference's stat key levels stay whole: an IPv4 value's dots become
/// `_` as the reference's stat names have them (`remote_address_50_0_0_5`),
/// any other dotted value stays in its label; neither adds a label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_with_dots_stays_one_stat_label() {
    let yaml = "domain: edge\ndescriptors:\n\
                - key: remote_address\n  value_to_metric: true\n  rate_limit: {unit: hour, requests_per_unit: 10}\n\
                - key: host\n  value_to_metric: true\n  descriptors:\n\
                \x20   - key: path\n      value_to_metric: true\n      rate_limit: {unit: hour, requests_per_unit: 10}\n";
    let (root, _) = runtime_root("dots", yaml);
    let (_child, grpc, metrics) = spawn_reference(&root, &[]);
    let mut c = connect(grpc).await;
    let request = |entries: &[(&str, &str)]| RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..Default::default()
        }],
        hits_addend: 0,
    };
    for r in [
        request(&[("remote_address", "50.0.0.5")]),
        request(&[("host", "api.example.com"), ("path", "/v1.2/x")]),
    ] {
        let a = c.should_rate_limit(r).await.unwrap().into_inner();
        assert_eq!(a.overall_code, Code::Ok as i32);
        assert_eq!(a.statuses[0].limit_remaining, 9);
    }
    let body = scrape(metrics).await;
    let mut series: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("ratelimit_service_rate_limit_"))
        .collect();
    series.sort_unstable();
    assert_eq!(
        series,
        [
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="host_api.example.com",key2="path_/v1.2/x"} 1"#,
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="remote_address_50_0_0_5"} 1"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="host_api.example.com",key2="path_/v1.2/x"} 1"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="remote_address_50_0_0_5"} 1"#,
        ]
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The next 1st of a month at 00:00 UTC after `t` (epoch seconds).
fn next_month_start(t: i64) -> i64 {
    let mut y = 1970;
    let mut m = 1;
    while days_from_civil(y, m, 1) * 86_400 <= t {
        m += 1;
        if m == 13 {
            m = 1;
            y += 1;
        }
    }
    days_from_civil(y, m, 1) * 86_400
}

/// `USE_CALENDAR_MONTH_RATE_LIMIT=true` (the reference's setting): a
/// `unit: month` limit counts per UTC calendar month, so its reset is the
/// next 1st at 00:00 UTC on Redis's clock, not the end of a 30-day window
/// from the epoch; `current_limit` still says 3 per MONTH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn use_calendar_month_rate_limit_counts_per_utc_calendar_month() {
    assert_eq!(next_month_start(1_709_161_200), 1_709_251_200); // 2024-02-29 → 2024-03-01
    let redis = RedisServer::start();
    let yaml = "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: month\n      requests_per_unit: 3\n";
    let (root, _) = runtime_root("calendar", yaml);
    let (_child, grpc, _) = spawn_reference(
        &root,
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port())),
            ("USE_CALENDAR_MONTH_RATE_LIMIT", "true".to_owned()),
        ],
    );
    let mut c = connect(grpc).await;
    let now = || -> f64 {
        let t: Vec<String> = redis.cmd(&["TIME"]);
        t[0].parse::<f64>().unwrap() + t[1].parse::<f64>().unwrap() / 1e6
    };
    let before = now();
    let a = c
        .should_rate_limit(tenant(None))
        .await
        .unwrap()
        .into_inner();
    let after = now();
    let s = &a.statuses[0];
    assert_eq!(s.limit_remaining, 2);
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (3, Unit::Month as i32)
    );
    let d = s.duration_until_reset.unwrap();
    let reset = d.seconds as f64 + f64::from(d.nanos) / 1e9;
    #[allow(clippy::cast_possible_truncation)]
    let end = next_month_start(before as i64) as f64;
    assert!(
        end - after <= reset && reset <= end - before,
        "reset {reset} s, the month ends {end}, called between {before} and {after}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
