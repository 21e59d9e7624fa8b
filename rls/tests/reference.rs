//! The reference service's YAML configuration (envoyproxy/ratelimit), read
//! unchanged and served over TCP to Envoy's generated gRPC client, on
//! memory, a real Redis and a Redis Cluster: the tree descent (key=value
//! before wildcard before key-only, no backtracking), units, `unlimited`,
//! `requests_per_unit: 0`, `replaces`, wildcards and `share_threshold`,
//! shadow mode per limit and global, `hits_addend`, several domains, an
//! unknown domain answered OK; and start-up errors naming file, tree path
//! and field, hostile YAML included. The scenarios are the reference's
//! config and integration tests', written as our own tables; every
//! scenario that decides runs on the three backends.

mod support;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use std::net::SocketAddr;
use std::path::Path;

use support::cluster::RedisCluster;
use support::limited_per as limited;
use support::{call, connect, d, no_limit, req, Client, RedisServer, T0_US};
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::descriptor::{FailureStatus, ReferenceConfig};
use tiered_ratelimit::response::HeaderStyle;
use tiered_ratelimit::EngineBuilder;
use tiered_ratelimit_rls::{serve, Rls};

/// A tenant tree with key-only defaults and value overrides at two levels.
const SHOP: &str = r"
domain: shop
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: route
        rate_limit:
          unit: second
          requests_per_unit: 4
      - key: route
        value: checkout
        rate_limit:
          unit: second
          requests_per_unit: 8
  - key: tenant
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: tenant
    value: big
    rate_limit:
      unit: Minute
      requests_per_unit: 6
  - key: tenant
    value: free
  - key: ip
    rate_limit:
      unit: HOUR
      requests_per_unit: 2
  - key: plan
    rate_limit:
      name: plan_daily
      unit: day
      requests_per_unit: 1
  - key: office
    rate_limit:
      unlimited: true
  - key: quarter
    rate_limit:
      unit: month
      requests_per_unit: 100
  - key: annual
    rate_limit:
      unit: year
      requests_per_unit: 1000
  - key: weekly
    rate_limit:
      unit: week
      requests_per_unit: 7
";

const FILES: &str = r"
domain: files
descriptors:
  - key: path
    value: /api/*
    rate_limit:
      unit: minute
      requests_per_unit: 2
  - key: path
    value: /v*/users*
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: path
    value: /api/exact
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: bucket
    value: b*
    share_threshold: true
    rate_limit:
      unit: minute
      requests_per_unit: 2
  - key: team
    value: t*
    share_threshold: true
    descriptors:
      - key: member
        rate_limit:
          unit: minute
          requests_per_unit: 2
";

const MISC: &str = r"
domain: misc
descriptors:
  - key: user
    rate_limit:
      name: per_user
      unit: minute
      requests_per_unit: 5
  - key: vip
    rate_limit:
      unit: minute
      requests_per_unit: 50
      replaces:
        - name: per_user
  - key: banned
    rate_limit:
      unit: second
      requests_per_unit: 0
  - key: trial
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

fn config(files: &[(&str, &str)]) -> ReferenceConfig {
    let mut c = ReferenceConfig::default();
    for (name, text) in files {
        c.add(Path::new(name), text).expect("valid YAML config");
    }
    c
}

/// Serves `config` on `backend` on a free loopback port.
async fn start(config: ReferenceConfig, backend: impl Into<Backend>, shadow: bool) -> SocketAddr {
    let limiters = config
        .limiters(&backend.into(), "rls-ref", shadow, || {
            // Generous: on a loaded machine the 100 ms default fails open.
            EngineBuilder::default()
                .headers(HeaderStyle::None)
                .backend_timeout(std::time::Duration::from_secs(10))
        })
        .expect("limiters");
    let rls = Rls::domains(limiters, FailureStatus::OverLimit);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(rls, listener, None, std::future::pending()));
    addr
}

async fn one(c: &mut Client, domain: &str, entries: &[(&str, &str)]) -> DescriptorStatus {
    let r = call(c, req(domain, vec![d(entries)])).await;
    assert_eq!(r.statuses.len(), 1);
    r.statuses[0].clone()
}

/// The reference's descent, units and names, one fresh call per row.
async fn tree_descent(addr: SocketAddr) {
    let mut c = connect(addr).await;
    use Code::{Ok, OverLimit};
    let rows: Vec<(&[(&str, &str)], DescriptorStatus)> = vec![
        // key-only default at the second level, and its value override.
        (
            &[("tenant", "acme"), ("route", "home")],
            limited(Ok, "", 4, Unit::Second, 3, 1),
        ),
        (
            &[("tenant", "acme"), ("route", "checkout")],
            limited(Ok, "", 8, Unit::Second, 7, 1),
        ),
        // acme's node has no limit of its own, and no backtracking to the
        // key-only `tenant`.
        (&[("tenant", "acme")], no_limit(0)),
        (&[("tenant", "acme"), ("other", "x")], no_limit(0)),
        (
            &[("tenant", "other")],
            limited(Ok, "", 3, Unit::Minute, 2, 40),
        ),
        (
            &[("tenant", "big")],
            limited(Ok, "", 6, Unit::Minute, 5, 40),
        ),
        // A value without a rate_limit lets it through.
        (&[("tenant", "free")], no_limit(0)),
        // Longer than the branch: no limit.
        (&[("tenant", "other"), ("route", "x")], no_limit(0)),
        (
            &[("tenant", "acme"), ("route", "home"), ("x", "y")],
            no_limit(0),
        ),
        (
            &[("ip", "10.0.0.1")],
            limited(Ok, "", 2, Unit::Hour, 1, 2_800),
        ),
        (
            &[("plan", "pro")],
            limited(Ok, "plan_daily", 1, Unit::Day, 0, 6_400),
        ),
        (&[("office", "x")], no_limit(u32::MAX)),
        (
            &[("weekly", "x")],
            limited(Ok, "", 7, Unit::Week, 6, 604_800 - 1_700_000_000 % 604_800),
        ),
        (
            &[("quarter", "x")],
            limited(
                Ok,
                "",
                100,
                Unit::Month,
                99,
                2_592_000 - 1_700_000_000 % 2_592_000,
            ),
        ),
        (
            &[("annual", "x")],
            limited(
                Ok,
                "",
                1000,
                Unit::Year,
                999,
                31_536_000 - 1_700_000_000 % 31_536_000,
            ),
        ),
        // The second call of plan=pro is over: remaining 0, reset at the day's end.
        (
            &[("plan", "pro")],
            limited(OverLimit, "plan_daily", 1, Unit::Day, 0, 6_400),
        ),
    ];
    for (entries, expected) in rows {
        assert_eq!(one(&mut c, "shop", entries).await, expected, "{entries:?}");
    }
    // An unknown domain: OK, no limit (the reference's answer; behind
    // failure_mode_deny an error would deny the domain's traffic).
    let r = call(&mut c, req("nowhere", vec![d(&[("tenant", "x")])])).await;
    assert_eq!(r.overall_code, Ok as i32);
    assert_eq!(r.statuses, vec![no_limit(0)]);
}

#[tokio::test]
async fn tree_descent_in_memory() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    tree_descent(start(config(&[("shop.yaml", SHOP)]), backend, false).await).await;
}

#[tokio::test]
async fn tree_descent_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    tree_descent(start(config(&[("shop.yaml", SHOP)]), backend, false).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tree_descent_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let backend = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    tree_descent(start(config(&[("shop.yaml", SHOP)]), backend, false).await).await;
}

/// Trailing, middle and several `*`; an exact value before a pattern;
/// `share_threshold` counting every matching value on one counter.
async fn wildcards(addr: SocketAddr) {
    let mut c = connect(addr).await;
    use Code::{Ok, OverLimit};
    let m = |code, n, rem| limited(code, "", n, Unit::Minute, rem, 40);
    let rows: Vec<(&[(&str, &str)], DescriptorStatus)> = vec![
        // Without share_threshold each value counts on its own.
        (&[("path", "/api/a")], m(Ok, 2, 1)),
        (&[("path", "/api/a")], m(Ok, 2, 0)),
        (&[("path", "/api/b")], m(Ok, 2, 1)),
        (&[("path", "/api/a")], m(OverLimit, 2, 0)),
        (&[("path", "/api/exact")], m(Ok, 10, 9)),
        (&[("path", "/v1/users/7")], m(Ok, 3, 2)),
        (&[("path", "/v22/users")], m(Ok, 3, 2)),
        (&[("path", "/v1/groups")], no_limit(0)),
        (&[("path", "/ap")], no_limit(0)),
        // share_threshold: b1, b2 and b3 share one counter of 2.
        (&[("bucket", "b1")], m(Ok, 2, 1)),
        (&[("bucket", "b2")], m(Ok, 2, 0)),
        (&[("bucket", "b3")], m(OverLimit, 2, 0)),
        (&[("bucket", "x")], no_limit(0)),
        // A shared pattern above the limit's level: teams t1 and t2 share,
        // members do not.
        (&[("team", "t1"), ("member", "ann")], m(Ok, 2, 1)),
        (&[("team", "t2"), ("member", "ann")], m(Ok, 2, 0)),
        (&[("team", "t3"), ("member", "bob")], m(Ok, 2, 1)),
    ];
    for (entries, expected) in rows {
        assert_eq!(one(&mut c, "files", entries).await, expected, "{entries:?}");
    }
}

#[tokio::test]
async fn wildcards_in_memory() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    wildcards(start(config(&[("files.yaml", FILES)]), backend, false).await).await;
}

#[tokio::test]
async fn wildcards_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    wildcards(start(config(&[("files.yaml", FILES)]), backend, false).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcards_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let backend = RedisBackend::cluster(cluster.urls())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    wildcards(start(config(&[("files.yaml", FILES)]), backend, false).await).await;
}

/// `replaces`, `requests_per_unit: 0`, per-limit shadow mode, hits_addend,
/// an empty descriptor list.
async fn replaces_blocking_shadow_and_hits(addr: SocketAddr) {
    let mut c = connect(addr).await;
    let m = |code, name, n, rem| limited(code, name, n, Unit::Minute, rem, 40);
    // vip replaces per_user in a request carrying both.
    let r = call(
        &mut c,
        req("misc", vec![d(&[("user", "a")]), d(&[("vip", "a")])]),
    )
    .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses, vec![no_limit(0), m(Code::Ok, "", 50, 49)]);
    // ... so per_user was not charged.
    assert_eq!(
        one(&mut c, "misc", &[("user", "a")]).await,
        m(Code::Ok, "per_user", 5, 4)
    );
    // requests_per_unit 0: every request over the limit, until the unit ends.
    let blocked = limited(Code::OverLimit, "", 0, Unit::Second, 0, 1);
    assert_eq!(one(&mut c, "misc", &[("banned", "x")]).await, blocked);
    let r = call(
        &mut c,
        req("misc", vec![d(&[("user", "b")]), d(&[("banned", "x")])]),
    )
    .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    // user=b passed and, the request denied, was charged nothing: all 5 left.
    assert_eq!(
        r.statuses,
        vec![m(Code::Ok, "per_user", 5, 5), blocked.clone()]
    );
    assert_eq!(
        one(&mut c, "misc", &[("user", "b")]).await,
        m(Code::Ok, "per_user", 5, 4)
    );
    // A limit in shadow mode: OK on its descriptor and overall, remaining 0.
    assert_eq!(
        one(&mut c, "misc", &[("trial", "t")]).await,
        m(Code::Ok, "", 1, 0)
    );
    let r = call(&mut c, req("misc", vec![d(&[("trial", "t")])])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses, vec![m(Code::Ok, "", 1, 0)]);
    // hits_addend is the cost; over the limit, remaining is 0.
    let mut five = req("misc", vec![d(&[("user", "c")])]);
    five.hits_addend = 5;
    assert_eq!(
        call(&mut c, five).await.statuses,
        vec![m(Code::Ok, "per_user", 5, 0)]
    );
    assert_eq!(
        one(&mut c, "misc", &[("user", "c")]).await,
        m(Code::OverLimit, "per_user", 5, 0)
    );
    // A descriptor's explicit hits_addend 0 charges nothing: it reads.
    let zero = || {
        let mut z = d(&[("user", "z")]);
        z.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
        req("misc", vec![z])
    };
    assert_eq!(
        one(&mut c, "misc", &[("user", "z")]).await,
        m(Code::Ok, "per_user", 5, 4)
    );
    for _ in 0..3 {
        assert_eq!(
            call(&mut c, zero()).await.statuses,
            vec![m(Code::Ok, "per_user", 5, 4)]
        );
    }
    assert_eq!(
        one(&mut c, "misc", &[("user", "z")]).await,
        m(Code::Ok, "per_user", 5, 3)
    );
    // ... and on an exhausted counter it is OK with nothing left.
    assert_eq!(
        call(&mut c, {
            let mut r = zero();
            r.descriptors[0].entries[0].value = "c".into();
            r
        })
        .await
        .statuses,
        vec![m(Code::Ok, "per_user", 5, 0)]
    );
    // No descriptors: an error, as the reference's.
    let s = c.should_rate_limit(req("misc", vec![])).await.unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert_eq!(s.message(), "descriptors: the list must not be empty");
    // Empty domain: an error too.
    let s = c
        .should_rate_limit(req("", vec![d(&[("user", "a")])]))
        .await
        .unwrap_err();
    assert_eq!(s.message(), "domain: empty");
}

#[tokio::test]
async fn replaces_blocking_shadow_and_hits_in_memory() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    replaces_blocking_shadow_and_hits(start(config(&[("misc.yaml", MISC)]), backend, false).await)
        .await;
}

#[tokio::test]
async fn replaces_blocking_shadow_and_hits_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    replaces_blocking_shadow_and_hits(start(config(&[("misc.yaml", MISC)]), backend, false).await)
        .await;
}

/// Both scenarios on one cluster (the requests of one never touch the
/// other's keys: different values).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaces_and_global_shadow_on_a_cluster() {
    let cluster = RedisCluster::start(0);
    let backend = || {
        RedisBackend::cluster(cluster.urls())
            .unwrap()
            .with_manual_clock(ManualClock::new(T0_US))
    };
    replaces_blocking_shadow_and_hits(
        start(config(&[("misc.yaml", MISC)]), backend(), false).await,
    )
    .await;
    global_shadow_mode(start(config(&[("misc.yaml", MISC)]), backend(), true).await).await;
}

/// SHADOW_MODE: the descriptor says OVER_LIMIT, the request is OK.
async fn global_shadow_mode(addr: SocketAddr) {
    let mut c = connect(addr).await;
    for left in (0..5).rev() {
        let r = call(&mut c, req("misc", vec![d(&[("user", "g")])])).await;
        assert_eq!(
            r.statuses,
            vec![limited(Code::Ok, "per_user", 5, Unit::Minute, left, 40)]
        );
    }
    let r = call(&mut c, req("misc", vec![d(&[("user", "g")])])).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, "per_user", 5, Unit::Minute, 0, 40)]
    );
}

#[tokio::test]
async fn global_shadow_mode_reports_over_limit_and_answers_ok() {
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    global_shadow_mode(start(config(&[("misc.yaml", MISC)]), backend, true).await).await;
}

#[tokio::test]
async fn global_shadow_mode_on_redis() {
    let redis = RedisServer::start();
    let backend = RedisBackend::from_url(&redis.url())
        .unwrap()
        .with_manual_clock(ManualClock::new(T0_US));
    global_shadow_mode(start(config(&[("misc.yaml", MISC)]), backend, true).await).await;
}

/// A directory of files, one domain each, served by one process; dotfiles
/// are skipped.
#[tokio::test]
async fn a_directory_serves_every_domain() {
    let dir = std::env::temp_dir().join(format!("rls-ref-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("nested")).unwrap();
    std::fs::write(dir.join("shop.yaml"), SHOP).unwrap();
    std::fs::write(dir.join("nested/misc.yml"), MISC).unwrap();
    std::fs::write(dir.join(".hidden.yaml"), "not: [valid").unwrap();
    let config = ReferenceConfig::from_path(&dir, true).expect("directory");
    let mut domains: Vec<&str> = config.domains.iter().map(|d| d.domain.as_str()).collect();
    domains.sort_unstable();
    assert_eq!(domains, ["misc", "shop"]);
    let backend = MemoryBackend::with_manual_clock(ManualClock::new(T0_US));
    let mut c = connect(start(config, backend, false).await).await;
    assert_eq!(
        one(&mut c, "shop", &[("ip", "1")]).await,
        limited(Code::Ok, "", 2, Unit::Hour, 1, 2_800)
    );
    assert_eq!(
        one(&mut c, "misc", &[("user", "1")]).await,
        limited(Code::Ok, "per_user", 5, Unit::Minute, 4, 40)
    );
    // Without skipping dotfiles the broken one fails the load, by name.
    let e = ReferenceConfig::from_path(&dir, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!("policy: {}", dir.join(".hidden.yaml").display())),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn load_error(text: &str) -> String {
    let mut c = ReferenceConfig::default();
    match c.add(Path::new("bad.yaml"), text) {
        Ok(()) => panic!("loaded: {text}"),
        Err(e) => e.to_string(),
    }
}

/// The reference's config error cases, each naming file, path and field.
#[test]
fn config_mistakes_name_the_file_the_tree_path_and_the_field() {
    let rows = [
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 5\n",
            "policy: bad.yaml: descriptors[0] (k_v): rate_limit.unit: invalid rate limit unit 'fortnight' (second, minute, hour, day, week, month or year)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 5\n",
            "policy: bad.yaml: descriptors[0] (k): rate_limit.unit: invalid rate limit unit '' (second, minute, hour, day, week, month or year)",
        ),
        (
            "descriptors:\n  - key: k\n",
            "policy: bad.yaml: domain: must not be empty",
        ),
        (
            "domain: d\ndescriptors:\n  - value: v\n",
            "policy: bad.yaml: descriptors[0]: key: must not be empty (descriptor has empty key)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        value: c\n      - key: b\n        value: c\n",
            "policy: bad.yaml: descriptors[0] (a).descriptors[1] (a.b_c): key: duplicate descriptor composite key 'a.b_c'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      unit: day\n",
            "policy: bad.yaml: descriptors[0] (k): rate_limit.unit: should not specify rate limit unit when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      name: me\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: me\n",
            "policy: bad.yaml: descriptors[0] (k): rate_limit.replaces: replaces should not contain name of same descriptor",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name:\n",
            "policy: bad.yaml: descriptors[0] (k): rate_limit.replaces: should not have an empty replaces entry",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n",
            "policy: bad.yaml: descriptors[0] (k_v): share_threshold: only for a wildcard value (one containing '*')",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n",
            "policy: bad.yaml: descriptors[0] (k): quota_mode: not supported by tiered-ratelimit-rls (remove it, or keep the reference service for this domain)",
        ),
    ];
    for (text, expected) in rows {
        assert_eq!(load_error(text), expected);
    }
    // The parser's own errors: the file, the field, the line.
    let e = load_error("domain: d\ndescriptors:\n  - key: k\n    ratelimit:\n      unit: day\n");
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    assert!(e.contains("ratelimit"), "{e}");
    assert!(e.contains("line 4"), "{e}");
    let e = load_error("domain: d\ndescriptors:\n  - a\n  - b\n");
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    let e = load_error("0.25: d\ndescriptors: []\n");
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    let e = load_error("'''\n");
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    // Two files, one domain.
    let mut c = config(&[("a.yaml", "domain: d\n")]);
    let e = c
        .add(Path::new("b.yaml"), "domain: d\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "policy: b.yaml: domain: \"d\" is the domain of a.yaml too"
    );
}

/// Hostile files fail fast with a clear error, never a hang or a panic.
#[test]
fn hostile_yaml_is_refused_at_start() {
    // Duplicate keys.
    let e = load_error("domain: d\ndomain: e\n");
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    assert!(e.to_lowercase().contains("duplicate"), "{e}");
    // An alias bomb (a billion laughs).
    let mut bomb = String::from(
        "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for (i, name) in ["b", "c", "d", "e", "f", "g", "h", "i"].iter().enumerate() {
        let prev = ["a", "b", "c", "d", "e", "f", "g", "h"][i];
        bomb.push_str(&format!("{name}: &{name} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"));
    }
    let started = std::time::Instant::now();
    let e = load_error(&bomb);
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // Nested far deeper than any descriptor.
    let mut deep = String::from("domain: d\ndescriptors:\n");
    for i in 0..200 {
        deep.push_str(&"  ".repeat(i + 1));
        deep.push_str("- key: k\n");
        deep.push_str(&"  ".repeat(i + 2));
        deep.push_str("descriptors:\n");
    }
    let e = load_error(&deep);
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    let deep_flow = format!(
        "domain: d\ndescriptors: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let e = load_error(&deep_flow);
    assert!(e.starts_with("policy: bad.yaml: "), "{e}");
    // 17 levels of descriptors: more entries than a descriptor may carry.
    let mut seventeen = String::from("domain: d\ndescriptors:\n");
    for i in 0..17 {
        seventeen.push_str(&format!(
            "{}- key: k{i}\n{}descriptors:\n",
            "  ".repeat(2 * i + 1),
            "  ".repeat(2 * i + 2)
        ));
    }
    let e = load_error(&seventeen);
    assert!(
        e.ends_with("descriptors: nested deeper than 16 levels"),
        "{e}"
    );
    // A huge file.
    let huge = format!("domain: d\n# {}\n", "x".repeat(5 << 20));
    let e = load_error(&huge);
    assert_eq!(
        e,
        format!(
            "policy: bad.yaml: {} bytes, at most 4194304 are read",
            huge.len()
        )
    );
}
