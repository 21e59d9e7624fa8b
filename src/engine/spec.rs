//! [`TierSpec`]: one tier as the engine knows it, with nothing of a
//! protocol in it (no key extractor, no request type). Each front door turns
//! its own tier type into these (the HTTP [`Tier`](crate::Tier), a rules
//! file's rule) and keeps the protocol half for itself.

use crate::algorithm::kind::Algorithm;
use crate::algorithm::penalty::Penalty;
use crate::engine::token_lease::TokenLease;
use crate::quota::Quota;
use crate::response::QuotaUnit;
use crate::rollout::Mode;

/// One tier's engine half: its name, algorithm and quotas, its options and
/// its mode. The request half (how a request's key, cost and plan are read)
/// stays with the front door, which answers the engine's
/// [`Facts`](super::facts::Facts) questions by tier index.
#[derive(Debug, Clone)]
pub(crate) struct TierSpec {
    /// 1-64 characters of `[A-Za-z0-9_-]`, unique within an engine.
    pub(crate) name: String,
    pub(crate) algorithm: Algorithm,
    pub(crate) quota: Quota,
    /// The fixed cost (in the tier's units); quotas are checked against it.
    pub(crate) cost: u64,
    pub(crate) mode: Mode,
    /// Per-plan quotas, in the order given.
    pub(crate) plans: Vec<(String, Quota)>,
    pub(crate) penalty: Option<Penalty>,
    /// Whether the tier takes per-key overrides.
    pub(crate) overrides: bool,
    pub(crate) lease: Option<TokenLease>,
    /// A calendar quota's calendar (the quota's limit per calendar window;
    /// see [`Tier::calendar`](crate::Tier::calendar)).
    pub(crate) calendar: Option<crate::algorithm::calendar::Calendar>,
    /// The status of the tier's denials, when not 429 (a calendar quota's 403).
    pub(crate) exhausted_status: Option<u16>,
    /// Give the charge back when the result is a failure.
    pub(crate) skip_failed: bool,
    /// Give the charge back when the result is a success.
    pub(crate) skip_successful: bool,
    /// How the front door names the tier's key source in logs (`ClientIp`).
    pub(crate) key_type: &'static str,
    /// What to say when the tier never finds a key (see
    /// [`NoKeyWatch`](super::no_key::NoKeyWatch)).
    pub(crate) no_key_cause: Option<String>,
    /// Priced by its response: its charge is a reservation at the
    /// estimate, settled by the front door (`engine/settle.rs`).
    pub(crate) priced: bool,
    /// The quota's unit as set ([`Tier::quota_unit`](crate::Tier::quota_unit));
    /// `None`: chosen by `build` (see [`QuotaUnit`]).
    pub(crate) unit: Option<QuotaUnit>,
    /// Costed by a function of the request (its quota counts costs).
    pub(crate) weighted: bool,
    /// Its staged rollout plan, run fleet-wide (`engine/rollout/`).
    pub(crate) rollout: Option<crate::rollout::RolloutPlan>,
    /// Its candidate quotas, at most four (`engine/candidates.rs`).
    pub(crate) candidates: Vec<Quota>,
    /// Its automatic fall back to shadow (`engine/rollout/guard.rs`).
    pub(crate) guard: Option<crate::rollout::FallbackGuard>,
}

impl TierSpec {
    /// A tier named `name` of `quota`, cost 1, token bucket, enforced, with
    /// no option. (The descriptor front door's constructor; the HTTP
    /// door splits its `Tier`.)
    #[cfg_attr(not(feature = "descriptor"), allow(dead_code))]
    pub(crate) fn new(name: impl Into<String>, quota: Quota) -> Self {
        Self {
            name: name.into(),
            algorithm: Algorithm::TokenBucket,
            quota,
            cost: 1,
            mode: Mode::Enforce,
            plans: Vec::new(),
            penalty: None,
            overrides: false,
            lease: None,
            calendar: None,
            exhausted_status: None,
            skip_failed: false,
            skip_successful: false,
            key_type: "",
            no_key_cause: None,
            priced: false,
            unit: None,
            weighted: false,
            rollout: None,
            candidates: Vec::new(),
            guard: None,
        }
    }
}
