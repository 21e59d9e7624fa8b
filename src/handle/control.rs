//! The fleet-wide control key: one Redis hash every instance polls, so one
//! `redis-cli` command switches the whole fleet.
//!
//! ```text
//! HSET rl:control mode off               # kill switch: every instance stops limiting
//! HSET rl:control mode shadow            # stop rejecting, keep counting
//! HSET rl:control tier:login canary:10   # one tier's mode
//! HDEL rl:control mode                   # back to the configured mode
//! DEL  rl:control                        # back to everything configured
//! ```
//!
//! Fields: `mode` (the global mode) and `tier:<name>` (a tier's mode), with
//! values `enforce`, `shadow`, `off` or `canary:<0-100>`. A field present
//! overrides the configured mode (and any [`RateLimitHandle`](crate::RateLimitHandle)
//! change) on every instance within one poll interval (default 5 s); a field
//! removed gives the configured mode back. A malformed field (unknown mode,
//! unknown tier) is logged at `error` and ignored — the last good value of
//! that field stays — so a typo can never silently switch limiting off. A
//! failed poll keeps the mode overrides as they were. Switching any mode override
//! drops the deny cache.
//!
//! One more field, `generation`, is the crate's own: every operator action
//! on a key ([`RateLimitHandle::reset`](crate::RateLimitHandle::reset),
//! [`lift`](crate::RateLimitHandle::lift),
//! [`set_override`](crate::RateLimitHandle::set_override),
//! [`remove_override`](crate::RateLimitHandle::remove_override), and so the
//! admin API and the CLI) increments it (`HINCRBY`), and an instance that
//! reads a new value drops its deny cache: the action reaches every
//! instance's cached 429s within one poll interval (plus the poll's round
//! trip).
//!
//! The watcher starts when the layer is built inside a Tokio runtime (else
//! with the first request the layer sees) and stops when the layer is
//! dropped.
//!
//! Two more fields carry the **fleet-wide settings**: `settings_version`
//! and `settings`, the quotas, plan quotas and list entries changed at run
//! time (written by
//! [`RateLimitHandle::set_fleet_quota`](crate::RateLimitHandle::set_fleet_quota)
//! and its siblings, or the admin API, never by hand), applied by every
//! instance at its next poll; see docs/rollout.md, "Fleet-wide settings".
//!
//! [`RateLimitHandle::set_fleet_mode`](crate::RateLimitHandle::set_fleet_mode)
//! writes the hash (what the admin page's buttons do when a control key is
//! configured), then reads it back and applies it to its own process at
//! once; the other instances follow within one poll interval.

pub use crate::engine::{ControlError, ControlKey};
