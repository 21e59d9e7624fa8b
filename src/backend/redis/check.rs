//! A request's check and refund on a single Redis or a Sentinel primary
//! (a cluster's go through `cluster.rs`): the script call built in one
//! buffer, its clock argument (Redis `TIME`, the deadline in Redis's clock,
//! or a test's manual clock), the calibration of Redis's clock from each
//! reply, and the refund mode of the cluster script.

use super::batch::{self, Entry};
use super::timed::with_timeout;
use super::{cluster, wire, RedisBackend};
use crate::backend::{CheckFuture, Shadow, TierCheck, TierRefund, Verdict};
use crate::error::BackendError;
use ::redis::Cmd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use wire::{CheckReply, ClockArg};

impl RedisBackend {
    /// The clock argument of a script call without a deadline: `""` for
    /// Redis `TIME`, or the manual clock (with the TTL slack, if any).
    pub(super) fn clock_arg(&self) -> ClockArg {
        match &self.clock {
            Some(c) => ClockArg::manual(c.now_us(), self.ttl_slack_ms),
            None => ClockArg::redis(),
        }
    }

    /// Sets the deadline budget: the layer's backend timeout. A check sent at
    /// local time `t` carries the deadline `t + budget` in Redis's clock (as
    /// calibrated by the previous reply); a script that starts after it
    /// (Redis was frozen, or the queue was long) writes nothing and answers
    /// "late", so a stall leaves no pile-up of charges for requests the app
    /// already answered by its failure policy.
    pub(crate) fn set_deadline_budget(&self, budget: Duration) {
        let us = u64::try_from(budget.as_micros()).unwrap_or(u64::MAX);
        self.inner.budget_us.store(us, Ordering::Relaxed);
    }

    pub(super) fn local_us(&self) -> i64 {
        self.local_us_at(Instant::now())
    }

    /// [`Self::local_us`] at `at`, an instant already read.
    fn local_us_at(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.inner.origin).as_micros())
            .unwrap_or(i64::MAX)
    }

    /// The check's `FCALL` (or `EVALSHA` where Redis has no Functions),
    /// built in one buffer: the function's name (the script's SHA1), the
    /// keys (each tier's, then the hour's set of refused keys and, with a
    /// tier in shadow mode, of shadow-limited keys, if any), the clock
    /// ([`Self::check_clock_arg`]) and one spec per tier
    /// ([`wire::TierSpec`]). `undo`: ask for the charges' undo values (for
    /// refunds by status).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_cmd(
        &self,
        sent: i64,
        checks: &[TierCheck],
        tiers: &[wire::ReplyTier],
        shadow: Shadow,
        live_of: &[u8],
        undo: bool,
        blocked: Option<(&str, &str)>,
    ) -> Cmd {
        let mut cmd = if self.inner.functions.load(Ordering::Relaxed) {
            let mut cmd = ::redis::cmd("FCALL");
            cmd.arg(&self.inner.library.function);
            cmd
        } else {
            let mut cmd = ::redis::cmd("EVALSHA");
            cmd.arg(self.inner.script.get_hash());
            cmd
        };
        // The shadow-limited set only with a tier in shadow mode: no other
        // tier can be shadow-limited, and each key costs Redis ~1 500
        // instructions a call (perf/README.md, "Redis CPU per check").
        let sets = match blocked {
            None => 0,
            Some(_) if shadow.0 == 0 => 1,
            Some(_) => 2,
        };
        // The candidates: a live check's packed in one key and one spec
        // when they can be (wire::packs), else each on its own key; the
        // packs at the end that their tier key holds, in their live
        // check's spec (wire::embedded_packs: no key and no spec).
        let live = checks.len().saturating_sub(live_of.len());
        let all_candidates = wire::packs(checks, live_of);
        let embedded = wire::embedded_packs(checks, &all_candidates, live);
        let (sent_candidates, embedded) = all_candidates.split_at(all_candidates.len() - embedded);
        cmd.arg(live + sent_candidates.len() + sets);
        for c in &checks[..live] {
            cmd.arg(c.key.as_str());
        }
        for s in sent_candidates {
            match s {
                wire::Sent::Own(i) => cmd.arg(checks[*i].key.as_str()),
                wire::Sent::Pack((of, _)) => cmd.arg(&wire::pack_key(checks, *of, live)[..]),
            };
        }
        if let Some((refused, shadow_limited)) = blocked {
            cmd.arg(refused);
            if sets == 2 {
                cmd.arg(shadow_limited);
            }
        }
        cmd.arg(self.check_clock_arg(sent).as_bytes());
        let undo = if undo { wire::UNDO } else { 0 };
        // The candidates last, never shadow (with the undo flag when the
        // others have it: the reply's layout is read under one set of
        // flags).
        for (i, (c, t)) in checks[..live].iter().zip(tiers).enumerate() {
            let shadow = if shadow.contains(i) { wire::SHADOW } else { 0 };
            let flags = shadow | undo | t.listing_flag();
            let pack = embedded.iter().find_map(|s| match s {
                wire::Sent::Pack(p) if p.0 == i => Some(p),
                _ => None,
            });
            match pack {
                Some(p) => wire::write_tier_with_pack(&mut cmd, c, flags, checks, p, i),
                None => wire::write_tier(&mut cmd, c, flags),
            }
        }
        for s in sent_candidates {
            match s {
                wire::Sent::Own(i) => {
                    if let (Some(c), Some(t)) = (checks.get(*i), tiers.get(*i)) {
                        let of = live_of.get(*i - live).copied().unwrap_or(0);
                        wire::write_candidate(&mut cmd, c, undo | t.listing_flag(), of.into());
                    }
                }
                wire::Sent::Pack(pack) => wire::write_pack(&mut cmd, checks, pack, pack.0),
            }
        }
        cmd
    }

    /// The clock argument of a standalone check sent at local µs `sent`:
    /// the test clock, or the deadline in Redis's clock, or Redis `TIME`
    /// alone before calibration or without a budget.
    fn check_clock_arg(&self, sent: i64) -> ClockArg {
        if self.clock.is_some() {
            return self.clock_arg();
        }
        match self.deadline_us(sent) {
            Some(deadline) => ClockArg::deadline(deadline),
            None => ClockArg::redis(),
        }
    }

    /// The deadline in Redis's clock (µs) of a check sent at local µs
    /// `sent`: `sent` + the budget, moved to Redis's clock by the last
    /// calibration; none with a test clock, without a budget, or before
    /// the first reply.
    pub(super) fn deadline_us(&self, sent: i64) -> Option<i64> {
        let budget = self.inner.budget_us.load(Ordering::Relaxed);
        let offset = self.inner.offset_us.load(Ordering::Relaxed);
        if self.clock.is_some() || budget == 0 || offset == i64::MIN {
            return None;
        }
        let d = sent
            .saturating_add(offset)
            .saturating_add(i64::try_from(budget).unwrap_or(i64::MAX));
        Some(d.max(1))
    }

    /// Records Redis's clock from a reply to a check sent at local `sent`.
    pub(super) fn calibrate(&self, sent: i64, redis_now: i64) {
        let mid = sent + (self.local_us() - sent) / 2;
        self.inner
            .offset_us
            .store(redis_now - mid, Ordering::Relaxed);
    }

    /// A check of every tier in one script call, bounded by `timeout`
    /// (locally from its first poll; in Redis's clock from `sent`, the
    /// caller's reading of the clock, now); the command is built now, so
    /// `checks` are only borrowed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_check(
        &self,
        checks: &[TierCheck],
        shadow: Shadow,
        live_of: &[u8],
        undo: bool,
        blocked: Option<(&str, &str)>,
        timeout: Option<Duration>,
        sent: Instant,
    ) -> CheckFuture {
        let this = self.clone();
        if self.is_cluster() {
            // The blocked-keys set lives in its own slot: on a cluster the
            // in-process sketch is the top-N source.
            let checks = checks.to_vec();
            let live_of = live_of.to_vec();
            return Box::pin(with_timeout(
                timeout,
                cluster::check(this, checks, shadow, live_of),
            ));
        }
        let sent_us = self.local_us_at(sent);
        let tiers: wire::ReplyTiers = (checks.iter().enumerate())
            .map(|(i, c)| wire::ReplyTier::new(c, listing_flag(checks, i)))
            .collect();
        let cmd = self.check_cmd(sent_us, checks, &tiers, shadow, live_of, undo, blocked);
        // The reply's commit is read as the live checks': a candidate's
        // denial never undoes it (its own charge the engine ignores).
        let read_as = crate::backend::candidates_observe(shadow, checks.len(), live_of.len());
        Box::pin(with_timeout(
            timeout,
            this.run_check(cmd, sent_us, tiers, batch::flags(undo), read_as),
        ))
    }

    /// The check's call and the parse of its reply. An `async` block, not
    /// an `async fn`: an `async fn` lays its arguments out twice in its
    /// future (once as arguments, once as locals), and the tiers are
    /// hundreds of bytes (`a_check_future_stays_small`).
    #[allow(clippy::manual_async_fn)]
    fn run_check(
        self,
        mut cmd: Cmd,
        sent: i64,
        mut tiers: wire::ReplyTiers,
        flags: u8,
        shadow: Shadow,
    ) -> impl std::future::Future<Output = Result<Verdict, BackendError>> + Send {
        async move {
            // Group commit (batch.rs): sent now when no call is in flight
            // (`_lead`, dropped when this call is over or given up, lets
            // the queued ones go), else queued for the next call.
            let _lead = match self.enter(&mut cmd, &mut tiers, flags, shadow) {
                Entry::Send(lead) => lead,
                Entry::Queued(rx) => return batch::queued(rx).await,
            };
            let mut conn = self.connection().await?;
            let wire::CheckValues(reply) = self
                .eval(&cmd, &self.inner.script, &mut conn)
                .await
                .map_err(|e| self.error(e))?;
            if self.clock.is_none() {
                if let Some(&now) = reply.first() {
                    self.calibrate(sent, now);
                }
            }
            self.verdict(&reply, &tiers, flags, shadow)
        }
    }

    /// A check's call, as [`Self::run_check`] makes it, for a request that
    /// waited in the group commit queue and goes alone.
    pub(super) async fn call_check(
        &self,
        cmd: Cmd,
        sent: i64,
        tiers: &wire::ReplyTiers,
        flags: u8,
        shadow: Shadow,
    ) -> Result<Verdict, BackendError> {
        let mut conn = self.connection().await?;
        let wire::CheckValues(reply) = self
            .eval(&cmd, &self.inner.script, &mut conn)
            .await
            .map_err(|e| self.error(e))?;
        if self.clock.is_none() {
            if let Some(&now) = reply.first() {
                self.calibrate(sent, now);
            }
        }
        self.verdict(&reply, tiers, flags, shadow)
    }

    /// The verdict of one request's check reply (`reply`), or a timeout
    /// when it reached Redis after its deadline (nothing was written).
    pub(super) fn verdict(
        &self,
        reply: &[i64],
        tiers: &wire::ReplyTiers,
        flags: u8,
        shadow: Shadow,
    ) -> Result<Verdict, BackendError> {
        match wire::parse_check(reply, tiers, flags, shadow)? {
            CheckReply::Decided(v) => Ok(v),
            CheckReply::Late => {
                let budget = self.inner.budget_us.load(Ordering::Relaxed);
                Err(BackendError::Timeout(Duration::from_micros(budget)))
            }
        }
    }
}

impl RedisBackend {
    /// Gives back charges with the `refund` mode of the cluster script
    /// (`lua/refund.lua`), reading the clock now: refill since the charge
    /// counts. On a single Redis one call; on a cluster one call per key.
    pub(crate) async fn refund(&self, refunds: &[TierRefund]) -> Result<(), BackendError> {
        if refunds.is_empty() {
            return Ok(());
        }
        if self.is_cluster() {
            return cluster::refund(self, refunds).await;
        }
        let mut cmd = ::redis::cmd("EVALSHA");
        cmd.arg(self.inner.refund_script.get_hash())
            .arg(refunds.len());
        for r in refunds {
            cmd.arg(r.check.key.as_str());
        }
        cmd.arg("refund").arg(self.clock_arg().as_bytes());
        for r in refunds {
            cmd.arg(&wire::refund_args(&r.check, &r.charge, r.debt)[..]);
        }
        let mut conn = self.connection().await?;
        self.eval::<i64>(&cmd, &self.inner.refund_script, &mut conn)
            .await
            .map(|_| ())
            .map_err(|e| self.error(e))
    }
}

/// Check `i`'s [`wire::REPEAT`] or [`wire::SHORT`] flag (see
/// [`wire::listing_flag`]); 0 past the end.
fn listing_flag(checks: &[TierCheck], i: usize) -> u8 {
    match (checks.get(..i), checks.get(i)) {
        (Some(earlier), Some(c)) => {
            wire::listing_flag(earlier.iter().map(|e| e.key.as_str()), &c.key, &c.limit)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    /// A check's future is built and boxed per request: it must stay small
    /// (a deadpool checkout future inside it once made it 14.8 KB, moved and
    /// copied on every request).
    #[tokio::test]
    async fn a_check_future_stays_small() {
        let b = super::super::RedisBackend::from_url("redis://127.0.0.1:1/").unwrap();
        let fut = b.start_check(
            &[],
            crate::backend::Shadow::NONE,
            &[],
            true,
            None,
            Some(std::time::Duration::from_secs(1)),
            std::time::Instant::now(),
        );
        let size = std::mem::size_of_val(&*fut);
        assert!(size <= 1024, "{size} bytes");
        eprintln!("a check's future: {size} bytes");
    }
}
