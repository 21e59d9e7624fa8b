//! An Envoy rate limit service (`envoy.service.ratelimit.v3.RateLimitService`)
//! on the tiered-ratelimit engine: [`Rls`] maps `ShouldRateLimit` onto a
//! [`DescriptorLimiter`] and back; [`serve`] runs it with `grpc.health.v1`
//! health, Prometheus `/metrics` and graceful shutdown. The
//! `tiered-ratelimit-rls` binary reads a rules file (see
//! [`RulesPolicy`](tiered_ratelimit::descriptor::RulesPolicy)) and serves it.
//! docs/envoy.md has the Envoy side.
//!
//! Every descriptor of a request is decided in one backend call, all or
//! nothing: no descriptor is charged unless every enforced one allows.

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as EnvoyCode, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use std::future::Future;
use std::time::Duration;
use tiered_ratelimit::descriptor::{
    Answer, Code, Descriptor, DescriptorLimiter, DomainLimiters, FailureStatus, RequestError,
    MAX_DESCRIPTORS,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

pub use envoy_types;

pub mod endpoints;
pub mod env;
pub mod reload;
pub mod stats;

/// The reference service's three response headers
/// (`LIMIT_RESPONSE_HEADERS_ENABLED`): the descriptor closest to its limit
/// (an `OVER_LIMIT` one first) as its `requests_per_unit`, its
/// `limit_remaining` and its `duration_until_reset` in whole seconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHeaders {
    /// Default `RateLimit-Limit` (`LIMIT_LIMIT_HEADER`).
    pub limit: http::HeaderName,
    /// Default `RateLimit-Remaining` (`LIMIT_REMAINING_HEADER`).
    pub remaining: http::HeaderName,
    /// Default `RateLimit-Reset` (`LIMIT_RESET_HEADER`).
    pub reset: http::HeaderName,
}

/// The `ShouldRateLimit` service over [`DomainLimiters`] (one
/// [`DescriptorLimiter`] per domain).
#[derive(Debug, Clone)]
pub struct Rls {
    limiter: std::sync::Arc<arc_swap::ArcSwap<DomainLimiters>>,
    failure_status: FailureStatus,
    limit_headers: Option<LimitHeaders>,
    engine_headers: bool,
    near_limit_ratio: f32,
}

impl Rls {
    /// The service deciding one domain with `limiter`; `failure_status` is
    /// the answer when the backend fails under `FailurePolicy::Closed`.
    pub fn new(limiter: DescriptorLimiter, failure_status: FailureStatus) -> Self {
        // One limiter is one domain: `new` cannot refuse it.
        Self::domains(
            DomainLimiters::new([limiter]).unwrap_or_default(),
            failure_status,
        )
    }

    /// The service deciding every domain of `limiters` (another domain:
    /// `OK` without limits).
    pub fn domains(limiters: DomainLimiters, failure_status: FailureStatus) -> Self {
        Self {
            limiter: std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(limiters)),
            failure_status,
            limit_headers: None,
            engine_headers: true,
            near_limit_ratio: stats::NEAR_LIMIT_RATIO,
        }
    }

    /// The limiters in service, to swap a new configuration in
    /// ([`reload::watch`]): a call in flight finishes on the ones it started
    /// with.
    pub fn limiters(&self) -> std::sync::Arc<arc_swap::ArcSwap<DomainLimiters>> {
        self.limiter.clone()
    }

    /// Whether the engine's own fields (the limiter's header style, and
    /// `Retry-After` when over) go to `response_headers_to_add` (default
    /// true; the reference service sends none).
    #[must_use]
    pub fn engine_headers(mut self, on: bool) -> Self {
        self.engine_headers = on;
        self
    }

    /// The reference's `NEAR_LIMIT_RATIO`: the share of a limit (0 to 1,
    /// default 0.8, [`stats::NEAR_LIMIT_RATIO`]) past which passing hits
    /// also count in the `near_limit` stat ([`stats::record`]). A value
    /// outside 0 to 1 (or not a number) is clamped into it; the binary
    /// refuses it at start, naming the variable.
    #[must_use]
    pub fn near_limit_ratio(mut self, ratio: f32) -> Self {
        self.near_limit_ratio = if ratio.is_nan() {
            stats::NEAR_LIMIT_RATIO
        } else {
            ratio.clamp(0.0, 1.0)
        };
        self
    }

    /// Adds the reference's three response headers to every answer with a
    /// limit ([`LimitHeaders`]).
    #[must_use]
    pub fn limit_headers(mut self, headers: LimitHeaders) -> Self {
        self.limit_headers = Some(headers);
        self
    }

    /// Decides one request (what the gRPC method runs).
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a request that cannot be decided (an empty
    /// domain, no descriptors or more than [`MAX_DESCRIPTORS`], a
    /// descriptor without entries or with `is_negative_hits`), with the
    /// reason; `UNAVAILABLE` when the backend failed under `Closed` with
    /// `failure_status = "unavailable"`.
    pub async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if req.descriptors.len() > MAX_DESCRIPTORS {
            let e = RequestError::TooManyDescriptors(req.descriptors.len());
            return Err(Status::invalid_argument(e.to_string()));
        }
        if let Some(i) = req.descriptors.iter().position(|d| d.is_negative_hits) {
            return Err(Status::invalid_argument(format!(
                "descriptors[{i}]: is_negative_hits is not supported"
            )));
        }
        let descriptors: Vec<Descriptor<'_>> = req.descriptors.iter().map(descriptor).collect();
        let limiters = self.limiter.load_full();
        match limiters
            .check(&req.domain, &descriptors, u64::from(req.hits_addend))
            .await
        {
            Ok(answer) => {
                stats::record(req, &answer, self.near_limit_ratio);
                let mut r = response(&answer);
                if !self.engine_headers {
                    r.response_headers_to_add.clear();
                }
                if let Some(h) = &self.limit_headers {
                    add_limit_headers(&mut r, h);
                }
                Ok(r)
            }
            Err(RequestError::Unavailable) => match self.failure_status {
                FailureStatus::Unavailable => Err(Status::unavailable("rate limiter unavailable")),
                _ => Ok(RateLimitResponse {
                    overall_code: EnvoyCode::OverLimit.into(),
                    statuses: req
                        .descriptors
                        .iter()
                        .map(|_| DescriptorStatus {
                            code: EnvoyCode::OverLimit.into(),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }),
            },
            Err(e) => Err(Status::invalid_argument(e.to_string())),
        }
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.get_ref()).await.map(Response::new)
    }
}

fn descriptor(d: &RateLimitDescriptor) -> Descriptor<'_> {
    Descriptor {
        entries: d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect(),
        hits_addend: d.hits_addend.map(|h| h.value),
    }
}

/// The limiter's answer as Envoy's response.
fn response(a: &Answer) -> RateLimitResponse {
    let statuses = a
        .statuses
        .iter()
        .map(|s| DescriptorStatus {
            code: code(s.code).into(),
            current_limit: s.limit.as_ref().map(|l| RateLimit {
                name: l.name.to_string(),
                requests_per_unit: l.requests_per_unit,
                unit: unit(l.unit).into(),
            }),
            limit_remaining: if s.unlimited {
                u32::MAX
            } else {
                u32::try_from(s.remaining).unwrap_or(u32::MAX)
            },
            // A cost above the rule's capacity never passes: no reset to wait for.
            duration_until_reset: s
                .limit
                .as_ref()
                .filter(|_| !s.exceeds_capacity)
                .map(|_| proto_duration(s.until_reset)),
            quota: None,
        })
        .collect();
    let mut headers = http::HeaderMap::new();
    if let Some(h) = &a.headers {
        h.write(&mut headers);
    }
    // A descriptor whose cost exceeds its rule's capacity never passes:
    // the 429's body says so (Envoy sends `raw_body` as the local reply).
    let raw_body = a
        .statuses
        .iter()
        .find(|s| s.exceeds_capacity)
        .and_then(|s| s.limit.as_ref())
        .map(|l| {
            format!(
                // Rule names are `[A-Za-z0-9_-]` (checked when built): no escaping.
                "{{\"error\":\"cost_exceeds_capacity\",\"rule\":\"{}\",\"limit\":{}}}",
                l.rule,
                l.quota.burst_size()
            )
            .into_bytes()
        })
        .unwrap_or_default();
    if !raw_body.is_empty() {
        // No wait lets it pass: SDKs that retry every 429 stop on this (as
        // the HTTP front door's never-fits 429 says).
        headers.insert(
            tiered_ratelimit::response::X_SHOULD_RETRY,
            http::HeaderValue::from_static("false"),
        );
    }
    RateLimitResponse {
        overall_code: code(a.overall).into(),
        raw_body,
        statuses,
        response_headers_to_add: headers
            .iter()
            .filter_map(|(k, v)| {
                Some(HeaderValue {
                    key: k.as_str().to_owned(),
                    value: v.to_str().ok()?.to_owned(),
                    ..Default::default()
                })
            })
            .collect(),
        ..Default::default()
    }
}

/// The reference's choice: the least `limit_remaining` among statuses with
/// a limit, and any `OVER_LIMIT` one over it (the last).
fn add_limit_headers(r: &mut RateLimitResponse, names: &LimitHeaders) {
    let mut chosen: Option<&DescriptorStatus> = None;
    for s in &r.statuses {
        if s.current_limit.is_none() {
            continue;
        }
        let over = s.code == EnvoyCode::OverLimit as i32;
        let chosen_over = chosen.is_some_and(|c| c.code == EnvoyCode::OverLimit as i32);
        if over || (!chosen_over && chosen.is_none_or(|c| s.limit_remaining < c.limit_remaining)) {
            chosen = Some(s);
        }
    }
    let Some(s) = chosen else { return };
    let reset = s
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds.saturating_add(i64::from(d.nanos > 0)));
    let per_unit = s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
    let headers = [
        (&names.limit, per_unit.to_string()),
        (&names.remaining, s.limit_remaining.to_string()),
        (&names.reset, reset.to_string()),
    ];
    for (k, v) in headers {
        r.response_headers_to_add.push(HeaderValue {
            key: k.as_str().to_owned(),
            value: v,
            ..Default::default()
        });
    }
}

fn code(c: Code) -> EnvoyCode {
    match c {
        Code::Ok => EnvoyCode::Ok,
        Code::OverLimit => EnvoyCode::OverLimit,
    }
}

fn proto_duration(d: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

fn unit(u: tiered_ratelimit::descriptor::Unit) -> Unit {
    use tiered_ratelimit::descriptor::Unit as U;
    match u {
        U::Second => Unit::Second,
        U::Minute => Unit::Minute,
        U::Hour => Unit::Hour,
        U::Day => Unit::Day,
        U::Week => Unit::Week,
        U::Month => Unit::Month,
        U::Year => Unit::Year,
        _ => Unit::Unknown,
    }
}

/// Serves `rls` on `grpc` (with `grpc.health.v1` health: `""` and the
/// rate limit service `SERVING` until shutdown) and, given one, Prometheus'
/// text format at `GET /metrics` on `metrics` (from the recorder `handle`
/// installed by the caller). Returns when `shutdown` resolves and the
/// calls in flight are answered (health turns `NOT_SERVING` first) and
/// the token leases of rules in lease mode are returned.
///
/// # Errors
/// The gRPC server's.
pub async fn serve(
    rls: Rls,
    grpc: TcpListener,
    metrics: Option<(TcpListener, metrics_exporter_prometheus::PrometheusHandle)>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    serve_http(rls, grpc, None, metrics, shutdown).await
}

/// [`serve`], and the reference's HTTP endpoints ([`endpoints::router`]:
/// `/healthcheck`, `/json`) on `http` when given: `/healthcheck` answers
/// 500 from the moment shutdown starts, and the HTTP server stops after
/// the gRPC calls in flight are answered.
///
/// # Errors
/// The gRPC server's.
pub async fn serve_http(
    rls: Rls,
    grpc: TcpListener,
    http: Option<TcpListener>,
    metrics: Option<(TcpListener, metrics_exporter_prometheus::PrometheusHandle)>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let limiters = rls.limiter.clone();
    let serving = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(listener) = http {
        let app = endpoints::router(rls.clone(), serving.clone());
        tokio::spawn(async move {
            let stopped = async move {
                let _ = http_stopped.await;
            };
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(stopped)
                .await
            {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
    }
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<RateLimitServiceServer<Rls>>().await;
    let (stop_metrics, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some((listener, handle)) = metrics {
        let upkeep = handle.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                upkeep.run_upkeep();
            }
        });
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { handle.render() }
            }),
        );
        tokio::spawn(async move {
            let stopped = async move {
                let _ = metrics_stopped.await;
            };
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(stopped)
                .await
            {
                tracing::error!(error = %e, "metrics server failed");
            }
        });
    }
    let shutdown = async move {
        shutdown.await;
        tracing::info!("shutting down: NOT_SERVING, answering the calls in flight");
        serving.store(false, std::sync::atomic::Ordering::Release);
        reporter
            .set_not_serving::<RateLimitServiceServer<Rls>>()
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let _ = stop_metrics.send(());
    };
    // TCP_NODELAY on every accepted connection (tonic's `TcpIncoming`
    // leaves Nagle on): a response written in two segments otherwise waits
    // for the client's delayed ACK, ~40 ms (perf/README.md, "Group commit").
    let incoming = tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(rls))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    let _ = stop_http.send(());
    // Lease mode: the tokens this instance holds go back to the shared
    // buckets (a crashed instance's are lost until refill).
    let mut returned = 0;
    for handle in &limiters.load().handles() {
        returned += handle.return_leases().await;
    }
    tracing::info!(
        leased_tokens_returned = returned,
        "stopped: calls in flight answered, token leases returned"
    );
    Ok(())
}
