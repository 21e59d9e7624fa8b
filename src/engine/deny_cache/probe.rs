//! Single flight: the first request for a lapsed key goes to the backend
//! (the probe); the others wait for its answer.

use super::DenyCache;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// A request gone to the backend for a lapsed key; others wait for it.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    done: AtomicBool,
    notify: Notify,
}

impl Probe {
    /// Resolves when the probe's answer has been fed to the cache (or the
    /// probe failed or was dropped), or after `timeout`.
    pub(crate) async fn wait(self: Arc<Self>, timeout: Duration) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Registered before `done` is read: a wake-up between the two is
        // not lost.
        notified.as_mut().enable();
        if !self.done.load(Ordering::Acquire) {
            let _ = tokio::time::timeout(timeout, notified).await;
        }
    }
}

/// Held by the request that probes a key: dropping it (after the answer was
/// fed to the cache, on an error, or with the request) ends the probe and
/// wakes its waiters.
pub(crate) struct ProbeGuard {
    probes: Arc<Mutex<HashMap<String, Arc<Probe>>>>,
    key: String,
    probe: Arc<Probe>,
}

impl std::fmt::Debug for ProbeGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeGuard")
            .field("key", &self.key)
            .finish()
    }
}

impl ProbeGuard {
    /// The storage key probed.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for ProbeGuard {
    fn drop(&mut self) {
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        if probes
            .get(&self.key)
            .is_some_and(|p| Arc::ptr_eq(p, &self.probe))
        {
            probes.remove(&self.key);
        }
        drop(probes);
        self.probe.done.store(true, Ordering::Release);
        self.probe.notify.notify_waiters();
    }
}

/// A request's part in the probe of a lapsed key.
pub(crate) enum Role {
    /// It probes: it goes to the backend, holding this.
    Lead(ProbeGuard),
    /// Another request probes: wait for it.
    Follow(Arc<Probe>),
}

impl DenyCache {
    /// Joins the probe of the lapsed `key`: leads it when none is in flight.
    pub(crate) fn join(&self, key: &str) -> Role {
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = probes.get(key) {
            return Role::Follow(p.clone());
        }
        let probe = Arc::new(Probe::default());
        probes.insert(key.to_owned(), probe.clone());
        Role::Lead(ProbeGuard {
            probes: self.probes.clone(),
            key: key.to_owned(),
            probe,
        })
    }
}
