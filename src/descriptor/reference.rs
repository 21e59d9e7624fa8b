//! The YAML configuration of Envoy's reference rate limit service
//! (envoyproxy/ratelimit), read as it is: [`ReferenceConfig`], one
//! [`ReferenceDomain`] per file, each a tree of descriptors (see the
//! `tree` module for how a request's descriptor finds its limit).
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

use super::rules::{EntryMatch, Rule};
use super::stat::{StatLevel, StatPath};
use super::tree::Tree;
use super::unit::Unit;
#[cfg(feature = "calendar")]
use crate::algorithm::calendar::Calendar;
use crate::algorithm::kind::Algorithm;
use crate::error::ConfigError;
use crate::quota::Quota;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The largest config file read (bytes).
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// The most files one directory may hold.
pub const MAX_FILES: usize = 1024;
/// The deepest descriptor tree accepted (the most entries a descriptor has).
const MAX_DEPTH: usize = super::MAX_ENTRIES;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    #[serde(default)]
    domain: Option<String>,
    #[serde(default)]
    descriptors: Option<Vec<YamlDescriptor>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
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

/// One domain of a reference configuration: its rules (one per node with
/// a `rate_limit`) and its tree.
#[derive(Debug)]
#[non_exhaustive]
pub struct ReferenceDomain {
    /// The file it came from.
    pub file: PathBuf,
    /// The `domain`.
    pub domain: String,
    /// One per node with a `rate_limit`, in the file's order.
    pub rules: Vec<Rule>,
    pub(super) tree: Tree,
}

/// A reference configuration: a file or a directory of them, one domain
/// per file.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ReferenceConfig {
    /// The domains, in file-name order.
    pub domains: Vec<ReferenceDomain>,
}

impl ReferenceConfig {
    /// Reads `path`: one YAML file, or every file of a directory and its
    /// subdirectories (the reference's runtime layout), in path order,
    /// following symlinks. Names starting with `..` are skipped (a
    /// Kubernetes ConfigMap mount's `..data` and `..<timestamp>`, which
    /// its files link into), and those starting with `.` when
    /// `ignore_dotfiles`.
    ///
    /// # Errors
    /// [`ConfigError::PolicyFile`] when a file cannot be read;
    /// [`ConfigError::Policy`] naming the file, the tree path and the
    /// field for a mistake, a file over [`MAX_FILE_BYTES`], more than
    /// [`MAX_FILES`] files, or two files with the same domain.
    pub fn from_path(path: &Path, ignore_dotfiles: bool) -> Result<Self, ConfigError> {
        let io = |p: &Path| {
            let p = p.to_owned();
            move |source| ConfigError::PolicyFile { path: p, source }
        };
        let mut files = Vec::new();
        if std::fs::metadata(path).map_err(io(path))?.is_dir() {
            collect(path, ignore_dotfiles, &mut files, 0)?;
            files.sort();
        } else {
            files.push(path.to_owned());
        }
        let mut config = Self::default();
        for file in files {
            let len = std::fs::metadata(&file).map_err(io(&file))?.len();
            if len > MAX_FILE_BYTES {
                return Err(ConfigError::Policy(format!(
                    "{}: {len} bytes, at most {MAX_FILE_BYTES} are read",
                    file.display()
                )));
            }
            let text = std::fs::read_to_string(&file).map_err(io(&file))?;
            config.add(&file, &text)?;
        }
        Ok(config)
    }

    /// Adds the domain of one file's text (`file` names it in errors).
    ///
    /// # Errors
    /// As [`from_path`](Self::from_path).
    pub fn add(&mut self, file: &Path, text: &str) -> Result<(), ConfigError> {
        let name = file.display();
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(ConfigError::Policy(format!(
                "{name}: {} bytes, at most {MAX_FILE_BYTES} are read",
                text.len()
            )));
        }
        let options = serde_saphyr::options! {
            budget: serde_saphyr::budget! {
                max_depth: 2 * MAX_DEPTH + 8,
                max_anchors: 1_000,
                max_aliases: 10_000,
                max_events: 1_000_000,
            },
            duplicate_keys: serde_saphyr::DuplicateKeyPolicy::Error,
            alias_limits: serde_saphyr::alias_limits! {
                max_total_replayed_events: 100_000,
                max_replay_stack_depth: 16,
                max_alias_expansions_per_anchor: 1_000,
            },
        };
        let root: YamlRoot = serde_saphyr::from_str_with_options(text, options)
            .map_err(|e| ConfigError::Policy(format!("{name}: {e}")))?;
        let domain = root.domain.unwrap_or_default();
        if domain.is_empty() {
            return Err(ConfigError::Policy(format!(
                "{name}: domain: must not be empty"
            )));
        }
        if let Some(other) = self.domains.iter().find(|d| d.domain == domain) {
            return Err(ConfigError::Policy(format!(
                "{name}: domain: \"{domain}\" is the domain of {} too",
                other.file.display()
            )));
        }
        let mut loader = Loader {
            file: file.to_owned(),
            tree: Tree::default(),
            rules: Vec::new(),
            names: HashMap::new(),
        };
        let descriptors = root.descriptors.unwrap_or_default();
        loader.load(0, "descriptors", "", &[], &[], &descriptors)?;
        self.domains.push(ReferenceDomain {
            file: file.to_owned(),
            domain,
            rules: loader.rules,
            tree: loader.tree,
        });
        Ok(())
    }
}

#[cfg(feature = "calendar")]
#[cfg_attr(docsrs, doc(cfg(feature = "calendar")))]
impl ReferenceConfig {
    /// The reference's `USE_CALENDAR_MONTH_RATE_LIMIT=true`: every limit of
    /// `unit: month` counts per UTC calendar month (from the 1st at
    /// 00:00 UTC to the next 1st) instead of 30-day windows from the epoch;
    /// `duration_until_reset` runs to the month's end, `current_limit`
    /// still says `requests_per_unit` per MONTH. Other units are unchanged.
    #[must_use]
    pub fn calendar_months(mut self) -> Self {
        for d in &mut self.domains {
            for r in &mut d.rules {
                if !r.unlimited && matches!(r.per_unit, Some((_, Unit::Month))) {
                    let month = Calendar::month();
                    r.quota =
                        Quota::new(r.quota.limit(), Duration::from_micros(month.longest_us()));
                    r.calendar = Some(month);
                }
            }
        }
        self
    }
}

fn collect(
    dir: &Path,
    ignore_dotfiles: bool,
    files: &mut Vec<PathBuf>,
    depth: usize,
) -> Result<(), ConfigError> {
    let io = |source| ConfigError::PolicyFile {
        path: dir.to_owned(),
        source,
    };
    if depth > 8 {
        return Err(ConfigError::Policy(format!(
            "{}: directories nested deeper than 8",
            dir.display()
        )));
    }
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // `..data` and `..<timestamp>`: a Kubernetes ConfigMap mount's
        // own entries (the files beside them are symlinks into `..data/`),
        // never configuration: read through them, each file would be
        // read twice more.
        if name.starts_with("..") || (ignore_dotfiles && name.starts_with('.')) {
            continue;
        }
        let meta = std::fs::metadata(&path).map_err(|source| ConfigError::PolicyFile {
            path: path.clone(),
            source,
        })?;
        if meta.is_dir() {
            collect(&path, ignore_dotfiles, files, depth + 1)?;
        } else if meta.is_file() {
            files.push(path);
            if files.len() > MAX_FILES {
                return Err(ConfigError::Policy(format!(
                    "{}: more than {MAX_FILES} files",
                    dir.display()
                )));
            }
        }
    }
    Ok(())
}

struct Loader {
    file: PathBuf,
    tree: Tree,
    rules: Vec<Rule>,
    /// Rule (tier) names given so far → how many times.
    names: HashMap<String, usize>,
}

impl Loader {
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
