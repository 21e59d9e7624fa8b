//! `[[tier]]`: [`TierPolicy`], its `key` ([`KeySpec`]) and `plan`
//! ([`PlanSource`]), and how it becomes a [`Tier`].

use crate::algorithm::calendar::{Calendar, CalendarPeriod};
use crate::error::ConfigError;
use crate::key::{ApiKey, ClientIp, Endpoint, Global, User};
use crate::util::de::{FieldIn, Header};
use crate::{algorithm::kind::Algorithm, http::tier::Tier, quota::Quota, rollout::Mode};
use http::HeaderName;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// One `[[tier]]` table: a [`Tier`] as a file gives it. Quotas, costs and
/// names are checked by [`build`](crate::RateLimitLayerBuilder::build), as
/// for a tier built in code.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TierPolicy {
    /// Tier name.
    pub name: String,
    /// What the tier keys by.
    pub key: KeySpec,
    /// The quota: `limit` (required), `period` (required by every
    /// algorithm but `concurrency`, which has none), `time_zone`,
    /// `anchor`, `burst`, and `sync` with its settings, written in the
    /// `[[tier]]` table itself, as a rules file's `[[rule]]` writes them.
    #[serde(flatten)]
    pub quota: super::QuotaPolicy,
    /// The status of the tier's denials: 429 (default) or, for a calendar
    /// period, 403; see [`Tier::exhausted_status`].
    #[serde(default)]
    pub exhausted_status: Option<u16>,
    /// What the quota counts, the IETF policy's `qu`: `"requests"`,
    /// `"content-bytes"`, `"concurrent-requests"` or a custom unit of
    /// `[a-z0-9-]`; default by the tier's kind, see [`Tier::quota_unit`].
    #[serde(default)]
    pub quota_unit: Option<String>,
    /// For `concurrency`: how long a slot is held without renewal
    /// (humantime, default `"60s"`); rejected by the other algorithms.
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
    /// Counting algorithm: one of [`Algorithm::NAMES`] (default
    /// `token_bucket`; `fixed_window`, the only one it takes, for a calendar
    /// period), checked when the file is read.
    #[serde(default, deserialize_with = "algorithm_name")]
    pub algorithm: Option<String>,
    /// For `leaky_bucket_shape`: the longest a request may be delayed
    /// (humantime, e.g. `"2s"`). Required by that algorithm, rejected by the others.
    #[serde(default, with = "humantime_serde")]
    pub max_delay: Option<Duration>,
    /// Tokens per request (default 1).
    #[serde(default = "one")]
    pub cost: u64,
    /// `"enforce"` (default), `"shadow"`, `"canary"` (with `canary_percent`)
    /// or `"off"`: [`Mode`]'s [labels](Mode::label).
    #[serde(default = "default_mode", deserialize_with = "mode_label")]
    pub mode: String,
    /// Percent of keys enforced in canary mode (0-100).
    #[serde(default)]
    pub canary_percent: Option<u8>,
    /// Methods counted (default: all but OPTIONS).
    #[serde(default, deserialize_with = "methods")]
    pub methods: Option<Vec<http::Method>>,
    /// Refund this tier's cost when the response's status is ≥ 400
    /// (default `false`); see [`Tier::skip_failed_requests`].
    #[serde(default)]
    pub skip_failed_requests: bool,
    /// Refund this tier's cost when the response's status is < 400
    /// (default `false`; for login endpoints); see
    /// [`Tier::skip_successful_requests`].
    #[serde(default)]
    pub skip_successful_requests: bool,
    /// Quotas per plan (`[tier.plans]`, each
    /// `{ limit = 100, period = "1m", burst = 200 }`, `burst` optional).
    #[serde(default)]
    pub plans: BTreeMap<String, Quota>,
    /// Where the plan is read (default `"extension"`).
    #[serde(default)]
    pub plan: PlanSource,
    /// A penalty box (`[tier.penalty]`: `violations`, `window`, `block`,
    /// optional `backoff`, `memory`, `max_block`); see [`Penalty`](crate::Penalty).
    #[serde(default)]
    pub penalty: Option<crate::algorithm::penalty::Penalty>,
    /// Whether the tier takes per-key overrides (default `false`; see
    /// [`Tier::overrides`](crate::Tier::overrides)).
    #[serde(default)]
    pub overrides: bool,
    /// Priced by the response (`[tier.priced]`; see
    /// [`PricedPolicy`](crate::policy::PricedPolicy) and
    /// [`Tier::priced`](crate::Tier::priced)).
    #[serde(default)]
    pub priced: Option<super::priced::PricedPolicy>,
    /// The tier's staged rollout plan, run fleet-wide through the control
    /// key: `rollout = [{ mode = "shadow", for = "1h" }, { mode =
    /// "canary:1", for = "1h" }, { mode = "canary:10", for = "1h" }, { mode
    /// = "enforce" }]` (see [`RolloutPlan`](crate::rollout::RolloutPlan);
    /// `plan` already names where a client's plan is read). Checked by
    /// `build()`, which also needs a `[control]` table.
    #[serde(default)]
    pub rollout: Option<Vec<crate::rollout::Stage>>,
    /// The plan's gates (`[tier.rollout_gates]`: `min_requests`,
    /// `min_keys`, `max_check_p99_increase`).
    #[serde(default)]
    pub rollout_gates: Option<crate::rollout::RolloutGates>,
    /// Up to four candidate quotas beside the live one (`candidates = [{
    /// limit = 50, period = "1m" }, { limit = 80, period = "1m", burst =
    /// 100 }]`; a calendar tier's take its own calendar period, or none):
    /// see [`Tier::candidates`](crate::Tier::candidates). Checked by
    /// `build()`, naming `candidates[i]`.
    #[serde(default)]
    pub candidates: Vec<CandidatePolicy>,
    /// The automatic fall back to shadow (`[tier.guard]`: `fallback =
    /// "shadow"`, then optional `bucket`, `k`, `confirm`, `warmup`,
    /// `min_sigma`, `min_requests`, `min_denied_keys`, `surge_factor`; see
    /// [`FallbackGuard`](crate::rollout::FallbackGuard)). Checked by
    /// `build()`, which also needs a `[control]` table.
    #[serde(default)]
    pub guard: Option<crate::rollout::FallbackGuard>,
}

/// One candidate quota of a `[[tier]]` (see [`TierPolicy::candidates`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CandidatePolicy {
    /// Requests per period.
    pub limit: u64,
    /// The period (humantime; a calendar tier's: its own period, or left
    /// out).
    #[serde(default, deserialize_with = "candidate_period")]
    pub period: Option<PolicyPeriod>,
    /// Capacity (default: `limit`).
    #[serde(default)]
    pub burst: Option<u64>,
}

/// The quotas of `candidates` of tier (or rule) `name`: a duration period
/// each (required), or on a calendar tier (`calendar`, its period `own`)
/// that period or none (`duration`: the tier's own quota's period). The
/// error names `candidates[i].<field>`.
pub(crate) fn candidate_quotas(
    name: &str,
    candidates: &[CandidatePolicy],
    own: PolicyPeriod,
    duration: Duration,
    calendar: bool,
) -> Result<Vec<Quota>, ConfigError> {
    let refused = |i: usize, field: &str, reason: String| ConfigError::Candidate {
        tier: name.to_owned(),
        field: format!("candidates[{i}].{field}"),
        reason,
    };
    candidates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let period = match (c.period, calendar) {
                (Some(PolicyPeriod::Duration(d)), false) => d,
                (None, false) => return Err(refused(i, "period", "required".into())),
                (None, true) => duration,
                (Some(p), true) if p == own => duration,
                (Some(_), true) => {
                    return Err(refused(
                        i,
                        "period",
                        "a calendar tier's candidates count per its own calendar window: give its period or none".into(),
                    ))
                }
                (Some(PolicyPeriod::Calendar(_)), false) => {
                    return Err(refused(
                        i,
                        "period",
                        "a calendar period is for a calendar tier's candidates".into(),
                    ))
                }
            };
            let q = Quota::new(c.limit, period);
            Ok(match c.burst {
                Some(b) => q.burst(b),
                None => q,
            })
        })
        .collect()
}

fn candidate_period<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PolicyPeriod>, D::Error> {
    period(d).map(Some)
}

/// A `[[tier]]`'s or a `[[rule]]`'s `period`: a duration or a calendar
/// period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyPeriod {
    /// A fixed length (humantime in the file).
    Duration(Duration),
    /// `"day"`, `"week"`, `"month"` or `"year"`.
    Calendar(CalendarPeriod),
}

impl Default for PolicyPeriod {
    fn default() -> Self {
        PolicyPeriod::Duration(Duration::ZERO)
    }
}

pub(super) fn period<'de, D: Deserializer<'de>>(d: D) -> Result<PolicyPeriod, D::Error> {
    let s = String::deserialize(d)?;
    if let Some(p) = CalendarPeriod::from_name(&s) {
        return Ok(PolicyPeriod::Calendar(p));
    }
    humantime::parse_duration(&s)
        .map(PolicyPeriod::Duration)
        .map_err(|e| {
            de::Error::custom(format!(
                "invalid period {s:?}: {e}; expected a duration (\"1m\") or one of day, week, month, year"
            ))
        })
}

pub(super) fn anchor<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Anchor {
        Day(u64),
        Name(String),
    }
    Ok(match Anchor::deserialize(d)? {
        Anchor::Day(n) => n.to_string(),
        Anchor::Name(s) => s,
    })
}

/// The calendar of a calendar `period` with its `time_zone` and `anchor`
/// (a `[[tier]]`'s or a descriptor `[[rule]]`'s); `None` for a duration,
/// which takes neither. The error names the field.
pub(super) fn calendar_of(
    period: PolicyPeriod,
    time_zone: Option<&str>,
    anchor: Option<&str>,
) -> Result<Option<Calendar>, String> {
    let PolicyPeriod::Calendar(p) = period else {
        let only =
            "only a calendar period (period = \"day\", \"week\", \"month\" or \"year\") uses it";
        return match (time_zone, anchor) {
            (Some(_), _) => Err(format!("time_zone: {only}")),
            (_, Some(_)) => Err(format!("anchor: {only}")),
            _ => Ok(None),
        };
    };
    zoned(p, time_zone, anchor).map(Some)
}

/// The calendar of the period `p` in `time_zone` from `anchor`.
#[cfg(feature = "calendar")]
fn zoned(
    p: CalendarPeriod,
    time_zone: Option<&str>,
    anchor: Option<&str>,
) -> Result<Calendar, String> {
    let mut c = Calendar::new(p);
    if let Some(tz) = time_zone {
        c = c.time_zone(tz).map_err(|e| e.to_string())?;
    }
    if let Some(a) = anchor {
        c = c.anchor(a).map_err(|e| e.to_string())?;
    }
    Ok(c)
}

/// Without the `calendar` feature: refused, naming the field and the
/// feature (not a parse error about an unknown period).
#[cfg(not(feature = "calendar"))]
fn zoned(
    p: CalendarPeriod,
    _time_zone: Option<&str>,
    _anchor: Option<&str>,
) -> Result<Calendar, String> {
    Err(format!(
        "period: {:?} is a calendar period, which needs the \"calendar\" feature of tiered-ratelimit (features = [\"calendar\"] in Cargo.toml)",
        p.name()
    ))
}

fn default_mode() -> String {
    Mode::default().label().to_owned()
}
fn one() -> u64 {
    1
}

/// A tier's `mode`: the labels of [`Mode`], the canary's percent given apart.
const MODES: [&str; 4] = [
    Mode::Enforce.label(),
    Mode::Shadow.label(),
    Mode::CANARY,
    Mode::Off.label(),
];

fn algorithm_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let name = String::deserialize(d)?;
    if Algorithm::NAMES.contains(&name.as_str()) {
        Ok(Some(name))
    } else {
        Err(de::Error::unknown_variant(&name, &Algorithm::NAMES))
    }
}

fn mode_label<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let label = String::deserialize(d)?;
    if MODES.contains(&label.as_str()) {
        Ok(label)
    } else {
        Err(de::Error::unknown_variant(&label, &MODES))
    }
}

fn methods<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<http::Method>>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|m| {
            http::Method::from_bytes(m.as_bytes())
                .map_err(|_| de::Error::invalid_value(de::Unexpected::Str(m), &"an HTTP method"))
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

impl TierPolicy {
    /// The tier, keyed by `client_ip` for `key = "ip"`.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] when `algorithm` and `max_delay`, or `mode`
    /// and `canary_percent`, do not go together.
    pub(crate) fn tier(&self, client_ip: &ClientIp) -> Result<Tier, ConfigError> {
        let error =
            |e: &dyn fmt::Display| ConfigError::Policy(format!("tier \"{}\": {e}", self.name));
        let limit = self.quota.limit.ok_or_else(|| error(&"limit: required"))?;
        let calendar = self.quota.calendar().map_err(|e| error(&e))?;
        let algorithm = match (&self.algorithm, &calendar) {
            (Some(a), _) => a.as_str(),
            (None, Some(_)) => Algorithm::FixedWindow.name(),
            (None, None) => Algorithm::default().name(),
        };
        let mut algorithm =
            Algorithm::from_name(algorithm, self.max_delay).map_err(|e| error(&e))?;
        match (&mut algorithm, self.lease) {
            (Algorithm::Concurrency { slot_ttl }, Some(l)) => *slot_ttl = l,
            (Algorithm::Concurrency { .. }, None) => {}
            (_, Some(_)) => return Err(error(&"lease: only algorithm = \"concurrency\" uses it")),
            (_, None) => {}
        }
        let mode = self.rollout_mode().map_err(|e| error(&e))?;
        let quota = match (self.quota.burst, algorithm) {
            // No period: the quota's is the slot TTL (never used to count).
            (_, Algorithm::Concurrency { slot_ttl }) => Quota::new(limit, slot_ttl),
            (Some(burst), _) => Quota::new(limit, self.duration()).burst(burst),
            (None, _) => Quota::new(limit, self.duration()),
        };
        let name = self.name.clone();
        let tier = match &self.key {
            KeySpec::Global => Tier::new(name, Global, quota),
            KeySpec::Ip => Tier::new(name, client_ip.clone(), quota),
            KeySpec::User => Tier::new(name, User, quota),
            KeySpec::Endpoint => Tier::new(name, Endpoint, quota),
            KeySpec::Header(h) => Tier::new(name, ApiKey::from_name(h.clone()), quota),
        };
        // The calendar first: an algorithm given with it is then refused by
        // build() (ConfigError::CalendarAlgorithm), not replaced.
        let on_calendar = calendar.is_some();
        let tier = match calendar {
            Some(c) => tier.calendar(c),
            None => tier,
        };
        let mut tier = tier
            .cost(self.cost)
            .algorithm(algorithm)
            .mode(mode)
            .skip_failed_requests(self.skip_failed_requests)
            .skip_successful_requests(self.skip_successful_requests);
        if let Some(methods) = &self.methods {
            tier = tier.methods(methods.iter().cloned());
        }
        if let Some(p) = self.penalty {
            tier = tier.penalty(p);
        }
        if let Some(s) = self.exhausted_status {
            tier = tier.exhausted_status(s);
        }
        if let Some(u) = &self.quota_unit {
            tier = tier.quota_unit(crate::response::QuotaUnit::named(u));
        }
        tier = tier.overrides(self.overrides);
        if let Some(stages) = &self.rollout {
            let plan = crate::rollout::RolloutPlan::new(stages.iter().cloned());
            tier = tier.rollout(match &self.rollout_gates {
                Some(g) => plan.gates(g.clone()),
                None => plan,
            });
        } else if self.rollout_gates.is_some() {
            return Err(ConfigError::RolloutPlan {
                tier: self.name.clone(),
                field: "rollout_gates".into(),
                reason: "gates without a plan: add `rollout = [...]`".into(),
            });
        }
        if let Some(g) = &self.guard {
            tier = tier.guard(g.clone());
        }
        if let Some(p) = &self.priced {
            let (estimate, actual) = p.compile(&self.name)?;
            tier = tier.priced(estimate, actual);
        }
        if let Some(lease) = self.quota.lease().map_err(|e| error(&e))? {
            tier = tier.lease(lease);
        }
        if !self.plans.is_empty() {
            tier = tier.plans(self.plans.iter().map(|(name, q)| (name.clone(), *q)));
        }
        if !self.candidates.is_empty() {
            tier = tier.candidates(self.candidate_quotas(on_calendar)?);
        }
        if let PlanSource::Header(h) = &self.plan {
            let h = h.clone();
            tier = tier.plan_fn(move |p: &http::request::Parts| {
                p.headers
                    .get(&h)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            });
        }
        Ok(tier)
    }

    /// The candidates' quotas (see [`candidate_quotas`]).
    fn candidate_quotas(&self, calendar: bool) -> Result<Vec<Quota>, ConfigError> {
        candidate_quotas(
            &self.name,
            &self.candidates,
            self.quota.period.unwrap_or_default(),
            self.duration(),
            calendar,
        )
    }

    /// The period's length (a calendar period's is set by its calendar).
    fn duration(&self) -> Duration {
        match self.quota.period.unwrap_or_default() {
            PolicyPeriod::Duration(d) => d,
            PolicyPeriod::Calendar(_) => Duration::ZERO,
        }
    }

    /// `mode` with `canary_percent`.
    fn rollout_mode(&self) -> Result<Mode, String> {
        let canary = self.mode == Mode::CANARY;
        match (canary, self.canary_percent) {
            (true, Some(percent)) if percent <= 100 => Ok(Mode::Canary { percent }),
            (true, Some(p)) => Err(format!("canary_percent: {p} is above 100")),
            (true, None) => Err("canary_percent: required by mode = \"canary\"".to_owned()),
            (false, Some(_)) => Err("canary_percent: only mode = \"canary\" uses it".to_owned()),
            (false, None) => self.mode.parse().map_err(|e| format!("mode: {e}")),
        }
    }
}

/// A tier's key in a policy file: `"global"`, `"ip"`, `"user"`,
/// `"endpoint"` or `{ header = "x-api-key" }`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySpec {
    /// [`Global`].
    Global,
    /// [`ClientIp`], configured by `[client_ip]`.
    Ip,
    /// [`User`] ([`UserId`](crate::key::UserId) from the request extensions).
    User,
    /// [`Endpoint`].
    Endpoint,
    /// [`ApiKey`] read from this header.
    Header(HeaderName),
}

impl KeySpec {
    /// The keys a policy file names with a string.
    const NAMED: [KeySpec; 4] = [
        KeySpec::Global,
        KeySpec::Ip,
        KeySpec::User,
        KeySpec::Endpoint,
    ];
    /// Their names.
    const NAMES: [&'static str; 4] = ["global", "ip", "user", "endpoint"];

    /// `global`, `ip`, `user`, `endpoint` or `header`.
    fn name(&self) -> &'static str {
        match self {
            KeySpec::Global => Self::NAMES[0],
            KeySpec::Ip => Self::NAMES[1],
            KeySpec::User => Self::NAMES[2],
            KeySpec::Endpoint => Self::NAMES[3],
            KeySpec::Header(_) => "header",
        }
    }
}

/// `global`, `ip`, `user`, `endpoint`, or `header:<name>` (lowercase): the
/// key as replay reports show it.
impl fmt::Display for KeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySpec::Header(h) => write!(f, "{}:{h}", self.name()),
            named => f.write_str(named.name()),
        }
    }
}

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeySpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#""global", "ip", "user", "endpoint" or { header = "<name>" }"#)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeySpec, E> {
                KeySpec::NAMED
                    .into_iter()
                    .find(|k| k.name() == v)
                    .ok_or_else(|| {
                        E::custom(format_args!(
                            "unknown key `{v}`, expected `global`, `ip`, `user`, `endpoint`, \
                             or {{ header = \"<name>\" }} to key on a request header \
                             (an API key: {{ header = \"x-api-key\" }})"
                        ))
                    })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<KeySpec, A::Error> {
                header_table(map).map(KeySpec::Header)
            }
        }
        d.deserialize_any(V)
    }
}

/// `{ header = "<name>" }`.
fn header_table<'de, A: MapAccess<'de>>(mut map: A) -> Result<HeaderName, A::Error> {
    let mut header = None;
    while map.next_key_seed(FieldIn(&["header"]))?.is_some() {
        header = Some(map.next_value::<Header>()?.0);
    }
    header.ok_or_else(|| de::Error::missing_field("header"))
}

/// Where a tier reads the client's plan: `"extension"` (the
/// [`Plan`](crate::rollout::Plan) set by your auth layer; the default) or
/// `{ header = "x-plan" }` — only behind a gateway that sets or strips that
/// header, since clients can send any header.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PlanSource {
    /// [`Plan`](crate::rollout::Plan) in the request extensions.
    #[default]
    Extension,
    /// A request header written by a trusted gateway.
    Header(HeaderName),
}

impl<'de> Deserialize<'de> for PlanSource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PlanSource;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#""extension" or { header = "<name>" }"#)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<PlanSource, A::Error> {
                Err(de::Error::custom(
                    "`plan` names where a client's plan is read (\"extension\" or { header = \"<name>\" }); a staged rollout plan is written `rollout = [{ mode = \"shadow\", for = \"1h\" }, …]`",
                ))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PlanSource, E> {
                match v {
                    "extension" => Ok(PlanSource::Extension),
                    other => Err(E::unknown_variant(other, &["extension"])),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PlanSource, A::Error> {
                header_table(map).map(PlanSource::Header)
            }
        }
        d.deserialize_any(V)
    }
}
