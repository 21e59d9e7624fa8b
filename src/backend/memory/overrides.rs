//! Per-key overrides in memory ([`handle`](crate::handle#per-key-overrides)): this process's own,
//! looked up by the override check of a tier that takes them.

use super::MemoryBackend;
use crate::backend::override_rule::Active;
use std::collections::HashMap;

/// The overrides by their key (`<tier key>{ov}`), and each tier's listing
/// (by `<prefix>:<tier>:{ov}`, then key part).
#[derive(Debug, Default)]
pub(super) struct Store {
    active: HashMap<String, Active>,
    listed: HashMap<String, HashMap<String, String>>,
}

impl MemoryBackend {
    fn overrides(&self) -> std::sync::MutexGuard<'_, Store> {
        self.inner
            .overrides
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The override stored under `key`, if it applies at `now_us`.
    pub(super) fn override_of(&self, key: &str, now_us: u64) -> Option<Active> {
        self.overrides()
            .active
            .get(key)
            .copied()
            .filter(|a| a.live(now_us))
    }

    pub(crate) fn set_override(
        &self,
        key: &str,
        active: Active,
        index: &str,
        field: &str,
        listing: &str,
    ) {
        let mut s = self.overrides();
        s.active.insert(key.to_owned(), active);
        s.listed
            .entry(index.to_owned())
            .or_default()
            .insert(field.to_owned(), listing.to_owned());
    }

    /// Removes the override under `key`: its expiry (Unix epoch µs, 0 for
    /// none), if there was one.
    pub(crate) fn remove_override(&self, key: &str, index: &str, field: &str) -> Option<u64> {
        let mut s = self.overrides();
        if let Some(l) = s.listed.get_mut(index) {
            l.remove(field);
        }
        s.active.remove(key).map(|a| a.until_us)
    }

    pub(crate) fn list_overrides(&self, index: &str) -> Vec<(String, String)> {
        self.overrides()
            .listed
            .get(index)
            .map(|l| l.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }
}
