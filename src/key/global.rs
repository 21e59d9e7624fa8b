use super::{KeyError, KeyExtractor, KeyWriter};
use http::request::Parts;

/// One bucket shared by every request: a global ceiling for the whole service
/// (per layer, across every app server sharing the backend).
///
/// Its key is the constant `all`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _parts: &Parts) -> Result<Option<String>, KeyError> {
        Ok(Some("all".to_owned()))
    }

    fn extract_into(&self, _parts: &Parts, out: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        out.trusted().push_str("all");
        Ok(true)
    }
}
