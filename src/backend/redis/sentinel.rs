//! Redis Sentinel: the primary of a monitored master, found through the
//! sentinels (redis-rs's `SentinelClient`), one multiplexed connection to it
//! shared by every request, and a fresh lookup once that connection fails.
//!
//! A lookup runs in a task of its own, one at a time: requests that need a
//! connection meanwhile wait for that lookup (each within its own
//! `backend_timeout`), and a request that gives up never cancels it, so a
//! lookup slower than the timeout still ends and serves the requests after
//! it. A failed lookup is reported to the requests that waited for it; for
//! [`RETRY_AFTER`] after it, requests fail at once (no storm of lookups
//! while the sentinels elect a new primary), then the next one looks again.
//!
//! The node a lookup finds must say `master` to `ROLE` on the very
//! connection the checks will use (redis-rs asks it too, on a connection of
//! its own, before), so no check goes to a node that was a replica when the
//! connection was made. A node that answers `READONLY` later (demoted under
//! us, its clients not closed) makes the connection be dropped, as a broken
//! one does: the next request looks again.

use super::shared::SharedConnection;
use super::{RedisBackend, Source};
use crate::error::{BackendError, ConfigError};
use ::redis::aio::MultiplexedConnection;
use ::redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use ::redis::{
    AsyncConnectionConfig, ErrorKind, RedisConnectionInfo, RedisError, RedisResult, Role,
    ServerErrorKind,
};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// After a failed lookup, requests fail at once for this long before the
/// next one looks again.
const RETRY_AFTER: Duration = Duration::from_millis(50);
/// Timeout of a connect to the primary.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound on one whole lookup: the sentinels (redis-rs: 1 s connect and
/// 500 ms response timeouts each), the primary's `ROLE`, the connect.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// The monitored master of [`RedisBackend::sentinel_with`]: its name, as in
/// the sentinels' `sentinel monitor <name> …`, and how to log in to the
/// primary the sentinels name (the sentinels' own credentials go in their
/// URLs).
///
/// ```
/// use tiered_ratelimit::backend::SentinelMaster;
/// let master = SentinelMaster::new("mymaster").db(2).password("s3cret");
/// assert_eq!(master.name(), "mymaster");
/// ```
#[derive(Clone)]
pub struct SentinelMaster {
    name: String,
    db: i64,
    username: Option<String>,
    password: Option<String>,
}

impl SentinelMaster {
    /// The master named `name`, database 0, no credentials.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            db: 0,
            username: None,
            password: None,
        }
    }

    /// The database number on the primary (default 0).
    #[must_use]
    pub fn db(mut self, db: i64) -> Self {
        self.db = db;
        self
    }

    /// The ACL user on the primary (default: none, i.e. `default`).
    #[must_use]
    pub fn username(mut self, username: impl Into<String>) -> Self {
        self.username = Some(username.into());
        self
    }

    /// The primary's password (`requirepass`, or the ACL user's).
    #[must_use]
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// The master's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn node_info(&self) -> SentinelNodeConnectionInfo {
        let mut info = RedisConnectionInfo::default().set_db(self.db);
        if let Some(u) = &self.username {
            info = info.set_username(u);
        }
        if let Some(p) = &self.password {
            info = info.set_password(p);
        }
        SentinelNodeConnectionInfo::default().set_redis_connection_info(info)
    }
}

/// The password never shows.
impl fmt::Debug for SentinelMaster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelMaster")
            .field("name", &self.name)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

impl RedisBackend {
    /// A backend for the primary that the Redis Sentinels at `sentinels`
    /// (`["redis://127.0.0.1:26379", ...]`, with the sentinels' own
    /// credentials if they have any) name for `master_name`; see
    /// [`sentinel_with`](Self::sentinel_with) for a primary with a password
    /// or another database.
    ///
    /// Does not connect yet: the first request asks the sentinels. Requests
    /// share one multiplexed connection to the primary; once it fails
    /// (closed, refused, or the node answers `READONLY`: demoted) the next
    /// request asks the sentinels again, so after a failover limiting
    /// resumes on the promoted replica. Meanwhile requests follow the
    /// failure policy within the layer's `backend_timeout`. Checks go only
    /// to a node that answered `ROLE` with `master` on the connection they
    /// use; one demoted later refuses them with `READONLY`, which is a
    /// failure (never an answer) and makes the sentinels be asked again.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), tiered_ratelimit::ConfigError> {
    /// use tiered_ratelimit::backend::RedisBackend;
    /// let redis = RedisBackend::sentinel(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "mymaster",
    /// )?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::InvalidRedisUrl`] when there is no sentinel, a URL
    /// does not parse, or `master_name` is empty.
    pub fn sentinel<I, S>(sentinels: I, master_name: &str) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::sentinel_with(sentinels, SentinelMaster::new(master_name))
    }

    /// [`sentinel`](Self::sentinel), logging in to the primary as `master`
    /// says (database, user, password).
    ///
    /// # Errors
    /// As [`sentinel`](Self::sentinel).
    pub fn sentinel_with<I, S>(sentinels: I, master: SentinelMaster) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let urls: Vec<String> = sentinels
            .into_iter()
            .map(|s| s.as_ref().to_owned())
            .collect();
        let bad = |what: String| ConfigError::InvalidRedisUrl(format!("sentinel: {what}"));
        if urls.is_empty() {
            return Err(bad("at least one sentinel URL is required".to_owned()));
        }
        if master.name.is_empty() {
            return Err(bad("the master name is empty".to_owned()));
        }
        for url in &urls {
            ::redis::IntoConnectionInfo::into_connection_info(url.as_str())
                .map_err(|e| bad(format!("{url}: {e}")))?;
        }
        let client = SentinelClient::build(
            urls,
            master.name.clone(),
            Some(master.node_info()),
            SentinelServerType::Master,
        )
        .map_err(|e| bad(e.to_string()))?;
        Ok(Self::new(Source::Sentinel(Arc::new(Sentinel {
            master,
            client: tokio::sync::Mutex::new(client),
            conn: SharedConnection::new(LOOKUP_TIMEOUT, RETRY_AFTER),
        }))))
    }
}

/// The sentinels, and the connection to the primary they named.
pub(super) struct Sentinel {
    master: SentinelMaster,
    /// Locked by the one lookup running.
    client: tokio::sync::Mutex<SentinelClient>,
    /// The primary's connection, and the lookup that makes it
    /// (`shared.rs`: one at a time, bounded by [`LOOKUP_TIMEOUT`]).
    conn: Arc<SharedConnection>,
}

impl Sentinel {
    /// The master's name.
    pub(super) fn master_name(&self) -> &str {
        self.master.name()
    }

    /// The primary's connection: the shared one, or the outcome of a lookup
    /// (started here if none is running and the last one did not just fail).
    pub(super) async fn connection(
        self: &Arc<Self>,
    ) -> Result<MultiplexedConnection, BackendError> {
        self.conn
            .get(|| {
                let this = self.clone();
                async move { this.connect().await }
            })
            .await
    }

    /// Drops the shared connection (it broke, or the node was demoted): the
    /// next request looks the primary up again.
    pub(super) fn forget(&self) {
        self.conn.forget();
    }

    /// Asks the sentinels for the primary, connects to it, and checks on
    /// that connection that it is a primary.
    async fn connect(&self) -> RedisResult<MultiplexedConnection> {
        let client = self.client.lock().await.async_get_client().await?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            // The layer's backend_timeout bounds every call.
            .set_response_timeout(None);
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let role: Role = ::redis::cmd("ROLE").query_async(&mut conn).await?;
        match role {
            Role::Primary { .. } => Ok(conn),
            _ => Err(RedisError::from((
                ErrorKind::Server(ServerErrorKind::ReadOnly),
                "sentinel: the node named as primary is not one (yet)",
            ))),
        }
    }
}
