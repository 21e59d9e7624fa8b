//! [`DescriptorLimiter`]: the engine deciding rate-limit *descriptors* (lists
//! of `key=value` entries, as Envoy's rate limit service receives them),
//! a front door without HTTP. The workspace's `rls` crate serves it as
//! `envoy.service.ratelimit.v3.RateLimitService` (docs/envoy.md); this
//! module has no gRPC dependency.
//!
//! Each [`Rule`] is a tier of the engine: a descriptor matches a rule when it
//! has as many entries as the rule, with the same keys in the same order and,
//! where the rule gives one, the same value. Among the rules a descriptor
//! matches, the most specific applies: the one with a value on the earliest
//! entry where the two differ (a rule `[remote_address = "10.0.0.1"]`
//! replaces `[remote_address]` for that address). The storage key is
//! `<prefix>:<rule>:` and the descriptor's values (the whole nested
//! descriptor forms the key). A descriptor that matches no rule is allowed
//! without a limit; an [`unlimited`](Rule::unlimited) rule's too, without a
//! backend call.
//!
//! All the descriptors of one request are decided **together, in one
//! backend call** (one Lua script call on Redis): either every enforced rule
//! allows and every one is charged, or none is charged. Two descriptors of
//! one request that match one rule with the same values are one check whose
//! cost is the sum of theirs.
//!
//! ```
//! use tiered_ratelimit::descriptor::{Code, Descriptor, DescriptorLimiter, RulesPolicy};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let policy = RulesPolicy::from_toml_str(r#"
//!     domain = "edge"
//!     [[rule]]
//!     name = "per_ip"
//!     match = [{ key = "remote_address" }]
//!     limit = 2
//!     period = "1m"
//! "#).unwrap();
//! let limiter = policy.limiter(tiered_ratelimit::backend::MemoryBackend::new()).unwrap();
//! let d = [Descriptor::new(vec![("remote_address", "10.0.0.1")])];
//! for _ in 0..2 {
//!     let a = limiter.check("edge", &d, 1).await.unwrap();
//!     assert_eq!(a.overall, Code::Ok);
//! }
//! let a = limiter.check("edge", &d, 1).await.unwrap();
//! assert_eq!(a.overall, Code::OverLimit);
//! assert_eq!(a.statuses[0].remaining, 0);
//! # }
//! ```

mod answer;
mod domains;
mod facts;
mod limiter;
mod matching;
mod reference;
mod rules;
#[cfg(test)]
mod tests;

pub use domains::DomainLimiters;
pub use limiter::{Answer, Code, DescriptorLimiter, DescriptorStatus, RequestError};
pub use matching::Descriptor;
pub use reference::{per_unit, StatLevel, StatPath, Unit};
#[cfg(feature = "envoy-yaml")]
#[cfg_attr(docsrs, doc(cfg(feature = "envoy-yaml")))]
pub use reference::{ReferenceConfig, ReferenceDomain, MAX_FILES, MAX_FILE_BYTES};
pub use rules::{EntryMatch, FailureStatus, Rule, RuleLimit, RulePolicy, RulesPolicy};

/// The most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = crate::engine::MAX_TIERS;

/// The most entries one descriptor may have.
pub const MAX_ENTRIES: usize = 16;
