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
//!
//! [`Policy`]: tiered_ratelimit::policy::Policy
//! [`UserId`]: tiered_ratelimit::key::UserId
//! [`Plan`]: tiered_ratelimit::rollout::Plan
//! [`RateLimitLayer::from_policy`]: tiered_ratelimit::RateLimitLayer::from_policy
//! [`MemoryBackend`]: tiered_ratelimit::backend::MemoryBackend

mod engine;
mod extension;
mod input;
mod line;
mod options;
mod parse;
mod plot;
mod report;
mod routes;
mod run;
mod setup;
mod suggest;
mod time;

pub use input::Input;
pub use options::{Engine, Modes, ReplayOptions};
pub use parse::{FieldMap, LogFormat, Target};
pub use plot::write_plot;
pub use report::{
    BlockedKey, EndpointReport, InputSummary, LineIssue, PeakMinute, Report, TierCount, TierReport,
    TierSummary, Timeline, TimelinePoint, Totals,
};
pub use tiered_ratelimit::offline::Admission;
pub use time::TimeFormat;

use engine::{Direct, Layer};
use http::request::Parts;
use http::Method;
use parse::{LineParser, Record};
use report::{Collector, FxMap};
use routes::Routes;
use tiered_ratelimit::backend::ManualClock;
use tiered_ratelimit::offline::{Checks, Offline};
use tiered_ratelimit::ConfigError;

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
    Replayed(Admission),
}

/// How a tier's keys are shown in the report.
#[derive(Debug, Clone)]
enum KeyKind {
    Plain,
    Header(http::HeaderName),
}

#[derive(Default)]
struct Spare {
    user: extension::Held,
    plan: extension::Held,
}

enum EngineImpl {
    Direct(Direct),
    Layer(Box<Layer>),
}

/// Replays log lines through a policy and collects the [`Report`].
pub struct Replayer {
    clock: ManualClock,
    clock_us: Option<u64>,
    /// The virtual second of the last per-key demand flush.
    demand_second: Option<u64>,
    /// Whether per-key demand is flushed (`ReplayOptions::demand`).
    demand: bool,
    /// The layer's handle (per-key demand and suggestions; the
    /// candidates' counts for the report).
    handle: tiered_ratelimit::RateLimitHandle,
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
    /// Where the user id and plan extensions are: in `parts`, or absent
    /// with the buffer of the last one removed kept for the next insert.
    spare: Spare,
    /// The route whose `MatchedPath` is in `parts` (`None`: no route's).
    matched_route: Option<usize>,
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
