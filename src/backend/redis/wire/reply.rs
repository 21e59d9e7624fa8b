//! The scripts' reply: read into [`CheckValues`] and parsed by
//! [`parse_check`] (a bucket's one-number state to a decision with the
//! model's arithmetic).

use super::*;
use crate::algorithm::{Limit, TierDecision};
use crate::backend::{Charge, Shadow, TierCheck, Verdict};
use crate::error::BackendError;

/// A check reply, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::backend::redis) enum CheckReply {
    /// The script started after the call's deadline and wrote nothing.
    Late,
    /// The decisions; [`Verdict::charges`] is empty when nothing was
    /// charged, else one entry per tier (`None` for a tier that denied).
    Decided(Verdict),
}

/// One tier of a check as its reply is read: the limit and the cost the
/// call sent for it.
#[derive(Debug, Clone, Copy)]
pub(in crate::backend::redis) struct ReplyTier {
    /// The tier's algorithm and parameters, as sent.
    pub(in crate::backend::redis) limit: Limit,
    /// The cost sent (tokens).
    pub(in crate::backend::redis) cost: u64,
    /// Sent [`REPEAT`](super::REPEAT) (its key listed before in the call):
    /// it answers in full even as a bucket.
    pub(in crate::backend::redis) repeat: bool,
}

impl ReplyTier {
    /// The tier of `c`, sent with `flags`.
    pub(in crate::backend::redis) fn new(c: &TierCheck, flags: u8) -> Self {
        Self {
            limit: c.limit,
            cost: c.cost,
            repeat: flags & super::REPEAT != 0,
        }
    }

    /// The flag that says how it answers: [`REPEAT`](super::REPEAT) (in
    /// full) or its [`short_flag`].
    pub(in crate::backend::redis) fn listing_flag(&self) -> u8 {
        if self.repeat {
            super::REPEAT
        } else {
            short_flag(&self.limit)
        }
    }
}

impl From<&TierCheck> for ReplyTier {
    fn from(c: &TierCheck) -> Self {
        Self::new(c, 0)
    }
}

/// Each tier of a check, for its reply (inline up to 4 tiers).
pub(in crate::backend::redis) type ReplyTiers = smallvec::SmallVec<[ReplyTier; 4]>;

/// The [`SHORT`] flag for a tier of this limit: token and leaky buckets,
/// fixed and calendar windows answer their state, one number, from which
/// [`parse_check`] derives the decision; a sliding log sent no [`UNDO`]
/// flag answers its remaining when it allows (three numbers when it denies).
pub(in crate::backend::redis) fn short_flag(limit: &Limit) -> u8 {
    if matches!(
        limit,
        Limit::TokenBucket(_)
            | Limit::LeakyBucket(_)
            | Limit::FixedWindow(_)
            | Limit::Calendar(_)
            | Limit::SlidingWindowLog(_)
    ) {
        SHORT
    } else {
        0
    }
}

/// The numbers of a check's reply, read from the RESP array without an
/// intermediate `Vec` (inline up to 8: up to seven buckets answering short).
#[derive(Debug)]
pub(in crate::backend::redis) struct CheckValues(
    pub(in crate::backend::redis) smallvec::SmallVec<[i64; 8]>,
);

impl ::redis::FromRedisValue for CheckValues {
    fn from_redis_value_ref(v: &::redis::Value) -> Result<Self, ::redis::ParsingError> {
        match v {
            ::redis::Value::Array(items) => items
                .iter()
                .map(|item| match item {
                    ::redis::Value::Int(n) => Ok(*n),
                    other => Err(format!("a check reply holds a non-integer: {other:?}").into()),
                })
                .collect::<Result<_, _>>()
                .map(CheckValues),
            other => Err(format!("a check reply is not an array: {other:?}").into()),
        }
    }

    fn from_redis_value(v: ::redis::Value) -> Result<Self, ::redis::ParsingError> {
        Self::from_redis_value_ref(&v)
    }
}

/// A group commit's reply (`lua/batch.lua`) as sent: the call's `now_us`,
/// then per request either its tiers' counts inline (a request decided
/// increment-first: `check_incr` in `lua/dispatch.lua`, one number per
/// tier, the short reply's) or its own reply as an array: its check reply,
/// or for a request the script could not check (a malformed spec) the
/// script's message. [`BatchValues::replies`] splits it by each request's
/// number of tiers, which the client knows.
#[derive(Debug)]
pub(in crate::backend::redis) struct BatchValues(Vec<BatchItem>);

/// One value of a [`BatchValues`].
#[derive(Debug)]
enum BatchItem {
    /// The call's `now_us`, or an inline count.
    Number(i64),
    /// A request's own reply (or message).
    Reply(Result<smallvec::SmallVec<[i64; 8]>, String>),
}

/// A request's check reply in a group commit (its numbers, as a check
/// alone answers them), or the script's message for it.
pub(in crate::backend::redis) type BatchReply = Result<smallvec::SmallVec<[i64; 8]>, String>;

impl BatchValues {
    /// The call's `now_us` (Redis's clock, read once for the call).
    pub(in crate::backend::redis) fn now(&self) -> Option<i64> {
        match self.0.first() {
            Some(BatchItem::Number(now)) => Some(*now),
            _ => None,
        }
    }

    /// Each request's reply, for requests of these numbers of tiers in call
    /// order: an inline request's counts after the call's `now_us`, as the
    /// check of a request alone answers them. `None` when the reply does not
    /// have that layout (too few or too many values, a number where a reply
    /// must be).
    pub(in crate::backend::redis) fn replies(
        self,
        tiers: impl IntoIterator<Item = usize>,
    ) -> Option<Vec<BatchReply>> {
        let mut items = self.0.into_iter();
        let Some(BatchItem::Number(now)) = items.next() else {
            return None;
        };
        let mut out = Vec::new();
        for n in tiers {
            match items.next()? {
                BatchItem::Reply(r) => out.push(r),
                BatchItem::Number(_) if n == 0 => return None,
                BatchItem::Number(first) => {
                    let mut v = smallvec::SmallVec::with_capacity(n + 1);
                    v.push(now);
                    v.push(first);
                    for _ in 1..n {
                        match items.next()? {
                            BatchItem::Number(c) => v.push(c),
                            BatchItem::Reply(_) => return None,
                        }
                    }
                    out.push(Ok(v));
                }
            }
        }
        if items.next().is_some() {
            return None;
        }
        Some(out)
    }
}

impl ::redis::FromRedisValue for BatchValues {
    fn from_redis_value_ref(v: &::redis::Value) -> Result<Self, ::redis::ParsingError> {
        let ::redis::Value::Array(items) = v else {
            return Err(format!("a group commit reply is not an array: {v:?}").into());
        };
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(match item {
                ::redis::Value::Int(n) => BatchItem::Number(*n),
                ::redis::Value::Array(a) => BatchItem::Reply(match a.as_slice() {
                    [::redis::Value::BulkString(m)] => Err(String::from_utf8_lossy(m).into_owned()),
                    _ => Ok(CheckValues::from_redis_value_ref(item)?.0),
                }),
                other => {
                    return Err(format!("a group commit reply holds {other:?}").into());
                }
            });
        }
        Ok(Self(out))
    }

    fn from_redis_value(v: ::redis::Value) -> Result<Self, ::redis::ParsingError> {
        Self::from_redis_value_ref(&v)
    }
}

/// Numbers per tier in a check's long reply, and per trailer entry.
pub(in crate::backend::redis) const PER_TIER: usize = 3;

/// Parses a check's reply (see the module docs) for these `tiers` (in call
/// order, with the limit and cost each was sent with), with these tiers in
/// shadow mode. `flags`: the flags every tier was sent with, of which
/// [`SHORT`] (the buckets were sent it: see [`short_flag`]) and [`UNDO`]
/// (the charges' undo values were asked for) count here.
///
/// # Errors
/// [`BackendError::Reply`] when the reply does not have the layout: wrong
/// length, a negative number where none can be, a bucket's state that
/// contradicts its allowed sign, a trailer entry for a tier that does not
/// exist, that denied or that answered short.
pub(in crate::backend::redis) fn parse_check(
    reply: &[i64],
    tiers: &[ReplyTier],
    flags: u8,
    shadow: Shadow,
) -> Result<CheckReply, BackendError> {
    let n = tiers.len();
    if n > 0 && reply.len() == 1 {
        return Ok(CheckReply::Late);
    }
    let bad = |what: &str| {
        BackendError::Reply(format!(
            "unexpected reply for {n} tiers ({what}): {} values",
            reply.len()
        ))
    };
    let u = |v: i64, what: &str| u64::try_from(v).map_err(|_| bad(what));
    let now_us = u(
        *reply.first().ok_or_else(|| bad("length"))?,
        "negative now_us",
    )?;
    let short = flags & SHORT != 0;
    let mut decisions = Vec::with_capacity(n);
    // Per tier: the wait for the next request when allowed (see
    // lua/dispatch.lua), its undo value, and whether it answered short.
    let mut after: smallvec::SmallVec<[(u64, u64, bool); 8]> = smallvec::SmallVec::new();
    let mut at = 1;
    // The override read just before a tier applied (its r is not 0): the
    // tier answers three numbers, whatever its flags.
    let mut overridden = false;
    // Bit per tier: a tier an unlimited override let through (charged
    // nothing, as in the memory backend: no charge, so no refund or settle).
    let mut unlimited = 0u64;
    for (i, t) in tiers.iter().enumerate() {
        let r = *reply.get(at).ok_or_else(|| bad("length"))?;
        // r: remaining (or a bucket's state) when allowed, -(it + 1) when
        // denied (no overflow: -(i64::MIN + 1) is i64::MAX).
        let allowed = r >= 0;
        let v = if allowed { r } else { -(r + 1) }.unsigned_abs();
        // A sliding log answers short only when it allows, without undo.
        let long_log =
            matches!(t.limit, Limit::SlidingWindowLog(_)) && (!allowed || flags & UNDO != 0);
        if short && !overridden && t.listing_flag() & SHORT != 0 && !long_log {
            at += 1;
            let (d, next_after_us, undo) = short_decision(&t.limit, v, t.cost, now_us);
            if d.allowed != allowed {
                return Err(bad("a short tier's state contradicts its decision"));
            }
            decisions.push(d);
            after.push((
                next_after_us,
                if flags & UNDO != 0 { undo } else { 0 },
                true,
            ));
        } else {
            let rest = reply
                .get(at + 1..at + PER_TIER)
                .ok_or_else(|| bad("length"))?;
            at += PER_TIER;
            let w = u(rest[1], "negative wait")?;
            decisions.push(TierDecision {
                allowed,
                limit: t.limit.capacity(),
                remaining: v,
                reset_after_us: u(rest[0], "negative reset")?,
                // An allowed tier's w is the wait for the next request (see
                // lua/dispatch.lua), kept in its charge below.
                retry_after_us: if allowed { 0 } else { w },
                delay_us: 0,
            });
            after.push((w, 0, false));
        }
        overridden = t.limit.is_override() && v != 0;
        if t.limit.is_override() && v == crate::backend::override_rule::CODE_UNLIMITED {
            unlimited |= 1u64
                .checked_shl(u32::try_from(i + 1).unwrap_or(64))
                .unwrap_or(0);
        }
    }
    if !(reply.len() - at).is_multiple_of(PER_TIER) {
        return Err(bad("length"));
    }
    for t in reply[at..].chunks_exact(PER_TIER) {
        // Tier numbers count from 1.
        let i = usize::try_from(t[0])
            .ok()
            .and_then(|i| i.checked_sub(1))
            .ok_or_else(|| bad("tier number"))?;
        let d = decisions.get_mut(i).ok_or_else(|| bad("tier number"))?;
        if !d.allowed || after[i].2 {
            return Err(bad("trailer entry for a denying or short tier"));
        }
        d.delay_us = u(t[1], "negative delay")?;
        after[i].1 = u(t[2], "negative undo")?;
    }
    // Charged: every enforced tier allowed (the script's commit rule), and
    // this one did.
    let charges = if !shadow.commits(&decisions) {
        Vec::new()
    } else {
        decisions
            .iter()
            .zip(&after)
            .enumerate()
            .map(|(i, (d, &(next_after_us, undo, _)))| {
                let uncharged = i < 64 && unlimited & (1 << i) != 0;
                (d.allowed && !uncharged).then_some(Charge {
                    at_us: now_us,
                    undo,
                    next_after_us,
                })
            })
            .collect()
    };
    Ok(CheckReply::Decided(Verdict {
        now_us,
        decisions,
        charges,
    }))
}

/// A short tier's decision from the state its script answered (`state`: a
/// token bucket's units short of full, a leaky bucket's backlog in ticks, a
/// fixed or calendar window's count in the window of `now_us`, all at the
/// script's `now_us`), with what the long form would have answered
/// besides: the wait before another request of the same cost would pass
/// once this one is charged (0 when at once), and the charge's undo value
/// (tokens left in units; backlog after the charge in ticks; 0 for a
/// window, whose refund takes its cost off). The same arithmetic as
/// `lua/token_bucket.lua`, `lua/leaky_bucket.lua` and `lua/fixed_window.lua`
/// (the model's, [`TokenBucket::check_missing`], [`Gcra::check_backlog`],
/// [`Window::fixed_check`], [`CalendarWindow::check`]).
///
/// [`TokenBucket::check_missing`]: crate::algorithm::TokenBucket
/// [`Gcra::check_backlog`]: crate::algorithm::Gcra
/// [`Window::fixed_check`]: crate::algorithm::Window::fixed_check
/// [`CalendarWindow::check`]: crate::algorithm::CalendarWindow::check
pub(in crate::backend::redis) fn short_decision(
    limit: &Limit,
    state: u64,
    cost: u64,
    now_us: u64,
) -> (TierDecision, u64, u64) {
    // window_decide's wait (lua/fixed_window.lua): the rest of the window
    // `[.., end)` once another request of this cost no longer fits.
    let window = |limit: u64, end: u64, d: TierDecision| {
        let next =
            if d.allowed && state.saturating_add(cost.saturating_mul(2)) > limit && cost <= limit {
                end.saturating_sub(now_us)
            } else {
                0
            };
        (d, next, 0)
    };
    match limit {
        Limit::FixedWindow(w) => {
            let start = now_us - now_us % w.window_us.max(1);
            let s = crate::algorithm::FixedWindowState {
                start_us: start,
                count: state,
                end_us: start + w.window_us,
            };
            let d = w.fixed_check(Some(s), now_us, cost);
            window(w.limit, start + w.window_us, d)
        }
        Limit::Calendar(c) => {
            let (start, end) = c.window(now_us);
            let s = crate::algorithm::FixedWindowState {
                start_us: start,
                count: state,
                end_us: end,
            };
            window(c.limit, end, c.check(Some(s), now_us, cost))
        }
        Limit::TokenBucket(b) => {
            let (d, used) = b.check_missing(state, cost);
            let Some(used) = used else {
                return (d, 0, 0);
            };
            let left = b.capacity - used;
            let cost = cost.saturating_mul(b.unit);
            let next = if cost > left && cost <= b.capacity {
                (cost - left).div_ceil(b.rate)
            } else {
                0
            };
            (d, next, left)
        }
        Limit::LeakyBucket(g) => {
            let d = g.check_backlog(state, cost);
            if !d.allowed {
                return (d, 0, 0);
            }
            let b = &g.bucket;
            let cost = cost.saturating_mul(b.unit);
            let after = state + cost;
            let tolerance = g.max_delay_us.map_or(0, |m| m.saturating_mul(b.rate));
            let next_over = (after + cost).saturating_sub(b.capacity);
            let next = if next_over > tolerance && cost <= b.capacity {
                (next_over - tolerance).div_ceil(b.rate)
            } else {
                0
            };
            (d, next, after)
        }
        // An allowing sliding log: its remaining (the long form's reset is
        // the window, its wait 0; no undo value without the UNDO flag).
        Limit::SlidingWindowLog(w) => (
            TierDecision {
                allowed: true,
                limit: w.limit,
                remaining: state,
                reset_after_us: w.window_us,
                retry_after_us: 0,
                delay_us: 0,
            },
            0,
            0,
        ),
        // Only buckets, windows and logs are sent the short flag (short_flag).
        other => (other.check(None, 0, cost), 0, 0),
    }
}
