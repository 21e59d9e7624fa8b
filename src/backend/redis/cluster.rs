//! Redis Cluster: one script call per hash slot, all slots at once, and a
//! refund when another slot denies.
//!
//! A Lua script may only touch keys of one hash slot, and the tiers of a
//! request (say `global`, `ip`, `user`) live in different slots. So:
//!
//! 1. Each tier's key becomes `{<key>}`: the whole layer key is the hash tag,
//!    so the slot is chosen by us (prefix, tier name and the escaped key
//!    part, which never holds `{` or `}`), never by a request.
//! 2. The tiers are grouped by slot. Each group is one `EVALSHA` of
//!    `lua/cluster.lua` in `check` mode, with the all-or-nothing commit rule
//!    among its own tiers; every group's call is sent at once, so a request
//!    costs one round trip of wall time.
//! 3. If an enforced tier of one group denied the request (or a group
//!    failed), every group that committed gets a `refund` call giving back
//!    exactly what it charged, minus what refill or a new window has already
//!    absorbed: a refund never frees more than the request took, so the
//!    cluster never admits more than a single Redis would; a denied request
//!    may hold capacity on the other slots for the round trip until its
//!    refund. The verdict is returned once the refunds are done.
//!
//! Steps 2-3 run in a task of their own when there are several groups, so a
//! caller that gives up (the layer's `backend_timeout`) never leaves a charge
//! without its refund. A request whose tiers share one slot is one call, no
//! refund, as on a single Redis.
//!
//! The calls go through [`Router`] (`router.rs`: our own slot map and
//! per-primary connections, `MOVED`/`ASK`/`TRYAGAIN` followed there), or
//! for a deadpool cluster pool through redis-rs's cluster connection.
//!
//! `NOSCRIPT` is answered per node: the `EVALSHA` that failed is sent again
//! as `EVAL` with the same keys, so it reaches the same node (by slot), runs,
//! and leaves the script cached there. Nothing is loaded on other nodes.

use super::router::{slot_of, Router};
use super::wire::{self, CheckReply, ClockArg, CLUSTER_LUA};
use super::RedisBackend;
use crate::algorithm::TierDecision;
use crate::backend::{Charge, Shadow, TierCheck, TierRefund, Verdict};
use crate::error::BackendError;
use crate::util::throttle::LogThrottle;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::Slot;
use ::redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Duration;

/// Failed refunds, by reason (`connection`, `script`).
pub(crate) const REFUND_FAILURES: &str = "tiered_ratelimit_refund_failures_total";

/// How script calls reach the cluster.
pub(super) enum Via {
    /// Our own router ([`RedisBackend::cluster`]).
    Router(Arc<Router>),
    /// redis-rs's cluster connection ([`RedisBackend::from_cluster_pool`]).
    Conn(ClusterConnection),
}

/// How a candidate quota's key suffix starts (`engine/candidates.rs`).
const CANDIDATE_TAG: &str = "{c:";

/// The Redis key of a layer key in a cluster: the whole key as hash tag.
/// A penalty box's key (`<key>{pb}`) keeps its tier key's tag, so both
/// are checked in one call: `{<key>}{pb}`; so do an override's read
/// (`{<key>}{ov}`) and a candidate quota's (`{<key>}{c:80/1m}`).
pub(crate) fn cluster_key(key: &str) -> String {
    for suffix in [
        crate::algorithm::PENALTY_KEY_SUFFIX,
        crate::backend::override_rule::KEY_SUFFIX,
    ] {
        if let Some(tier) = key.strip_suffix(suffix) {
            let mut k = cluster_key(tier);
            k.push_str(suffix);
            return k;
        }
    }
    // A candidate quota's key, `<tier key>{c:<quota>}`: its tier key's tag.
    if let Some(at) = key
        .ends_with('}')
        .then(|| key.rfind(CANDIDATE_TAG))
        .flatten()
    {
        let mut k = cluster_key(&key[..at]);
        k.push_str(&key[at..]);
        return k;
    }
    let mut k = String::with_capacity(key.len() + 2);
    k.push('{');
    k.push_str(key);
    k.push('}');
    k
}

/// One slot's share of a request: indices into the checks.
struct Group {
    tiers: Vec<usize>,
}

/// One slot's answer: its tiers' decisions and, when the slot committed,
/// their charges (see [`wire::parse_check`]).
type GroupReply = Verdict;

/// Whether a slot's call charged its tiers.
fn committed(r: &GroupReply) -> bool {
    !r.charges.is_empty()
}

/// Everything one request's cluster check needs, owned (it may run in a task).
struct Job {
    backend: RedisBackend,
    via: Via,
    checks: Vec<TierCheck>,
    keys: Vec<String>,
    shadow: Shadow,
    /// The last `live_of.len()` checks are candidate quotas, each of the
    /// live check at its index here (`docs/rollout.md`, "Candidate quotas").
    live_of: Vec<u8>,
    clock: ClockArg,
    groups: Vec<Group>,
}

pub(super) async fn check(
    backend: RedisBackend,
    checks: Vec<TierCheck>,
    shadow: Shadow,
    live_of: Vec<u8>,
) -> Result<Verdict, BackendError> {
    let keys: Vec<String> = checks.iter().map(|c| cluster_key(&c.key)).collect();
    let mut slots: Vec<Slot> = Vec::new();
    let mut groups: Vec<Group> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let slot = Slot::for_key(k.as_bytes());
        match slots.iter().position(|s| *s == slot) {
            Some(g) => groups[g].tiers.push(i),
            None => {
                slots.push(slot);
                groups.push(Group { tiers: vec![i] });
            }
        }
    }
    let via = backend.cluster_via().await?;
    let job = Job {
        clock: backend.clock_arg(),
        backend,
        via,
        checks,
        keys,
        shadow,
        live_of,
        groups,
    };
    if job.groups.len() <= 1 {
        return job.run().await;
    }
    tokio::spawn(job.run())
        .await
        .map_err(|e| BackendError::Task(std::sync::Arc::new(e)))?
}

impl Job {
    async fn run(self) -> Result<Verdict, BackendError> {
        let calls = self.groups.iter().map(|g| self.check_group(g)).collect();
        let replies = join_all(calls).await;

        let mut decisions: Vec<Option<TierDecision>> = vec![None; self.checks.len()];
        let mut charges: Vec<Option<Charge>> = vec![None; self.checks.len()];
        let mut now_us = None;
        let mut error = None;
        let mut charged = Vec::new();
        for (g, reply) in self.groups.iter().zip(replies) {
            match reply {
                Ok(r) => {
                    if g.tiers.contains(&0) {
                        now_us = Some(r.now_us);
                    }
                    for (&i, d) in g.tiers.iter().zip(&r.decisions) {
                        decisions[i] = Some(*d);
                    }
                    for (&i, c) in g.tiers.iter().zip(&r.charges) {
                        // A cluster reports no next-pass wait (see
                        // `Charge::next_after_us`).
                        charges[i] = c.map(|c| Charge {
                            next_after_us: 0,
                            ..c
                        });
                    }
                    if committed(&r) {
                        charged.push((g, r));
                    }
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        let decisions: Vec<TierDecision> = decisions.into_iter().flatten().collect();
        let live = self.live();
        let complete = error.is_none() && decisions.len() == self.checks.len();
        let commit = complete && self.shadow.commits(&decisions[..live]);
        // What stays charged: the live checks when the request commits; a
        // candidate when it allowed and every enforced live check but its
        // own did (each slot charged it by that rule among its own checks).
        let keep = |i: usize| match i.checked_sub(live) {
            None => commit,
            Some(j) => {
                complete
                    && self.live_of.get(j).is_some_and(|&of| {
                        decisions[..live].iter().enumerate().all(|(k, d)| {
                            d.allowed || self.shadow.contains(k) || k == usize::from(of)
                        })
                    })
            }
        };
        let undo: Vec<bool> = (0..self.checks.len()).map(|i| !keep(i)).collect();
        let to_refund: Vec<&(&Group, GroupReply)> = charged
            .iter()
            .filter(|(g, r)| {
                g.tiers
                    .iter()
                    .zip(&r.charges)
                    .any(|(&i, c)| c.is_some() && undo[i])
            })
            .collect();
        if !to_refund.is_empty() {
            let refunds = to_refund
                .iter()
                .map(|(g, r)| self.refund_group(g, r, &undo))
                .collect();
            for result in join_all(refunds).await {
                if let Err(e) = result {
                    refund_failed(&e);
                }
            }
        }
        if let Some(e) = error {
            return Err(e);
        }
        Ok(Verdict {
            now_us: now_us.unwrap_or(0),
            decisions,
            charges: if commit {
                // A candidate's charge is never the caller's to refund.
                charges
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| c.filter(|_| i < live))
                    .collect()
            } else {
                Vec::new()
            },
        })
    }

    /// The number of live checks (the candidates follow them).
    fn live(&self) -> usize {
        self.checks.len().saturating_sub(self.live_of.len())
    }

    async fn check_group(&self, g: &Group) -> Result<GroupReply, BackendError> {
        let mut specs = Vec::with_capacity(g.tiers.len());
        let mut tiers = wire::ReplyTiers::new();
        // The group's shadow tiers, by their place in the group; its
        // candidates, with their live check's place.
        let mut shadow = 0;
        let mut candidates: smallvec::SmallVec<[(usize, Option<usize>); 4]> =
            smallvec::SmallVec::new();
        let live = self.live();
        for (j, &i) in g.tiers.iter().enumerate() {
            let c = &self.checks[i];
            // Always the undo values: a cross-slot denial refunds this slot.
            let earlier = g.tiers[..j].iter().map(|&k| self.keys[k].as_str());
            let mut flags = wire::UNDO | wire::listing_flag(earlier, &self.keys[i], &c.limit);
            if let Some(&of) = i.checked_sub(live).and_then(|k| self.live_of.get(k)) {
                // Its key shares its live check's hash tag: the same slot.
                let at = g.tiers.iter().position(|&k| k == usize::from(of));
                // (Without its live check here, a place past the group's:
                // then it needs every enforced check to allow.)
                specs.push(wire::TierSpec::flagged(
                    c,
                    wire::candidate_flags(flags, at.unwrap_or(g.tiers.len())),
                ));
                tiers.push(wire::ReplyTier::new(c, flags));
                candidates.push((j, at));
                continue;
            }
            if self.shadow.contains(i) {
                flags |= wire::SHADOW;
                // j <= i < 64.
                shadow |= 1 << j;
            }
            specs.push(wire::TierSpec::new(c, flags));
            tiers.push(wire::ReplyTier::new(c, flags));
        }
        let keys: Vec<&str> = g.tiers.iter().map(|&i| self.keys[i].as_str()).collect();
        let reply: Vec<i64> = self
            .invoke(&keys, "check", self.clock, &specs)
            .await
            .map_err(|e| self.error(e))?;
        if candidates.is_empty() {
            return match wire::parse_check(
                &reply,
                &tiers,
                wire::SHORT | wire::UNDO,
                Shadow(shadow),
            )? {
                CheckReply::Decided(v) => Ok(v),
                CheckReply::Late => Err(BackendError::Reply(
                    "a cluster check without a deadline answered late".to_owned(),
                )),
            };
        }
        // Read as if every check committed (each allowing one's undo
        // value), then each charge kept as the script made it: the live
        // checks' when they commit, a candidate's by its own rule.
        match wire::parse_check(&reply, &tiers, wire::SHORT | wire::UNDO, Shadow(u64::MAX))? {
            CheckReply::Decided(mut v) => {
                let is_candidate = |j: usize| candidates.iter().any(|&(k, _)| k == j);
                let enforced_ok = |except: Option<usize>| {
                    v.decisions.iter().enumerate().all(|(k, d)| {
                        d.allowed
                            || Shadow(shadow).contains(k)
                            || is_candidate(k)
                            || Some(k) == except
                    })
                };
                let commit = enforced_ok(None);
                let kept: Vec<bool> = (0..v.decisions.len())
                    .map(|j| match candidates.iter().find(|&&(k, _)| k == j) {
                        Some(&(_, at)) => enforced_ok(at),
                        None => commit,
                    })
                    .collect();
                for (c, keep) in v.charges.iter_mut().zip(kept) {
                    if !keep {
                        *c = None;
                    }
                }
                if v.charges.iter().all(Option::is_none) {
                    v.charges.clear();
                }
                Ok(v)
            }
            CheckReply::Late => Err(BackendError::Reply(
                "a cluster check without a deadline answered late".to_owned(),
            )),
        }
    }

    /// Gives back the charges of `g` whose check `undo` marks.
    async fn refund_group(
        &self,
        g: &Group,
        r: &GroupReply,
        undo: &[bool],
    ) -> Result<(), BackendError> {
        let mut keys = Vec::new();
        let mut nums = Vec::new();
        for (&i, c) in g.tiers.iter().zip(&r.charges) {
            // A shadow tier that denied was not charged.
            if let (Some(charge), true) = (c, undo[i]) {
                keys.push(self.keys[i].as_str());
                nums.extend(wire::refund_args(&self.checks[i], charge, false));
            }
        }
        if keys.is_empty() {
            return Ok(());
        }
        // The refund reads its own clock: refill since the charge counts.
        let clock = self.backend.clock_arg();
        // The refund answers one integer (the keys it gave back), not the
        // check's list: read as a list, every refund that landed was
        // counted and logged as failed.
        invoke::<i64, i64>(&self.backend, &self.via, &keys, "refund", &clock, &nums)
            .await
            .map(|_| ())
            .map_err(|e| self.error(e))
    }

    /// `EVALSHA`, and on `NOSCRIPT` the same call as `EVAL`: routed by the
    /// keys' slot to the node that lacks the script, which caches it.
    async fn invoke<A: ::redis::ToRedisArgs + Sync>(
        &self,
        keys: &[&str],
        mode: &str,
        clock: ClockArg,
        args: &[A],
    ) -> RedisResult<Vec<i64>> {
        invoke(&self.backend, &self.via, keys, mode, &clock, args).await
    }

    fn error(&self, e: RedisError) -> BackendError {
        self.backend.error(e)
    }
}

/// Refunds (by response status, or a priced request's settles): one
/// `refund` call per hash slot, all at once. Each tier key is its own slot,
/// so a slot's call carries every refund of its key in the batch: a hot key
/// whose settles the instance batched (`settle.rs`) costs one call.
pub(super) async fn refund(
    backend: &RedisBackend,
    refunds: &[TierRefund],
) -> Result<(), BackendError> {
    let via = backend.cluster_via().await?;
    let clock = backend.clock_arg();
    let mut slots: Vec<(u16, Vec<String>, Vec<i64>)> = Vec::new();
    for r in refunds {
        let key = cluster_key(&r.check.key);
        let slot = super::router::slot_of(key.as_bytes());
        let nums = wire::refund_args(&r.check, &r.charge, r.debt);
        match slots.iter_mut().find(|s| s.0 == slot) {
            Some((_, keys, args)) => {
                keys.push(key);
                args.extend(nums);
            }
            None => slots.push((slot, vec![key], nums.into_iter().collect())),
        }
    }
    let calls = slots
        .iter()
        .map(|(_, keys, nums)| {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let (via, clock) = (&via, &clock);
            async move {
                invoke::<i64, i64>(backend, via, &keys, "refund", clock, nums)
                    .await
                    .map(|_| ())
                    .map_err(|e| backend.error(e))
            }
        })
        .collect();
    let mut first = Ok(());
    for r in join_all(calls).await {
        if let Err(e) = r {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// `EVALSHA` of the cluster script, and on `NOSCRIPT` the same call as
/// `EVAL` to the same node, which caches it. Through [`Router::call`]
/// (which also follows `MOVED`/`ASK` and retries `TRYAGAIN`), or for a
/// deadpool cluster pool through redis-rs's cluster connection.
async fn invoke<T: ::redis::FromRedisValue, A: ::redis::ToRedisArgs + Sync>(
    backend: &RedisBackend,
    via: &Via,
    keys: &[&str],
    mode: &str,
    clock: &ClockArg,
    args: &[A],
) -> RedisResult<T> {
    let script = &backend.inner.script;
    let build = |eval: bool| -> Cmd {
        let mut cmd = super::peek::script_cmd(eval, script, CLUSTER_LUA);
        cmd.arg(keys.len())
            .arg(keys)
            .arg(mode)
            .arg(clock.as_bytes())
            .arg(args);
        cmd
    };
    match via {
        Via::Router(router) => {
            // Every key of one call is in one slot.
            let slot = keys.first().map_or(0, |k| slot_of(k.as_bytes()));
            let reply = router.call(slot, build).await?;
            Ok(::redis::from_redis_value(reply)?)
        }
        Via::Conn(conn) => {
            let mut conn = conn.clone();
            match build(false).query_async(&mut conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    build(true).query_async(&mut conn).await
                }
                other => other,
            }
        }
    }
}

/// One command (not a script call) to the node holding `key`: through the
/// router, or the pool's cluster connection.
pub(super) async fn command<T: ::redis::FromRedisValue>(
    via: &Via,
    key: &str,
    cmd: &Cmd,
) -> RedisResult<T> {
    match via {
        Via::Router(router) => {
            let reply = router
                .call(slot_of(key.as_bytes()), |_| cmd.clone())
                .await?;
            Ok(::redis::from_redis_value(reply)?)
        }
        Via::Conn(conn) => cmd.query_async(&mut conn.clone()).await,
    }
}

/// A refund that did not land: the denied request keeps its charge on that
/// slot's tiers (capacity is under-used until it refills; nothing is ever
/// over-admitted). Logged at most once a second, counted always.
fn refund_failed(e: &BackendError) {
    metrics::counter!(REFUND_FAILURES, "kind" => e.kind()).increment(1);
    static LOG: OnceLock<LogThrottle> = OnceLock::new();
    let log = LOG.get_or_init(|| LogThrottle::new(Duration::from_secs(1)));
    if let Some(suppressed) = log.permit() {
        tracing::warn!(
            error = %e,
            suppressed,
            "rate limiter: cross-slot refund failed; a denied request keeps its charge on one slot"
        );
    }
}

/// Polls every future until all are done; outputs in order.
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futures.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_layer_key_is_the_hash_tag() {
        assert_eq!(cluster_key("rl:user:alice"), "{rl:user:alice}");
        // Key parts never hold braces (they are escaped), so the tag is the
        // whole key: same slot as the plain key, chosen by nothing else.
        for k in [
            "rl:global:all",
            "rl:endpoint:GET%20/users/%7Bid%7D",
            "p:ip:2001:db8::/64",
        ] {
            assert_eq!(Slot::for_key(cluster_key(k)), Slot::for_key(k));
        }
        assert_ne!(
            Slot::for_key(cluster_key("rl:user:%7Bx%7D")),
            Slot::for_key("x")
        );
        // A candidate quota's key keeps its tier key's tag.
        assert_eq!(
            cluster_key("rl:user:alice{c:80/1m,burst=100}"),
            "{rl:user:alice}{c:80/1m,burst=100}"
        );
    }
}
