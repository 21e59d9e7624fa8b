//! One reference YAML file's text → its rules and its tree: the file's
//! schema (`YamlRoot` …, unknown fields refused) and the [`Loader`] that
//! walks its `descriptors`, naming the tree path and the field of a
//! mistake.

use super::stat::{StatLevel, StatPath};
use super::tree::Tree;
use super::unit::Unit;
use crate::algorithm::kind::Algorithm;
use crate::descriptor::rules::{EntryMatch, Rule};
use crate::error::ConfigError;
use crate::quota::Quota;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The deepest descriptor tree accepted (the most entries a descriptor has).
pub(super) const MAX_DEPTH: usize = crate::descriptor::MAX_ENTRIES;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct YamlRoot {
    #[serde(default)]
    pub(super) domain: Option<String>,
    #[serde(default)]
    pub(super) descriptors: Option<Vec<YamlDescriptor>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct YamlDescriptor {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Option<Vec<YamlDescriptor>>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    /// Metric naming: the rule's [`StatPath`].
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    /// Only sent in the reference's dynamic metadata (off by default):
    /// read and not used.
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Option<Vec<YamlReplaces>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    #[serde(default)]
    name: Option<String>,
}

/// The walk of one file's `descriptors`: the tree and the rules so far.
pub(super) struct Loader {
    file: PathBuf,
    tree: Tree,
    rules: Vec<Rule>,
    /// Rule (tier) names given so far → how many times.
    names: HashMap<String, usize>,
}

impl Loader {
    /// The rules and the tree of `file`'s `descriptors`.
    pub(super) fn domain(
        file: &Path,
        descriptors: &[YamlDescriptor],
    ) -> Result<(Vec<Rule>, Tree), ConfigError> {
        let mut loader = Loader {
            file: file.to_owned(),
            tree: Tree::default(),
            rules: Vec::new(),
            names: HashMap::new(),
        };
        loader.load(0, "descriptors", "", &[], &[], descriptors)?;
        Ok((loader.rules, loader.tree))
    }

    fn load(
        &mut self,
        node: usize,
        at: &str,
        parent_key: &str,
        path: &[EntryMatch],
        levels: &[StatLevel],
        descriptors: &[YamlDescriptor],
    ) -> Result<(), ConfigError> {
        let file = self.file.display().to_string();
        for (i, d) in descriptors.iter().enumerate() {
            let here = format!("{at}[{i}]");
            let bad = |field: &str, what: &str| {
                ConfigError::Policy(format!("{file}: {here}: {field}: {what}"))
            };
            let key = d.key.as_deref().unwrap_or("");
            if key.is_empty() {
                return Err(bad("key", "must not be empty (descriptor has empty key)"));
            }
            let value = d.value.as_deref().unwrap_or("");
            let composite = if value.is_empty() {
                key.to_owned()
            } else {
                format!("{key}_{value}")
            };
            let full_key = if parent_key.is_empty() {
                composite.clone()
            } else {
                format!("{parent_key}.{composite}")
            };
            let here = format!("{here} ({full_key})");
            let bad = |field: &str, what: &str| {
                ConfigError::Policy(format!("{file}: {here}: {field}: {what}"))
            };
            if path.len() >= MAX_DEPTH {
                return Err(bad(
                    "descriptors",
                    &format!("nested deeper than {MAX_DEPTH} levels"),
                ));
            }
            if d.quota_mode {
                return Err(bad(
                    "quota_mode",
                    "not supported by tiered-ratelimit-rls (remove it, or keep the reference service for this domain)",
                ));
            }
            if d.share_threshold && !composite.contains('*') {
                return Err(bad(
                    "share_threshold",
                    "only for a wildcard value (one containing '*')",
                ));
            }
            let Some(id) = self.tree.add(node, &composite) else {
                return Err(bad(
                    "key",
                    &format!("duplicate descriptor composite key '{full_key}'"),
                ));
            };
            if d.share_threshold {
                self.tree.nodes[id].share = Some(value.into());
            }
            let mut entries = path.to_vec();
            entries.push(EntryMatch {
                key: key.to_owned(),
                value: (!value.is_empty()).then(|| value.to_owned()),
            });
            let mut stat_levels = levels.to_vec();
            stat_levels.push(StatLevel {
                value_to_metric: d.value_to_metric,
                share: d.share_threshold,
                ..StatLevel::new(key, (!value.is_empty()).then(|| value.to_owned()))
            });
            if let Some(rl) = &d.rate_limit {
                let mut rule = self.rule(rl, d, &full_key, entries.clone(), &bad)?;
                rule.stat = Some(StatPath {
                    levels: stat_levels.clone(),
                    detailed: d.detailed_metric,
                });
                self.tree.nodes[id].rule = Some(self.rules.len());
                self.rules.push(rule);
            }
            let children = d.descriptors.as_deref().unwrap_or_default();
            self.load(
                id,
                &format!("{here}.descriptors"),
                &full_key,
                &entries,
                &stat_levels,
                children,
            )?;
        }
        Ok(())
    }

    fn rule(
        &mut self,
        rl: &YamlRateLimit,
        d: &YamlDescriptor,
        full_key: &str,
        entries: Vec<EntryMatch>,
        bad: &dyn Fn(&str, &str) -> ConfigError,
    ) -> Result<Rule, ConfigError> {
        let unit = rl.unit.as_deref().unwrap_or("");
        let parsed = Unit::from_name(unit);
        if rl.unlimited && parsed.is_some() {
            return Err(bad(
                "rate_limit.unit",
                "should not specify rate limit unit when unlimited",
            ));
        }
        if !rl.unlimited && parsed.is_none() {
            return Err(bad(
                "rate_limit.unit",
                &format!(
                    "invalid rate limit unit '{unit}' (second, minute, hour, day, week, month or year)"
                ),
            ));
        }
        let name = rl.name.clone().unwrap_or_default();
        let mut replaces = Vec::new();
        for r in rl.replaces.as_deref().unwrap_or_default() {
            let r = r.name.as_deref().unwrap_or("");
            if r.is_empty() {
                return Err(bad(
                    "rate_limit.replaces",
                    "should not have an empty replaces entry",
                ));
            }
            if r == name {
                return Err(bad(
                    "rate_limit.replaces",
                    "replaces should not contain name of same descriptor",
                ));
            }
            replaces.push(r.to_owned());
        }
        let unit = parsed.unwrap_or(Unit::Second);
        let period = Duration::from_secs(unit.seconds());
        // `requests_per_unit: 0` blocks every request: a tier of 1 that
        // every check overflows (the limiter charges such a rule 2).
        let blocked = !rl.unlimited && rl.requests_per_unit == 0;
        let quota = Quota::new(u64::from(rl.requests_per_unit.max(1)), period);
        let mut rule = Rule::new(self.tier_name(full_key), entries, quota);
        rule.algorithm = Algorithm::FixedWindow;
        rule.shadow = d.shadow_mode;
        rule.unlimited = rl.unlimited;
        rule.blocked = blocked;
        rule.per_unit = Some((rl.requests_per_unit, unit));
        rule.limit_name = Some(name);
        rule.replaces = replaces;
        Ok(rule)
    }

    /// The engine tier's name for the node `full_key`: its characters
    /// outside `[A-Za-z0-9_-]` as `_`, at most 56 of them, then `-<n>` when
    /// another node already has that name.
    fn tier_name(&mut self, full_key: &str) -> String {
        let mut base: String = full_key
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(56)
            .collect();
        if base.is_empty() {
            base.push('_');
        }
        let mut name = base.clone();
        let mut n = 1;
        while self.names.contains_key(&name) {
            n += 1;
            name = format!("{base}-{n}");
        }
        self.names.insert(name.clone(), n);
        name
    }
}
