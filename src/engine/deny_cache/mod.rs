//! The local deny cache: a key the backend just denied is denied here, with
//! no backend call, until its exact retry time. It is also **primed by
//! admissions**: when a request's charge leaves a tier less than another
//! request of the same cost, a single Redis says (in the same reply) when
//! the next one would pass — token bucket, fixed window, leaky bucket — and
//! the key is cached as denied until then. So under a flood from one key
//! only the admitted requests (one per token) reach Redis; the denied ones
//! do not, not even the first after each admission.
//!
//! **The rule: the cache may change the number of backend calls, never a
//! response.** A 429 from the cache has the status, `Retry-After`,
//! `X-RateLimit-*`, IETF fields and body the backend's answer would have
//! had at that instant (on one clock: `tests/redis/deny_cache_equivalence.rs`
//! checks it on random request sequences, cache on against cache off).
//! Three things make it so:
//!
//! * **An entry's answer does not change while it lives.** An entry records
//!   the retry instant the backend computed for a request of a given cost,
//!   under a given limit, on one storage key; it applies only to requests of
//!   exactly that cost and limit (a larger cost waits longer, a smaller one
//!   may fit: both go to the backend). Every algorithm's retry instant is
//!   fixed while the key's state does not change, and denied requests change
//!   nothing. So must be `X-RateLimit-Remaining`: a fixed window's count
//!   does not move within the window, but the other algorithms refill while
//!   a key is denied (a token bucket or GCRA with a cost above 1, a sliding
//!   counter's decay, a sliding log's entries expiring). There the remaining
//!   only grows and stays below the cost while denied, so it is constant when
//!   it is already `cost − 1` — always, for a cost of 1. Other denials (and
//!   primings) are not cached ([`stays_exact`]).
//! * **A charge on the key forgets its entry** (unless the charge's answer
//!   writes a new one): a request of another cost or under another limit
//!   admitted on the same key moves its retry instant.
//! * **The 429 describes the binding tier**, the enforced denying tier with
//!   the longest wait (the first on a tie), as the backend's answer does.
//!   The cache answers only when that tier is one with a live entry: every
//!   other enforced check of the request has a live entry with a shorter
//!   wait (or an equal one, after it), or could not, whatever its key's
//!   state, be denied with a wait that would make it bind instead
//!   ([`longest_wait_us`]: a fixed window's end, a sliding log's window, a
//!   sliding counter's next window's end, a token bucket's refill of the
//!   cost; a leaky bucket has no such bound), or has a live *room fact*.
//!   Otherwise the request goes to the backend.
//! * **Room facts.** That bound alone sends the end of every retry period
//!   to the backend: a 1 000/s token bucket next to a 100/s one could bind
//!   with a 1 ms wait, so the last millisecond of each 10 ms token asked
//!   Redis (issue 16: 0.12 calls per denied request in the paced flood
//!   instead of 0.003). So an answer that writes an entry also notes, for
//!   each other enforced check of the request that had room under a limit
//!   whose room only grows until something charges it ([`keeps_room`]: a
//!   token bucket refills, a fixed window's count resets), the cost that
//!   still fits; a check of no more than that passes at the backend, so it
//!   neither binds nor is violated. A fact counts every charge it cannot
//!   see ([`flight`]): the checks in flight (a lookup reserves their summed
//!   cost), the answers fed while its own check was in flight (taken off
//!   when it is written, in the key's critical section), and checks that
//!   end without an answer (an error, a timeout, a dropped request: the
//!   facts from checks sent before are void, assuming one connection
//!   delivers commands in order). Any other charge on the key forgets it,
//!   as it does an entry. (`tests/redis/faults.rs` counts the paced flood's
//!   calls exactly: one per token.)
//!
//! Shadow tiers are never cached (nor do they bind a 429). Tiers that refund
//! by response status (`skip_failed_requests`, `skip_successful_requests`)
//! are never cached: a refund could make room earlier. Entries are dropped
//! by any runtime change (modes, quotas, lists, the kill switch).
//!
//! Times: an entry's instant is measured from *before* the request was sent
//! (the instant the check is built); on a manual clock that is the instant
//! the backend decides at, and a cached answer at `now` gives the same
//! `Retry-After` and `X-RateLimit-Reset` as the backend would at `now`. On
//! Redis `TIME` the local clock stands in for Redis's, so an entry can only
//! end early (by the round trip), never late.
//!
//! What it cannot know: an admission on the same key by *another* instance
//! after the denial can push the real retry time later than the cached one;
//! the cached answer is then the backend's answer at the denial, aged —
//! optimistic by that much, and it never admits anything. Likewise another
//! instance's charges can empty a tier a room fact says has room: the 429
//! then names the cached tier where the backend would name that one. Turn it off with
//! [`deny_cache(0)`](crate::RateLimitLayerBuilder::deny_cache) where that
//! matters more than sparing the backend.
//!
//! **Single flight.** An entry is kept for [`LAPSED_FOR`] after its retry
//! instant. The first request that finds it lapsed goes to the backend (the
//! *probe*); requests for the same key, cost and limit that arrive while the
//! probe is in flight wait for its answer instead of asking too (at most the
//! backend timeout), then look the cache up again: the probe's answer has
//! written a new entry (it was denied, or its admission emptied the tier
//! again) and they are answered from it under the same rule as any lookup,
//! or it has not (there is room) and they go to the backend. Waiting never refuses anything the backend would
//! admit; it saves the calls of every request that arrives during the
//! probe's round trip, which without it all reach the backend. The wait
//! counts against `backend_timeout` (a request that waited gets what is
//! left for its own check: the layer adds at most that much to a request).
//! An answer that leaves room, or one the cache may not answer for
//! (above), ends the single flight: the lapsed entry is dropped, so
//! requests on a key with room never wait for each other. An exact answer
//! whose instant passed within its round trip does not (a denial: the probe
//! reached the backend just before the key's next pass, entries ending
//! early by the round trip; an admission: the next pass came within the
//! round trip): the key is still at its limit, and the next request probes
//! while the others wait. A request that waited
//! keeps the plan it was made with (limits, modes), as does any request in
//! flight during a runtime change. The probe's backend call starts when its
//! response future is first polled (at once under axum, one task per
//! request); a caller that builds response futures and awaits another
//! first makes the waiters wait for the timeout.
//!
//! Bounded by entry count (a `moka` cache, TinyLFU eviction, built with the
//! `redis` feature only: [`store`]); each entry also
//! expires [`LAPSED_FOR`] after its retry time. Probes in flight are held only
//! while their request is (a guard in the request removes its probe and wakes
//! the waiters when the answer has been fed to the cache, on an error, or
//! when the request is dropped).

// Without `redis` the cache is never enabled (the memory backend caches no
// denials, [`store`]): what only an entry in a store reads goes unread.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

mod flight;
mod probe;
mod rule;
mod store;
#[cfg(test)]
mod tests;

pub(crate) use flight::Flight;
pub(crate) use probe::{Probe, ProbeGuard, Role};
pub(crate) use rule::{keeps_room, longest_wait_us, stays_exact};

use crate::algorithm::Limit;
use flight::Flights;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{Op, Store};

/// How long an entry is kept after its retry instant, so that the requests
/// right after it know the key was at its limit: the first goes to the
/// backend, the others wait for its answer.
pub(crate) const LAPSED_FOR: Duration = Duration::from_secs(1);
const LAPSED_FOR_US: u64 = 1_000_000;

/// What the cache knows about a key, for a request of a given cost and limit.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// Denied until then: answer 429 without the backend.
    Denied(Denied),
    /// Denied until a moment ago: the key is at its limit, so its next
    /// answer is worth sharing (see [`DenyCache::join`]).
    Lapsed,
    /// The backend would let a request of this cost and limit through on
    /// this key (a room fact): it neither denies nor binds.
    Room,
    /// Nothing that applies.
    Miss,
}

/// A cached denial.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Denied {
    /// Backend-clock microseconds at which requests of `min_cost` pass again.
    pub(crate) until_us: u64,
    /// The cost that was denied; other costs go to the backend.
    pub(crate) min_cost: u64,
    /// The limit it was decided under: a request checked under another (its
    /// plan differs, or the quota changed while the check was in flight) goes
    /// to the backend.
    pub(crate) quota: Limit,
    /// What was left at the denial.
    pub(crate) remaining: u64,
    /// The `X-RateLimit-Limit` the backend's answer showed: the capacity
    /// of the limit the backend applied, and for a penalty box its tier's
    /// (not the box's `violations`).
    pub(crate) shown_limit: u64,
    /// How long the entry lives in real time.
    ttl: Duration,
    /// Written by an admission that emptied the tier (not by a denial), and
    /// no 429 answered from it yet: its first 429 is the key's first
    /// denial, counted `limited` ([`DenyCache::first_denial`]).
    pub(crate) primed: bool,
}

impl Denied {
    pub(crate) fn new(
        until_us: u64,
        min_cost: u64,
        quota: Limit,
        remaining: u64,
        ttl: Duration,
    ) -> Self {
        Self {
            until_us,
            min_cost,
            quota,
            remaining,
            shown_limit: quota.capacity(),
            ttl,
            primed: false,
        }
    }

    /// The `X-RateLimit-Limit` the backend's answer showed (by default the
    /// capacity of `quota`): a cached 429 shows the same.
    #[must_use]
    pub(crate) fn showing_limit(mut self, limit: u64) -> Self {
        self.shown_limit = limit;
        self
    }

    /// Marks an entry written by an admission (the backend denied nothing):
    /// the first 429 answered from it is the key's first denial.
    #[must_use]
    pub(crate) fn primed(mut self, primed: bool) -> Self {
        self.primed = primed;
        self
    }
}

/// A room fact: the backend's answer showed room for `remaining` more cost
/// on a key whose room only grows while nothing charges it
/// ([`keeps_room`]), net of the charges fed while that answer was in
/// flight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Room {
    remaining: u64,
    /// The limit it was seen under.
    quota: Limit,
    /// The epoch its check was sent in (see [`flight`]).
    epoch: u64,
    /// How long the entry lives in real time: that of the denial written
    /// from the same answer.
    ttl: Duration,
}

/// What is cached for a key.
#[derive(Debug, Clone, Copy)]
enum Entry {
    Denied(Denied),
    Room(Room),
}

impl Entry {
    fn ttl(&self) -> Duration {
        match self {
            Entry::Denied(d) => d.ttl,
            Entry::Room(r) => r.ttl,
        }
    }
}

pub(crate) struct DenyCache {
    cache: Option<Store>,
    /// The latest `until_us` of any entry plus [`LAPSED_FOR`]: once the clock
    /// passes it every entry is gone, and a lookup (hashing the key) can be
    /// skipped. Most requests of a service nobody floods take that shortcut.
    latest_until_us: AtomicU64,
    /// Probes in flight, by storage key.
    probes: Arc<Mutex<HashMap<String, Arc<Probe>>>>,
    /// The backend checks in flight (for room facts).
    flights: Arc<Flights>,
}

impl DenyCache {
    /// A cache of at most `capacity` entries; 0 disables it.
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            latest_until_us: AtomicU64::new(0),
            probes: Arc::default(),
            flights: Arc::default(),
            cache: (capacity > 0).then(|| Store::new(capacity)).flatten(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// What is cached for `key` at `now_us`, for a request of `cost` checked
    /// under `quota` (an entry for another cost or limit does not apply).
    pub(crate) fn lookup(&self, key: &str, cost: u64, quota: &Limit, now_us: u64) -> Lookup {
        if now_us >= self.latest_until_us.load(Ordering::Relaxed) {
            return Lookup::Miss;
        }
        let d = match self.cache.as_ref().and_then(|c| c.get(key)) {
            Some(Entry::Denied(d)) => d,
            Some(Entry::Room(r)) => {
                // Room for this cost, with every check in flight charging
                // it first.
                let room = *quota == r.quota
                    && r.epoch == self.flights.epoch()
                    && r.remaining >= cost.saturating_add(self.flights.in_flight());
                return if room { Lookup::Room } else { Lookup::Miss };
            }
            None => return Lookup::Miss,
        };
        if cost != d.min_cost || *quota != d.quota {
            Lookup::Miss
        } else if now_us < d.until_us {
            Lookup::Denied(d)
        } else if now_us < d.until_us.saturating_add(LAPSED_FOR_US) {
            Lookup::Lapsed
        } else {
            Lookup::Miss
        }
    }

    /// Forgets `key`'s entry if it has lapsed at `now_us`: a probe's answer
    /// left room (or wrote nothing that outlives its round trip), so the next
    /// requests need not wait for each other. A live entry stays.
    pub(crate) fn remove_lapsed(&self, key: &str, now_us: u64) {
        if let Some(c) = &self.cache {
            c.compute(key, |e| match e {
                Some(Entry::Denied(d)) if d.until_us <= now_us => Op::Remove,
                _ => Op::Nop,
            });
        }
    }

    /// Forgets `key`'s entry (a charge changed the key's state). `now_us`
    /// is read only when some entry may be live. (Through the entry API,
    /// as room facts are written: a room fact written from an older answer
    /// cannot land after this.)
    pub(crate) fn forget(&self, key: &str, now_us: impl FnOnce() -> u64) {
        if let Some(c) = &self.cache {
            if now_us() < self.latest_until_us.load(Ordering::Relaxed) {
                c.compute(key, |e| match e {
                    Some(_) => Op::Remove,
                    None => Op::Nop,
                });
            }
        }
    }

    pub(crate) fn insert(&self, key: String, denied: Denied) {
        if let Some(c) = &self.cache {
            self.latest_until_us.fetch_max(
                denied.until_us.saturating_add(LAPSED_FOR_US),
                Ordering::Relaxed,
            );
            c.insert(key, Entry::Denied(denied));
        }
    }

    /// A check of summed `cost` (over its tiers) is sent to the backend:
    /// held until its answer has been fed (or it failed, or was dropped).
    pub(crate) fn start_flight(&self, cost: u64) -> Flight {
        self.flights.start(cost)
    }

    /// Notes that `flight`'s answer showed room for `remaining` more cost
    /// on `key` under `quota` (a limit whose room only grows while nothing
    /// charges it), less the charges fed while it was in flight; kept until
    /// `until_us` (+ [`LAPSED_FOR`]), `ttl` from now in real time. No room
    /// left: the key's entry is forgotten. Not `charged` (another tier
    /// denied the request): a denial cached for another cost stays.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn note_room(
        &self,
        key: &str,
        remaining: u64,
        quota: Limit,
        flight: &Flight,
        charged: bool,
        until_us: u64,
        ttl: Duration,
    ) {
        let Some(c) = &self.cache else {
            return;
        };
        self.latest_until_us
            .fetch_max(until_us.saturating_add(LAPSED_FOR_US), Ordering::Relaxed);
        // Read in the entry's critical section: an answer fed after this
        // one is written either counts here or forgets the key after.
        c.compute(key, |e| {
            if !charged && matches!(e, Some(Entry::Denied(_))) {
                return Op::Nop;
            }
            match remaining.checked_sub(flight.unseen()) {
                Some(remaining) if remaining > 0 => Op::Put(Entry::Room(Room {
                    remaining,
                    quota,
                    epoch: flight.epoch(),
                    ttl,
                })),
                _ => Op::Remove,
            }
        });
    }

    /// Whether a 429 answered from `key`'s primed entry (one written by an
    /// admission, [`Denied::primed`], retry instant `until_us`) is the
    /// first: true for exactly one caller, which counts it `limited` (the
    /// backend counted no denial for that key); the entry is then no longer
    /// primed, and later 429s from it count `cache_blocked`.
    pub(crate) fn first_denial(&self, key: &str, until_us: u64) -> bool {
        let Some(c) = &self.cache else {
            return false;
        };
        let mut first = false;
        c.compute(key, |e| match e {
            Some(Entry::Denied(d)) if d.primed && d.until_us == until_us => {
                first = true;
                Op::Put(Entry::Denied(d.primed(false)))
            }
            _ => Op::Nop,
        });
        first
    }

    /// Drops every entry (runtime changes and the kill switch).
    pub(crate) fn clear(&self) {
        if let Some(c) = &self.cache {
            self.latest_until_us.store(0, Ordering::Relaxed);
            c.clear();
        }
    }
}
