//! The backend checks in flight, for room facts: which charges a fact's
//! answer cannot show.
//!
//! A room fact says a key had room for `remaining` more cost when the
//! backend answered. Without charges, room only grows (a token bucket
//! refills, a fixed window's count resets), so the fact holds until a charge
//! the cache has not seen: one by a check still in flight (the lookup keeps
//! their summed cost in reserve), one fed while the fact's own check was in
//! flight (subtracted when the fact is written), or one whose answer never
//! comes back (an error, a timeout, a dropped request: every fact written
//! by a check sent before it ends is void).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Counters shared by the cache and the checks in flight.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    /// The summed cost of the checks sent and not yet done.
    in_flight: AtomicU64,
    /// The summed cost of every answer fed to the cache so far.
    fed: AtomicU64,
    /// Bumped when a check ends without its answer fed: its charge may
    /// land unseen, so room facts from checks sent before are void.
    epoch: AtomicU64,
}

impl Flights {
    /// The summed cost of the checks in flight.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The current epoch: a room fact of another is void.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// A check of summed `cost` (over its tiers) is sent.
    pub(crate) fn start(self: &Arc<Self>, cost: u64) -> Flight {
        let fed_at_start = self.fed.load(Ordering::SeqCst);
        let epoch = self.epoch.load(Ordering::SeqCst);
        self.in_flight.fetch_add(cost, Ordering::SeqCst);
        Flight {
            flights: self.clone(),
            cost,
            fed_at_start,
            epoch,
            answered: AtomicBool::new(false),
        }
    }
}

/// A backend check in flight, held in its request's meta until the request
/// is decided (or dropped).
pub(crate) struct Flight {
    flights: Arc<Flights>,
    cost: u64,
    fed_at_start: u64,
    epoch: u64,
    answered: AtomicBool,
}

impl std::fmt::Debug for Flight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flight")
            .field("cost", &self.cost)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl Flight {
    /// Its answer is about to be fed to the cache (before any entry is
    /// written or forgotten for it).
    pub(crate) fn answered(&self) {
        if !self.answered.swap(true, Ordering::SeqCst) {
            self.flights.fed.fetch_add(self.cost, Ordering::SeqCst);
        }
    }

    /// The summed cost of the other answers fed since it was sent: charges
    /// that may have landed after it on the backend, which its answer does
    /// not show.
    pub(crate) fn unseen(&self) -> u64 {
        let own = if self.answered.load(Ordering::SeqCst) {
            self.cost
        } else {
            0
        };
        self.flights
            .fed
            .load(Ordering::SeqCst)
            .saturating_sub(self.fed_at_start)
            .saturating_sub(own)
    }

    /// The epoch it was sent in.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if !self.answered.load(Ordering::SeqCst) {
            self.flights.epoch.fetch_add(1, Ordering::SeqCst);
        }
        self.flights
            .in_flight
            .fetch_sub(self.cost, Ordering::SeqCst);
    }
}
