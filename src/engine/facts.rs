//! [`Facts`]: what the engine asks a front door about one request.
//!
//! The engine never sees the request itself. Each front door (the tower
//! layer over `http::Request`, replay over a log line) answers these
//! questions from its own protocol, lazily: the engine asks about a tier only
//! when the tier's mode is not off, so a switched-off tier costs no
//! extraction.

use crate::key::{KeyError, KeyWriter};
use crate::rollout::AccessList;
use std::borrow::Cow;

/// The facts of one request, as a front door reads them. Tier numbers are
/// positions in the layer's tier list (check order, from 0).
pub(crate) trait Facts {
    /// Whether the request feeds the operator's view: the per-endpoint
    /// metrics and anomaly series, the top-N sketches and the check's
    /// latency. Replay's offline front door says no: its report is its own,
    /// and the layer being replayed serves no one.
    const OBSERVED: bool = true;

    /// Whether `list` (the allow- or denylist) names this request's client.
    fn listed(&self, list: &AccessList) -> bool;

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
