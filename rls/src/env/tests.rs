//! The reference environment variables read, refused and defaulted.

use super::*;

fn env(vars: &[(&str, &str)]) -> Result<ReferenceEnv, EnvError> {
    ReferenceEnv::from_vars(vars.iter().map(|(k, v)| ((*k).into(), (*v).into())))
}

#[test]
fn the_reference_variables_are_honoured() {
    let e = env(&[
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("GRPC_PORT", "9001"),
        ("PORT", "9002"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis.local:6380"),
        ("REDIS_AUTH", "secret"),
        ("SHADOW_MODE", "true"),
        ("LOG_LEVEL", "DEBUG"),
        ("USE_STATSD", "false"),
        ("REDIS_POOL_SIZE", "20"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("LIMIT_RESET_HEADER", "X-Reset"),
    ])
    .unwrap();
    assert_eq!(e.config_dir, Some(PathBuf::from("/data/ratelimit/config")));
    assert!(e.ignore_dotfiles);
    assert!(!e.watch_root);
    assert_eq!(e.grpc, Some("0.0.0.0:9001".parse().unwrap()));
    assert_eq!(e.http, Some("0.0.0.0:9002".parse().unwrap()));
    assert_eq!(
        e.redis.unwrap().url.as_deref(),
        Some("redis://:secret@redis.local:6380/")
    );
    assert!(e.shadow_mode);
    assert_eq!(e.log_level.as_deref(), Some("debug"));
    assert_eq!(e.no_effect, ["REDIS_POOL_SIZE"]);
    let h = e.response_headers.unwrap();
    assert_eq!(
        [h.limit.as_str(), h.remaining.as_str(), h.reset.as_str()],
        ["ratelimit-limit", "ratelimit-remaining", "x-reset"]
    );
    let c = env(&[
        ("REDIS_TYPE", "cluster"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "a:1,b:2"),
    ])
    .unwrap()
    .redis
    .unwrap();
    assert_eq!(c.cluster_nodes, ["redis://a:1/", "redis://b:2/"]);
    let s = env(&[
        ("REDIS_TYPE", "SENTINEL"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
    ])
    .unwrap()
    .redis
    .unwrap();
    assert_eq!(s.master_name.as_deref(), Some("mymaster"));
    assert_eq!(s.sentinels, ["redis://s1:26379/", "redis://s2:26379/"]);
    let u = env(&[("REDIS_URL", "/var/run/redis.sock")])
        .unwrap()
        .redis
        .unwrap();
    assert_eq!(u.url.as_deref(), Some("redis+unix:///var/run/redis.sock"));
    let m = env(&[("USE_PROMETHEUS", "true")]).unwrap();
    assert_eq!(m.metrics, Some("0.0.0.0:9090".parse().unwrap()));
    assert_eq!(m.near_limit_ratio, None);
    let n = env(&[("NEAR_LIMIT_RATIO", "0.7")]).unwrap();
    assert_eq!(n.near_limit_ratio, Some(0.7));
    assert!(n.no_effect.is_empty());
}

#[test]
fn the_near_limit_threshold_is_the_reference_s_float32_product() {
    use crate::stats::{near_limit_threshold, NEAR_LIMIT_RATIO};
    assert_eq!(near_limit_threshold(5, NEAR_LIMIT_RATIO), 4);
    assert_eq!(near_limit_threshold(10, NEAR_LIMIT_RATIO), 8);
    assert_eq!(near_limit_threshold(10, 0.7), 7);
    // In 32 bits 90 × 0.7 rounds to 63; in 64 bits it is 62.999999…
    assert_eq!(near_limit_threshold(90, 0.7), 63);
    assert_eq!(near_limit_threshold(10, 0.0), 0);
    assert_eq!(near_limit_threshold(10, 1.0), 10);
    assert_eq!(near_limit_threshold(u32::MAX, 1.0), 4_294_967_296);
}

#[test]
fn a_variable_that_cannot_be_honoured_is_refused_by_name() {
    let rows = [
        (
            ("USE_STATSD", "true"),
            "USE_STATSD=true: statsd is not exported; metrics are Prometheus (USE_PROMETHEUS)",
        ),
        (
            ("BACKEND_TYPE", "memcache"),
            "BACKEND_TYPE=memcache: only Redis (or memory without REDIS_URL) is supported",
        ),
        (
            ("MERGE_DOMAIN_CONFIG", "true"),
            "MERGE_DOMAIN_CONFIG=true: several files with one domain are not merged",
        ),
        (
            ("REDIS_TLS", "true"),
            "REDIS_TLS=true: TLS to Redis is not supported",
        ),
        (
            ("PORT", "http"),
            "HOST/PORT=0.0.0.0:http: expected an IP address and a port",
        ),
        (
            ("SHADOW_MODE", "maybe"),
            "SHADOW_MODE=maybe: expected true or false",
        ),
        (
            ("REDIS_TYPE", "ring"),
            "REDIS_TYPE=ring: expected single, cluster or sentinel",
        ),
        (
            ("LOG_LEVEL", "loud"),
            "LOG_LEVEL=loud: expected debug, info, warn or error",
        ),
        (
            ("NEAR_LIMIT_RATIO", "1.5"),
            "NEAR_LIMIT_RATIO=1.5: expected a number from 0 to 1",
        ),
        (
            ("NEAR_LIMIT_RATIO", "most"),
            "NEAR_LIMIT_RATIO=most: expected a number from 0 to 1",
        ),
    ];
    for ((k, v), expected) in rows {
        let vars: &[(&str, &str)] = if k == "REDIS_TYPE" {
            &[(k, v), ("REDIS_URL", "x:1"), ("REDIS_SOCKET_TYPE", "tcp")]
        } else {
            &[(k, v)]
        };
        assert_eq!(env(vars).unwrap_err().to_string(), expected);
    }
}
