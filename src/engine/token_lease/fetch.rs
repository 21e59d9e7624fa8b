//! The background half of lease mode: taking a key's next lease (one
//! ordinary check of cost k through `Backend::start_check`, single flight per
//! key) and returning unspent tokens through the refund of the lease's charge
//! (`Backend::refund`, `lua/refund.lua`).

use super::entry::Entry;
use super::pool::{Inner, LEASE_CALLS, LEASE_TOKENS};
use crate::backend::{Check, Shadow, TierCheck, TierRefund};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Inner {
    pub(super) async fn return_all(self: Arc<Inner>) -> u64 {
        // Leases being taken land first (bounded by the backend timeout).
        let deadline = tokio::time::Instant::now() + self.timeout + Duration::from_millis(50);
        while self.busy.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut refunds = Vec::new();
        let mut total = 0;
        for shard in self.shards.iter() {
            let map = shard
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for e in map.values() {
                e.expires_us.store(0, Ordering::Release);
                let n = e.tokens.swap(0, Ordering::AcqRel);
                if n == 0 {
                    continue;
                }
                total += n;
                if let Some(r) = e.refund(n) {
                    refunds.push(r);
                }
            }
        }
        self.give_back(refunds, total).await;
        total
    }

    pub(super) async fn give_back(&self, refunds: Vec<TierRefund>, tokens: u64) {
        if tokens == 0 {
            return;
        }
        self.returned.fetch_add(tokens, Ordering::Relaxed);
        metrics::counter!(LEASE_TOKENS, "op" => "returned").increment(tokens);
        if refunds.is_empty() {
            return;
        }
        if let Err(e) = self.backend.refund_charges(refunds).await {
            tracing::debug!(target: crate::engine::LOG_TARGET, error = %e, "token lease return failed");
        }
    }

    /// Takes a lease of `k` tokens for `entry` (the background task), at
    /// most one retry with a quarter of what the shared bucket has left.
    pub(super) async fn fetch(self: Arc<Inner>, entry: Arc<Entry>, mut k: u64, started: u64) {
        for _ in 0..2 {
            self.calls.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(LEASE_CALLS).increment(1);
            let check = TierCheck {
                key: entry.key.to_string(),
                limit: entry.limit,
                cost: k,
                home: entry.home,
            };
            let result = match self.backend.start_check(
                std::slice::from_ref(&check),
                Shadow::NONE,
                &[],
                true,
                None,
                Some(self.timeout),
                std::time::Instant::now(),
            ) {
                Check::Ready(r) => r,
                Check::Pending(f) => f.await,
            };
            let v = match result {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(target: crate::engine::LOG_TARGET, error = %e, "token lease take failed");
                    return;
                }
            };
            let Some(d) = v.decisions.first() else { return };
            if d.allowed {
                let charge = v.charges.first().copied().flatten();
                entry.install(&self, k, charge, d, started).await;
                // The entry was replaced meanwhile (the quota changed) or
                // dropped: no request will spend these, hand them back.
                let current = self
                    .shard(&entry.key)
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get(&*entry.key)
                    .is_some_and(|e| Arc::ptr_eq(e, &entry));
                if !current {
                    entry.expires_us.store(0, Ordering::Release);
                    let n = entry.tokens.swap(0, Ordering::AcqRel);
                    let refund = entry.refund(n);
                    self.give_back(refund.into_iter().collect(), n).await;
                }
                return;
            }
            entry.seen.store(d.remaining, Ordering::Release);
            let again = k.min(d.remaining / 4);
            if again < entry.lease.min || again == 0 {
                return;
            }
            k = again;
        }
    }
}
