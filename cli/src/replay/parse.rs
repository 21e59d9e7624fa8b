//! Access-log lines to [`Record`]s: the combined / common log format (nginx,
//! Apache) and JSON lines with configurable field names.

use super::time::{self, TimeFormat};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
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
    /// [`ReplayOptions::extra_fields`](super::ReplayOptions::extra_fields)).
    Combined,
    /// One JSON object per line; the fields are named by
    /// [`ReplayOptions::fields`](super::ReplayOptions::fields).
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
    fields: Vec<(Target, String)>,
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

/// A reusable field buffer.
#[derive(Debug, Default, Clone)]
pub(crate) struct Buf {
    pub(crate) bytes: Vec<u8>,
    pub(crate) set: bool,
}

impl Buf {
    fn put(&mut self, b: &[u8]) {
        self.bytes.clear();
        self.bytes.extend_from_slice(b);
        self.set = true;
    }
    fn clear(&mut self) {
        self.set = false;
        self.bytes.clear();
    }
    pub(crate) fn get(&self) -> Option<&[u8]> {
        self.set.then_some(&self.bytes[..])
    }
}

/// One parsed log line, in buffers reused from line to line.
#[derive(Debug, Default)]
pub(crate) struct Record {
    pub(crate) time_us: Option<u64>,
    pub(crate) ip: Option<IpAddr>,
    pub(crate) method: Buf,
    pub(crate) target: Buf,
    request: Buf,
    pub(crate) status: Option<u16>,
    pub(crate) user: Buf,
    pub(crate) plan: Buf,
    /// One per configured header, in [`LineParser::headers`] order.
    pub(crate) headers: Vec<Buf>,
}

impl Record {
    fn reset(&mut self, headers: usize) {
        self.time_us = None;
        self.ip = None;
        self.method.clear();
        self.target.clear();
        self.request.clear();
        self.status = None;
        self.user.clear();
        self.plan.clear();
        self.headers.resize_with(headers, Buf::default);
        for h in &mut self.headers {
            h.clear();
        }
    }
}

/// Why a line could not be replayed: the reason, and whether the line is
/// malformed (`true`) or a well-formed line whose request is not one a
/// server passes on (`false`: `"-"`, TLS bytes on a plain port).
pub(crate) type Malformed = (&'static str, bool);

fn bad(reason: &'static str) -> Malformed {
    (reason, true)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Time,
    Ip,
    Method,
    Path,
    Request,
    Status,
    User,
    Plan,
    Header(usize),
}

/// Parses lines of one configuration.
#[derive(Debug)]
pub(crate) struct LineParser {
    time_format: TimeFormat,
    /// JSON: `(dotted path, slot)`.
    json: Vec<(String, Slot)>,
    /// Combined: what the quoted fields after the user agent are.
    extras: Vec<Slot>,
    /// Header names, indexed by `Slot::Header`.
    pub(crate) headers: Vec<http::HeaderName>,
    /// Combined: `$remote_user` becomes the user id.
    remote_user: bool,
    /// The last CLF timestamp text and its value (most lines share a second).
    time_cache: TimeCache,
    /// Later timestamps are malformed: a log line cannot come from more
    /// than a day after the replay (epoch µs).
    max_time_us: u64,
}

/// A timestamp later than a day from now is not a log's: one such line
/// would otherwise move the virtual clock (which never goes back) past all
/// the lines after it.
fn max_time_us() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    u64::try_from(now)
        .unwrap_or(u64::MAX)
        .saturating_add(86_400_000_000)
}

impl LineParser {
    pub(crate) fn new(
        fields: &FieldMap,
        extras: &[Target],
        time_format: TimeFormat,
        remote_user: bool,
    ) -> Self {
        let mut headers: Vec<http::HeaderName> = Vec::new();
        let slot = |t: &Target, headers: &mut Vec<http::HeaderName>| match t {
            Target::Time => Slot::Time,
            Target::Ip => Slot::Ip,
            Target::Method => Slot::Method,
            Target::Path => Slot::Path,
            Target::Request => Slot::Request,
            Target::Status => Slot::Status,
            Target::User => Slot::User,
            Target::Plan => Slot::Plan,
            Target::Header(h) => {
                let i = headers.iter().position(|x| x == h).unwrap_or_else(|| {
                    headers.push(h.clone());
                    headers.len() - 1
                });
                Slot::Header(i)
            }
        };
        let json = fields
            .fields
            .iter()
            .map(|(t, p)| (p.clone(), slot(t, &mut headers)))
            .collect();
        let extras = extras.iter().map(|t| slot(t, &mut headers)).collect();
        Self {
            time_format,
            json,
            extras,
            headers,
            remote_user,
            time_cache: TimeCache::default(),
            max_time_us: max_time_us(),
        }
    }

    /// Parses `line` (without its newline) in `format` into `rec`.
    pub(crate) fn parse(
        &mut self,
        format: LogFormat,
        line: &[u8],
        rec: &mut Record,
    ) -> Result<(), Malformed> {
        rec.reset(self.headers.len());
        match format {
            LogFormat::Json => self.parse_json(line, rec)?,
            _ => self.parse_combined(line, rec)?,
        }
        match rec.time_us {
            None => return Err(bad("no readable timestamp")),
            Some(t) if t > self.max_time_us => {
                return Err(bad("timestamp more than a day in the future"))
            }
            Some(_) => {}
        }
        if rec.ip.is_none() {
            return Err(bad("no client IP address"));
        }
        if !rec.method.set || !rec.target.set {
            if let Some(r) = rec.request.get() {
                let (m, t) = split_request(r)
                    .ok_or(("request line is not `METHOD target [protocol]`", false))?;
                if !rec.method.set {
                    rec.method.put(m);
                }
                if !rec.target.set {
                    rec.target.put(t);
                }
            }
        }
        if !rec.method.set {
            return Err(bad("no method"));
        }
        if !rec.target.set {
            return Err(bad("no request path"));
        }
        Ok(())
    }

    fn put(&self, slot: Slot, b: &[u8], rec: &mut Record) {
        put(self.time_format, slot, b, rec);
    }
}

fn put(time_format: TimeFormat, slot: Slot, b: &[u8], rec: &mut Record) {
    match slot {
        Slot::Time => rec.time_us = time::parse_text(b, time_format),
        Slot::Ip => rec.ip = parse_ip(b),
        Slot::Method => rec.method.put(b),
        Slot::Path => rec.target.put(b),
        Slot::Request => rec.request.put(b),
        Slot::Status => {
            rec.status = std::str::from_utf8(b).ok().and_then(|s| s.parse().ok());
        }
        Slot::User => {
            if !b.is_empty() && b != b"-" {
                rec.user.put(b);
            }
        }
        Slot::Plan => {
            if !b.is_empty() && b != b"-" {
                rec.plan.put(b);
            }
        }
        Slot::Header(i) => {
            if !b.is_empty() && b != b"-" {
                if let Some(h) = rec.headers.get_mut(i) {
                    h.put(b);
                }
            }
        }
    }
}

impl LineParser {
    fn parse_combined(&mut self, line: &[u8], rec: &mut Record) -> Result<(), Malformed> {
        let mut c = Cursor { b: line, i: 0 };
        let host = c.token().ok_or(bad("missing client address"))?;
        rec.ip = Some(parse_ip(host).ok_or(bad("client address is not an IP address"))?);
        c.token().ok_or(bad("missing ident field"))?;
        let user = c.token().ok_or(bad("missing user field"))?;
        if self.remote_user && user != b"-" && !user.is_empty() {
            rec.user.put(user);
        }
        let ts = c.bracketed().ok_or(bad("missing [timestamp]"))?;
        rec.time_us = Some(
            self.time_cache
                .parse(ts, self.time_format)
                .ok_or(bad("unreadable [timestamp]"))?,
        );
        let request = c.quoted().ok_or(bad("missing \"request\""))?;
        unescape_into(request, &mut rec.request.bytes);
        rec.request.set = true;
        let status = c.token().ok_or(bad("missing status"))?;
        rec.status = std::str::from_utf8(status)
            .ok()
            .and_then(|s| s.parse().ok());
        c.token().ok_or(bad("missing body bytes"))?;
        // Optional: referer, user agent, then the configured extras.
        if c.at_end() {
            return Ok(());
        }
        c.field().ok_or(bad("unreadable referer"))?;
        if c.at_end() {
            return Ok(());
        }
        c.field().ok_or(bad("unreadable user agent"))?;
        let mut scratch = Vec::new();
        for k in 0..self.extras.len() {
            if c.at_end() {
                break;
            }
            let f = c.field().ok_or(bad("unreadable extra field"))?;
            let slot = self.extras[k];
            if f.contains(&b'\\') {
                unescape_into(f, &mut scratch);
                self.put(slot, &scratch, rec);
            } else {
                self.put(slot, f, rec);
            }
        }
        Ok(())
    }

    fn parse_json(&mut self, line: &[u8], rec: &mut Record) -> Result<(), Malformed> {
        let mut out = JsonOut {
            time_format: self.time_format,
            time_cache: &mut self.time_cache,
            rec,
        };
        let mut de = serde_json::Deserializer::from_slice(line);
        MapSeed {
            paths: &self.json,
            out: &mut out,
        }
        .deserialize(&mut de)
        .map_err(|_| bad("not a JSON object"))?;
        de.end()
            .map_err(|_| bad("trailing characters after the JSON object"))?;
        Ok(())
    }
}

/// Splits `GET /x HTTP/1.1` into method and target (the protocol, when it
/// is the last word and starts with `HTTP/`, is dropped; a target with
/// spaces stays whole and fails as a URI later).
fn split_request(r: &[u8]) -> Option<(&[u8], &[u8])> {
    let sp = r.iter().position(|&b| b == b' ')?;
    let (m, rest) = (&r[..sp], &r[sp + 1..]);
    if m.is_empty() || rest.is_empty() {
        return None;
    }
    let t = match rest.iter().rposition(|&b| b == b' ') {
        Some(p) if rest[p + 1..].starts_with(b"HTTP/") => &rest[..p],
        _ => rest,
    };
    (!t.is_empty()).then_some((m, t))
}

/// `1.2.3.4`, `2001:db8::1`, `[2001:db8::1]`, `1.2.3.4:5678`, `[::1]:80`.
fn parse_ip(b: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(b).ok()?;
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(inner) = s.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        return inner.parse().ok();
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip())
}

/// Undoes the escapes nginx (`\xHH`) and Apache (`\"`, `\\`, `\xHH`) write
/// in quoted fields.
fn unescape_into(b: &[u8], out: &mut Vec<u8>) {
    out.clear();
    if !b.contains(&b'\\') {
        out.extend_from_slice(b);
        return;
    }
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'\\' && i + 1 < b.len() {
            match b[i + 1] {
                b'x' if i + 3 < b.len() && hex(b[i + 2]).is_some() && hex(b[i + 3]).is_some() => {
                    out.push(hex(b[i + 2]).unwrap_or(0) << 4 | hex(b[i + 3]).unwrap_or(0));
                    i += 4;
                    continue;
                }
                b'"' | b'\\' => {
                    out.push(b[i + 1]);
                    i += 2;
                    continue;
                }
                _ => {}
            }
        }
        out.push(c);
        i += 1;
    }
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn skip_spaces(&mut self) {
        while self.i < self.b.len() && self.b[self.i] == b' ' {
            self.i += 1;
        }
    }
    fn at_end(&mut self) -> bool {
        self.skip_spaces();
        self.i >= self.b.len()
    }
    /// Up to the next space.
    fn token(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        let start = self.i;
        while self.i < self.b.len() && self.b[self.i] != b' ' {
            self.i += 1;
        }
        (self.i > start).then(|| &self.b[start..self.i])
    }
    /// `[...]`.
    fn bracketed(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        if self.b.get(self.i) != Some(&b'[') {
            return None;
        }
        let start = self.i + 1;
        let end = start + memchr::memchr(b']', &self.b[start..])?;
        self.i = end + 1;
        Some(&self.b[start..end])
    }
    /// `"..."` with backslash escapes; the raw (escaped) content.
    fn quoted(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        if self.b.get(self.i) != Some(&b'"') {
            return None;
        }
        let start = self.i + 1;
        let mut j = start;
        // The next quote not escaped by an odd number of backslashes.
        while let Some(p) = memchr::memchr(b'"', &self.b[j..]) {
            let q = j + p;
            let backslashes = self.b[start..q]
                .iter()
                .rev()
                .take_while(|&&c| c == b'\\')
                .count();
            if backslashes % 2 == 0 {
                self.i = q + 1;
                return Some(&self.b[start..q]);
            }
            j = q + 1;
        }
        None
    }
    /// A quoted field or a bare token.
    fn field(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        if self.b.get(self.i) == Some(&b'"') {
            self.quoted()
        } else {
            self.token()
        }
    }
}

struct JsonOut<'r> {
    time_format: TimeFormat,
    time_cache: &'r mut TimeCache,
    rec: &'r mut Record,
}

/// The last timestamp's text and value: consecutive log lines mostly share
/// their second, and parsing a date is most of a line's parsing.
#[derive(Debug, Default)]
struct TimeCache {
    text: Vec<u8>,
    us: Option<u64>,
}

impl TimeCache {
    fn parse(&mut self, b: &[u8], format: TimeFormat) -> Option<u64> {
        if self.us.is_some() && b == &self.text[..] {
            return self.us;
        }
        let t = time::parse_text(b, format)?;
        self.text.clear();
        self.text.extend_from_slice(b);
        self.us = Some(t);
        Some(t)
    }
}

/// A JSON object, reading the fields in `paths` (relative to this object).
struct MapSeed<'a, 'o, 'r, P> {
    paths: &'a [(P, Slot)],
    out: &'o mut JsonOut<'r>,
}

impl<'de, P: AsRef<str>> DeserializeSeed<'de> for MapSeed<'_, '_, '_, P> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, P: AsRef<str>> Visitor<'de> for MapSeed<'_, '_, '_, P> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(m) = map.next_key_seed(KeySeed { paths: self.paths })? {
            match m {
                KeyMatch::Leaf(slot) => map.next_value_seed(ValueSeed {
                    slot,
                    out: &mut *self.out,
                })?,
                KeyMatch::Prefix { mask, len } => map.next_value_seed(NestedSeed {
                    mask,
                    key_len: len,
                    paths: self.paths,
                    out: &mut *self.out,
                })?,
                KeyMatch::None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A nested object under a key of `key_len` bytes that is the first segment
/// of the paths in `mask`.
struct NestedSeed<'a, 'o, 'r, P> {
    mask: u64,
    key_len: usize,
    paths: &'a [(P, Slot)],
    out: &'o mut JsonOut<'r>,
}

impl<'de, P: AsRef<str>> DeserializeSeed<'de> for NestedSeed<'_, '_, '_, P> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, P: AsRef<str>> Visitor<'de> for NestedSeed<'_, '_, '_, P> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let len = self.key_len;
        let sub: Vec<(&str, Slot)> = self
            .paths
            .iter()
            .enumerate()
            .filter(|(i, _)| *i < 64 && self.mask & (1 << i) != 0)
            .map(|(_, (p, s))| (&p.as_ref()[len + 1..], *s))
            .collect();
        MapSeed {
            paths: &sub,
            out: self.out,
        }
        .visit_map(map)
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

enum KeyMatch {
    Leaf(Slot),
    /// The key (this many bytes) is the first segment of the dotted paths
    /// in `mask` (by index).
    Prefix {
        mask: u64,
        len: usize,
    },
    None,
}

struct KeySeed<'a, P> {
    paths: &'a [(P, Slot)],
}

impl<'de, P: AsRef<str>> DeserializeSeed<'de> for KeySeed<'_, P> {
    type Value = KeyMatch;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<KeyMatch, D::Error> {
        // As bytes: serde_json then skips the UTF-8 check of every key (a
        // key is only compared with the configured names).
        d.deserialize_bytes(self)
    }
}

impl<'de, P: AsRef<str>> Visitor<'de> for KeySeed<'_, P> {
    type Value = KeyMatch;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E: de::Error>(self, k: &str) -> Result<KeyMatch, E> {
        self.visit_bytes(k.as_bytes())
    }
    fn visit_bytes<E: de::Error>(self, k: &[u8]) -> Result<KeyMatch, E> {
        let mut mask = 0u64;
        for (i, (p, s)) in self.paths.iter().enumerate() {
            let p = p.as_ref().as_bytes();
            // The cheap tests first: most keys differ from most names in
            // length, in the first byte, or in the byte after the prefix.
            if p.len() == k.len() {
                if p.first() == k.first() && p == k {
                    return Ok(KeyMatch::Leaf(*s));
                }
            } else if i < 64 && p.len() > k.len() && p[k.len()] == b'.' && p.starts_with(k) {
                mask |= 1 << i;
            }
        }
        Ok(if mask == 0 {
            KeyMatch::None
        } else {
            KeyMatch::Prefix { mask, len: k.len() }
        })
    }
}

struct ValueSeed<'o, 'r> {
    slot: Slot,
    out: &'o mut JsonOut<'r>,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a number")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let JsonOut {
            time_format,
            time_cache,
            rec,
        } = self.out;
        match self.slot {
            Slot::Time => rec.time_us = time_cache.parse(v.as_bytes(), *time_format),
            slot => put(*time_format, slot, v.as_bytes(), rec),
        }
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let JsonOut {
            time_format, rec, ..
        } = self.out;
        match self.slot {
            Slot::Time => rec.time_us = time::epoch_u64_us(v),
            Slot::Status => rec.status = u16::try_from(v).ok(),
            s => put(*time_format, s, v.to_string().as_bytes(), rec),
        }
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => {
                let JsonOut {
                    time_format, rec, ..
                } = self.out;
                if !matches!(self.slot, Slot::Time | Slot::Status) {
                    put(*time_format, self.slot, v.to_string().as_bytes(), rec);
                }
                Ok(())
            }
        }
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        let JsonOut {
            time_format, rec, ..
        } = self.out;
        match self.slot {
            Slot::Time => rec.time_us = time::epoch_f64_us(v),
            Slot::Status => {}
            s => put(*time_format, s, v.to_string().as_bytes(), rec),
        }
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        let JsonOut {
            time_format, rec, ..
        } = self.out;
        if !matches!(self.slot, Slot::Time | Slot::Status) {
            put(
                *time_format,
                self.slot,
                if v { b"true" } else { b"false" },
                rec,
            );
        }
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

/// Whether a line looks like JSON (for [`LogFormat::Auto`]).
pub(crate) fn looks_like_json(line: &[u8]) -> bool {
    line.iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parser(extras: &[Target]) -> LineParser {
        LineParser::new(&FieldMap::default(), extras, TimeFormat::Auto, true)
    }

    #[test]
    fn combined_line() {
        let mut p = parser(&[Target::Header(http::HeaderName::from_static("x-api-key"))]);
        let mut r = Record::default();
        let line = br#"203.0.113.9 - alice [10/Oct/2000:13:55:36 -0700] "GET /users/7?x=1 HTTP/1.1" 200 2326 "http://ex.com/" "curl/8 \"q\"" "sk_live_1""#;
        p.parse(LogFormat::Combined, line, &mut r).unwrap();
        assert_eq!(r.ip, Some("203.0.113.9".parse().unwrap()));
        assert_eq!(r.method.get(), Some(&b"GET"[..]));
        assert_eq!(r.target.get(), Some(&b"/users/7?x=1"[..]));
        assert_eq!(r.user.get(), Some(&b"alice"[..]));
        assert_eq!(r.status, Some(200));
        assert_eq!(r.headers[0].get(), Some(&b"sk_live_1"[..]));
        assert_eq!(r.time_us, Some(971_211_336_000_000));
        // common format: no referer / agent
        let line = br#"::1 - - [10/Oct/2000:13:55:36 +0000] "POST /login HTTP/1.0" 401 -"#;
        p.parse(LogFormat::Combined, line, &mut r).unwrap();
        assert_eq!(r.user.get(), None);
        assert_eq!(r.headers[0].get(), None);
        assert!(p.parse(LogFormat::Combined, b"garbage", &mut r).is_err());
        assert!(p
            .parse(
                LogFormat::Combined,
                br#"host.example - - [10/Oct/2000:13:55:36 +0000] "GET / HTTP/1.0" 200 1"#,
                &mut r
            )
            .is_err());
    }

    #[test]
    fn request_line_escapes() {
        let mut p = parser(&[]);
        let mut r = Record::default();
        let line =
            br#"1.2.3.4 - - [10/Oct/2000:13:55:36 +0000] "GET /a\x22b HTTP/1.1" 200 1 "-" "-""#;
        p.parse(LogFormat::Combined, line, &mut r).unwrap();
        assert_eq!(r.target.get(), Some(&b"/a\"b"[..]));
        let line = br#"1.2.3.4 - - [10/Oct/2000:13:55:36 +0000] "-" 400 0 "-" "-""#;
        assert!(p.parse(LogFormat::Combined, line, &mut r).is_err());
    }

    #[test]
    fn json_line_flat_and_nested() {
        let mut f = FieldMap::default();
        f.set(Target::Ip, "client.ip")
            .set(
                Target::Header(http::HeaderName::from_static("x-api-key")),
                "headers.x-api-key",
            )
            .set(Target::Plan, "plan");
        let mut p = LineParser::new(&f, &[], TimeFormat::Auto, false);
        let mut r = Record::default();
        let line = br#"{"time":"2000-10-10T13:55:36Z","client":{"ip":"198.51.100.1","port":5},"request":"GET /x HTTP/1.1","status":"429","headers":{"x-api-key":"k1"},"plan":"pro","other":[1,{"a":2}]}"#;
        p.parse(LogFormat::Json, line, &mut r).unwrap();
        assert_eq!(r.ip, Some("198.51.100.1".parse().unwrap()));
        assert_eq!(r.method.get(), Some(&b"GET"[..]));
        assert_eq!(r.target.get(), Some(&b"/x"[..]));
        assert_eq!(r.status, Some(429));
        assert_eq!(r.headers[0].get(), Some(&b"k1"[..]));
        assert_eq!(r.plan.get(), Some(&b"pro"[..]));
        assert_eq!(r.time_us, Some(971_186_136_000_000));
        // flat dotted key, epoch number
        let line =
            br#"{"time":971186136.5,"client.ip":"198.51.100.2","method":"POST","path":"/y"}"#;
        p.parse(LogFormat::Json, line, &mut r).unwrap();
        assert_eq!(r.ip, Some("198.51.100.2".parse().unwrap()));
        assert_eq!(r.time_us, Some(971_186_136_500_000));
        // Keys are compared as bytes: an unknown key that is not UTF-8 is
        // skipped like any other; a value that is read must be UTF-8.
        let mut line =
            br#"{"time":971186136,"client.ip":"198.51.100.3","method":"GET","path":"/z","#.to_vec();
        line.extend_from_slice(b"\"k\xff\":1}");
        p.parse(LogFormat::Json, &line, &mut r).unwrap();
        assert_eq!(r.target.get(), Some(&b"/z"[..]));
        let mut line =
            br#"{"time":971186136,"client.ip":"198.51.100.3","method":"GET","path":"/"#.to_vec();
        line.extend_from_slice(b"\xff\"}");
        assert!(p.parse(LogFormat::Json, &line, &mut r).is_err());
        assert!(p.parse(LogFormat::Json, b"{\"time\":1", &mut r).is_err());
        assert!(p.parse(LogFormat::Json, b"[1,2]", &mut r).is_err());
    }
}
