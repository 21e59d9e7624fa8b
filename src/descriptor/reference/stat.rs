//! The reference service's stat key of a limit (envoyproxy/ratelimit):
//! `<domain>.<level>.<level>…`, each level `key` or `key_value` as its
//! node matched, rewritten by the node's `detailed_metric`,
//! `value_to_metric` and `share_threshold` as the reference does. The
//! Envoy service exports `ratelimit.service.rate_limit.<stat key>.*` under
//! these keys (docs/envoy.md).

/// One node on a limit's path in the reference's descriptor tree.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatLevel {
    /// The node's `key`.
    pub key: String,
    /// The node's `value` (a wildcard pattern when it has a `*`); `None`
    /// for a key-only node.
    pub value: Option<String>,
    /// `value_to_metric`: the request's value replaces a key-only node's
    /// absent value or a wildcard pattern.
    pub value_to_metric: bool,
    /// `share_threshold`: a wildcard node keeps its pattern.
    pub share: bool,
}

/// The path of a limit's node (one [`StatLevel`] per request entry), and
/// its `detailed_metric`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StatPath {
    /// Root first.
    pub levels: Vec<StatLevel>,
    /// `detailed_metric` of the limit's node: every level as the request's
    /// `key_value`.
    pub detailed: bool,
}

impl StatLevel {
    /// A level of `key` and `value` without flags.
    pub fn new(key: impl Into<String>, value: Option<String>) -> Self {
        Self {
            key: key.into(),
            value,
            value_to_metric: false,
            share: false,
        }
    }
}

impl StatPath {
    /// The stat key of a request's descriptor `entries` (as many as
    /// levels: the limit matched them) in `domain`: the domain and
    /// [`levels_of`](Self::levels_of) joined by `.`.
    pub fn key(&self, domain: &str, entries: &[(&str, &str)]) -> String {
        let mut out = String::from(domain);
        for level in self.levels_of(entries) {
            out.push('.');
            out.push_str(&level);
        }
        out
    }

    /// The stat key's levels for a request's descriptor `entries`, one
    /// per level (`key` or `key_value`), each whole: a value containing
    /// dots (`50.0.0.5`, `example.com`) stays in its level.
    pub fn levels_of(&self, entries: &[(&str, &str)]) -> Vec<String> {
        let shared = self.levels.iter().any(|l| l.share);
        let mut out = Vec::with_capacity(self.levels.len());
        for (i, level) in self.levels.iter().enumerate() {
            let actual = entries.get(i).map_or("", |e| e.1);
            let pattern = level.value.as_deref().filter(|v| v.contains('*'));
            let value = match (self.detailed, &level.value, pattern) {
                (_, _, Some(p)) if level.share => p,
                // Detailed without a shared pattern: always `key_value`,
                // `key_` for an empty value (as the reference writes it).
                (true, _, _) if !shared => {
                    out.push(format!("{}_{actual}", level.key));
                    continue;
                }
                (true, _, _) => actual,
                (false, _, Some(_)) if level.value_to_metric => actual,
                (false, _, Some(p)) => p,
                (false, Some(v), None) => v,
                (false, None, _) if level.value_to_metric => actual,
                (false, None, _) => "",
            };
            if value.is_empty() {
                out.push(level.key.clone());
            } else {
                out.push(format!("{}_{value}", level.key));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{StatLevel, StatPath};

    fn path(levels: &[(&str, Option<&str>, bool, bool)], detailed: bool) -> StatPath {
        StatPath {
            levels: levels
                .iter()
                .map(|&(k, v, vtm, share)| StatLevel {
                    value_to_metric: vtm,
                    share,
                    ..StatLevel::new(k, v.map(str::to_owned))
                })
                .collect(),
            detailed,
        }
    }

    #[test]
    fn stat_keys_as_the_reference_names_them() {
        let e = [("route", "api"), ("user", "bob")];
        // Plain: the nodes as configured.
        let p = path(
            &[
                ("route", Some("api"), false, false),
                ("user", None, false, false),
            ],
            false,
        );
        assert_eq!(p.key("d", &e), "d.route_api.user");
        // value_to_metric on a key-only node: the request's value.
        let p = path(
            &[
                ("route", Some("api"), false, false),
                ("user", None, true, false),
            ],
            false,
        );
        assert_eq!(p.key("d", &e), "d.route_api.user_bob");
        // A wildcard: its pattern, the value with value_to_metric, the
        // pattern always with share_threshold.
        let w = [("path", "/files/a")];
        let p = path(&[("path", Some("/files/*"), false, false)], false);
        assert_eq!(p.key("d", &w), "d.path_/files/*");
        let p = path(&[("path", Some("/files/*"), true, false)], false);
        assert_eq!(p.key("d", &w), "d.path_/files/a");
        let p = path(&[("path", Some("/files/*"), true, true)], false);
        assert_eq!(p.key("d", &w), "d.path_/files/*");
        // detailed_metric: every level key_value as requested (an empty
        // value as `key_`), a shared wildcard keeping its pattern.
        let p = path(
            &[
                ("route", Some("api"), false, false),
                ("user", None, false, false),
            ],
            true,
        );
        assert_eq!(p.key("d", &e), "d.route_api.user_bob");
        assert_eq!(
            p.key("d", &[("route", "api"), ("user", "")]),
            "d.route_api.user_"
        );
        let p = path(
            &[
                ("path", Some("/files/*"), false, true),
                ("user", None, false, false),
            ],
            true,
        );
        assert_eq!(
            p.key("d", &[("path", "/files/a"), ("user", "bob")]),
            "d.path_/files/*.user_bob"
        );
        assert_eq!(
            p.key("d", &[("path", "/files/a"), ("user", "")]),
            "d.path_/files/*.user"
        );
    }
}
