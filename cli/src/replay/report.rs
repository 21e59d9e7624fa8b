//! Counting decisions into a [`Report`], and printing it.

use super::time::{format_utc_minute, format_utc_seconds};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use tiered_ratelimit::offline::{Checks, Decision};

/// A fast, non-cryptographic hasher (rustc's Fx) for the report's own maps:
/// their keys were already made safe by the layer, and the replay reads
/// logs the operator chose, so hash flooding is not a concern here.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A `HashMap` with [`FxHasher`].
pub(crate) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;
use std::fmt::Write as _;

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

#[derive(Debug, Clone, Default)]
struct MinuteAcc {
    requests: u64,
    rejected: u64,
    applied: Vec<u64>,
    rejected_by: Vec<u64>,
}

impl MinuteAcc {
    fn new(tiers: usize) -> Self {
        Self {
            requests: 0,
            rejected: 0,
            applied: vec![0; tiers],
            rejected_by: vec![0; tiers],
        }
    }
    fn merge(&mut self, o: &MinuteAcc) {
        self.requests += o.requests;
        self.rejected += o.rejected;
        for (a, b) in self.applied.iter_mut().zip(&o.applied) {
            *a += b;
        }
        for (a, b) in self.rejected_by.iter_mut().zip(&o.rejected_by) {
            *a += b;
        }
    }
}

struct KeyAcc {
    display: String,
    rejected: u64,
    /// Requests on the tier from the first would-be 429 on (included).
    requests: u64,
    first_us: u64,
    last_us: u64,
}

struct TierAcc {
    name: String,
    applied: u64,
    rejected: u64,
    shadow_limited: u64,
    keys: FxMap<String, KeyAcc>,
}

struct EndpointAcc {
    label: String,
    requests: u64,
    rejected: u64,
    by_tier: Vec<u64>,
}

/// Accumulates decisions.
pub(crate) struct Collector {
    tiers: Vec<TierAcc>,
    endpoints: Vec<EndpointAcc>,
    minutes: BTreeMap<u64, MinuteAcc>,
    cur_minute: Option<u64>,
    cur: MinuteAcc,
    pub(crate) input: InputSummary,
    totals: Totals,
    first_us: Option<u64>,
    last_us: u64,
    max_examples: usize,
}

impl Collector {
    pub(crate) fn new(tier_names: Vec<String>, max_examples: usize) -> Self {
        let n = tier_names.len();
        Self {
            tiers: tier_names
                .into_iter()
                .map(|name| TierAcc {
                    name,
                    applied: 0,
                    rejected: 0,
                    shadow_limited: 0,
                    keys: FxMap::default(),
                })
                .collect(),
            endpoints: Vec::new(),
            minutes: BTreeMap::new(),
            cur_minute: None,
            cur: MinuteAcc::new(n),
            input: InputSummary::default(),
            totals: Totals::default(),
            first_us: None,
            last_us: 0,
            max_examples,
        }
    }

    /// Registers an endpoint label; returns its index.
    pub(crate) fn add_endpoint(&mut self, label: String) -> usize {
        if let Some(i) = self.endpoints.iter().position(|e| e.label == label) {
            return i;
        }
        let n = self.tiers.len();
        self.endpoints.push(EndpointAcc {
            label,
            requests: 0,
            rejected: 0,
            by_tier: vec![0; n],
        });
        self.endpoints.len() - 1
    }

    pub(crate) fn issue(&mut self, input: &str, line: u64, reason: &str, malformed: bool) {
        if malformed {
            self.input.malformed += 1;
            if self.input.first_malformed.is_none() {
                self.input.first_malformed = Some(LineIssue {
                    input: input.to_owned(),
                    line,
                    reason: reason.to_owned(),
                });
            }
        } else {
            self.input.unreplayable += 1;
        }
        if self.input.examples.len() < self.max_examples {
            self.input.examples.push(LineIssue {
                input: input.to_owned(),
                line,
                reason: reason.to_owned(),
            });
        }
    }

    pub(crate) fn input_error(&mut self, input: &str, line: u64, error: String) {
        self.input.errors.push(LineIssue {
            input: input.to_owned(),
            line,
            reason: error,
        });
    }

    /// The time of a replayed request (`clock` is the virtual clock after
    /// it: never behind).
    pub(crate) fn time(&mut self, t_us: u64, clock_us: u64) {
        if t_us < clock_us {
            self.input.out_of_order += 1;
            #[allow(clippy::cast_precision_loss)]
            let back = (clock_us - t_us) as f64 / 1e6;
            if back > self.input.max_step_back_seconds {
                self.input.max_step_back_seconds = back;
            }
        }
        if self.first_us.is_none() {
            self.first_us = Some(clock_us);
        }
        self.last_us = self.last_us.max(clock_us);
        let m = clock_us / MINUTE_US;
        if self.cur_minute != Some(m) {
            self.flush_minute();
            self.cur_minute = Some(m);
        }
    }

    fn flush_minute(&mut self) {
        if let Some(m) = self.cur_minute.take() {
            let n = self.tiers.len();
            let cur = std::mem::replace(&mut self.cur, MinuteAcc::new(n));
            match self.minutes.get_mut(&m) {
                Some(acc) => acc.merge(&cur),
                None => {
                    self.minutes.insert(m, cur);
                }
            }
        }
    }

    /// Counts one replayed request: `planned` holds the checks the layer
    /// made (tier and key each); `blocked` the binding check's index and
    /// the key's display form when rejected; `shadow_tiers` a bit per tier
    /// index.
    pub(crate) fn request(
        &mut self,
        now_us: u64,
        endpoint: usize,
        planned: &Checks,
        decision: &Decision,
        blocked: Option<(usize, &dyn Fn() -> String)>,
        shadow_tiers: u64,
    ) {
        self.input.replayed += 1;
        let t = &mut self.totals;
        t.requests += 1;
        self.cur.requests += 1;
        for c in 0..planned.len() {
            let (i, key) = (planned.tier(c), planned.key_part(c));
            let tier = &mut self.tiers[i];
            tier.applied += 1;
            self.cur.applied[i] += 1;
            if !tier.keys.is_empty() {
                if let Some(k) = tier.keys.get_mut(key) {
                    k.requests += 1;
                }
            }
        }
        let e = &mut self.endpoints[endpoint];
        e.requests += 1;
        match decision {
            Decision::Allowed {
                delayed,
                shadow_limited,
            } => {
                t.allowed += 1;
                t.delayed += u64::from(*delayed);
                t.shadow_limited += u64::from(*shadow_limited);
            }
            Decision::Rejected { .. } => {
                t.rejected += 1;
                e.rejected += 1;
                self.cur.rejected += 1;
                if let Some((c, display)) = blocked.filter(|(c, _)| *c < planned.len()) {
                    let (i, key) = (planned.tier(c), planned.key_part(c));
                    e.by_tier[i] += 1;
                    self.cur.rejected_by[i] += 1;
                    let tier = &mut self.tiers[i];
                    tier.rejected += 1;
                    match tier.keys.get_mut(key) {
                        Some(k) => {
                            k.rejected += 1;
                            k.last_us = now_us;
                        }
                        None => {
                            tier.keys.insert(
                                key.to_owned(),
                                KeyAcc {
                                    display: display(),
                                    rejected: 1,
                                    requests: 1,
                                    first_us: now_us,
                                    last_us: now_us,
                                },
                            );
                        }
                    }
                }
            }
            Decision::Allowlisted => t.allowlisted += 1,
            Decision::Denylisted => t.denylisted += 1,
            Decision::Skipped => t.skipped += 1,
            Decision::FailOpen => t.fail_open += 1,
            Decision::FailClosed => t.fail_closed += 1,
            // A decision this version of the report does not know.
            _ => {}
        }
        if shadow_tiers != 0 {
            for (i, tier) in self.tiers.iter_mut().enumerate() {
                if i < 64 && shadow_tiers & (1 << i) != 0 {
                    tier.shadow_limited += 1;
                }
            }
        }
    }

    pub(crate) fn finish(
        mut self,
        engine: &'static str,
        modes: &'static str,
        policy: Vec<TierSummary>,
        routes: Vec<String>,
        top: usize,
        shadow_known: bool,
    ) -> Report {
        self.flush_minute();
        let n = self.tiers.len();
        let mut input = self.input;
        input.first = self.first_us.map(format_utc_seconds);
        input.last = self.first_us.map(|_| format_utc_seconds(self.last_us));
        #[allow(clippy::cast_precision_loss)]
        {
            input.span_seconds = self
                .first_us
                .map_or(0.0, |f| (self.last_us - f) as f64 / 1e6);
        }
        let mut totals = self.totals;
        totals.rejection_rate = rate(totals.rejected, totals.requests);

        let peak = |f: &dyn Fn(&MinuteAcc) -> (u64, u64)| -> Option<PeakMinute> {
            let mut best: Option<(u64, u64, u64)> = None;
            for (m, acc) in &self.minutes {
                let (rej, req) = f(acc);
                if rej > 0 && best.is_none_or(|(_, r, _)| rej > r) {
                    best = Some((*m, rej, req));
                }
            }
            best.map(|(m, rejected, requests)| PeakMinute {
                minute: format_utc_minute(m * MINUTE_US),
                rejected,
                requests,
            })
        };

        let tiers = self
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut keys: Vec<(&String, &KeyAcc)> = t.keys.iter().collect();
                keys.sort_by(|a, b| b.1.rejected.cmp(&a.1.rejected).then(a.0.cmp(b.0)));
                TierReport {
                    name: t.name.clone(),
                    requests: t.applied,
                    rejected: t.rejected,
                    rejection_rate: rate(t.rejected, t.applied),
                    shadow_limited: shadow_known.then_some(t.shadow_limited),
                    distinct_keys_blocked: t.keys.len() as u64,
                    top_blocked_keys: keys
                        .into_iter()
                        .take(top)
                        .map(|(_, a)| BlockedKey {
                            key: a.display.clone(),
                            rejected: a.rejected,
                            requests_since_first_429: a.requests,
                            first: format_utc_seconds(a.first_us),
                            last: format_utc_seconds(a.last_us),
                        })
                        .collect(),
                    peak_minute: peak(&|m: &MinuteAcc| (m.rejected_by[i], m.applied[i])),
                }
            })
            .collect();

        let mut endpoints: Vec<EndpointReport> = self
            .endpoints
            .iter()
            .filter(|e| e.requests > 0)
            .map(|e| EndpointReport {
                endpoint: e.label.clone(),
                requests: e.requests,
                rejected: e.rejected,
                rejection_rate: rate(e.rejected, e.requests),
                by_tier: e
                    .by_tier
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| **c > 0)
                    .map(|(i, c)| TierCount {
                        tier: self.tiers[i].name.clone(),
                        rejected: *c,
                    })
                    .collect(),
            })
            .collect();
        endpoints.sort_by(|a, b| {
            b.requests
                .cmp(&a.requests)
                .then(a.endpoint.cmp(&b.endpoint))
        });

        let peak_minute = peak(&|m: &MinuteAcc| (m.rejected, m.requests));
        let timeline = timeline(&self.minutes, n);
        Report {
            engine,
            modes,
            policy,
            routes,
            input,
            totals,
            tiers,
            endpoints,
            peak_minute,
            timeline,
        }
    }
}

fn rate(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        #[allow(clippy::cast_precision_loss)]
        let r = a as f64 / b as f64;
        r
    }
}

/// Bucket widths, in minutes, from which the timeline picks the smallest
/// giving at most [`MAX_POINTS`] buckets.
const BUCKETS_MIN: [u64; 10] = [1, 5, 10, 15, 30, 60, 180, 360, 720, 1440];
const MAX_POINTS: u64 = 720;

fn timeline(minutes: &BTreeMap<u64, MinuteAcc>, tiers: usize) -> Timeline {
    let (Some(first), Some(last)) = (minutes.keys().next(), minutes.keys().next_back()) else {
        return Timeline::default();
    };
    let span = last - first + 1;
    let width = BUCKETS_MIN
        .iter()
        .copied()
        .find(|w| span.div_ceil(*w) <= MAX_POINTS)
        .unwrap_or(1440);
    let mut buckets: BTreeMap<u64, MinuteAcc> = BTreeMap::new();
    for (m, acc) in minutes {
        let b = m - m % width;
        buckets
            .entry(b)
            .or_insert_with(|| MinuteAcc::new(tiers))
            .merge(acc);
    }
    Timeline {
        bucket_seconds: width * 60,
        points: buckets
            .into_iter()
            .map(|(b, acc)| TimelinePoint {
                start: format_utc_minute(b * MINUTE_US),
                start_epoch: b * 60,
                requests: acc.requests,
                rejected: acc.rejected,
                requests_by_tier: acc.applied,
                rejected_by_tier: acc.rejected_by,
            })
            .collect(),
    }
}

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn pct(r: f64) -> String {
    if r == 0.0 {
        "0%".to_owned()
    } else if r < 0.0001 {
        "<0.01%".to_owned()
    } else {
        format!("{:.2}%", r * 100.0)
    }
}

fn duration(secs: f64) -> String {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let s = secs.round() as u64;
    let (d, h, m, s) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m"),
        _ => format!("{d}d{h:02}h{m:02}m"),
    }
}

/// A plain-text table.
struct Table {
    header: Vec<&'static str>,
    /// Right-aligned columns.
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn render(&self, out: &mut String) {
        let cols = self.header.len();
        let mut w: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String], out: &mut String| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = w[i].saturating_sub(c.chars().count());
                if i > 0 {
                    s.push_str("  ");
                }
                if self.right[i] {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    if i + 1 < cells.len() {
                        s.push_str(&" ".repeat(pad));
                    }
                }
            }
            out.push_str(s.trim_end());
            out.push('\n');
        };
        let head: Vec<String> = self.header.iter().map(|h| (*h).to_owned()).collect();
        line(&head, out);
        for r in &self.rows {
            line(r, out);
        }
    }
}

impl Report {
    /// The report as text tables, for a terminal.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let i = &self.input;
        let t = &self.totals;
        let _ = writeln!(
            o,
            "Replayed {} requests from {} lines ({} malformed, {} unreplayable), engine {}, {}.",
            thousands(t.requests),
            thousands(i.lines),
            thousands(i.malformed),
            thousands(i.unreplayable),
            self.engine,
            if self.modes == "enforce" {
                "every tier enforced"
            } else {
                "modes as configured"
            }
        );
        if let (Some(first), Some(last)) = (&i.first, &i.last) {
            let _ = writeln!(
                o,
                "Log time: {first} to {last} ({}).",
                duration(i.span_seconds)
            );
        }
        if let Some(m) = &i.first_malformed {
            let _ = writeln!(
                o,
                "First malformed line: {}:{}: {}",
                m.input, m.line, m.reason
            );
        }
        if i.out_of_order > 0 {
            let _ = writeln!(
                o,
                "{} lines were out of time order (at most {:.3} s back): replayed at the latest time seen.",
                thousands(i.out_of_order),
                i.max_step_back_seconds
            );
        }
        let _ = write!(
            o,
            "Would be rejected (429): {} ({})",
            thousands(t.rejected),
            pct(t.rejection_rate)
        );
        if let Some(p) = &self.peak_minute {
            let _ = write!(
                o,
                "; peak minute {} with {} of {} requests",
                p.minute,
                thousands(p.rejected),
                thousands(p.requests)
            );
        }
        o.push_str(".\n");
        let mut extra = Vec::new();
        for (n, label) in [
            (t.delayed, "delayed by shaping"),
            (t.shadow_limited, "shadow-limited"),
            (t.allowlisted, "allowlisted"),
            (t.denylisted, "denylisted"),
            (t.skipped, "no tier applied"),
            (t.fail_open, "failed open"),
            (t.fail_closed, "failed closed"),
        ] {
            if n > 0 {
                extra.push(format!("{} {label}", thousands(n)));
            }
        }
        if !extra.is_empty() {
            let _ = writeln!(o, "Also: {}.", extra.join(", "));
        }

        o.push('\n');
        let mut tiers = Table {
            header: vec![
                "TIER",
                "REQUESTS",
                "429s",
                "RATE",
                "KEYS BLOCKED",
                "PEAK 429 MINUTE",
            ],
            right: vec![false, true, true, true, true, false],
            rows: Vec::new(),
        };
        for tr in &self.tiers {
            tiers.rows.push(vec![
                tr.name.clone(),
                thousands(tr.requests),
                thousands(tr.rejected),
                pct(tr.rejection_rate),
                thousands(tr.distinct_keys_blocked),
                tr.peak_minute.as_ref().map_or_else(
                    || "-".to_owned(),
                    |p| format!("{} ({})", p.minute, thousands(p.rejected)),
                ),
            ]);
        }
        tiers.render(&mut o);

        o.push('\n');
        let mut eps = Table {
            header: vec!["ENDPOINT", "REQUESTS", "429s", "RATE", "BY TIER"],
            right: vec![false, true, true, true, false],
            rows: Vec::new(),
        };
        for e in &self.endpoints {
            eps.rows.push(vec![
                e.endpoint.clone(),
                thousands(e.requests),
                thousands(e.rejected),
                pct(e.rejection_rate),
                e.by_tier
                    .iter()
                    .map(|c| format!("{} {}", c.tier, thousands(c.rejected)))
                    .collect::<Vec<_>>()
                    .join(", "),
            ]);
        }
        eps.render(&mut o);

        if self.tiers.iter().any(|t| !t.top_blocked_keys.is_empty()) {
            o.push('\n');
            let mut keys = Table {
                header: vec![
                    "TIER",
                    "TOP BLOCKED KEY",
                    "429s",
                    "REQUESTS SINCE 1ST 429",
                    "FIRST 429",
                    "LAST 429",
                ],
                right: vec![false, false, true, true, false, false],
                rows: Vec::new(),
            };
            for tr in &self.tiers {
                for k in &tr.top_blocked_keys {
                    keys.rows.push(vec![
                        tr.name.clone(),
                        k.key.clone(),
                        thousands(k.rejected),
                        thousands(k.requests_since_first_429),
                        k.first.clone(),
                        k.last.clone(),
                    ]);
                }
            }
            keys.render(&mut o);
        }

        if !i.examples.is_empty() || !i.errors.is_empty() {
            o.push('\n');
            for e in &i.errors {
                let _ = writeln!(o, "input error: {}:{}: {}", e.input, e.line, e.reason);
            }
            if !i.examples.is_empty() {
                let skipped = i.malformed + i.unreplayable;
                let _ = writeln!(
                    o,
                    "Lines not replayed ({} of {}, first {} shown):",
                    thousands(skipped),
                    thousands(i.lines),
                    i.examples.len()
                );
                for e in &i.examples {
                    let _ = writeln!(o, "  {}:{}: {}", e.input, e.line, e.reason);
                }
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1234), "1,234");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(pct(0.25), "25.00%");
        assert_eq!(duration(3600.0 * 24.0 * 7.0), "7d00h00m");
        assert_eq!(duration(59.0), "59s");
    }
}
