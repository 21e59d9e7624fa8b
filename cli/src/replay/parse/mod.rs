//! Access-log lines to [`Record`]s: the combined / common log format (nginx,
//! Apache) and JSON lines with configurable field names.

mod combined;
mod config;
mod json;
#[cfg(test)]
mod tests;

pub use config::{FieldMap, LogFormat, Target};

use super::time::{self, TimeFormat};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

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
        Slot::Status => rec.status = parse_status(b),
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
    if let Some(v4) = dotted_quad(b) {
        return Some(IpAddr::V4(v4));
    }
    let s = std::str::from_utf8(b).ok()?;
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(inner) = s.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        return inner.parse().ok();
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip())
}

/// A status code as `u16`'s `FromStr` reads it. Up to four ASCII digits
/// (every status a log holds) are read directly: the same value, without
/// UTF-8 validation and std's general integer parser.
fn parse_status(b: &[u8]) -> Option<u16> {
    if (1..=4).contains(&b.len()) && b.iter().all(u8::is_ascii_digit) {
        return Some(b.iter().fold(0, |v, &c| v * 10 + u16::from(c - b'0')));
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// A plain dotted-quad IPv4 address (`10.0.0.1`), most logs' client
/// address, read straight from the bytes: exactly the text std's
/// `Ipv4Addr` parser accepts (four decimal octets of one to three digits,
/// none over 255, no leading zero) and nothing else, so `None` leaves every
/// other form to std. About half of std's cost, which validates UTF-8 and
/// tries each form through a general parser.
fn dotted_quad(b: &[u8]) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    // The octet being read: its index, value and number of digits.
    let (mut k, mut v, mut digits) = (0, 0u16, 0);
    for &c in b {
        match c {
            b'0'..=b'9' => {
                // A fourth digit, or a digit after a leading zero.
                if digits == 3 || (digits == 1 && v == 0) {
                    return None;
                }
                v = v * 10 + u16::from(c - b'0');
                digits += 1;
            }
            b'.' if digits > 0 && k < 3 => {
                octets[k] = u8::try_from(v).ok()?;
                (k, v, digits) = (k + 1, 0, 0);
            }
            _ => return None,
        }
    }
    if digits == 0 || k != 3 {
        return None;
    }
    octets[3] = u8::try_from(v).ok()?;
    Some(Ipv4Addr::from(octets))
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

/// Whether a line looks like JSON (for [`LogFormat::Auto`]).
pub(crate) fn looks_like_json(line: &[u8]) -> bool {
    line.iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{')
}
