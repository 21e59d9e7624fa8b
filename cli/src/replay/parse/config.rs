//! What to read: the log format, what each field becomes in the replayed
//! request, and the JSON field names.

use std::fmt;
use std::str::FromStr;

/// The format of an input (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LogFormat {
    /// Decided per input from its first non-empty line: `{` means JSON
    /// lines, anything else the combined format.
    #[default]
    Auto,
    /// The combined log format (nginx's default `combined`, Apache's
    /// `%h %l %u %t \"%r\" %>s %b \"%{Referer}i\" \"%{User-agent}i\"`),
    /// or the common one (without referer and user agent), optionally with
    /// more fields after the user agent (see
    /// [`ReplayOptions::extra_fields`](crate::replay::ReplayOptions::extra_fields)).
    Combined,
    /// One JSON object per line; the fields are named by
    /// [`ReplayOptions::fields`](crate::replay::ReplayOptions::fields).
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(LogFormat::Auto),
            "combined" | "common" | "clf" => Ok(LogFormat::Combined),
            "json" | "jsonl" | "ndjson" => Ok(LogFormat::Json),
            other => Err(format!(
                "unknown log format {other:?} (auto, combined, json)"
            )),
        }
    }
}

/// What a log field becomes in the replayed request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Target {
    /// The request's time (the virtual clock).
    Time,
    /// The TCP peer address (`SocketAddr` extension, read by `key = "ip"`).
    Ip,
    /// The HTTP method.
    Method,
    /// The request target (`/users/7?x=1`), matched against the routes.
    Path,
    /// A whole request line (`GET /users/7 HTTP/1.1`), used when the method
    /// or the path is missing.
    Request,
    /// The response status the server logged (reported, not replayed).
    Status,
    /// The user id ([`UserId`](tiered_ratelimit::key::UserId) extension, read by
    /// `key = "user"`).
    User,
    /// The client's plan ([`Plan`](tiered_ratelimit::rollout::Plan) extension, read by tiers
    /// with `[tier.plans]`).
    Plan,
    /// A request header, such as `x-api-key` for `key = { header = ".." }`
    /// or `x-forwarded-for` for trusted proxies.
    Header(http::HeaderName),
}

impl FromStr for Target {
    type Err = String;

    /// `time`, `ip`, `method`, `path`, `request`, `status`, `user`, `plan`
    /// or `header:<name>`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "time" => Target::Time,
            "ip" => Target::Ip,
            "method" => Target::Method,
            "path" => Target::Path,
            "request" => Target::Request,
            "status" => Target::Status,
            "user" => Target::User,
            "plan" => Target::Plan,
            other => match other.strip_prefix("header:") {
                Some(h) => Target::Header(
                    http::HeaderName::from_bytes(h.as_bytes())
                        .map_err(|_| format!("invalid header name {h:?}"))?,
                ),
                None => {
                    return Err(format!(
                        "unknown target {other:?} (time, ip, method, path, request, status, user, plan, header:<name>)"
                    ))
                }
            },
        })
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Time => f.write_str("time"),
            Target::Ip => f.write_str("ip"),
            Target::Method => f.write_str("method"),
            Target::Path => f.write_str("path"),
            Target::Request => f.write_str("request"),
            Target::Status => f.write_str("status"),
            Target::User => f.write_str("user"),
            Target::Plan => f.write_str("plan"),
            Target::Header(h) => write!(f, "header:{h}"),
        }
    }
}

/// The JSON field names (dotted paths for nested objects: `request.method`
/// matches `{"request":{"method":..}}` and a flat `"request.method"` key)
/// for each [`Target`]. The defaults follow nginx variable names:
///
/// | target | field |
/// |---|---|
/// | time | `time` |
/// | ip | `remote_addr` |
/// | method | `method` |
/// | path | `path` |
/// | request | `request` |
/// | status | `status` |
/// | user | `user` |
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldMap {
    pub(super) fields: Vec<(Target, String)>,
}

impl Default for FieldMap {
    fn default() -> Self {
        Self {
            fields: vec![
                (Target::Time, "time".into()),
                (Target::Ip, "remote_addr".into()),
                (Target::Method, "method".into()),
                (Target::Path, "path".into()),
                (Target::Request, "request".into()),
                (Target::Status, "status".into()),
                (Target::User, "user".into()),
            ],
        }
    }
}

impl FieldMap {
    /// Reads `target` from the field `path` (replacing the default); an
    /// empty path or `-` stops reading the target at all.
    pub fn set(&mut self, target: Target, path: impl Into<String>) -> &mut Self {
        let path = path.into();
        self.fields.retain(|(t, _)| *t != target);
        if !path.is_empty() && path != "-" {
            self.fields.push((target, path));
        }
        self
    }

    /// Parses `target=path` (`--field ip=client.addr`).
    ///
    /// # Errors
    /// A message naming what is wrong.
    pub fn set_spec(&mut self, spec: &str) -> Result<&mut Self, String> {
        let (t, p) = spec
            .split_once('=')
            .ok_or_else(|| format!("expected TARGET=FIELD, got {spec:?}"))?;
        let target = t.trim().parse::<Target>()?;
        Ok(self.set(target, p.trim()))
    }

    /// The configured `(target, field)` pairs.
    pub fn fields(&self) -> &[(Target, String)] {
        &self.fields
    }
}
