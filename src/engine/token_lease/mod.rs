//! Lease mode (`sync = "lease"`): a tier's hot keys decided in process from
//! tokens leased out of the shared bucket, never over the quota.
//!
//! Not to be confused with a *concurrency* tier's slots
//! ([`Tier::concurrency`](crate::Tier::concurrency), `src/engine/slots.rs`,
//! `lua/slot.lua`), held by one request while it runs. A **token
//! lease** is a batch of a rate tier's tokens that one instance took out of
//! the shared bucket in one script call and spends locally, one request at a
//! time, without calling Redis.
//!
//! # How it works
//!
//! * An instance takes a lease of `k` tokens from the key's shared bucket
//!   with one ordinary, atomic check of cost `k` (the tokens leave the shared
//!   bucket: no other instance can spend them), then admits requests from it
//!   with a compare-and-swap on a local counter.
//! * A request whose instance holds too few tokens is checked exactly as
//!   without lease mode (its own script call, with the other tiers, all or
//!   nothing); it never waits for a lease. The next lease is taken by one
//!   background task per key (single flight), ahead of need: when the local
//!   count falls to a quarter of the last lease.
//! * Size: `k` = the key's local demand over the last [`interval`](TokenLease::interval)
//!   (in tokens), at most [`max`](TokenLease::max) minus what the instance
//!   still holds, and at most a quarter of what the shared bucket had left
//!   at the last answer, so that the last tokens are not stranded in one
//!   instance while another denies. A key whose demand is below
//!   [`min`](TokenLease::min) tokens per interval (or with a single token
//!   asked for since its measure began, at most 8 intervals ago) is not
//!   leased (per-key tiers: a key with a few requests a minute keeps one
//!   call per request).
//! * A lease lives `2 × interval` (a fixed window's: at most until its
//!   window ends). Unused tokens go back to the shared bucket when it
//!   expires, and on [`RateLimitHandle::return_leases`](crate::RateLimitHandle::return_leases)
//!   (graceful shutdown; dropping the layer does the same in a task). They
//!   go back through the refund of the lease's charge: never more than the
//!   charge still takes away, so a return never lifts the bucket above where
//!   it would be had the lease never been taken. A crashed instance's lease
//!   is lost: an under-admission of at most its size until refill.
//!
//! # Guarantees
//!
//! * **Never over the quota**: every admitted request spent a token that
//!   left the shared bucket first (a lease, or its own check), and a local
//!   token is spent at most once (compare-and-swap; a return swaps the
//!   counter to zero first). Across the fleet, admitted ≤ what the shared
//!   bucket let out, at every instant.
//! * **Bounded false denials**: one instance holds at most `max` tokens of a
//!   key (leases in flight included), so a request is denied while tokens
//!   the shared bucket let out are unspent elsewhere for at most
//!   `instances × max` tokens at any instant (tests/redis/lease_mode.rs checks it
//!   with 4 instances, and a model test over long random runs).
//! * Bursts: over any interval the fleet admits at most what the shared
//!   bucket let out in it plus `instances × max`.
//!
//! Headers of a request decided locally are approximate: `remaining` is the
//! shared bucket's count at the instance's last lease (or last answer) plus
//! the tokens the instance still holds (the lease less what it spent since);
//! `reset` is derived from it. A denial never comes from a lease: it is the
//! shared bucket's answer, or the deny cache's (which answers only what the
//! shared bucket would), so `Retry-After` is exact.
//!
//! Lease mode applies to the Redis backend (single and Cluster); on the
//! memory backend it is a no-op (the buckets are already local). It takes
//! token buckets, policing leaky buckets and fixed windows; `build()`
//! refuses it on other algorithms, with a penalty box, per-key overrides or
//! refunds by status. Shadow and canary-observed checks are never leased.
//! A priced tier (`Tier::priced`) reserves its estimate from the lease like
//! any cost; its settle gives a refund back to the lease while it lives and
//! charges a debt on the shared bucket (`engine/settle.rs`).

mod entry;
mod fetch;
pub(crate) mod pool;
pub(crate) mod taken;
#[cfg(test)]
mod tests;

use serde::{de, Deserialize, Deserializer};
use std::time::Duration;

/// The values of a policy table's `sync` (a `[[tier]]`, an RLS `[[rule]]`).
const SYNCS: [&str; 2] = ["request", "lease"];

/// Deserializes a `sync` field: one of [`SYNCS`], else serde's
/// unknown-variant error naming them.
pub(crate) fn deserialize_sync<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<String>, D::Error> {
    let name = String::deserialize(d)?;
    if SYNCS.contains(&name.as_str()) {
        Ok(Some(name))
    } else {
        Err(de::Error::unknown_variant(&name, &SYNCS))
    }
}

/// A policy table's `sync`, `sync_interval`, `sync_max` and `sync_min` as
/// lease settings (`None`: one call per request), or the field at fault
/// and why (the caller names the table).
pub(crate) fn lease_from_policy(
    sync: Option<&str>,
    interval: Option<Duration>,
    max: Option<u64>,
    min: Option<u64>,
) -> Result<Option<TokenLease>, &'static str> {
    if sync != Some("lease") {
        return match (interval, max, min) {
            (Some(_), _, _) => Err("sync_interval: only sync = \"lease\" uses it"),
            (_, Some(_), _) => Err("sync_max: only sync = \"lease\" uses it"),
            (_, _, Some(_)) => Err("sync_min: only sync = \"lease\" uses it"),
            _ => Ok(None),
        };
    }
    let mut lease = TokenLease::new();
    if let Some(i) = interval {
        if i.is_zero() {
            return Err("sync_interval: must be above 0");
        }
        lease = lease.interval(i);
    }
    if let Some(m) = max {
        if m == 0 {
            return Err("sync_max: must be at least 1");
        }
        lease = lease.max(m);
    }
    if let Some(m) = min {
        lease = lease.min(m);
    }
    Ok(Some(lease))
}

/// A tier's lease mode settings ([`Tier::lease`](crate::Tier::lease);
/// `sync = "lease"` in a policy file). See the [module](self) docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLease {
    pub(crate) interval: Duration,
    pub(crate) max: Option<u64>,
    pub(crate) min: u64,
}

impl Default for TokenLease {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenLease {
    /// Default settings: interval 100 ms, `max` an eighth of the tier's
    /// capacity, `min` 2 tokens per interval.
    pub const fn new() -> Self {
        Self {
            interval: Duration::from_millis(100),
            max: None,
            min: 2,
        }
    }

    /// How much demand one lease covers (default 100 ms; leases live twice
    /// as long). Longer: fewer Redis calls, more tokens held per instance.
    pub const fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// The most tokens (requests) one instance holds of one key, leases in
    /// flight included (default: the tier's capacity ÷ 8, at least 1). The
    /// false-denial bound is `instances × max`.
    pub const fn max(mut self, tokens: u64) -> Self {
        self.max = Some(tokens);
        self
    }

    /// The least local demand (tokens per interval) for a key to be leased
    /// (default 2): below it, a key keeps one call per request.
    pub const fn min(mut self, tokens: u64) -> Self {
        self.min = tokens;
        self
    }

    /// The lease interval.
    pub const fn interval_duration(&self) -> Duration {
        self.interval
    }
}

/// One leased key as [`RateLimitHandle::leases`](crate::RateLimitHandle::leases)
/// reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStatus {
    /// The full storage key (`<prefix>:<tier>:<key part>`).
    pub key: String,
    /// Tokens (requests) this instance holds, unspent.
    pub tokens: u64,
}

/// This instance's lease counters since the layer was built (also exported
/// as metrics: `tiered_ratelimit_lease_calls_total`,
/// `tiered_ratelimit_lease_tokens_total{op="taken"|"returned"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LeaseCounts {
    /// Script calls that took (or tried to take) a lease.
    pub calls: u64,
    /// Tokens taken out of shared buckets by leases.
    pub taken: u64,
    /// Tokens handed back (expiry, shutdown); refill may have absorbed part
    /// of them already.
    pub returned: u64,
    /// Requests admitted from a local lease, without a Redis call for that
    /// tier.
    pub local: u64,
}
