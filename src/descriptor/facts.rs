//! A request's descriptors as the engine's [`Facts`]: tier `t` is asked once
//! per group of its descriptors with the same (storage) values.

use super::matching::Descriptor;
use crate::engine::Facts;
use crate::key::{KeyError, KeyWriter};
use std::borrow::Cow;

/// Descriptor `index`'s values as its storage key has them: its own, but
/// the pattern's value for an entry a `share_threshold` wildcard matched.
pub(super) fn value<'a>(
    descriptors: &'a [Descriptor<'a>],
    shared: &'a [Vec<(usize, &'a str)>],
    index: usize,
    entry: usize,
) -> &'a str {
    shared
        .get(index)
        .and_then(|s| s.iter().find(|(e, _)| *e == entry))
        .map_or_else(|| descriptors[index].entries[entry].1, |(_, v)| v)
}

/// Whether descriptors `a` and `b` (of one rule) have the same storage values.
pub(super) fn same_values<'a>(
    descriptors: &'a [Descriptor<'a>],
    shared: &'a [Vec<(usize, &'a str)>],
    a: usize,
    b: usize,
) -> bool {
    let n = descriptors[a].entries.len();
    n == descriptors[b].entries.len()
        && (0..n).all(|e| value(descriptors, shared, a, e) == value(descriptors, shared, b, e))
}

/// Descriptor `index`'s storage key part before escaping. The rule fixes
/// the keys, so the values identify the descriptor: one value as it is;
/// several, each after its length (`5:alice|4:/api`), so that no two lists
/// of values share a key.
pub(super) fn raw_key<'a>(
    descriptors: &'a [Descriptor<'a>],
    shared: &'a [Vec<(usize, &'a str)>],
    index: usize,
) -> Vec<u8> {
    let n = descriptors[index].entries.len();
    if n == 1 {
        return value(descriptors, shared, index, 0).as_bytes().to_vec();
    }
    let mut raw = Vec::new();
    for e in 0..n {
        if e > 0 {
            raw.push(b'|');
        }
        let v = value(descriptors, shared, index, e);
        raw.extend_from_slice(itoa::Buffer::new().format(v.len()).as_bytes());
        raw.push(b':');
        raw.extend_from_slice(v.as_bytes());
    }
    raw
}

pub(super) struct DescriptorFacts<'a> {
    pub(super) descriptors: &'a [Descriptor<'a>],
    /// Per descriptor: `(entry, pattern value)` of its shared entries.
    pub(super) shared: &'a [Vec<(usize, &'a str)>],
    /// Per engine tier: its groups (first descriptor, summed cost).
    pub(super) groups: &'a [Vec<(usize, u64)>],
    pub(super) domain: &'a str,
}

impl Facts for DescriptorFacts<'_> {
    const DETAILS: bool = true;

    fn cost(&self, tier: usize) -> Option<u64> {
        self.cost_at(tier, 0)
    }
    fn key(&self, tier: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        self.key_at(tier, 0, key)
    }
    fn occurrences(&self, tier: usize) -> usize {
        self.groups.get(tier).map_or(0, Vec::len)
    }
    fn cost_at(&self, tier: usize, n: usize) -> Option<u64> {
        self.groups.get(tier)?.get(n).map(|&(_, cost)| cost)
    }
    fn key_at(&self, tier: usize, n: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        let Some(&(first, _)) = self.groups.get(tier).and_then(|g| g.get(n)) else {
            return Ok(false);
        };
        let Some(d) = self.descriptors.get(first) else {
            return Ok(false);
        };
        if d.entries.len() == 1 {
            key.part(value(self.descriptors, self.shared, first, 0).as_bytes());
        } else {
            key.part(&raw_key(self.descriptors, self.shared, first));
        }
        Ok(true)
    }
    fn plan(&self, _: usize) -> Option<Cow<'_, str>> {
        None
    }
    fn endpoint(&self) -> (&str, &str) {
        ("RLS", self.domain)
    }
}
