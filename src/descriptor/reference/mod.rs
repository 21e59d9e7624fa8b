//! Compatibility with Envoy's reference rate limit service
//! (envoyproxy/ratelimit), in one place: its YAML configuration, read as
//! it is ([`ReferenceConfig`], one [`ReferenceDomain`] per file, each a
//! tree of descriptors; feature `envoy-yaml`), how a request's descriptor
//! finds its limit in that tree, and the names its answers and metrics
//! use (units, stat keys). One concept a file:
//!
//! * `config.rs`: [`ReferenceConfig`] and [`ReferenceDomain`], read from a
//!   file or a directory (feature `envoy-yaml`);
//! * `load.rs`: one file's YAML schema and its walk into rules and a tree
//!   (feature `envoy-yaml`);
//! * `tree.rs`: the descriptor tree and its descent;
//! * `unit.rs`: [`Unit`], `current_limit`'s units, and [`per_unit`];
//! * `stat.rs`: [`StatPath`], the reference's stat key of a limit.
//!
//! The units and the tree serve the rules file's limiter too (a rule's
//! `current_limit`), so only the YAML half is behind `envoy-yaml`.
//!
//! ```yaml
//! domain: mongo_cps
//! descriptors:
//!   - key: database
//!     value: users
//!     rate_limit:
//!       unit: second          # second, minute, hour, day, week, month, year
//!       requests_per_unit: 500
//!   - key: database
//!     value: default
//!     rate_limit:
//!       unit: second
//!       requests_per_unit: 50
//! ```
//!
//! Every limit is a fixed window of its unit aligned to the Unix epoch, as
//! the reference counts; `current_limit` answers the configured
//! `requests_per_unit` and `unit`. A mistake fails the load with the file,
//! the path in the tree (`descriptors[0].descriptors[1]`, with its composite
//! key) and the field. Hostile files (over 4 MiB, nested deeper than 32
//! levels, anchors expanded past a budget, a key given twice) fail with the
//! parser's message, never a hang or a panic.

#[cfg(feature = "envoy-yaml")]
mod config;
#[cfg(feature = "envoy-yaml")]
mod load;
mod stat;
pub(super) mod tree;
mod unit;

#[cfg(feature = "envoy-yaml")]
pub use config::{ReferenceConfig, ReferenceDomain, MAX_FILES, MAX_FILE_BYTES};
pub use stat::{StatLevel, StatPath};
pub use unit::{per_unit, Unit};
