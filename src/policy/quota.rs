//! [`QuotaPolicy`]: the quota fields that a policy file's `[[tier]]` and
//! the Envoy service's rules file's `[[rule]]` share, flattened into both
//! tables: one schema, read by one parser, with the same field names and
//! the same errors naming them.
//!
//! A flattened table's values reach their parsers without their place in
//! the file (serde buffers them): each field's reader puts the field's name
//! before its message (`sync: unknown variant ...`), and the TOML readers
//! put the error back on that field's line (`toml_error`), as the parser
//! reports every other field.

use super::tier::{calendar_of, PolicyPeriod};
use crate::algorithm::calendar::Calendar;
use crate::engine::TokenLease;
use serde::{de, Deserialize, Deserializer};
use std::time::Duration;

/// A quota as a file gives it: `limit` per `period` (a duration or a
/// calendar period in `time_zone` from `anchor`), up to `burst` at once,
/// and how the count is kept with the backend (`sync` and its settings).
///
/// Its fields sit directly in the table that holds it (a `[[tier]]` or a
/// `[[rule]]`), beside that table's own; what each table requires of them
/// (a tier's `limit`, a limited rule's `limit` and `period`) is checked
/// when the table becomes a tier or a rule, naming the table and the field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct QuotaPolicy {
    /// Requests per period (`concurrency`: requests in flight at once).
    #[serde(default, deserialize_with = "limit")]
    pub limit: Option<u64>,
    /// The period: a duration in humantime (`"1s"`, `"10s"`, `"1m"`,
    /// `"1h"`), or a calendar period, `"day"`, `"week"`, `"month"` or
    /// `"year"` (a quota renewed at local midnight, see
    /// [`Calendar`](crate::algorithm::Calendar) and `time_zone`, `anchor`).
    #[serde(default, deserialize_with = "period")]
    pub period: Option<PolicyPeriod>,
    /// A calendar period's IANA time zone (default `"UTC"`); rejected with
    /// a duration.
    #[serde(default, deserialize_with = "time_zone")]
    pub time_zone: Option<String>,
    /// A calendar period's first day: a weekday for `"week"` (`"monday"`
    /// …), a day of the month for `"month"` (`15` or `"15"`; past a month's
    /// end, its last day), `"MM-DD"` for `"year"`; default the first.
    /// Rejected with a duration and with `"day"`.
    #[serde(default, deserialize_with = "anchor")]
    pub anchor: Option<String>,
    /// Capacity (default: `limit`).
    #[serde(default, deserialize_with = "burst")]
    pub burst: Option<u64>,
    /// How the count is kept with the backend: `"request"` (the default:
    /// one script call per request) or `"lease"` (lease mode, Redis only,
    /// see [`crate::engine::token_lease`]).
    #[serde(default, deserialize_with = "sync")]
    pub sync: Option<String>,
    /// With `sync = "lease"`: the demand one lease covers (humantime,
    /// default `"100ms"`); see [`TokenLease::interval`](crate::engine::TokenLease::interval).
    #[serde(default, deserialize_with = "sync_interval")]
    pub sync_interval: Option<Duration>,
    /// With `sync = "lease"`: the most tokens one instance holds of one key
    /// (default the capacity ÷ 8); see [`TokenLease::max`](crate::engine::TokenLease::max).
    #[serde(default, deserialize_with = "sync_max")]
    pub sync_max: Option<u64>,
    /// With `sync = "lease"`: the least demand per interval for a key to be
    /// leased (default 2); see [`TokenLease::min`](crate::engine::TokenLease::min).
    #[serde(default, deserialize_with = "sync_min")]
    pub sync_min: Option<u64>,
}

impl QuotaPolicy {
    /// The calendar of a calendar `period` with `time_zone` and `anchor`;
    /// `None` for a duration (or no period), which takes neither. The error
    /// names the field.
    pub(crate) fn calendar(&self) -> Result<Option<Calendar>, String> {
        calendar_of(
            self.period.unwrap_or_default(),
            self.time_zone.as_deref(),
            self.anchor.as_deref(),
        )
    }

    /// `sync` and its settings as lease settings (`None`: one call per
    /// request), or the field at fault and why.
    pub(crate) fn lease(&self) -> Result<Option<TokenLease>, &'static str> {
        crate::engine::lease_from_policy(
            self.sync.as_deref(),
            self.sync_interval,
            self.sync_max,
            self.sync_min,
        )
    }
}

/// `parse(d)`, its error led by `field: `.
fn named<'de, D: Deserializer<'de>, T>(
    field: &str,
    d: D,
    parse: impl FnOnce(D) -> Result<T, D::Error>,
) -> Result<Option<T>, D::Error> {
    parse(d)
        .map(Some)
        .map_err(|e| de::Error::custom(format_args!("{field}: {}", e.to_string().trim_end())))
}

fn limit<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    named("limit", d, u64::deserialize)
}
fn period<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PolicyPeriod>, D::Error> {
    named("period", d, super::tier::period)
}
fn time_zone<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    named("time_zone", d, String::deserialize)
}
fn anchor<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    named("anchor", d, super::tier::anchor)
}
fn burst<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    named("burst", d, u64::deserialize)
}
fn sync<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    named("sync", d, crate::engine::deserialize_sync).map(Option::flatten)
}
fn sync_interval<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    named(
        "sync_interval",
        d,
        humantime_serde::deserialize::<Duration, D>,
    )
}
fn sync_max<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    named("sync_max", d, u64::deserialize)
}
fn sync_min<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    named("sync_min", d, u64::deserialize)
}

/// The names of [`QuotaPolicy`]'s fields, as a file writes them.
#[cfg(feature = "policy-file")]
const FIELDS: [&str; 9] = [
    "limit",
    "period",
    "time_zone",
    "anchor",
    "burst",
    "sync",
    "sync_interval",
    "sync_max",
    "sync_min",
];

/// A TOML parser's error as text, put back on its field's line when it is
/// about a field of a table that flattens [`QuotaPolicy`]: serde reads
/// such a table's fields through a buffer, so the parser can only point at
/// the table's header. An unknown field (`unknown field `limt``) then points
/// at its key, a quota field's bad value at its value (with the parser's
/// message, without the `burst: ` its field's reader put before it), as the
/// parser points at every other field. Any other error is the parser's as
/// it is.
#[cfg(feature = "policy-file")]
pub(crate) fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message();
    let field = message
        .strip_prefix("unknown field `")
        .and_then(|m| m.split('`').next())
        .map(|f| (f, true))
        .or_else(|| {
            let (f, _) = message.split_once(": ")?;
            FIELDS.contains(&f).then_some((f, false))
        });
    let (Some(span), Some((field, key))) = (e.span(), field) else {
        return e.to_string();
    };
    match field_in_table(text, span.start, field, key) {
        // The line names the field: the parser's own message, as for the
        // table's other fields.
        Some(at) if key => render(text, at, message),
        Some(at) => render(text, at, &message[field.len() + 2..]),
        None => e.to_string(),
    }
}

/// Where `field` is written in the table whose header starts at `header`:
/// its key (`key`) or its value, as a byte range of `text`.
#[cfg(feature = "policy-file")]
fn field_in_table(
    text: &str,
    header: usize,
    field: &str,
    key: bool,
) -> Option<std::ops::Range<usize>> {
    let mut start = text.get(..header)?.rfind('\n').map_or(0, |n| n + 1);
    let mut first = true;
    for line in text.get(start..)?.split_inclusive('\n') {
        let at = start;
        start += line.len();
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') && !first {
            return None;
        }
        first = false;
        let Some((k, v)) = trimmed.split_once('=') else {
            continue;
        };
        if k.trim().trim_matches(|c| c == '"' || c == '\'') != field {
            continue;
        }
        let indent = line.len() - trimmed.len();
        if key {
            return Some(at + indent..at + indent + k.trim_end().len());
        }
        let v_start = at + indent + k.len() + 1 + (v.len() - v.trim_start().len());
        return Some(v_start..v_start + v.trim().len());
    }
    None
}

/// `message` at `span` of `text`, laid out as the TOML parser lays out its
/// errors (`TOML parse error at line L, column C`, the line, a caret).
#[cfg(feature = "policy-file")]
fn render(text: &str, span: std::ops::Range<usize>, message: &str) -> String {
    use std::fmt::Write;
    let before = &text[..span.start];
    let line = before.matches('\n').count();
    let column = before[before.rfind('\n').map_or(0, |n| n + 1)..]
        .chars()
        .count();
    let content = text.split('\n').nth(line).unwrap_or("");
    let gutter = " ".repeat((line + 1).to_string().len() + 1);
    let carets = "^".repeat(text[span].chars().count().max(1));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "TOML parse error at line {}, column {}",
        line + 1,
        column + 1
    );
    let _ = writeln!(out, "{gutter}|");
    let _ = writeln!(out, "{} | {content}", line + 1);
    let _ = writeln!(out, "{gutter}|{}{carets}", " ".repeat(column + 1));
    let _ = writeln!(out, "{message}");
    out
}
