//! Key extractors: what a tier counts a request against.
//!
//! A [`KeyExtractor`] looks at the request's head ([`http::request::Parts`],
//! never the body) and returns the key of the bucket to charge, or `None` when
//! the tier does not apply to the request (an anonymous request skips the
//! `user` tier). Closures `Fn(&Parts) -> Option<String>` are extractors:
//!
//! ```
//! use tiered_ratelimit::{Quota, Tier};
//!
//! #[derive(Clone)]
//! struct Tenant(String);
//!
//! let tier = Tier::new(
//!     "tenant",
//!     |p: &http::request::Parts| p.extensions.get::<Tenant>().map(|t| t.0.clone()),
//!     Quota::per_minute(600),
//! );
//! ```
//!
//! # Key hygiene
//! Whatever an extractor returns (built-in or yours) is passed through
//! [`storage_key_part`] by the layer before
//! it reaches Redis or memory: printable ASCII stays readable, every other
//! byte and the structural characters `%`, `#`, `{`, `}` are percent-escaped,
//! and anything whose escaped form would pass [`MAX_KEY_PART`] bytes is
//! replaced by `#` and its 128-bit XXH3 hash in hex (XXH3 is stable across
//! processes and versions, so every app server computes the same key). Request bytes can therefore never change a key's structure or its
//! Redis Cluster slot, and a key part is at most 128 bytes however large the
//! header it came from.

mod client_ip;
mod endpoint;
mod global;
mod header;
mod user;

pub use client_ip::{ClientIp, ForwardedHeader, UnknownForwardedHeader, MAX_FORWARDED_HOPS};
#[cfg(feature = "grpc")]
pub(crate) use endpoint::is_grpc;
#[cfg(all(feature = "grpc", test))]
pub(crate) use endpoint::method_path;
pub(crate) use endpoint::route_of;
pub use endpoint::{Endpoint, UNMATCHED_ROUTE};
pub use global::Global;
pub use header::ApiKey;
pub use user::{User, UserId};

use http::request::Parts;

/// Why an extractor could not produce a key.
///
/// The layer cannot compute that tier for the request, so it treats the tier
/// as undecided and lets the [`FailurePolicy`](crate::FailurePolicy) decide
/// **that tier alone**: under `Open` and `Fallback` the tier is skipped for
/// this request while every other tier still applies (with its headers as
/// usual); under `Closed` the request is answered 503. Either way every
/// failure is counted in `tiered_ratelimit_key_errors_total{tier, reason}`
/// (`reason` is [`KeyError::reason`]) and logged, at most once a minute per
/// tier with the number of suppressed lines: at `ERROR` with what to change
/// for a [configuration](KeyError::is_configuration) error, at `WARN`
/// otherwise.
///
/// Your own extractors return [`KeyError::Configuration`] when the server is
/// set up wrongly (a missing extension another layer should have inserted,
/// say), with a message that says exactly what to change, and
/// [`KeyError::Request`] for anything else. An extractor should not fail on
/// request content at all: under `Open` that would let a client skip the
/// tier by sending a malformed value. Return a key for malformed input (one
/// shared key, for instance) or `Ok(None)` when the tier does not apply.
///
/// ```
/// use tiered_ratelimit::key::{KeyError, KeyExtractor};
///
/// #[derive(Clone)]
/// struct TenantId(String);
///
/// struct Tenant;
/// impl KeyExtractor for Tenant {
///     fn extract(&self, p: &http::request::Parts) -> Result<Option<String>, KeyError> {
///         match p.extensions.get::<TenantId>() {
///             Some(t) => Ok(Some(t.0.clone())),
///             None => Err(KeyError::Configuration(
///                 "Tenant needs the TenantId extension: add the tenant middleware \
///                  outside the rate limit layer"
///                     .into(),
///             )),
///         }
///     }
/// }
/// let (parts, _) = http::Request::new(()).into_parts();
/// let e = Tenant.extract(&parts).unwrap_err();
/// assert!(e.is_configuration());
/// assert_eq!(e.reason(), "configuration");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// `ClientIp` found neither axum's `ConnectInfo<SocketAddr>` nor a
    /// `SocketAddr` in the request extensions. A configuration error.
    #[error("ClientIp needs the peer address: serve the app with `into_make_service_with_connect_info::<SocketAddr>()`")]
    MissingConnectInfo,
    /// The server is set up so that the extractor can never work (no request
    /// can succeed until it is fixed). The message says what to change.
    #[error("{0}")]
    Configuration(String),
    /// The extractor failed for this request only.
    #[error("{0}")]
    Request(String),
}

impl KeyError {
    /// Whether the failure is the server's configuration (the same for every
    /// request until someone changes it) rather than this request's.
    pub fn is_configuration(&self) -> bool {
        match self {
            KeyError::MissingConnectInfo | KeyError::Configuration(_) => true,
            KeyError::Request(_) => false,
        }
    }

    /// A short, bounded label for metrics: `missing_connect_info`,
    /// `configuration` or `request`.
    pub fn reason(&self) -> &'static str {
        match self {
            KeyError::MissingConnectInfo => "missing_connect_info",
            KeyError::Configuration(_) => "configuration",
            KeyError::Request(_) => "request",
        }
    }
}

/// Produces the key a tier charges for a request.
///
/// `Ok(None)` means the tier does not apply to this request; `Err` means the
/// extractor cannot work at all (see [`KeyError`]).
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key for this request, or `None` to skip the tier.
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError>;

    /// Writes this request's key part to `out` (after the tier's key prefix)
    /// and returns `true`, or returns `false` to skip the tier. This is what
    /// the layer calls, once per tier per request.
    ///
    /// The default calls [`extract`](KeyExtractor::extract) and writes its
    /// key with [`KeyWriter::part`]. Override it only to save that
    /// intermediate `String` on the hot path: a [`KeyWriter`] escapes or
    /// hashes whatever it is given, so an extractor cannot put braces,
    /// control bytes or an unbounded length into a storage key.
    ///
    /// # Errors
    /// As [`extract`](KeyExtractor::extract).
    fn extract_into(&self, parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        Ok(match self.extract(parts)? {
            Some(key) => {
                out.part(key.as_bytes());
                true
            }
            None => false,
        })
    }

    /// The likely cause, for the one `WARN` line of a tier that found no
    /// key on every one of its first requests
    /// ([`no_key_warning_after`](crate::RateLimitLayerBuilder::no_key_warning_after)):
    /// what to check, in a sentence. Asked once, when the layer is built.
    /// The default (`None`) logs a generic cause.
    fn no_key_cause(&self) -> Option<String> {
        None
    }
}

/// Where a [`KeyExtractor`] writes a request's key part: the storage key
/// being built (`<prefix>:<tier>:`, then the part). It takes request bytes
/// only through [`part`](KeyWriter::part) and [`parts`](KeyWriter::parts),
/// which apply [`storage_key_part`]'s escaping (or hashing, past
/// [`MAX_KEY_PART`] bytes): the guarantee is the type's, not a comment's.
#[derive(Debug)]
pub struct KeyWriter<'a>(&'a mut String);

impl<'a> KeyWriter<'a> {
    /// A writer appending to `key` (the crate's own callers).
    pub(crate) fn new(key: &'a mut String) -> Self {
        Self(key)
    }

    /// Appends `bytes` as a storage-safe key part ([`storage_key_part`]).
    /// Call it once per key: two calls write two escaped parts side by
    /// side, which is not [`parts`](KeyWriter::parts)' single part.
    pub fn part(&mut self, bytes: &[u8]) {
        storage_key_parts_into(self.0, &[bytes]);
    }

    /// Appends the key part of the concatenation of `parts`, without
    /// building the concatenation.
    pub fn parts(&mut self, parts: &[&[u8]]) {
        storage_key_parts_into(self.0, parts);
    }

    /// The key itself, for the built-in extractors that write text already
    /// in storage form (an IP address, a hex hash, a cached escaped route).
    pub(crate) fn trusted(&mut self) -> &mut String {
        self.0
    }
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        Ok(self(parts))
    }
}

/// The longest key part, in bytes, stored as (escaped) text; longer values
/// are hashed.
pub const MAX_KEY_PART: usize = 128;

fn is_plain(b: u8) -> bool {
    b.is_ascii_graphic() && !matches!(b, b'%' | b'#' | b'{' | b'}')
}

/// Turns request-derived bytes into a storage-safe key part (see the module
/// docs): at most 128 bytes, printable ASCII, never containing `{` or `}`.
/// Injective up to hash collisions: two different inputs never share an
/// escaped form, and escaped forms never start with `#`.
pub fn storage_key_part(bytes: &[u8]) -> String {
    let mut out = String::new();
    storage_key_part_into(&mut out, bytes);
    out
}

/// [`storage_key_part`], appended to `out` (no allocation of its own).
pub(crate) fn storage_key_part_into(out: &mut String, bytes: &[u8]) {
    storage_key_parts_into(out, &[bytes]);
}

/// [`storage_key_part`] of the concatenation of `parts`, appended to `out`
/// without building the concatenation.
pub(crate) fn storage_key_parts_into(out: &mut String, parts: &[&[u8]]) {
    // One part that needs no escaping (a user id, an API key): copied as
    // it is, not byte by byte. Plain bytes are ASCII, so the text is UTF-8.
    if let [one] = parts {
        if one.len() <= MAX_KEY_PART && one.iter().all(|&b| is_plain(b)) {
            if let Ok(text) = std::str::from_utf8(one) {
                out.push_str(text);
                return;
            }
        }
    }
    let escaped_len: usize = parts
        .iter()
        .flat_map(|p| p.iter())
        .map(|&b| if is_plain(b) { 1 } else { 3 })
        .sum();
    if escaped_len > MAX_KEY_PART {
        out.push('#');
        let h = match parts {
            [one] => xxhash_rust::xxh3::xxh3_128(one),
            _ => {
                let mut hasher = xxhash_rust::xxh3::Xxh3::new();
                for p in parts {
                    hasher.update(p);
                }
                hasher.digest128()
            }
        };
        push_hex128(out, h);
        return;
    }
    out.reserve(escaped_len);
    for &b in parts.iter().flat_map(|p| p.iter()) {
        if is_plain(b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
}

/// A stored key part as people read it: the percent-escapes of
/// [`storage_key_part`] decoded (`GET%20/users/%7Bid%7D` →
/// `GET /users/{id}`; bytes that are not UTF-8 become U+FFFD), a hashed
/// part (`#` and 32 hex digits) unchanged. The result is request-derived
/// text: escape it for wherever it is shown (HTML, a terminal).
#[must_use]
pub fn readable_key_part(stored: &str) -> String {
    if is_hashed(stored) || !stored.contains('%') {
        return stored.to_owned();
    }
    let b = stored.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).and_then(|&h| hex_digit(h)),
            b.get(i + 2).and_then(|&l| hex_digit(l)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A key part typed by an operator (the admin page and API, the CLI, the
/// handle's peek, reset, lift and overrides), in either form: a stored
/// part exactly as [`storage_key_part`] writes it is taken as it is; any
/// other text is a key as people read it ([`readable_key_part`]) and is
/// stored-escaped (or hashed, past [`MAX_KEY_PART`] bytes) as the layer
/// does it. (Text that happens to be a stored part's exact form, such as
/// `a%20b`, is read as stored.) Empty stays empty.
pub(crate) fn typed_key_part(typed: &str) -> std::borrow::Cow<'_, str> {
    if typed.is_empty() || is_stored_form(typed) {
        std::borrow::Cow::Borrowed(typed)
    } else {
        std::borrow::Cow::Owned(storage_key_part(typed.as_bytes()))
    }
}

/// `#` and 32 lowercase hex digits: a hashed key part.
fn is_hashed(s: &str) -> bool {
    s.len() == 33
        && s.starts_with('#')
        && s.bytes()
            .skip(1)
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `s` is exactly what [`storage_key_part`] writes for some input.
fn is_stored_form(s: &str) -> bool {
    if is_hashed(s) {
        return true;
    }
    if s.len() > MAX_KEY_PART {
        return false;
    }
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if is_plain(b[i]) {
            i += 1;
            continue;
        }
        let upper = |c: Option<&u8>| {
            c.filter(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(*c))
                .and_then(|&c| hex_digit(c))
        };
        match (b[i], upper(b.get(i + 1)), upper(b.get(i + 2))) {
            (b'%', Some(h), Some(l)) if !is_plain(h << 4 | l) => i += 3,
            _ => return false,
        }
    }
    true
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Checks that `e`'s `extract_into` appends exactly what the default
/// (`extract`, then [`storage_key_part`]) would, for each request.
#[cfg(test)]
pub(crate) fn assert_extract_into_agrees<E: KeyExtractor>(e: &E, requests: &[Parts]) {
    for p in requests {
        let want = e
            .extract(p)
            .map(|k| k.map(|k| format!("pre:{}", storage_key_part(k.as_bytes()))));
        let mut out = String::from("pre:");
        let got = e
            .extract_into(p, &mut KeyWriter::new(&mut out))
            .map(|hit| hit.then_some(out));
        assert_eq!(got, want, "{:?} {}", p.method, p.uri);
    }
}

const HEX_LOWER: &[u8; 16] = b"0123456789abcdef";

/// Appends `h` as 32 lowercase hex digits (what `format!("{h:032x}")` writes).
pub(crate) fn push_hex128(out: &mut String, h: u128) {
    for shift in (0..32).rev() {
        out.push(char::from(HEX_LOWER[((h >> (shift * 4)) & 0xf) as usize]));
    }
}
const HEX: &[u8; 16] = b"0123456789ABCDEF";

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys are shown decoded and may be typed in either form: every
    /// stored form reads back as itself, every other text is escaped as the
    /// layer escapes request bytes.
    #[test]
    fn typed_keys_in_either_form() {
        for raw in [
            "alice",
            "GET /users/{id}",
            "<script>alert('x')</script>",
            "a\"b & c",
            "100%",
            "a%41",
            "é",
            "#abc",
        ] {
            let stored = storage_key_part(raw.as_bytes());
            assert_eq!(readable_key_part(&stored), raw, "{stored}");
            assert_eq!(typed_key_part(raw), stored, "typed as read: {raw}");
            assert_eq!(typed_key_part(&stored), stored, "typed as stored: {raw}");
        }
        assert_eq!(
            readable_key_part("GET%20/users/%7Bid%7D"),
            "GET /users/{id}"
        );
        let long = "k".repeat(200);
        let hashed = storage_key_part(long.as_bytes());
        assert_eq!(typed_key_part(&long), hashed);
        assert_eq!(typed_key_part(&hashed), hashed);
        assert_eq!(readable_key_part(&hashed), hashed);
        assert_eq!(readable_key_part("%FF%41"), "\u{fffd}A");
        assert_eq!(typed_key_part(""), "");
    }

    #[test]
    fn plain_keys_stay_readable() {
        assert_eq!(storage_key_part(b"alice"), "alice");
        assert_eq!(storage_key_part(b"198.51.100.7"), "198.51.100.7");
    }

    #[test]
    fn structure_bytes_are_escaped() {
        assert_eq!(
            storage_key_part(b"GET /users/{id}"),
            "GET%20/users/%7Bid%7D"
        );
        assert_eq!(storage_key_part(b"a%b#c\n\0"), "a%25b%23c%0A%00");
        assert_eq!(storage_key_part(&[0xff, 0xfe]), "%FF%FE");
    }

    #[test]
    fn long_values_are_hashed_to_a_fixed_size() {
        let big = vec![b'a'; 64 * 1024];
        let k = storage_key_part(&big);
        assert_eq!(k.len(), 33);
        assert!(k.starts_with('#'));
        assert_ne!(k, storage_key_part(&big[1..]));
        // escaping that would overflow the cap also hashes
        assert_eq!(storage_key_part(&[b'{'; 50]).len(), 33);
    }

    #[test]
    fn parts_escape_and_hash_as_their_concatenation() {
        let long = "/{id}".repeat(30);
        for parts in [
            vec![&b"GET"[..], b" ", b"/users/{id}"],
            vec![&b"GET"[..], b" ", long.as_bytes()],
            vec![&b""[..], b"a\xff"],
        ] {
            let mut out = String::new();
            storage_key_parts_into(&mut out, &parts);
            assert_eq!(out, storage_key_part(&parts.concat()));
        }
    }

    /// A user's extractor that overrides `extract_into` can only write
    /// through the `KeyWriter`: braces, control bytes and length come out
    /// escaped or hashed.
    #[test]
    fn a_custom_extract_into_cannot_write_raw_bytes() {
        struct Hostile;
        impl KeyExtractor for Hostile {
            fn extract(&self, _: &Parts) -> Result<Option<String>, KeyError> {
                Ok(None)
            }
            fn extract_into(&self, _: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
                out.part(b"{tag}\r\n");
                out.parts(&[&[b'x'; 300][..], b"}"]);
                Ok(true)
            }
        }
        let (parts, ()) = http::Request::new(()).into_parts();
        let mut key = String::from("rl:t:");
        assert!(Hostile
            .extract_into(&parts, &mut KeyWriter::new(&mut key))
            .unwrap());
        assert_eq!(&key[..20], "rl:t:%7Btag%7D%0D%0A");
        // The 301-byte part is hashed: '#' and 32 hex digits.
        assert_eq!(key.len(), 20 + 33);
        assert!(key[20..].starts_with('#'));
        assert!(key
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}'));
    }
}
