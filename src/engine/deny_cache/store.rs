//! The deny cache's bounded store: a `moka` cache (TinyLFU eviction, each
//! entry expiring [`LAPSED_FOR`] after its own time-to-live) with the
//! `redis` feature. Without it the only backend is the memory backend,
//! which caches no denials (it answers as fast as a cache would), so there
//! is no store to build and `moka` is not compiled.

use super::Entry;
#[cfg(feature = "redis")]
use super::LAPSED_FOR;

/// What [`Store::compute`] does with a key's entry.
pub(super) enum Op {
    /// Leave it as it is.
    Nop,
    /// Remove it.
    Remove,
    /// Write this entry.
    Put(Entry),
}

#[cfg(feature = "redis")]
pub(super) struct Store(moka::sync::Cache<String, Entry>);

/// Without the `redis` feature: no store can be built.
#[cfg(not(feature = "redis"))]
pub(super) enum Store {}

#[cfg(feature = "redis")]
struct UntilRetry;

#[cfg(feature = "redis")]
impl moka::Expiry<String, Entry> for UntilRetry {
    fn expire_after_create(
        &self,
        _key: &String,
        value: &Entry,
        _created_at: std::time::Instant,
    ) -> Option<std::time::Duration> {
        Some(value.ttl() + LAPSED_FOR)
    }
    fn expire_after_update(
        &self,
        _key: &String,
        value: &Entry,
        _updated_at: std::time::Instant,
        _duration_until_expiry: Option<std::time::Duration>,
    ) -> Option<std::time::Duration> {
        Some(value.ttl() + LAPSED_FOR)
    }
}

#[cfg(feature = "redis")]
impl Store {
    /// A store of at most `capacity` entries (more than 0).
    pub(super) fn new(capacity: u64) -> Option<Self> {
        Some(Self(
            moka::sync::Cache::builder()
                .max_capacity(capacity)
                .expire_after(UntilRetry)
                .build(),
        ))
    }

    pub(super) fn get(&self, key: &str) -> Option<Entry> {
        self.0.get(key)
    }

    pub(super) fn insert(&self, key: String, entry: Entry) {
        self.0.insert(key, entry);
    }

    /// Reads and changes `key`'s entry in one critical section.
    pub(super) fn compute(&self, key: &str, f: impl FnOnce(Option<Entry>) -> Op) {
        use moka::ops::compute::Op as M;
        self.0
            .entry_by_ref(key)
            .and_compute_with(|e| match f(e.map(|e| e.into_value())) {
                Op::Nop => M::Nop,
                Op::Remove => M::Remove,
                Op::Put(v) => M::Put(v),
            });
    }

    pub(super) fn clear(&self) {
        self.0.invalidate_all();
    }
}

#[cfg(not(feature = "redis"))]
impl Store {
    pub(super) fn new(_capacity: u64) -> Option<Self> {
        None
    }

    pub(super) fn get(&self, _key: &str) -> Option<Entry> {
        match *self {}
    }

    pub(super) fn insert(&self, _key: String, _entry: Entry) {
        match *self {}
    }

    pub(super) fn compute(&self, _key: &str, _f: impl FnOnce(Option<Entry>) -> Op) {
        match *self {}
    }

    pub(super) fn clear(&self) {
        match *self {}
    }
}
