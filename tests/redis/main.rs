//! Redis deployments and faults: standalone, Cluster, Sentinel, a proxy that fails, the deny cache, lease mode.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod deny_cache_equivalence;
mod failover_proxy;
mod faults;
mod group_commit;
mod lease_mode;
mod redis_backend;
mod sentinel;
