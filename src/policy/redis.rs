//! The `[redis]` table of a policy: where the Redis backend is.

use serde::Deserialize;
use std::fmt;

/// Where the Redis backend is, as a policy's `[redis]` table: exactly one
/// of `url` (a single Redis, as [`RedisBackend::from_url`] takes it),
/// `cluster_nodes` (a Redis Cluster, as [`RedisBackend::cluster`]) or
/// `sentinels` with `master_name` (Redis Sentinel, as
/// [`RedisBackend::sentinel_with`]; `db`, `username` and `password` are
/// then the primary's login, the sentinels' own go in their URLs). Every
/// field is optional to the parser; [`RedisConfig::backend`] checks that
/// they go together.
///
/// The table is read whatever the crate's features;
/// [`RedisConfig::backend`] needs the `redis` feature.
///
/// ```no_run
/// # #[cfg(feature = "redis")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tiered_ratelimit::ConfigError> {
/// use tiered_ratelimit::policy::Policy;
/// let policy = Policy::from_toml_str(r#"
///     [redis]
///     sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"]
///     master_name = "mymaster"
///     db = 0                     # optional, default 0
///     # username = "app"         # optional: the primary's ACL user
///     # password = "…"           # optional: the primary's password
///
///     [[tier]]
///     name = "global"
///     key = "global"
///     limit = 1000
///     period = "1s"
/// "#)?;
/// let redis = policy.redis.as_ref().expect("a [redis] table").backend()?;
/// // build() + one PING: an unreachable Redis is said at start-up.
/// let layer = policy.builder(redis)?.build_checked().await?;
/// # Ok(()) }
/// # #[cfg(not(feature = "redis"))]
/// # fn main() {}
/// ```
///
/// [`RedisBackend::from_url`]: crate::backend::RedisBackend::from_url
/// [`RedisBackend::cluster`]: crate::backend::RedisBackend::cluster
/// [`RedisBackend::sentinel_with`]: crate::backend::RedisBackend::sentinel_with
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RedisConfig {
    /// A single Redis: `redis://[user:pass@]host:port/[db]`.
    pub url: Option<String>,
    /// Redis Cluster: any reachable nodes' URLs (the rest is discovered).
    pub cluster_nodes: Vec<String>,
    /// Redis Sentinel: the sentinels' URLs (`redis://host:26379`).
    pub sentinels: Vec<String>,
    /// With `sentinels`: the monitored master's name.
    pub master_name: Option<String>,
    /// With `sentinels`: the database number on the primary (default 0).
    pub db: Option<i64>,
    /// With `sentinels`: the primary's ACL user.
    pub username: Option<String>,
    /// With `sentinels`: the primary's password.
    pub password: Option<String>,
    /// Group commit: the most requests one script call carries (default
    /// 32; `1` sends every request alone). See
    /// [`RedisBackend::with_max_batch`](crate::backend::RedisBackend::with_max_batch).
    pub max_batch: Option<usize>,
}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl RedisConfig {
    /// The backend this table describes. Does not connect yet (see each
    /// constructor).
    ///
    /// # Errors
    /// [`ConfigError::Policy`](crate::ConfigError::Policy) when the table
    /// names no deployment or several, `sentinels` come without
    /// `master_name`, or `master_name`, `db`, `username` or `password` come
    /// without `sentinels`; otherwise the constructor's error
    /// ([`ConfigError::InvalidRedisUrl`](crate::ConfigError::InvalidRedisUrl)).
    pub fn backend(&self) -> Result<crate::backend::RedisBackend, crate::error::ConfigError> {
        use crate::backend::{RedisBackend, SentinelMaster};
        use crate::error::ConfigError;
        let bad = |what: &str| ConfigError::Policy(format!("redis: {what}"));
        let kinds = [
            self.url.is_some(),
            !self.cluster_nodes.is_empty(),
            !self.sentinels.is_empty(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(bad("set exactly one of url, cluster_nodes or sentinels"));
        }
        let primary_login = self.master_name.is_some()
            || self.db.is_some()
            || self.username.is_some()
            || self.password.is_some();
        if self.sentinels.is_empty() && primary_login {
            return Err(bad(
                "master_name, db, username and password go with sentinels \
                 (a url carries its own login and db)",
            ));
        }
        if self.max_batch == Some(0) {
            return Err(bad("max_batch is at least 1 (1: no group commit)"));
        }
        let batch = |b: RedisBackend| match self.max_batch {
            Some(n) => b.with_max_batch(n),
            None => b,
        };
        if let Some(url) = &self.url {
            return RedisBackend::from_url(url).map(batch);
        }
        if !self.cluster_nodes.is_empty() {
            return RedisBackend::cluster(&self.cluster_nodes);
        }
        let Some(name) = &self.master_name else {
            return Err(bad("sentinels need master_name"));
        };
        let mut master = SentinelMaster::new(name.clone()).db(self.db.unwrap_or(0));
        if let Some(u) = &self.username {
            master = master.username(u.clone());
        }
        if let Some(p) = &self.password {
            master = master.password(p.clone());
        }
        RedisBackend::sentinel_with(&self.sentinels, master).map(batch)
    }
}

/// Passwords never show: the `password` field, nor one inside a URL.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls = |v: &[String]| v.iter().map(|u| redact(u)).collect::<Vec<_>>();
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact))
            .field("cluster_nodes", &urls(&self.cluster_nodes))
            .field("sentinels", &urls(&self.sentinels))
            .field("master_name", &self.master_name)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("max_batch", &self.max_batch)
            .finish()
    }
}

/// Where the table points, in one line with passwords redacted, for a
/// start-up log line: `redis at redis://***@10.0.0.5:6379/`, `redis
/// cluster at …`, `redis primary of "mymaster" via sentinels …`.
impl fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls = |v: &[String]| v.iter().map(|u| redact(u)).collect::<Vec<_>>().join(", ");
        if let Some(url) = &self.url {
            write!(f, "redis at {}", redact(url))
        } else if !self.cluster_nodes.is_empty() {
            write!(f, "redis cluster at {}", urls(&self.cluster_nodes))
        } else if !self.sentinels.is_empty() {
            write!(
                f,
                "redis primary of {:?} via sentinels {}",
                self.master_name.as_deref().unwrap_or(""),
                urls(&self.sentinels)
            )
        } else {
            f.write_str("redis (no url, cluster_nodes or sentinels)")
        }
    }
}

/// `redis://user:secret@host/` → `redis://***@host/`.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}***{}", &url[..scheme_end + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(toml: &str) -> RedisConfig {
        crate::policy::Policy::from_toml_str(toml)
            .unwrap()
            .redis
            .expect("a [redis] table")
    }

    #[test]
    fn each_deployment_reads_into_its_fields() {
        let s = table(
            "[redis]\nsentinels = ['redis://a:26379', 'redis://b:26379']\n\
             master_name = 'mymaster'\ndb = 2\nusername = 'app'\npassword = 'pw'\n",
        );
        assert_eq!(s.sentinels, ["redis://a:26379", "redis://b:26379"]);
        assert_eq!(s.master_name.as_deref(), Some("mymaster"));
        assert_eq!(
            (s.db, s.username.as_deref(), s.password.as_deref()),
            (Some(2), Some("app"), Some("pw"))
        );
        let c = table("[redis]\ncluster_nodes = ['redis://a:7000']\n");
        assert_eq!(c.cluster_nodes, ["redis://a:7000"]);
        let u = table("[redis]\nurl = 'redis://a:6379/'\n");
        assert_eq!(u.url.as_deref(), Some("redis://a:6379/"));
        assert!(crate::policy::Policy::from_toml_str("")
            .unwrap()
            .redis
            .is_none());
        let err = crate::policy::Policy::from_toml_str("[redis]\nmaster = 'm'\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("master"), "{err}");
    }

    #[test]
    fn debug_hides_passwords() {
        let s = table(
            "[redis]\nsentinels = ['redis://:spw@a:26379']\nmaster_name = 'm'\npassword = 'pw'\n",
        );
        let shown = format!("{s:?}");
        assert!(
            !shown.contains("spw") && !shown.contains("\"pw\""),
            "{shown}"
        );
        assert!(shown.contains("redis://***@a:26379"), "{shown}");
    }

    #[cfg(feature = "redis")]
    #[test]
    fn backend_checks_that_the_fields_go_together() {
        let err = |toml: &str| table(toml).backend().unwrap_err().to_string();
        let one = "policy: redis: set exactly one of url, cluster_nodes or sentinels";
        assert_eq!(err("[redis]\n"), one);
        assert_eq!(
            err("[redis]\nurl = 'redis://a/'\ncluster_nodes = ['redis://b:7000']\n"),
            one
        );
        assert_eq!(
            err("[redis]\nurl = 'redis://a/'\nmaster_name = 'm'\n"),
            "policy: redis: master_name, db, username and password go with sentinels \
             (a url carries its own login and db)"
        );
        assert_eq!(
            err("[redis]\nsentinels = ['redis://a:26379']\n"),
            "policy: redis: sentinels need master_name"
        );
        assert_eq!(
            err("[redis]\nsentinels = ['nope://a']\nmaster_name = 'm'\n"),
            "redis url: sentinel: nope://a: Redis URL did not parse - InvalidClientConfig"
        );
        assert_eq!(
            err("[redis]\nurl = 'redis://a/'\nmax_batch = 0\n"),
            "policy: redis: max_batch is at least 1 (1: no group commit)"
        );
        for ok in [
            "[redis]\nurl = 'redis://127.0.0.1:6379/'\n",
            "[redis]\nurl = 'redis://127.0.0.1:6379/'\nmax_batch = 1\n",
            "[redis]\ncluster_nodes = ['redis://127.0.0.1:7000']\n",
            "[redis]\nsentinels = ['redis://127.0.0.1:26379']\nmaster_name = 'm'\ndb = 1\n",
        ] {
            table(ok).backend().unwrap();
        }
    }
}
