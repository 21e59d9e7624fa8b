//! The environment variables of Envoy's reference rate limit service
//! (envoyproxy/ratelimit) as [`ReferenceEnv`]: each one that means
//! something here is honoured, each one that would change what the service
//! does and cannot be honoured is refused at start with its name
//! ([`EnvError`], [`REFUSED`]), and those that only tune the reference's
//! own machinery (pool sizes, pipelining, stats flushing) or configure one
//! of its features that is off (TLS files, xDS, statsd, memcached,
//! tracing) are accepted and listed once in the start-up log
//! ([`ReferenceEnv::no_effect`], [`NO_EFFECT`]). Every variable of the
//! reference's `settings.go` is in one of [`HONOURED`], [`REFUSED`] and
//! [`NO_EFFECT`] (`env::tests` checks it).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tiered_ratelimit::policy::RedisConfig;

/// What the environment asks for. `None`: not set (the command line or
/// the default decides).
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ReferenceEnv {
    /// `RUNTIME_ROOT`/`RUNTIME_SUBDIRECTORY`/`RUNTIME_APPDIRECTORY`
    /// (`config` by default): the directory of YAML files.
    pub config_dir: Option<PathBuf>,
    /// `RUNTIME_ROOT`: what a reload watches under `RUNTIME_WATCH_ROOT`
    /// (a symlink swap of the whole runtime directory is seen).
    pub runtime_root: Option<PathBuf>,
    /// `RUNTIME_IGNOREDOTFILES`: skip files whose name starts with `.`
    /// (names starting with `..`, a ConfigMap mount's, are always skipped).
    pub ignore_dotfiles: bool,
    /// `RUNTIME_WATCH_ROOT` (default true): what a reload watches (the
    /// runtime root, or the config directory).
    pub watch_root: bool,
    /// `GRPC_HOST`:`GRPC_PORT` (defaults 0.0.0.0 and 8081).
    pub grpc: Option<SocketAddr>,
    /// `HOST`:`PORT` (defaults 0.0.0.0 and 8080): where the HTTP
    /// `/healthcheck` and `/json` listen.
    pub http: Option<SocketAddr>,
    /// `USE_PROMETHEUS=true` and `PROMETHEUS_ADDR` (default `:9090`):
    /// where `GET /metrics` listens.
    pub metrics: Option<SocketAddr>,
    /// `REDIS_URL` with `REDIS_TYPE`, `REDIS_SOCKET_TYPE`, `REDIS_AUTH`.
    pub redis: Option<RedisConfig>,
    /// `REDIS_TIMEOUT`: the backend timeout.
    pub backend_timeout: Option<Duration>,
    /// `CACHE_KEY_PREFIX`: the storage keys' prefix.
    pub key_prefix: Option<String>,
    /// `SHADOW_MODE`: every limit decided and reported, never enforced.
    pub shadow_mode: bool,
    /// `LOG_LEVEL` as a tracing filter (`warn`, `debug`, …).
    pub log_level: Option<String>,
    /// `LIMIT_RESPONSE_HEADERS_ENABLED=true`: the three header names
    /// (`LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
    pub response_headers: Option<crate::LimitHeaders>,
    /// `NEAR_LIMIT_RATIO` (0 to 1; the reference's default 0.8 when
    /// unset): the share of a limit past which passing hits also count
    /// in the `near_limit` stat ([`crate::stats`]).
    pub near_limit_ratio: Option<f32>,
    /// `USE_CALENDAR_MONTH_RATE_LIMIT=true`: a `unit: month` limit counts
    /// per UTC calendar month, not per 30 days from the epoch.
    pub calendar_month: bool,
    /// `DISABLE_STATS=true`: no stats at all, so no metrics server (the
    /// stat sink variables are then not looked at).
    pub disable_stats: bool,
    /// The variables set that have no effect here (they tune the
    /// reference's own machinery, or configure a feature of it that is off).
    pub no_effect: Vec<String>,
}

/// The reference's variables honoured here (the refused ones are honoured
/// at their "off" values too).
pub const HONOURED: &[&str] = &[
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "RUNTIME_APPDIRECTORY",
    "RUNTIME_IGNOREDOTFILES",
    "RUNTIME_WATCH_ROOT",
    "GRPC_HOST",
    "GRPC_PORT",
    "HOST",
    "PORT",
    "USE_PROMETHEUS",
    "PROMETHEUS_ADDR",
    "DISABLE_STATS",
    "REDIS_URL",
    "REDIS_TYPE",
    "REDIS_SOCKET_TYPE",
    "REDIS_AUTH",
    "REDIS_TIMEOUT",
    "CACHE_KEY_PREFIX",
    "SHADOW_MODE",
    "LOG_LEVEL",
    "NEAR_LIMIT_RATIO",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "USE_CALENDAR_MONTH_RATE_LIMIT",
];

/// A variable refused at start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// Set to a value this service cannot honour.
    #[error("{name}={value}: {why}")]
    Unsupported {
        /// The variable.
        name: String,
        /// Its value.
        value: String,
        /// Why.
        why: &'static str,
    },
    /// Not a valid value.
    #[error("{name}={value}: {why}")]
    Invalid {
        /// The variable.
        name: String,
        /// Its value.
        value: String,
        /// What is expected.
        why: String,
    },
}

/// Variables with no effect here: they tune the reference's own machinery,
/// or configure one of its features that is off (each of those features
/// is refused when turned on: [`REFUSED`]).
pub const NO_EFFECT: &[&str] = &[
    // Tuning.
    "REDIS_POOL_SIZE",
    "REDIS_PIPELINE_WINDOW",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    "REDIS_STARTUP_INITIAL_INTERVAL",
    "REDIS_STARTUP_MAX_INTERVAL",
    "REDIS_STARTUP_MAX_ELAPSED_TIME",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "STATS_FLUSH_INTERVAL",
    "DEBUG_HOST",
    "DEBUG_PORT",
    "GRPC_MAX_CONNECTION_AGE",
    "GRPC_MAX_CONNECTION_AGE_GRACE",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
    // gRPC TLS (GRPC_SERVER_USE_TLS).
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_CLIENT_TLS_SAN",
    // xDS (CONFIG_TYPE=GRPC_XDS_SOTW).
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
    // statsd and DogStatsD (USE_STATSD, USE_DOG_STATSD).
    "STATSD_HOST",
    "STATSD_PORT",
    "USE_DOG_STATSD_MOGRIFIERS",
    // TLS to Redis (REDIS_TLS).
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    // The per-second Redis (REDIS_PERSECOND).
    "REDIS_PERSECOND_SOCKET_TYPE",
    "REDIS_PERSECOND_TYPE",
    "REDIS_PERSECOND_URL",
    "REDIS_PERSECOND_POOL_SIZE",
    "REDIS_PERSECOND_AUTH",
    "REDIS_PERSECOND_TLS",
    "REDIS_PERSECOND_SENTINEL_AUTH",
    "REDIS_PERSECOND_PIPELINE_WINDOW",
    "REDIS_PERSECOND_PIPELINE_LIMIT",
    "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
    "REDIS_PERSECOND_TIMEOUT",
    "REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR",
    // memcached (MEMCACHE_HOST_PORT, MEMCACHE_SRV).
    "MEMCACHE_MAX_IDLE_CONNS",
    "MEMCACHE_SRV_REFRESH",
    "MEMCACHE_TLS",
    "MEMCACHE_TLS_CLIENT_CERT",
    "MEMCACHE_TLS_CLIENT_KEY",
    "MEMCACHE_TLS_CACERT",
    "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
    // Tracing (TRACING_ENABLED).
    "TRACING_SERVICE_NAME",
    "TRACING_SERVICE_NAMESPACE",
    "TRACING_SERVICE_INSTANCE_ID",
    "TRACING_EXPORTER_PROTOCOL",
    "TRACING_SAMPLING_RATE",
];

/// The stat sink variables: not looked at under `DISABLE_STATS=true`, as
/// the reference ignores them then.
const STAT_SINKS: &[&str] = &[
    "USE_STATSD",
    "USE_DOG_STATSD",
    "PROMETHEUS_PATH",
    "PROMETHEUS_MAPPER_YAML",
    "EXTRA_TAGS",
];

/// Variables refused when set to anything but their "off" values.
pub const REFUSED: &[(&str, &[&str], &str)] = &[
    (
        "BACKEND_TYPE",
        &["redis"],
        "only Redis (or memory without REDIS_URL) is supported",
    ),
    (
        "CONFIG_TYPE",
        &["FILE"],
        "only file configuration is supported (no xDS)",
    ),
    (
        "MERGE_DOMAIN_CONFIG",
        &["false"],
        "several files with one domain are not merged",
    ),
    ("QUOTA_MODE", &["false"], "quota mode is not supported"),
    (
        "RESPONSE_DYNAMIC_METADATA",
        &["false"],
        "dynamic metadata is not sent",
    ),
    (
        "REDIS_PERSECOND",
        &["false"],
        "a second Redis for per-second limits is not supported",
    ),
    ("REDIS_TLS", &["false"], "TLS to Redis is not supported"),
    (
        "REDIS_SENTINEL_AUTH",
        &[""],
        "put the password in the sentinel address instead",
    ),
    (
        "GRPC_SERVER_USE_TLS",
        &["false"],
        "serve TLS from a sidecar or Envoy",
    ),
    ("GRPC_UDS", &[""], "a Unix socket listener is not supported"),
    (
        "USE_STATSD",
        &["false"],
        "statsd is not exported; metrics are Prometheus (USE_PROMETHEUS)",
    ),
    ("USE_DOG_STATSD", &["false"], "DogStatsD is not exported"),
    (
        "TRACING_ENABLED",
        &["false"],
        "OpenTelemetry tracing is not exported",
    ),
    ("LOG_FORMAT", &["text"], "logs are text"),
    (
        "LOCAL_CACHE_SIZE_IN_BYTES",
        &["0"],
        "the engine's own deny cache replaces it",
    ),
    (
        "PROMETHEUS_PATH",
        &["/metrics"],
        "metrics are served at /metrics",
    ),
    ("PROMETHEUS_MAPPER_YAML", &[""], "stat names are fixed"),
    (
        "EXTRA_TAGS",
        &[""],
        "no tags are added: the per-limit series carry domain, key1 and key2",
    ),
    ("MEMCACHE_HOST_PORT", &[""], "memcached is not supported"),
    ("MEMCACHE_SRV", &[""], "memcached is not supported"),
];

fn boolean(name: &str, value: &str) -> Result<bool, EnvError> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" | "" => Ok(false),
        _ => Err(EnvError::Invalid {
            name: name.into(),
            value: value.into(),
            why: "expected true or false".into(),
        }),
    }
}

impl ReferenceEnv {
    /// The reference's variables among `vars` (the others are not looked
    /// at).
    ///
    /// # Errors
    /// [`EnvError`] naming the first variable refused or invalid.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, EnvError> {
        let vars: std::collections::BTreeMap<String, String> = vars.into_iter().collect();
        let get = |n: &str| vars.get(n).map(String::as_str);
        let invalid = |name: &str, value: &str, why: &str| EnvError::Invalid {
            name: name.into(),
            value: value.into(),
            why: why.into(),
        };
        let disable_stats = match get("DISABLE_STATS") {
            Some(v) => boolean("DISABLE_STATS", v)?,
            None => false,
        };
        for (name, off, why) in REFUSED {
            if disable_stats && STAT_SINKS.contains(name) {
                continue;
            }
            if let Some(v) = get(name) {
                if !off.iter().any(|o| o.eq_ignore_ascii_case(v.trim())) {
                    return Err(EnvError::Unsupported {
                        name: (*name).into(),
                        value: v.into(),
                        why,
                    });
                }
            }
        }
        let mut env = Self {
            watch_root: true,
            disable_stats,
            ..Self::default()
        };
        if let Some(v) = get("USE_CALENDAR_MONTH_RATE_LIMIT") {
            env.calendar_month = boolean("USE_CALENDAR_MONTH_RATE_LIMIT", v)?;
        }
        env.no_effect = NO_EFFECT
            .iter()
            .filter(|n| get(n).is_some())
            .map(|n| (*n).to_owned())
            .collect();
        if let Some(root) = get("RUNTIME_ROOT") {
            let mut dir = PathBuf::from(root);
            if let Some(sub) = get("RUNTIME_SUBDIRECTORY").filter(|s| !s.is_empty()) {
                dir.push(sub);
            }
            dir.push(get("RUNTIME_APPDIRECTORY").unwrap_or("config"));
            env.config_dir = Some(dir);
            env.runtime_root = Some(PathBuf::from(root));
        }
        if let Some(v) = get("RUNTIME_IGNOREDOTFILES") {
            env.ignore_dotfiles = boolean("RUNTIME_IGNOREDOTFILES", v)?;
        }
        if let Some(v) = get("RUNTIME_WATCH_ROOT") {
            env.watch_root = boolean("RUNTIME_WATCH_ROOT", v)?;
        }
        if get("GRPC_HOST").is_some() || get("GRPC_PORT").is_some() {
            let host = get("GRPC_HOST").unwrap_or("0.0.0.0");
            let port = get("GRPC_PORT").unwrap_or("8081");
            let addr = format!("{host}:{port}");
            env.grpc = Some(addr.parse().map_err(|_| {
                invalid(
                    "GRPC_HOST/GRPC_PORT",
                    &addr,
                    "expected an IP address and a port",
                )
            })?);
        }
        if get("HOST").is_some() || get("PORT").is_some() {
            let addr = format!(
                "{}:{}",
                get("HOST").unwrap_or("0.0.0.0"),
                get("PORT").unwrap_or("8080")
            );
            env.http =
                Some(addr.parse().map_err(|_| {
                    invalid("HOST/PORT", &addr, "expected an IP address and a port")
                })?);
        }
        if let Some(v) = get("USE_PROMETHEUS").filter(|_| !disable_stats) {
            if boolean("USE_PROMETHEUS", v)? {
                let addr = get("PROMETHEUS_ADDR").unwrap_or(":9090");
                let full = match addr.strip_prefix(':') {
                    Some(port) => format!("0.0.0.0:{port}"),
                    None => addr.to_owned(),
                };
                env.metrics = Some(
                    full.parse()
                        .map_err(|_| invalid("PROMETHEUS_ADDR", addr, "expected [host]:port"))?,
                );
            }
        }
        if let Some(url) = get("REDIS_URL").filter(|u| !u.is_empty()) {
            env.redis = Some(redis(
                url,
                get("REDIS_TYPE"),
                get("REDIS_SOCKET_TYPE"),
                get("REDIS_AUTH"),
            )?);
        }
        if let Some(v) = get("REDIS_TIMEOUT") {
            env.backend_timeout = Some(
                humantime::parse_duration(v)
                    .map_err(|e| invalid("REDIS_TIMEOUT", v, &e.to_string()))?,
            );
        }
        env.key_prefix = get("CACHE_KEY_PREFIX")
            .filter(|p| !p.is_empty())
            .map(str::to_owned);
        if let Some(v) = get("SHADOW_MODE") {
            env.shadow_mode = boolean("SHADOW_MODE", v)?;
        }
        if let Some(v) = get("LOG_LEVEL") {
            let level = match v.to_ascii_lowercase().as_str() {
                "trace" => "trace",
                "debug" => "debug",
                "info" => "info",
                "warn" | "warning" => "warn",
                "error" | "fatal" | "panic" => "error",
                _ => {
                    return Err(invalid(
                        "LOG_LEVEL",
                        v,
                        "expected debug, info, warn or error",
                    ))
                }
            };
            env.log_level = Some(level.to_owned());
        }
        if let Some(v) = get("NEAR_LIMIT_RATIO") {
            let ratio = v
                .trim()
                .parse::<f32>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| invalid("NEAR_LIMIT_RATIO", v, "expected a number from 0 to 1"))?;
            env.near_limit_ratio = Some(ratio);
        }
        if let Some(v) = get("LIMIT_RESPONSE_HEADERS_ENABLED") {
            if boolean("LIMIT_RESPONSE_HEADERS_ENABLED", v)? {
                let name = |var: &str, default: &str| -> Result<http::HeaderName, EnvError> {
                    let v = get(var).unwrap_or(default);
                    http::HeaderName::try_from(v)
                        .map_err(|_| invalid(var, v, "expected a header name"))
                };
                env.response_headers = Some(crate::LimitHeaders {
                    limit: name("LIMIT_LIMIT_HEADER", "RateLimit-Limit")?,
                    remaining: name("LIMIT_REMAINING_HEADER", "RateLimit-Remaining")?,
                    reset: name("LIMIT_RESET_HEADER", "RateLimit-Reset")?,
                });
            }
        }
        Ok(env)
    }
}

/// The reference's Redis address forms: `host:port` (or a socket path
/// under `REDIS_SOCKET_TYPE=unix`, its default), `host:port,host:port` for
/// a cluster, `master,host:port,…` for Sentinel; `REDIS_AUTH` is
/// `password` or `user:password`.
fn redis(
    url: &str,
    kind: Option<&str>,
    socket: Option<&str>,
    auth: Option<&str>,
) -> Result<RedisConfig, EnvError> {
    let invalid = |name: &str, value: &str, why: &str| EnvError::Invalid {
        name: name.into(),
        value: value.into(),
        why: why.into(),
    };
    let userinfo = match auth.filter(|a| !a.is_empty()) {
        None => String::new(),
        Some(a) if a.contains(':') => format!("{a}@"),
        Some(a) => format!(":{a}@"),
    };
    let unix = match socket.unwrap_or("unix").to_ascii_lowercase().as_str() {
        "unix" => true,
        "tcp" => false,
        other => return Err(invalid("REDIS_SOCKET_TYPE", other, "expected tcp or unix")),
    };
    let tcp = |hostport: &str| format!("redis://{userinfo}{}/", hostport.trim());
    let mut config = RedisConfig::default();
    match kind.unwrap_or("single").to_ascii_lowercase().as_str() {
        "single" => {
            config.url = Some(if unix {
                if !userinfo.is_empty() {
                    return Err(invalid(
                        "REDIS_AUTH",
                        "***",
                        "not supported over a Unix socket",
                    ));
                }
                format!("redis+unix://{url}")
            } else {
                tcp(url)
            });
        }
        "cluster" if !unix => config.cluster_nodes = url.split(',').map(tcp).collect(),
        "sentinel" if !unix => {
            let mut parts = url.split(',');
            let master = parts.next().unwrap_or_default().trim();
            let sentinels: Vec<String> = parts.map(|s| format!("redis://{}/", s.trim())).collect();
            if master.is_empty() || sentinels.is_empty() {
                return Err(invalid(
                    "REDIS_URL",
                    url,
                    "expected master,host:port[,host:port…]",
                ));
            }
            config.master_name = Some(master.to_owned());
            config.sentinels = sentinels;
            if let Some(a) = auth.filter(|a| !a.is_empty()) {
                match a.split_once(':') {
                    Some((user, pass)) => {
                        config.username = Some(user.to_owned());
                        config.password = Some(pass.to_owned());
                    }
                    None => config.password = Some(a.to_owned()),
                }
            }
        }
        "cluster" | "sentinel" => {
            return Err(invalid(
                "REDIS_SOCKET_TYPE",
                "unix",
                "a cluster or Sentinel is reached over tcp",
            ))
        }
        other => {
            return Err(invalid(
                "REDIS_TYPE",
                other,
                "expected single, cluster or sentinel",
            ))
        }
    }
    Ok(config)
}

#[cfg(test)]
mod tests;
