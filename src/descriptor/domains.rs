//! [`DomainLimiters`]: several domains served by one process, one
//! [`DescriptorLimiter`] each; a domain without one is answered OK with no
//! limit, as Envoy's reference service answers it.

use super::limiter::{Answer, Code, DescriptorLimiter, DescriptorStatus, RequestError};
use super::matching::Descriptor;
use crate::error::ConfigError;
use crate::handle::RateLimitHandle;
use std::collections::HashMap;
use std::sync::Arc;

/// One limiter per domain. Cloning is cheap.
#[derive(Debug, Clone, Default)]
pub struct DomainLimiters {
    by_domain: Arc<HashMap<Arc<str>, DescriptorLimiter>>,
}

impl DomainLimiters {
    /// The limiters, one per domain.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] naming a domain two limiters serve.
    pub fn new(limiters: impl IntoIterator<Item = DescriptorLimiter>) -> Result<Self, ConfigError> {
        let mut by_domain = HashMap::new();
        for l in limiters {
            let domain: Arc<str> = Arc::from(l.domain());
            if by_domain.insert(domain.clone(), l).is_some() {
                return Err(ConfigError::Policy(format!(
                    "domain: \"{domain}\" is configured twice"
                )));
            }
        }
        Ok(Self {
            by_domain: Arc::new(by_domain),
        })
    }

    /// The limiter of `domain`.
    pub fn get(&self, domain: &str) -> Option<&DescriptorLimiter> {
        self.by_domain.get(domain)
    }

    /// The domains served, sorted.
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.by_domain.keys().map(|k| &**k).collect();
        d.sort_unstable();
        d
    }

    /// Handles on every domain's engine (to return leases at shutdown).
    pub fn handles(&self) -> Vec<RateLimitHandle> {
        self.by_domain
            .values()
            .map(DescriptorLimiter::handle)
            .collect()
    }

    /// Decides a request as its domain's limiter does
    /// ([`DescriptorLimiter::check`]); a domain not served here is answered
    /// `Ok` with no limit on every descriptor, without a backend call.
    ///
    /// # Errors
    /// [`RequestError::EmptyDomain`], [`RequestError::NoDescriptors`], and
    /// the domain's limiter's.
    pub async fn check(
        &self,
        domain: &str,
        descriptors: &[Descriptor<'_>],
        hits_addend: u64,
    ) -> Result<Answer, RequestError> {
        if domain.is_empty() {
            return Err(RequestError::EmptyDomain);
        }
        if descriptors.is_empty() {
            return Err(RequestError::NoDescriptors);
        }
        match self.by_domain.get(domain) {
            Some(l) => l.check(domain, descriptors, hits_addend).await,
            None => Ok(Answer {
                overall: Code::Ok,
                statuses: descriptors
                    .iter()
                    .map(|_| DescriptorStatus::bare(Code::Ok))
                    .collect(),
                headers: None,
                fail_open: false,
            }),
        }
    }
}

#[cfg(feature = "envoy-yaml")]
impl super::ReferenceConfig {
    /// One limiter per domain on `backend`, each on the engine `builder()`
    /// builds (failure policy, timeout, header style, …) with the key prefix
    /// `<key_prefix>:<domain>` (a domain that is not printable ASCII
    /// without braces, or too long, as `d<hash>`); `shadow_mode` is the
    /// reference's `SHADOW_MODE`.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] naming the file and domain: more than
    /// [`MAX_TIERS`](crate::MAX_TIERS) limited rules in one domain, and
    /// whatever [`DescriptorLimiter::new`] refuses.
    pub fn limiters(
        self,
        backend: &crate::backend::Backend,
        key_prefix: &str,
        shadow_mode: bool,
        builder: impl Fn() -> crate::engine::EngineBuilder,
    ) -> Result<DomainLimiters, ConfigError> {
        let mut limiters = Vec::with_capacity(self.domains.len());
        for d in self.domains {
            let readable = d.domain.len() + key_prefix.len() < 64
                && d.domain
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}');
            let prefix = if readable {
                format!("{key_prefix}:{}", d.domain)
            } else {
                format!(
                    "{key_prefix}:d{:016x}",
                    xxhash_rust::xxh3::xxh3_64(d.domain.as_bytes())
                )
            };
            let b = builder().backend(backend.clone()).key_prefix(prefix);
            let file = d.file.display().to_string();
            let domain = d.domain.clone();
            let limiter = DescriptorLimiter::build(d.domain, d.rules, Some(d.tree), shadow_mode, b)
                .map_err(|e| ConfigError::Policy(format!("{file}: domain \"{domain}\": {e}")))?;
            limiters.push(limiter);
        }
        DomainLimiters::new(limiters)
    }
}
