//! `tiered-ratelimit-rls`: the Envoy rate limit service (docs/envoy.md).
//!
//! ```sh
//! tiered-ratelimit-rls --config rls.toml --listen 0.0.0.0:8081 --metrics 0.0.0.0:9090
//! ```
//!
//! The backend is the rules file's `[redis]` table (a URL, cluster nodes, or
//! sentinels), or in memory without one. SIGTERM or Ctrl-C: health turns
//! `NOT_SERVING`, the calls in flight are answered, then it exits.

use clap::Parser;
use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, MemoryBackend};
use tiered_ratelimit::descriptor::{DomainLimiters, FailureStatus};
use tiered_ratelimit::descriptor::{ReferenceConfig, RulesPolicy};
use tiered_ratelimit::FailurePolicy;
use tiered_ratelimit_rls::env::ReferenceEnv;
use tiered_ratelimit_rls::reload::RecursiveMode;
use tiered_ratelimit_rls::{serve_http, Rls};

/// The Envoy rate limit service (envoy.service.ratelimit.v3) on tiered-ratelimit.
#[derive(Debug, Parser)]
#[command(name = "tiered-ratelimit-rls", version)]
struct Args {
    /// The rules file (TOML: domain, [[rule]] tables, [redis]), or the
    /// reference service's YAML: a `.yaml`/`.yml` file or a directory of
    /// them (one domain per file).
    /// Default: the reference's `RUNTIME_ROOT`/`RUNTIME_SUBDIRECTORY`/`config`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where the gRPC service listens (default: the reference's
    /// `GRPC_HOST`:`GRPC_PORT`, else 0.0.0.0:8081).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Where `GET /metrics` listens; `none` for no metrics server
    /// (default: `PROMETHEUS_ADDR` under `USE_PROMETHEUS=true`, else
    /// 0.0.0.0:9090).
    #[arg(long)]
    metrics: Option<String>,
    /// Where the reference's HTTP `/healthcheck` and `/json` listen;
    /// `none` for neither (default: the reference's `HOST`:`PORT`, else
    /// 0.0.0.0:8080 when serving its YAML, else none).
    #[arg(long)]
    http: Option<String>,
}

/// `--http`, else `HOST`:`PORT`, else `default`.
async fn http_listener(
    flag: Option<&str>,
    env: Option<SocketAddr>,
    default: Option<SocketAddr>,
) -> Result<Option<tokio::net::TcpListener>, Box<dyn std::error::Error>> {
    let addr = match flag {
        Some("none") => return Ok(None),
        Some(a) => Some(a.parse().map_err(|e| format!("--http {a}: {e}"))?),
        None => env.or(default),
    };
    let Some(addr) = addr else { return Ok(None) };
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--http (HOST/PORT) {addr}: {e}"))?;
    tracing::info!(addr = %l.local_addr()?, "HTTP /healthcheck and /json");
    Ok(Some(l))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Display, not Debug: the errors name the file's field or the flag.
            eprintln!("tiered-ratelimit-rls: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The reference service's variables first: one that cannot be honoured
    // stops the start, by name (docs/envoy.md).
    let env = ReferenceEnv::from_vars(std::env::vars())?;
    // Logs go to stdout; colours only when it is a terminal (a file, a
    // pipe or a log collector gets plain text). RUST_LOG, else LOG_LEVEL.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(env.log_level.as_deref().unwrap_or("info"))
            }),
        )
        .with_ansi(std::io::stdout().is_terminal())
        .init();
    if !env.no_effect.is_empty() {
        tracing::info!(
            variables = %env.no_effect.join(","),
            "these variables of the reference service have no effect here (docs/envoy.md)"
        );
    }
    let args = Args::parse();
    let config_path = args
        .config
        .clone()
        .or_else(|| env.config_dir.clone())
        .ok_or("--config: required (or the reference's RUNTIME_ROOT)")?;
    let listen = args
        .listen
        .or(env.grpc)
        .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 8081)));
    let metrics_addr = args
        .metrics
        .clone()
        .or_else(|| env.disable_stats.then(|| "none".to_owned()))
        .or_else(|| env.metrics.map(|a| a.to_string()))
        .unwrap_or_else(|| "0.0.0.0:9090".to_owned());
    let yaml = std::fs::metadata(&config_path).is_ok_and(|m| m.is_dir())
        || config_path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
    if yaml {
        let http = http_listener(
            args.http.as_deref(),
            env.http,
            Some(SocketAddr::from(([0, 0, 0, 0], 8080))),
        )
        .await?;
        return serve_reference(&config_path, listen, http, &metrics_addr, env).await;
    }
    let http = http_listener(args.http.as_deref(), env.http, None).await?;
    let policy = RulesPolicy::from_file(&config_path)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;
    let (backend, backend_text): (Backend, String) = match &policy.redis {
        Some(redis) => (redis.backend()?.into(), redis.to_string()),
        None => (
            MemoryBackend::new().into(),
            "memory (this process only)".to_owned(),
        ),
    };
    // Said at start-up, not on the first call: a backend that does not
    // answer refuses the start under `closed` (every call would fail), and
    // is one WARN line otherwise.
    let timeout = std::time::Duration::from_millis(policy.backend_timeout_ms)
        .max(std::time::Duration::from_secs(1));
    if let Err(e) = backend.ping(timeout).await {
        match policy.failure_policy {
            FailurePolicy::Closed => {
                return Err(
                    format!("failure_policy = \"closed\" and {e}: refusing to start").into(),
                )
            }
            FailurePolicy::Fallback => tracing::warn!(
                "{e}: calls are decided by the local fallback limiter until it answers"
            ),
            _ => tracing::warn!(
                "{e}: calls are answered OK (failure_policy = \"open\") until it answers"
            ),
        }
    }
    let rules = policy.rules.len();
    // The recorder first: what the limiter registers when it is built (the
    // mode gauges, lease counters at 0, every series' HELP text) is then
    // in the first scrape.
    let metrics = metrics_server(&metrics_addr).await?;
    let limiter = policy.limiter(backend.clone())?;
    let rls = Rls::new(limiter, policy.failure_status);
    // Reload: the file's directory (not recursively), the file read again.
    let load = {
        let path = config_path.clone();
        let (redis, failure_status) = (policy.redis.clone(), policy.failure_status);
        move || reload_rules(&path, &backend, redis.as_ref(), failure_status)
    };
    let watched = parent_dir(&config_path);
    let _watch = tiered_ratelimit_rls::reload::watch(
        watched.clone(),
        RecursiveMode::NonRecursive,
        rls.limiters(),
        load,
    )
    .map_err(|e| format!("{}: cannot watch for changes: {e}", watched.display()))?;
    let grpc = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("--listen {listen}: {e}"))?;
    tracing::info!(
        addr = %grpc.local_addr()?,
        domain = %policy.domain,
        backend = %backend_text,
        rules,
        "serving envoy.service.ratelimit.v3.RateLimitService"
    );
    serve_http(rls, grpc, http, metrics, shutdown_signal()).await?;
    Ok(())
}

/// Serves the reference service's YAML (a file or a directory) with its
/// environment: `REDIS_URL` & co. (else in memory), `CACHE_KEY_PREFIX`,
/// `REDIS_TIMEOUT`, `SHADOW_MODE`, `LIMIT_RESPONSE_HEADERS_ENABLED`,
/// `USE_CALENDAR_MONTH_RATE_LIMIT`. A backend failure is a gRPC error, as
/// the reference answers one.
async fn serve_reference(
    path: &std::path::Path,
    listen: SocketAddr,
    http: Option<tokio::net::TcpListener>,
    metrics_addr: &str,
    env: ReferenceEnv,
) -> Result<(), Box<dyn std::error::Error>> {
    let calendar_month = env.calendar_month;
    let read = move |path: &std::path::Path, ignore_dotfiles: bool| {
        ReferenceConfig::from_path(path, ignore_dotfiles).map(|c| {
            if calendar_month {
                c.calendar_months()
            } else {
                c
            }
        })
    };
    let config = read(path, env.ignore_dotfiles)?;
    let (backend, backend_text): (Backend, String) = match &env.redis {
        Some(redis) => (redis.backend()?.into(), redis.to_string()),
        None => (
            MemoryBackend::new().into(),
            "memory (this process only; REDIS_URL unset)".to_owned(),
        ),
    };
    let timeout = env.backend_timeout.unwrap_or(Duration::from_millis(100));
    if let Err(e) = backend.ping(timeout.max(Duration::from_secs(1))).await {
        tracing::warn!(
            "{e}: calls are answered the gRPC error UNAVAILABLE until it answers \
             (Envoy's failure_mode_deny decides, as with the reference service)"
        );
    }
    let metrics = metrics_server(metrics_addr).await?;
    let domains: Vec<String> = config.domains.iter().map(|d| d.domain.clone()).collect();
    let rules: usize = config.domains.iter().map(|d| d.rules.len()).sum();
    let prefix = env.key_prefix.clone().unwrap_or_else(|| "rls".to_owned());
    // A backend failure is a gRPC error, as the reference answers a Redis
    // error (it has no failure policy): Envoy's failure_mode_deny decides.
    let builder = move || {
        tiered_ratelimit::EngineBuilder::default()
            .headers(tiered_ratelimit::response::HeaderStyle::None)
            .backend_timeout(timeout)
            .failure_policy(FailurePolicy::Closed)
    };
    let limiters = config.limiters(&backend, &prefix, env.shadow_mode, builder)?;
    let mut rls = Rls::domains(limiters, FailureStatus::Unavailable)
        .engine_headers(false)
        .near_limit_ratio(
            env.near_limit_ratio
                .unwrap_or(tiered_ratelimit_rls::stats::NEAR_LIMIT_RATIO),
        );
    if let Some(h) = env.response_headers.clone() {
        rls = rls.limit_headers(h);
    }
    // Reload: RUNTIME_ROOT under RUNTIME_WATCH_ROOT (the reference's
    // default), else the config directory (or a file's directory).
    let watched = match (&env.runtime_root, env.watch_root) {
        (Some(root), true) => root.clone(),
        _ if path.is_dir() => path.to_owned(),
        _ => parent_dir(path),
    };
    let load = {
        let (path, backend) = (path.to_owned(), backend.clone());
        let (ignore, shadow) = (env.ignore_dotfiles, env.shadow_mode);
        move || {
            read(&path, ignore)
                .and_then(|c| c.limiters(&backend, &prefix, shadow, builder))
                .map_err(|e| e.to_string())
        }
    };
    let _watch = tiered_ratelimit_rls::reload::watch(
        watched.clone(),
        RecursiveMode::Recursive,
        rls.limiters(),
        load,
    )
    .map_err(|e| format!("{}: cannot watch for changes: {e}", watched.display()))?;
    let grpc = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("--listen {listen}: {e}"))?;
    tracing::info!(
        addr = %grpc.local_addr()?,
        domains = %domains.join(","),
        backend = %backend_text,
        rules,
        shadow_mode = env.shadow_mode,
        "serving envoy.service.ratelimit.v3.RateLimitService"
    );
    serve_http(rls, grpc, http, metrics, shutdown_signal()).await?;
    Ok(())
}

/// The directory holding `file` (`.` for a bare file name).
fn parent_dir(file: &std::path::Path) -> PathBuf {
    file.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf)
}

/// The TOML rules file read again for a reload, on the backend chosen at
/// start: a change of `[redis]` or `failure_status` is refused (they are
/// read at start only), so is any error the start would refuse.
fn reload_rules(
    path: &std::path::Path,
    backend: &Backend,
    redis: Option<&tiered_ratelimit::policy::RedisConfig>,
    failure_status: FailureStatus,
) -> Result<DomainLimiters, String> {
    let refuse = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let policy = RulesPolicy::from_file(path).map_err(|e| refuse(&e))?;
    if policy.redis.as_ref() != redis {
        return Err(refuse(
            &"[redis]: changed; the backend is read at start only (restart to change it)",
        ));
    }
    if policy.failure_status != failure_status {
        return Err(refuse(
            &"failure_status: changed; it is read at start only (restart to change it)",
        ));
    }
    let limiter = policy.limiter(backend.clone()).map_err(|e| refuse(&e))?;
    DomainLimiters::new([limiter]).map_err(|e| refuse(&e))
}

/// The recorder and the listener of `GET /metrics` (`none`: neither).
async fn metrics_server(
    addr: &str,
) -> Result<
    Option<(
        tokio::net::TcpListener,
        metrics_exporter_prometheus::PrometheusHandle,
    )>,
    Box<dyn std::error::Error>,
> {
    if addr == "none" {
        return Ok(None);
    }
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let addr: SocketAddr = addr.parse().map_err(|e| format!("--metrics {addr}: {e}"))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics {addr}: {e}"))?;
    tracing::info!(addr = %listener.local_addr()?, "metrics at GET /metrics");
    Ok(Some((listener, handle)))
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
