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

/// Every variable of the reference's `src/settings/settings.go` (the
/// `envconfig` tags, in its order; `USE_CALENDAR_MONTH_RATE_LIMIT` from its
/// calendar-month change) as of this writing.
const REFERENCE_SETTINGS: &[&str] = &[
    "HOST",
    "PORT",
    "DEBUG_HOST",
    "DEBUG_PORT",
    "GRPC_UDS",
    "GRPC_HOST",
    "GRPC_PORT",
    "GRPC_MAX_CONNECTION_AGE",
    "GRPC_MAX_CONNECTION_AGE_GRACE",
    "GRPC_SERVER_USE_TLS",
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_CLIENT_TLS_SAN",
    "LOG_LEVEL",
    "LOG_FORMAT",
    "CONFIG_TYPE",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
    "CONFIG_GRPC_XDS_NODE_ID",
    "CONFIG_GRPC_XDS_NODE_METADATA",
    "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
    "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
    "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
    "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
    "XDS_CLIENT_BACKOFF_JITTER",
    "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
    "USE_DOG_STATSD",
    "USE_DOG_STATSD_MOGRIFIERS",
    "USE_STATSD",
    "STATSD_HOST",
    "STATSD_PORT",
    "EXTRA_TAGS",
    "STATS_FLUSH_INTERVAL",
    "DISABLE_STATS",
    "USE_PROMETHEUS",
    "PROMETHEUS_ADDR",
    "PROMETHEUS_PATH",
    "PROMETHEUS_MAPPER_YAML",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "RUNTIME_APPDIRECTORY",
    "RUNTIME_IGNOREDOTFILES",
    "RUNTIME_WATCH_ROOT",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "NEAR_LIMIT_RATIO",
    "CACHE_KEY_PREFIX",
    "BACKEND_TYPE",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "REDIS_SOCKET_TYPE",
    "REDIS_TYPE",
    "REDIS_URL",
    "REDIS_POOL_SIZE",
    "REDIS_AUTH",
    "REDIS_TLS",
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_PERSECOND",
    "REDIS_PERSECOND_SOCKET_TYPE",
    "REDIS_PERSECOND_TYPE",
    "REDIS_PERSECOND_URL",
    "REDIS_PERSECOND_POOL_SIZE",
    "REDIS_PERSECOND_AUTH",
    "REDIS_PERSECOND_TLS",
    "REDIS_SENTINEL_AUTH",
    "REDIS_PERSECOND_SENTINEL_AUTH",
    "REDIS_PERSECOND_PIPELINE_WINDOW",
    "REDIS_PERSECOND_PIPELINE_LIMIT",
    "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_TIMEOUT",
    "REDIS_PERSECOND_TIMEOUT",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_STARTUP_INITIAL_INTERVAL",
    "REDIS_STARTUP_MAX_INTERVAL",
    "REDIS_STARTUP_MAX_ELAPSED_TIME",
    "MEMCACHE_HOST_PORT",
    "MEMCACHE_MAX_IDLE_CONNS",
    "MEMCACHE_SRV",
    "MEMCACHE_SRV_REFRESH",
    "MEMCACHE_TLS",
    "MEMCACHE_TLS_CLIENT_CERT",
    "MEMCACHE_TLS_CLIENT_KEY",
    "MEMCACHE_TLS_CACERT",
    "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
    "SHADOW_MODE",
    "QUOTA_MODE",
    "RESPONSE_DYNAMIC_METADATA",
    "MERGE_DOMAIN_CONFIG",
    "TRACING_ENABLED",
    "TRACING_SERVICE_NAME",
    "TRACING_SERVICE_NAMESPACE",
    "TRACING_SERVICE_INSTANCE_ID",
    "TRACING_EXPORTER_PROTOCOL",
    "TRACING_SAMPLING_RATE",
    "USE_CALENDAR_MONTH_RATE_LIMIT",
];

#[test]
fn every_reference_variable_is_honoured_refused_or_of_no_effect() {
    let refused: Vec<&str> = REFUSED.iter().map(|r| r.0).collect();
    for name in REFERENCE_SETTINGS {
        let classes = [
            HONOURED.contains(name),
            refused.contains(name),
            NO_EFFECT.contains(name),
        ];
        assert_eq!(
            classes.iter().filter(|c| **c).count(),
            1,
            "{name}: honoured, refused, no effect = {classes:?}"
        );
    }
    // And nothing is listed that the reference does not read.
    for name in HONOURED.iter().chain(&refused).chain(NO_EFFECT) {
        assert!(REFERENCE_SETTINGS.contains(name), "{name}");
    }
    assert_eq!(REFERENCE_SETTINGS.len(), 115);
}

#[test]
fn calendar_months_disabled_stats_and_extra_tags() {
    assert!(!env(&[]).unwrap().calendar_month);
    assert!(
        env(&[("USE_CALENDAR_MONTH_RATE_LIMIT", "true")])
            .unwrap()
            .calendar_month
    );
    assert_eq!(
        env(&[("USE_CALENDAR_MONTH_RATE_LIMIT", "monthly")])
            .unwrap_err()
            .to_string(),
        "USE_CALENDAR_MONTH_RATE_LIMIT=monthly: expected true or false"
    );
    // DISABLE_STATS=true: no metrics, and the sinks are not looked at (the
    // reference's default USE_STATSD=true included).
    let d = env(&[
        ("DISABLE_STATS", "true"),
        ("USE_STATSD", "true"),
        ("USE_PROMETHEUS", "true"),
        ("EXTRA_TAGS", "team:edge"),
    ])
    .unwrap();
    assert!(d.disable_stats);
    assert_eq!(d.metrics, None);
    assert_eq!(
        env(&[("EXTRA_TAGS", "team:edge")]).unwrap_err().to_string(),
        "EXTRA_TAGS=team:edge: no tags are added: the per-limit series carry domain, key1 and key2"
    );
    let x = env(&[
        ("CONFIG_GRPC_XDS_SERVER_URL", "xds:18000"),
        ("TRACING_SAMPLING_RATE", "0.1"),
    ])
    .unwrap();
    assert_eq!(
        x.no_effect,
        ["CONFIG_GRPC_XDS_SERVER_URL", "TRACING_SAMPLING_RATE"]
    );
}
