//! Counting decisions into a [`Report`], and printing it.

mod collect;
mod fx;
mod text;
mod timeline;

pub(crate) use collect::Collector;
pub(crate) use fx::FxMap;

use serde::Serialize;

const MINUTE_US: u64 = 60_000_000;

/// A line that was not replayed, for the report's examples.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LineIssue {
    /// The input's name as given (`-` for stdin).
    pub input: String,
    /// 1-based line number within that input.
    pub line: u64,
    /// Why.
    pub reason: String,
}

/// The replay of a set of logs through a policy (see `docs/replay.md`).
///
/// Rates are fractions (0.25 = 25 %). Timestamps are UTC, RFC 3339. The
/// tiers are in policy order; `timeline.points[].rejected_by_tier` follows
/// that order.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// `"direct"` or `"layer"`.
    pub engine: &'static str,
    /// `"enforce"` (every tier not `off` enforced) or `"as-configured"`.
    pub modes: &'static str,
    /// The policy's tiers as replayed.
    pub policy: Vec<TierSummary>,
    /// The routes endpoints were matched against.
    pub routes: Vec<String>,
    /// What was read.
    pub input: InputSummary,
    /// Requests by decision.
    pub totals: Totals,
    /// Per tier, in policy order.
    pub tiers: Vec<TierReport>,
    /// Per endpoint (`METHOD route`, `METHOD <unmatched>`), busiest first.
    pub endpoints: Vec<EndpointReport>,
    /// The minute with the most would-be 429s, all tiers together.
    pub peak_minute: Option<PeakMinute>,
    /// Requests and would-be 429s over time.
    pub timeline: Timeline,
    /// Per tier with candidate quotas (docs/rollout.md, "Candidate
    /// quotas"), in policy order: what each would have done on the replayed
    /// traffic beside the live quota (`window_secs` 0: the whole replay).
    /// A candidate's `would_deny` and `keys_denied` are the `rejected` and
    /// `distinct_keys_blocked` of a replay with it as the tier's quota.
    pub candidates: Vec<tiered_ratelimit::observe::CandidatesReport>,
}

/// One tier of the policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierSummary {
    /// Name.
    pub name: String,
    /// `global`, `ip`, `user`, `endpoint` or `header:<name>`.
    pub key: String,
    /// The algorithm's policy name.
    pub algorithm: String,
    /// Requests per period.
    pub limit: u64,
    /// The period, humantime.
    pub period: String,
    /// Capacity.
    pub burst: u64,
    /// Tokens per request.
    pub cost: u64,
    /// The mode replayed (`enforce`, `shadow`, `canary:N`, `off`).
    pub mode: String,
}

/// What was read.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct InputSummary {
    /// Lines read (empty lines excluded).
    pub lines: u64,
    /// Requests replayed.
    pub replayed: u64,
    /// Lines that could not be read in the input's format.
    pub malformed: u64,
    /// The first of them (input, 1-based line number, why), whether or not
    /// it is among `examples`; `null` when there is none.
    pub first_malformed: Option<LineIssue>,
    /// Lines read but not replayable as an HTTP request (an invalid method
    /// or target, which the server answers 400 before any middleware).
    pub unreplayable: u64,
    /// The first few malformed or unreplayable lines.
    pub examples: Vec<LineIssue>,
    /// Inputs that could not be (fully) read.
    pub errors: Vec<LineIssue>,
    /// Lines whose time was before an earlier line's: replayed at the
    /// latest time seen (the virtual clock never goes back).
    pub out_of_order: u64,
    /// The largest such step back, in seconds.
    pub max_step_back_seconds: f64,
    /// The first request's time.
    pub first: Option<String>,
    /// The last request's time.
    pub last: Option<String>,
    /// `last - first`, in seconds.
    pub span_seconds: f64,
}

/// Requests by decision.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Totals {
    /// Requests replayed.
    pub requests: u64,
    /// Passed (delayed and shadow-limited ones included).
    pub allowed: u64,
    /// Would be answered 429 by a tier.
    pub rejected: u64,
    /// `rejected / requests`.
    pub rejection_rate: f64,
    /// Held by a shaping tier, then passed.
    pub delayed: u64,
    /// Passed, but an observing (shadow or canary) tier would have rejected.
    pub shadow_limited: u64,
    /// On the allowlist.
    pub allowlisted: u64,
    /// Refused by the denylist.
    pub denylisted: u64,
    /// No tier applied.
    pub skipped: u64,
    /// An extractor failed; passed (`failure_policy = "open"`).
    pub fail_open: u64,
    /// An extractor failed; 503 (`failure_policy = "closed"`).
    pub fail_closed: u64,
}

/// One tier's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierReport {
    /// The tier.
    pub name: String,
    /// Requests the tier applied to (it had a key for them).
    pub requests: u64,
    /// Would-be 429s with this tier binding.
    pub rejected: u64,
    /// `rejected / requests`.
    pub rejection_rate: f64,
    /// Requests this tier would have rejected while observing (shadow or
    /// canary); `null` with the layer engine, which cannot tell tiers apart.
    pub shadow_limited: Option<u64>,
    /// Distinct keys with at least one would-be 429 on this tier.
    pub distinct_keys_blocked: u64,
    /// The keys with the most would-be 429s (API keys masked unless
    /// `--show-keys`).
    pub top_blocked_keys: Vec<BlockedKey>,
    /// The minute with the most would-be 429s on this tier.
    pub peak_minute: Option<PeakMinute>,
}

/// A blocked key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockedKey {
    /// The key as people read it: an address or /64, a user id, a masked
    /// API key, `GET /route`, `all`.
    pub key: String,
    /// Its would-be 429s.
    pub rejected: u64,
    /// Its requests on this tier from its first would-be 429 on (that one
    /// included): how hard it kept trying.
    pub requests_since_first_429: u64,
    /// The first would-be 429.
    pub first: String,
    /// The last would-be 429.
    pub last: String,
}

/// A minute and its would-be 429s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeakMinute {
    /// The minute (`2024-03-01T12:34Z`).
    pub minute: String,
    /// Would-be 429s in it.
    pub rejected: u64,
    /// Requests in it (for the tier: requests it applied to).
    pub requests: u64,
}

/// One endpoint's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointReport {
    /// `GET /users/{id}`, or `GET <unmatched>` for paths no route matched.
    pub endpoint: String,
    /// Requests.
    pub requests: u64,
    /// Would-be 429s.
    pub rejected: u64,
    /// `rejected / requests`.
    pub rejection_rate: f64,
    /// Would-be 429s by binding tier (tiers with none left out).
    pub by_tier: Vec<TierCount>,
}

/// A count for a tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierCount {
    /// The tier.
    pub tier: String,
    /// The count.
    pub rejected: u64,
}

/// Counts per time bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct Timeline {
    /// Bucket width in seconds (1 min to 1 day, for at most about 720
    /// buckets).
    pub bucket_seconds: u64,
    /// Buckets with at least one request, in time order.
    pub points: Vec<TimelinePoint>,
}

/// One time bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    /// Bucket start.
    pub start: String,
    /// Bucket start, epoch seconds (for plotting).
    pub start_epoch: u64,
    /// Requests.
    pub requests: u64,
    /// Would-be 429s.
    pub rejected: u64,
    /// Requests each tier applied to, in policy order.
    pub requests_by_tier: Vec<u64>,
    /// Would-be 429s by binding tier, in policy order.
    pub rejected_by_tier: Vec<u64>,
}
