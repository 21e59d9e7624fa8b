//! Replay access logs through a [`Policy`] offline, to plan limits from real
//! traffic (the `tiered-ratelimit replay` command).
//!
//! Each log line becomes an `http::Request` (method, path, headers, the peer
//! address as a `SocketAddr` extension, the user id as [`UserId`], the plan
//! as [`Plan`]) and is decided by a layer built with
//! [`RateLimitLayer::from_policy`] on a [`MemoryBackend`] whose
//! [`ManualClock`] follows the log's timestamps: no Redis, no sleeping. Route
//! templates (`/users/{id}`) are matched as axum matches them, so the
//! `endpoint` tier sees a real `MatchedPath`. The decisions are counted into
//! a [`Report`]: per tier and endpoint, the would-be 429s, the keys blocked,
//! the peak minute, a timeline; printed as tables, JSON, or a chart
//! ([`write_plot`]).
//!
//! ```no_run
//! use tiered_ratelimit_cli::replay::{Input, ReplayOptions, Replayer};
//! use tiered_ratelimit::policy::Policy;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = Policy::from_file("policy.toml")?;
//! let mut options = ReplayOptions::default();
//! options.routes = vec!["/users/{id}".into(), "/login".into()];
//! let mut replayer = Replayer::new(&policy, options)?;
//! replayer.run(&[Input::from_arg("access.log.gz")], false)?;
//! let report = replayer.finish();
//! println!("{}", report.to_text());
//! # Ok(()) }
//! ```
//!
//! See `docs/replay.md` for the workflow from a week of logs to a policy in
//! shadow mode.

mod engine;
mod input;
mod parse;
mod plot;
mod report;
mod routes;
mod time;

pub use input::Input;
pub use parse::{FieldMap, LogFormat, Target};
pub use plot::write_plot;
pub use report::{
    BlockedKey, EndpointReport, InputSummary, LineIssue, PeakMinute, Report, TierCount, TierReport,
    TierSummary, Timeline, TimelinePoint, Totals,
};
pub use tiered_ratelimit::offline::Decision;
pub use time::TimeFormat;

use axum::extract::MatchedPath;
use engine::{Direct, Layer, LoggedStatus};
use http::request::Parts;
use http::{HeaderValue, Method, Uri};
use parse::{LineParser, Record};
use report::{Collector, FxMap};
use routes::Routes;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tiered_ratelimit::backend::{ManualClock, MemoryBackend};
use tiered_ratelimit::key::{Endpoint, KeyExtractor};
use tiered_ratelimit::offline::{Checks, Offline};
use tiered_ratelimit::policy::KeySpec;
use tiered_ratelimit::rollout::{Mode, Plan};
use tiered_ratelimit::{
    key::UserId, policy::Policy, Algorithm, ConfigError, LeakyBucket, RateLimitLayer,
};

/// Which engine decides requests (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Engine {
    /// `direct`, unless a tier refunds by response status
    /// (`skip_failed_requests` / `skip_successful_requests`): `layer`.
    #[default]
    Auto,
    /// The layer's planning and the memory backend's check, without HTTP:
    /// several times faster, with the same decisions (tested request by
    /// request against `layer`).
    Direct,
    /// A real axum `Router` with the layer, called once per line: the
    /// reference.
    Layer,
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Engine::Auto),
            "direct" => Ok(Engine::Direct),
            "layer" => Ok(Engine::Layer),
            other => Err(format!("unknown engine {other:?} (auto, direct, layer)")),
        }
    }
}

/// How the policy's modes are replayed (`--modes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Modes {
    /// Every tier is enforced (shadow and canary tiers too, and a global
    /// `mode` is ignored), except tiers with `mode = "off"`: what would
    /// happen if the policy were switched on. The default.
    #[default]
    Enforce,
    /// The modes in the file: shadow and not-enforced canary tiers pass
    /// requests and are counted as `shadow_limited`.
    AsConfigured,
}

impl std::str::FromStr for Modes {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enforce" => Ok(Modes::Enforce),
            "as-configured" | "as_configured" => Ok(Modes::AsConfigured),
            other => Err(format!("unknown modes {other:?} (enforce, as-configured)")),
        }
    }
}

/// What to read and how to replay it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// The log format (default: detected per input).
    pub format: LogFormat,
    /// JSON field names.
    pub fields: FieldMap,
    /// Combined format: what the fields after the user agent are, in order
    /// (nginx's `main` format adds `"$http_x_forwarded_for"`, which is
    /// `Target::Header(x-forwarded-for)`).
    pub extra_fields: Vec<Target>,
    /// How timestamps are written (default: detected per value).
    pub time_format: TimeFormat,
    /// Combined format: use `$remote_user` (the third field) as the user id
    /// (default true; `-` is anonymous).
    pub remote_user: bool,
    /// Route templates in axum syntax (`/users/{id}`, `/static/{*path}`),
    /// for the `endpoint` tier and the per-endpoint report. Paths matching
    /// none are `<unmatched>`.
    pub routes: Vec<String>,
    /// Which engine decides.
    pub engine: Engine,
    /// How modes are replayed.
    pub modes: Modes,
    /// Blocked keys listed per tier (default 10).
    pub top: usize,
    /// Malformed lines listed (default 10).
    pub max_examples: usize,
    /// Show API keys in full instead of masked.
    pub show_keys: bool,
    /// The memory backend's bucket limit (default 1 000 000, as the layer's):
    /// past it, the buckets closest to full are forgotten.
    pub max_keys: usize,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            format: LogFormat::Auto,
            fields: FieldMap::default(),
            extra_fields: Vec::new(),
            time_format: TimeFormat::Auto,
            remote_user: true,
            routes: Vec::new(),
            engine: Engine::Auto,
            modes: Modes::Enforce,
            top: 10,
            max_examples: 10,
            show_keys: false,
            max_keys: 1_000_000,
        }
    }
}

/// Why a replay could not start or go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The policy does not build.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A route template is invalid or conflicts with another.
    #[error("route {pattern:?}: {reason}")]
    Route {
        /// The template.
        pattern: String,
        /// Why.
        reason: String,
    },
    /// The chosen engine cannot replay this policy faithfully, or the
    /// route matcher disagreed with axum.
    #[error("{0}")]
    Engine(String),
    /// Reading inputs failed to start.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What became of one line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LineOutcome {
    /// Empty: not counted.
    Empty,
    /// Not readable in the input's format.
    Malformed(&'static str),
    /// Read, but not an HTTP request the server would have passed on.
    Unreplayable(&'static str),
    /// Replayed, with the layer's decision.
    Replayed(Decision),
}

/// How a tier's keys are shown in the report.
#[derive(Debug, Clone)]
enum KeyKind {
    Plain,
    Header(http::HeaderName),
}

#[derive(Default)]
struct Spare {
    user: Option<String>,
    plan: Option<String>,
}

enum EngineImpl {
    Direct(Direct),
    Layer(Box<Layer>),
}

/// Replays log lines through a policy and collects the [`Report`].
pub struct Replayer {
    clock: ManualClock,
    clock_us: Option<u64>,
    /// The layer's engine for request heads, and the checks it planned for
    /// the current line.
    offline: Offline,
    checks: Checks,
    engine: EngineImpl,
    engine_name: &'static str,
    modes_name: &'static str,
    routes: Routes,
    parser: LineParser,
    format: LogFormat,
    input_format: Option<LogFormat>,
    /// A line of the current input has read in `input_format`.
    format_confirmed: bool,
    rec: Record,
    parts: Parts,
    /// Buffers of extensions removed from `parts`, for the next insert.
    spare: Spare,
    uri_buf: bytes::BytesMut,
    endpoint_ids: FxMap<(Method, Option<usize>), usize>,
    collector: Collector,
    key_kinds: Vec<KeyKind>,
    policy_summary: Vec<TierSummary>,
    input_name: String,
    line_no: u64,
    top: usize,
    show_keys: bool,
}

impl std::fmt::Debug for Replayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer")
            .field("engine", &self.engine_name)
            .field("modes", &self.modes_name)
            .field("routes", &self.routes.patterns())
            .finish_non_exhaustive()
    }
}

/// The algorithm's name, with the shaping bucket's `max_delay`.
fn algorithm_name(a: Algorithm) -> String {
    match a {
        Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) => format!(
            "{} (max_delay {})",
            a.name(),
            humantime::format_duration(max_delay)
        ),
        _ => a.name().to_owned(),
    }
}

impl Replayer {
    /// Builds the layer for `policy` on a memory backend with a manual
    /// clock, and everything to feed it.
    ///
    /// # Errors
    /// The policy does not build, a route is invalid, or the engine asked
    /// for cannot replay this policy.
    pub fn new(policy: &Policy, options: ReplayOptions) -> Result<Self, ReplayError> {
        let clock = ManualClock::new(0);
        let memory = MemoryBackend::with_manual_clock(clock.clone()).max_keys(options.max_keys);
        let layer = RateLimitLayer::from_policy(policy, memory.clone())?;
        let handle = layer.handle();
        if options.modes == Modes::Enforce {
            let tiers = handle.tiers();
            handle.update(|c| {
                c.mode(Mode::Enforce);
                for t in &tiers {
                    if t.mode != Mode::Off {
                        c.tier_mode(&t.name, Mode::Enforce)?;
                    }
                }
                Ok(())
            })?;
        }
        let refunds = policy
            .tiers
            .iter()
            .any(|t| t.skip_failed_requests || t.skip_successful_requests);
        let engine_choice = match (options.engine, refunds) {
            (Engine::Auto, true) | (Engine::Layer, _) => Engine::Layer,
            (Engine::Auto, false) | (Engine::Direct, false) => Engine::Direct,
            (Engine::Direct, true) => {
                return Err(ReplayError::Engine(
                    "the direct engine does not replay skip_failed_requests / \
                     skip_successful_requests (refunds by response status): use --engine layer"
                        .into(),
                ))
            }
        };
        let routes = Routes::new(&options.routes)
            .map_err(|(pattern, reason)| ReplayError::Route { pattern, reason })?;
        let engine = match engine_choice {
            Engine::Layer => EngineImpl::Layer(Box::new(Layer::new(&layer, routes.patterns())?)),
            _ => EngineImpl::Direct(Direct),
        };
        let statuses = handle.tiers();
        let policy_summary = policy
            .tiers
            .iter()
            .zip(&statuses)
            .map(|(t, s)| TierSummary {
                name: t.name.clone(),
                key: t.key.to_string(),
                algorithm: algorithm_name(s.algorithm),
                limit: s.quota.limit(),
                period: humantime::format_duration(s.quota.period()).to_string(),
                burst: s.quota.burst_size(),
                cost: t.cost,
                mode: s.effective_mode.to_string(),
            })
            .collect();
        let key_kinds = policy
            .tiers
            .iter()
            .map(|t| match &t.key {
                KeySpec::Header(h) => KeyKind::Header(h.clone()),
                _ => KeyKind::Plain,
            })
            .collect();
        let names = layer.tier_names().map(str::to_owned).collect();
        let parser = LineParser::new(
            &options.fields,
            &options.extra_fields,
            options.time_format,
            options.remote_user,
        );
        Ok(Self {
            clock,
            clock_us: None,
            offline: layer
                .offline()
                .ok_or_else(|| ReplayError::Engine("replay needs the memory backend".into()))?,
            checks: Checks::default(),
            engine,
            engine_name: if engine_choice == Engine::Layer {
                "layer"
            } else {
                "direct"
            },
            modes_name: match options.modes {
                Modes::Enforce => "enforce",
                Modes::AsConfigured => "as-configured",
            },
            routes,
            parser,
            format: options.format,
            input_format: None,
            format_confirmed: false,
            rec: Record::default(),
            parts: http::Request::new(()).into_parts().0,
            spare: Spare::default(),
            uri_buf: bytes::BytesMut::with_capacity(64 << 10),
            endpoint_ids: FxMap::default(),
            collector: Collector::new(names, options.max_examples),
            key_kinds,
            policy_summary,
            input_name: "-".into(),
            line_no: 0,
            top: options.top,
            show_keys: options.show_keys,
        })
    }

    /// The engine deciding requests: `"direct"` or `"layer"`.
    pub fn engine(&self) -> &'static str {
        self.engine_name
    }

    /// Starts a new input: line numbers restart at 1 and, with
    /// [`LogFormat::Auto`], the format is detected again.
    pub fn start_input(&mut self, name: &str) {
        name.clone_into(&mut self.input_name);
        self.line_no = 0;
        self.input_format = None;
        self.format_confirmed = false;
    }

    /// Records that the current input could not be read past its current
    /// line.
    pub fn input_error(&mut self, error: String) {
        let (name, line) = (self.input_name.clone(), self.line_no);
        self.collector.input_error(&name, line, error);
    }

    /// Counts a line of the current input that was longer than 16 MiB (the
    /// reader skipped it) as malformed.
    fn too_long_line(&mut self) {
        self.line_no += 1;
        self.collector.input.lines += 1;
        self.collector.issue(
            &self.input_name,
            self.line_no,
            "line longer than 16 MiB (skipped)",
            true,
        );
    }

    /// Replays one line (without its newline) of the current input.
    ///
    /// # Errors
    /// Only when the route matcher and axum disagree on a route (never with
    /// the pinned versions); malformed lines are counted, not errors.
    pub fn replay_line(&mut self, line: &[u8]) -> Result<LineOutcome, ReplayError> {
        self.line_no += 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(LineOutcome::Empty);
        }
        self.collector.input.lines += 1;
        // A byte order mark before the first line is not part of it.
        let line = if self.line_no == 1 {
            line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line)
        } else {
            line
        };
        let format = match (self.format, self.input_format) {
            (LogFormat::Auto, Some(f)) => f,
            (LogFormat::Auto, None) => {
                let f = if parse::looks_like_json(line) {
                    LogFormat::Json
                } else {
                    LogFormat::Combined
                };
                self.input_format = Some(f);
                f
            }
            (f, _) => f,
        };
        let mut parsed = self.parser.parse(format, line, &mut self.rec);
        if parsed.is_err() && self.format == LogFormat::Auto && !self.format_confirmed {
            // Detected from a line that reads in neither format (a partial
            // first line, say): until a line reads, one that reads in the
            // other format switches the input to it.
            let other = match format {
                LogFormat::Json => LogFormat::Combined,
                _ => LogFormat::Json,
            };
            if self.parser.parse(other, line, &mut self.rec).is_ok() {
                self.input_format = Some(other);
                parsed = Ok(());
            }
        }
        if parsed.is_ok() {
            self.format_confirmed = true;
        }
        if let Err((reason, malformed)) = parsed {
            self.collector
                .issue(&self.input_name, self.line_no, reason, malformed);
            return Ok(if malformed {
                LineOutcome::Malformed(reason)
            } else {
                LineOutcome::Unreplayable(reason)
            });
        }
        let rec = &self.rec;
        let Ok(method) = Method::from_bytes(rec.method.get().unwrap_or_default()) else {
            let reason = "invalid HTTP method";
            self.collector
                .issue(&self.input_name, self.line_no, reason, false);
            return Ok(LineOutcome::Unreplayable(reason));
        };
        // The target is copied into an arena the URI then shares (one
        // allocation per 64 KiB of targets, not one per line).
        self.uri_buf
            .extend_from_slice(rec.target.get().unwrap_or_default());
        let Ok(uri) = Uri::from_maybe_shared(self.uri_buf.split().freeze()) else {
            let reason = "invalid request target";
            self.collector
                .issue(&self.input_name, self.line_no, reason, false);
            return Ok(LineOutcome::Unreplayable(reason));
        };
        // The virtual clock: the log's time, never going back.
        let t = rec.time_us.unwrap_or(0);
        let now = self.clock_us.map_or(t, |c| c.max(t));
        self.clock_us = Some(now);
        self.clock.set(now);
        self.collector.time(t, now);

        // The request head.
        let route = self.routes.find(uri.path());
        let p = &mut self.parts;
        p.method = method;
        p.uri = uri;
        p.headers.clear();
        for (name, v) in self.parser.headers.iter().zip(&rec.headers) {
            if let Some(Ok(v)) = v.get().map(HeaderValue::from_bytes) {
                p.headers.append(name.clone(), v);
            }
        }
        // Extensions are updated in place where they exist: an insert
        // boxes its value (and frees the one it replaces) on every line.
        if let Some(ip) = rec.ip {
            let addr = SocketAddr::new(ip, 0);
            match p.extensions.get_mut::<SocketAddr>() {
                Some(a) => *a = addr,
                None => {
                    p.extensions.insert(addr);
                }
            }
        }
        set_string_extension::<UserId>(&mut p.extensions, rec.user.get(), &mut self.spare.user);
        set_string_extension::<Plan>(&mut p.extensions, rec.plan.get(), &mut self.spare.plan);
        match route {
            Some(i) => {
                let m = self
                    .routes
                    .matched_path(i, &p.uri)
                    .map_err(ReplayError::Engine)?;
                match p.extensions.get_mut::<MatchedPath>() {
                    Some(old) => *old = m,
                    None => {
                        p.extensions.insert(m);
                    }
                }
            }
            None => {
                p.extensions.remove::<MatchedPath>();
            }
        }
        let status = rec.status;
        let endpoint = match self.endpoint_ids.get(&(p.method.clone(), route)) {
            Some(&e) => e,
            None => {
                let label = Endpoint
                    .extract(p)
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| format!("{} <unmatched>", p.method));
                let e = self.collector.add_endpoint(label);
                self.endpoint_ids.insert((p.method.clone(), route), e);
                e
            }
        };

        let outcome = match &mut self.engine {
            EngineImpl::Direct(d) => d.decide(&self.offline, &mut self.checks, &self.parts),
            EngineImpl::Layer(l) => {
                self.offline.plan(&self.parts, &mut self.checks);
                let req = layer_request(&self.parts, status);
                l.decide(&self.checks, req)
            }
        };
        let display = |c: usize| -> String {
            let tier = self.checks.tier(c);
            match &self.key_kinds[tier] {
                KeyKind::Header(h) => {
                    let v = self
                        .parts
                        .headers
                        .get(h)
                        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                        .unwrap_or_default();
                    if self.show_keys {
                        v
                    } else {
                        mask(&v)
                    }
                }
                KeyKind::Plain => shorten(&self.offline.raw_key(tier, &self.parts)),
            }
        };
        let blocked = outcome.binding_check.map(|c| (c, move || display(c)));
        let blocked_ref: Option<(usize, &dyn Fn() -> String)> = blocked
            .as_ref()
            .map(|(c, f)| (*c, f as &dyn Fn() -> String));
        self.collector.request(
            now,
            endpoint,
            &self.checks,
            &outcome.decision,
            blocked_ref,
            outcome.shadow_tiers,
        );
        Ok(LineOutcome::Replayed(outcome.decision))
    }

    /// Replays every input in order: read (and decompressed) on a second
    /// thread, with a progress bar on stderr when `progress` is set, stderr
    /// is a terminal and the input is large (over 32 MiB, or stdin).
    ///
    /// Inputs that cannot be opened or are cut short are recorded in the
    /// report (`input.errors`) and the run goes on with the next.
    ///
    /// # Errors
    /// The reader thread cannot start, or [`Replayer::replay_line`] fails.
    pub fn run(&mut self, inputs: &[Input], progress: bool) -> Result<(), ReplayError> {
        let read = Arc::new(AtomicU64::new(0));
        let sizes: Option<u64> = inputs.iter().map(Input::len).sum();
        let show =
            progress && std::io::stderr().is_terminal() && sizes.is_none_or(|s| s > 32 << 20);
        let bar = if show {
            let bar = match sizes {
                Some(total) => indicatif::ProgressBar::new(total).with_style(
                    indicatif::ProgressStyle::with_template(
                        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta}) {msg}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                ),
                None => indicatif::ProgressBar::new_spinner().with_style(
                    indicatif::ProgressStyle::with_template(
                        "{spinner} [{elapsed_precise}] {bytes} ({bytes_per_sec}) {msg}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                ),
            };
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        let reader = input::spawn(inputs.to_vec(), read.clone())?;
        let mut result = Ok(());
        for msg in &reader.rx {
            match msg {
                input::Msg::Start { input } => {
                    let name = inputs.get(input).map(Input::name).unwrap_or_default();
                    self.start_input(&name);
                }
                input::Msg::Chunk { buf, len } => {
                    let mut rest = &buf[..len];
                    while !rest.is_empty() {
                        let (line, next) = match memchr::memchr(b'\n', rest) {
                            Some(p) => (&rest[..p], &rest[p + 1..]),
                            None => (rest, &[][..]),
                        };
                        if let Err(e) = self.replay_line(line) {
                            result = Err(e);
                            break;
                        }
                        rest = next;
                    }
                    let _ = reader.recycle.send(buf);
                    if result.is_err() {
                        break;
                    }
                    bar.set_position(read.load(Ordering::Relaxed));
                    bar.set_message(format!("{} lines", self.collector.input.lines));
                }
                input::Msg::TooLong => self.too_long_line(),
                input::Msg::Error { input, error } => {
                    let name = inputs.get(input).map(Input::name).unwrap_or_default();
                    if name != self.input_name {
                        self.start_input(&name);
                    }
                    self.input_error(error);
                }
            }
        }
        drop(reader.rx);
        let _ = reader.handle.join();
        bar.finish_and_clear();
        result
    }

    /// The report of everything replayed.
    pub fn finish(self) -> Report {
        let shadow_known = matches!(self.engine, EngineImpl::Direct(_));
        self.collector.finish(
            self.engine_name,
            self.modes_name,
            self.policy_summary,
            self.routes.patterns().to_vec(),
            self.top,
            shadow_known,
        )
    }
}

/// The request the layer engine sends: the planner's head without the
/// `MatchedPath` (axum sets its own), plus the logged status for the app.
fn layer_request(p: &Parts, status: Option<u16>) -> http::Request<axum::body::Body> {
    let mut req = http::Request::new(axum::body::Body::empty());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = p.uri.clone();
    *req.headers_mut() = p.headers.clone();
    let ext = req.extensions_mut();
    if let Some(a) = p.extensions.get::<SocketAddr>() {
        ext.insert(*a);
    }
    if let Some(u) = p.extensions.get::<UserId>() {
        ext.insert(u.clone());
    }
    if let Some(plan) = p.extensions.get::<Plan>() {
        ext.insert(plan.clone());
    }
    if let Some(s) = status {
        ext.insert(LoggedStatus(s));
    }
    req
}

/// An API key as shown in reports: `sk_l…9f3a`.
fn mask(v: &str) -> String {
    let chars: Vec<char> = v.chars().collect();
    if chars.len() <= 8 {
        let head: String = chars.iter().take(2).collect();
        format!("{head}…")
    } else {
        let head: String = chars.iter().take(4).collect();
        let tail: String = chars[chars.len() - 4..].iter().collect();
        format!("{head}…{tail}")
    }
}

/// Long keys cut to 80 characters for display.
fn shorten(v: &str) -> String {
    if v.chars().count() <= 80 {
        v.to_owned()
    } else {
        let head: String = v.chars().take(79).collect();
        format!("{head}…")
    }
}

/// A request extension that is a string (the user id, the plan).
trait StringExtension: Clone + Send + Sync + 'static {
    fn wrap(s: String) -> Self;
    fn string(&mut self) -> &mut String;
    fn unwrap(self) -> String;
}

impl StringExtension for UserId {
    fn wrap(s: String) -> Self {
        UserId(s)
    }
    fn string(&mut self) -> &mut String {
        &mut self.0
    }
    fn unwrap(self) -> String {
        self.0
    }
}

impl StringExtension for Plan {
    fn wrap(s: String) -> Self {
        Plan(s)
    }
    fn string(&mut self) -> &mut String {
        &mut self.0
    }
    fn unwrap(self) -> String {
        self.0
    }
}

/// Sets extension `T` to `value` (removed when `None`) in place where it
/// exists: an insert boxes its value, so a removed one's buffer is kept in
/// `spare` for the next insert.
fn set_string_extension<T: StringExtension>(
    ext: &mut http::Extensions,
    value: Option<&[u8]>,
    spare: &mut Option<String>,
) {
    match value {
        Some(v) => match ext.get_mut::<T>() {
            Some(t) => set_lossy(t.string(), v),
            None => {
                let mut s = spare.take().unwrap_or_default();
                set_lossy(&mut s, v);
                ext.insert(T::wrap(s));
            }
        },
        None => {
            if let Some(t) = ext.remove::<T>() {
                *spare = Some(t.unwrap());
            }
        }
    }
}

/// `s` becomes `bytes` as `String::from_utf8_lossy` reads them, reusing its
/// buffer.
fn set_lossy(s: &mut String, bytes: &[u8]) {
    s.clear();
    s.push_str(&String::from_utf8_lossy(bytes));
}
