use super::{KeyError, KeyExtractor, KeyWriter};
use http::{header::HeaderName, request::Parts};

/// Keys by an API key sent in a request header; requests without the header
/// (or with an empty value) skip the tier.
///
/// The key is stored **hashed** (the 128-bit XXH3 of the header's bytes, as
/// 32 hex digits), never in clear: API keys are secrets and must not
/// show up in Redis `KEYS`/`SCAN` output or memory dumps. When the header is
/// repeated, the first value counts.
///
/// ```
/// use tiered_ratelimit::key::ApiKey;
/// let by_key = ApiKey::header("x-api-key");
/// ```
///
/// # Panics
/// [`ApiKey::header`] panics on a string that is not a valid header name, as
/// `http::HeaderName::from_static` does; use [`ApiKey::try_header`] for
/// names that come from configuration.
#[derive(Debug, Clone)]
pub struct ApiKey {
    header: HeaderName,
}

impl ApiKey {
    /// Reads the key from header `name` (case-insensitive).
    pub fn header(name: &str) -> Self {
        Self::try_header(name)
            .unwrap_or_else(|| panic!("ApiKey::header: invalid header name {name:?}"))
    }

    /// Like [`ApiKey::header`], returning `None` for an invalid header name.
    pub fn try_header(name: &str) -> Option<Self> {
        HeaderName::from_bytes(name.as_bytes())
            .ok()
            .map(|header| Self { header })
    }

    /// Reads the key from header `header`.
    pub(crate) fn from_name(header: HeaderName) -> Self {
        Self { header }
    }

    /// The header read.
    pub fn header_name(&self) -> &HeaderName {
        &self.header
    }

    /// The request's non-empty key header.
    fn value<'p>(&self, parts: &'p Parts) -> Option<&'p [u8]> {
        parts
            .headers
            .get(&self.header)
            .map(|v| v.as_bytes())
            .filter(|v| !v.is_empty())
    }
}

impl KeyExtractor for ApiKey {
    fn extract(&self, parts: &Parts) -> Result<Option<String>, KeyError> {
        Ok(self
            .value(parts)
            .map(|v| format!("{:032x}", xxhash_rust::xxh3::xxh3_128(v))))
    }

    fn extract_into(&self, parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        let Some(v) = self.value(parts) else {
            return Ok(false);
        };
        // 32 lowercase hex digits: plain, no escaping.
        super::push_hex128(out.trusted(), xxhash_rust::xxh3::xxh3_128(v));
        Ok(true)
    }

    fn no_key_cause(&self) -> Option<String> {
        Some(format!(
            "no request carried a non-empty `{}` header: check the header's name, and that \
             no proxy in front of the app strips it",
            self.header
        ))
    }
}
