//! [`ReferenceConfig`]: a reference configuration read from a file or a
//! directory of them (one domain per file), within the limits a hostile
//! directory meets ([`MAX_FILE_BYTES`], [`MAX_FILES`], 8 levels of
//! subdirectories).

use super::load::{Loader, YamlRoot, MAX_DEPTH};
use super::tree::Tree;
#[cfg(feature = "calendar")]
use super::unit::Unit;
#[cfg(feature = "calendar")]
use crate::algorithm::calendar::Calendar;
use crate::descriptor::rules::Rule;
use crate::error::ConfigError;
#[cfg(feature = "calendar")]
use crate::quota::Quota;
use std::path::{Path, PathBuf};
#[cfg(feature = "calendar")]
use std::time::Duration;

/// The largest config file read (bytes).
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// The most files one directory may hold.
pub const MAX_FILES: usize = 1024;

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
    pub(in crate::descriptor) tree: Tree,
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
        let (rules, tree) = Loader::domain(file, &root.descriptors.unwrap_or_default())?;
        self.domains.push(ReferenceDomain {
            file: file.to_owned(),
            domain,
            rules,
            tree,
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
