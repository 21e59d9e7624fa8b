//! From a descriptor to its rule: a rule compiled for matching, and the
//! most specific match.

use super::rules::{EntryMatch, RuleLimit};

/// A descriptor of a request: its entries, and optionally its own cost
/// (Envoy's per-descriptor `hits_addend`).
#[derive(Debug, Clone, Default)]
pub struct Descriptor<'a> {
    /// `(key, value)`, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// Replaces the request's cost for this descriptor.
    /// `Some(0)` charges nothing: the descriptor's numbers are read
    /// without a charge (an extra backend read), and it is never over the
    /// limit.
    pub hits_addend: Option<u64>,
}

impl<'a> Descriptor<'a> {
    /// A descriptor with these entries and the request's cost.
    pub fn new(entries: Vec<(&'a str, &'a str)>) -> Self {
        Self {
            entries,
            hits_addend: None,
        }
    }
}

/// A rule as compiled: its engine tier (none when unlimited).
#[derive(Debug)]
pub(super) struct Compiled {
    /// Its names and numbers as the answer has them.
    pub(super) limit: RuleLimit,
    pub(super) entries: Vec<EntryMatch>,
    pub(super) tier: Option<usize>,
    pub(super) shadow: bool,
    pub(super) blocked: bool,
    /// The reference's stat key path ([`Rule::stat`](super::Rule::stat)).
    pub(super) stat: Option<std::sync::Arc<super::StatPath>>,
    /// Refills at a steady rate (token and leaky buckets): a cost of `c`
    /// takes `c × period ÷ limit` to come back.
    pub(super) steady_refill: bool,
    pub(super) replaces: Vec<String>,
}

impl Compiled {
    pub(super) fn matches(&self, d: &Descriptor<'_>) -> bool {
        self.entries.len() == d.entries.len()
            && self
                .entries
                .iter()
                .zip(&d.entries)
                .all(|(m, (k, v))| m.key == *k && m.value.as_deref().is_none_or(|mv| mv == *v))
    }

    /// Greater is more specific: a value on an earlier entry wins.
    pub(super) fn specificity(&self) -> impl Iterator<Item = bool> + '_ {
        self.entries.iter().map(|e| e.value.is_some())
    }
}

/// The rule of `rules` a descriptor matches (the most specific).
pub(super) fn rule_of(rules: &[Compiled], d: &Descriptor<'_>) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, r) in rules.iter().enumerate() {
        if !r.matches(d) {
            continue;
        }
        let better = match best {
            None => true,
            Some(b) => r.specificity().gt(rules[b].specificity()),
        };
        if better {
            best = Some(i);
        }
    }
    best
}
