//! The reference service's descriptor tree (envoyproxy/ratelimit): how a
//! descriptor finds its limit in a domain's nested `descriptors`.
//!
//! A node's children are named by their *composite key*: `key` for a
//! key-only entry, `key_value` with a value. A descriptor descends one
//! entry at a time, looking each entry up among the current node's
//! children as `key_value` first, then (no such child) against the
//! children whose composite key holds `*` (in the file's order, the first
//! that matches; each `*` stands for any run of characters, so `foo*`,
//! `bar*b` and `foo*bar*baz` are all patterns), then as the key alone. The
//! descent stops at the first entry with no child, or at a child without
//! children of its own; the descriptor's limit is the limit of the node its
//! **last** entry reached (a descriptor longer or shorter than the branch
//! has none). There is no backtracking: a `key_value` child without the
//! next entry hides a key-only sibling that has it.

use std::collections::HashMap;

/// One node: its children by composite key, its wildcard children, its
/// rule (a node with a `rate_limit`).
#[derive(Debug, Default)]
pub(in crate::descriptor) struct Node {
    pub(in crate::descriptor) children: HashMap<Box<str>, usize>,
    /// `(composite key split on '*', child)`, in the file's order.
    pub(in crate::descriptor) wildcards: Vec<(Vec<Box<str>>, usize)>,
    pub(in crate::descriptor) rule: Option<usize>,
    /// `share_threshold`: the value part of this node's pattern, which
    /// stands for every value it matches in the storage key.
    pub(in crate::descriptor) share: Option<Box<str>>,
}

/// A domain's tree; node 0 is the root.
#[derive(Debug)]
pub(in crate::descriptor) struct Tree {
    pub(in crate::descriptor) nodes: Vec<Node>,
}

impl Default for Tree {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
        }
    }
}

/// Where a descriptor landed: its rule, and for the entries matched by a
/// `share_threshold` pattern, the pattern's value.
#[derive(Debug, Default)]
pub(in crate::descriptor) struct Landing<'t> {
    pub(in crate::descriptor) rule: Option<usize>,
    pub(in crate::descriptor) shared: Vec<(usize, &'t str)>,
}

impl Tree {
    /// Adds a child of `parent` named `composite` (its key, or
    /// `key_value`); `None` when `parent` has one by that name already.
    #[cfg_attr(not(feature = "envoy-yaml"), allow(dead_code))]
    pub(in crate::descriptor) fn add(&mut self, parent: usize, composite: &str) -> Option<usize> {
        if self.nodes[parent].children.contains_key(composite) {
            return None;
        }
        let id = self.nodes.len();
        self.nodes.push(Node::default());
        let p = &mut self.nodes[parent];
        p.children.insert(composite.into(), id);
        if composite.contains('*') {
            p.wildcards
                .push((composite.split('*').map(Box::from).collect(), id));
        }
        Some(id)
    }

    /// The landing of a descriptor's entries (see the module docs).
    pub(in crate::descriptor) fn descend<'t>(&'t self, entries: &[(&str, &str)]) -> Landing<'t> {
        let mut landing = Landing::default();
        let mut at = 0;
        let mut composite = String::new();
        for (i, (key, value)) in entries.iter().enumerate() {
            let node = &self.nodes[at];
            composite.clear();
            composite.push_str(key);
            composite.push('_');
            composite.push_str(value);
            let mut next = node.children.get(composite.as_str()).copied();
            let mut by_pattern = false;
            if next.is_none() {
                next = node
                    .wildcards
                    .iter()
                    .find(|(parts, _)| wildcard_match(parts, &composite))
                    .map(|&(_, n)| n);
                by_pattern = next.is_some();
            }
            if next.is_none() {
                next = node.children.get(*key).copied();
            }
            let Some(n) = next else { break };
            let child = &self.nodes[n];
            if by_pattern {
                if let Some(share) = &child.share {
                    landing.shared.push((i, share));
                }
            }
            if i + 1 == entries.len() {
                landing.rule = child.rule;
            }
            if child.children.is_empty() {
                break;
            }
            at = n;
        }
        if landing.rule.is_none() {
            landing.shared.clear();
        }
        landing
    }
}

/// Whether `text` matches a pattern split on its `*`s (each `*` any run
/// of characters, possibly empty).
fn wildcard_match(parts: &[Box<str>], text: &str) -> bool {
    let [first, middle @ .., last] = parts else {
        return parts.first().is_some_and(|p| **p == *text);
    };
    if first.len() + last.len() > text.len()
        || !text.starts_with(&**first)
        || !text.ends_with(&**last)
    {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for part in middle {
        match rest.find(&**part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(p: &str) -> Vec<Box<str>> {
        p.split('*').map(Box::from).collect()
    }

    #[test]
    fn wildcards_trailing_middle_and_several() {
        let cases = [
            ("wild_foo*", "wild_foo", true),
            ("wild_foo*", "wild_foobar", true),
            ("wild_foo*", "wild_fo", false),
            ("midWild_bar*b", "midWild_barb", true),
            ("midWild_bar*b", "midWild_barxyzb", true),
            ("midWild_bar*b", "midWild_barxyz", false),
            ("multiWild_foo*bar*baz", "multiWild_foo1bar2baz", true),
            ("multiWild_foo*bar*baz", "multiWild_foobarbaz", true),
            ("multiWild_foo*bar*baz", "multiWild_foobaz", false),
            ("multiWild_foo*bar*baz", "multiWild_foo_baz_bar", false),
            ("a*a", "a", false),
            ("a*a", "aa", true),
        ];
        for (pattern, text, expected) in cases {
            assert_eq!(
                wildcard_match(&parts(pattern), text),
                expected,
                "{pattern} ~ {text}"
            );
        }
    }
}
