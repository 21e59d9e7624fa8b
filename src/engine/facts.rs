//! [`Facts`]: what the engine asks a front door about one request.
//!
//! The engine never sees the request itself. Each front door (the tower
//! layer over `http::Request`, replay over a log line) answers these
//! questions from its own protocol, lazily: the engine asks about a tier only
//! when the tier's mode is not off, so a switched-off tier costs no
//! extraction.

use crate::key::{KeyError, KeyWriter};
use crate::rollout::Standing;
use std::borrow::Cow;

/// The facts of one request, as a front door reads them. Tier numbers are
/// positions in the layer's tier list (check order, from 0).
pub(crate) trait Facts {
    /// Whether the request feeds the operator's view: the per-endpoint
    /// metrics and anomaly series, the top-N sketches and the check's
    /// latency. Replay's offline front door says no: its report is its own,
    /// and the layer being replayed serves no one.
    const OBSERVED: bool = true;

    /// Whether the decision carries every check's result
    /// ([`Details`](super::decision::Details)), for a front door that
    /// answers per check (the descriptor front door); the HTTP layer shows
    /// the binding tier only and says no.
    const DETAILS: bool = false;

    /// Whether an allowed request's decision carries its rate-limit
    /// headers (default yes). Replay's offline front door says no: no
    /// response is built (a denial still carries its rejection).
    const HEADERS: bool = true;

    /// How many checks tier `tier` makes for this request (default 1): a
    /// front door whose request can name one tier several times under
    /// different keys (two descriptors matching one rule) plans each, as
    /// occurrences `0..n`, asked through [`cost_at`](Self::cost_at) and
    /// [`key_at`](Self::key_at). A request has at most
    /// [`MAX_TIERS`](crate::MAX_TIERS) checks in all; occurrences past that
    /// are not planned.
    fn occurrences(&self, _tier: usize) -> usize {
        1
    }

    /// [`cost`](Self::cost) of occurrence `n` of tier `tier`.
    #[inline]
    fn cost_at(&self, tier: usize, _n: usize) -> Option<u64> {
        self.cost(tier)
    }

    /// [`key`](Self::key) of occurrence `n` of tier `tier`.
    ///
    /// # Errors
    /// As [`key`](Self::key).
    #[inline]
    fn key_at(&self, tier: usize, _n: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        self.key(tier, key)
    }

    /// The request's standing on the front door's allow- and denylists
    /// (default: unlisted, for a front door without lists).
    fn standing(&self) -> Standing {
        Standing::Unlisted
    }

    /// Tier `tier`'s cost for this request (in the tier's units), or `None`
    /// when the tier does not count it (its methods exclude the request's).
    /// A cost of 0 also leaves the tier out.
    fn cost(&self, tier: usize) -> Option<u64>;

    /// Appends tier `tier`'s key part for this request to `key`; `false`
    /// when the tier has no key for it (an anonymous request on a user
    /// tier).
    ///
    /// # Errors
    /// The tier's extractor cannot run (see [`KeyError`]).
    fn key(&self, tier: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError>;

    /// The plan the request names on tier `tier` (asked only of tiers with
    /// plans).
    fn plan(&self, tier: usize) -> Option<Cow<'_, str>>;

    /// The endpoint label: the method and the route template.
    fn endpoint(&self) -> (&str, &str);
}
