//! The library behind the `tiered-ratelimit` command: [`replay`] access logs
//! through a [`tiered_ratelimit::policy::Policy`] offline, to plan limits from real
//! traffic (docs/replay.md).
#![forbid(unsafe_code)]
#![deny(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod replay;
