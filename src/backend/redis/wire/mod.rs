//! The wire format between this crate and its Lua scripts: which files make
//! each script, what a call's `ARGV` holds, and the one reply layout both
//! check entry points (`lua/check.lua` on a single Redis, `lua/cluster.lua`'s
//! `check` mode on one hash slot of a cluster) return. Everything either
//! side writes or reads is encoded or parsed here.
//!
//! # Arguments
//!
//! ```text
//! clock     "" = Redis TIME; "d<deadline>" = Redis TIME, and a script that
//!           starts after the deadline writes nothing and answers "late";
//!           "<now>[:<ttl slack ms>]" = a test clock (ManualClock)
//! per tier  one argument, its spec: seven integers separated by single
//!           spaces, "<algorithm> <p1> <p2> <p3> <p4> <cost> <flags>":
//!           algorithm (1 fixed window, 2 sliding window log, 3 sliding
//!           window counter, 4 token bucket, 5 leaky bucket, 6 concurrency,
//!           7 penalty box, 8 a per-key override's read), p1..p4, cost,
//!           flags (+1 shadow, +2 undo wanted, +8 short: a bucket answers
//!           its state, one number; +4 is unused).
//!           One argument rather than seven: the script keeps parsed specs
//!           by their string (as a Redis Function, across calls), so a tier
//!           costs Redis one table lookup instead of seven conversions
//! refund    eight numbers per key: algorithm, p1..p4, cost, charged_at, undo
//! ```
//!
//! `p1..p4`: windows `limit, window_us, 0, 0`; token bucket `capacity, rate,
//! unit, 0`; leaky bucket `capacity, rate, unit, max_delay_us` (−1 = police);
//! concurrency (algorithm 6) `limit, lease_us, lease id, 0`; a penalty box
//! (algorithm 7) `violations + 1024 × backoff + 2^20 × memory_s, window_us,
//! block_us, max_block_us`; an override's read (algorithm 8) `0, 0, 0, 0`
//! (its reply's r: 0 none, 1 unlimited, 2 blocked, 3 + a quota's capacity;
//! see `lua/override.lua` and [`crate::handle::overrides`]).
//!
//! # The check reply
//!
//! ```text
//! { now_us,
//!   then per tier, in call order: s (one number: a bucket answering
//!   short) or r, reset_after_us, w (three: every other tier),
//!   then a trailer, three per entry: i, delay_us, undo }
//! late: { now_us }
//! ```
//!
//! All times are microseconds; `now_us` is Unix epoch µs, the others are
//! relative to it.
//!
//! **Short** (a token or leaky bucket sent the flag +8, [`short_flag`],
//! with no override applied to it: see below): `s` is the bucket's state at
//! `now_us` before this request, the units it is short of full (token
//! bucket) or its backlog in ticks (leaky bucket), and `-(s + 1)` when the
//! tier denies. The client derives the decision, the wait for the next
//! request, the shaping delay and the undo value from it, the limit and
//! the cost, with the model's own arithmetic ([`parse_check`]), so the
//! script divides nothing and answers one number where it answered three.
//!
//! **Long** (every other tier): `r` is the tier's remaining when it allows
//! and `-(remaining + 1)` when it denies; `w` its retry_after_us when it
//! denies and, when it allows, the wait before another request of the same
//! cost would pass (0 when at once or not computed). An override's read
//! (algorithm 8) is long; when its `r` is not 0 (an override applied) the
//! next tier runs under the override's spec, without the short flag, and
//! answers long too.
//!
//! The trailer lists, by tier number `i` (from 1), every allowing long tier
//! with a shaping delay and, when the call charged and the tier has the
//! undo flag, a non-zero `undo`: what its charge returned, the argument of
//! its refund. Every other delay and undo is 0 (or derived, for a short
//! tier).
//!
//! Whether the call charged is not sent: the script charges exactly when
//! every enforced tier allows, and the caller knows which tiers are in
//! shadow mode, so [`parse_check`] derives it ([`Verdict::charges`] is
//! empty when nothing was charged). As few numbers as possible: redis-rs
//! parses each number of a reply (about 1 000 instructions apiece), and
//! Redis converts each from Lua (`docs/performance.md`, "Redis CPU").
//!
//! "Late" cannot be confused with a check's reply: every tier answers at
//! least one number, so a reply of one value is late for `n ≥ 1` tiers
//! (with no tier there is nothing to write, late or not).

use crate::algorithm::{Decision, Limit};
use crate::backend::{Charge, Shadow, TierCheck, Verdict};
use crate::error::BackendError;
use ::redis::Cmd;

/// The files of `lua/` every script starts with (the shared helpers and
/// the seven algorithms, the overrides' reader), joined, then the named files of `lua/`, in order.
macro_rules! lua {
    ($($file:literal),* $(,)?) => {
        concat!(
            include_str!("../../../../lua/common.lua"),
            include_str!("../../../../lua/fixed_window.lua"),
            include_str!("../../../../lua/sliding_window_log.lua"),
            include_str!("../../../../lua/sliding_window_counter.lua"),
            include_str!("../../../../lua/token_bucket.lua"),
            include_str!("../../../../lua/leaky_bucket.lua"),
            include_str!("../../../../lua/concurrency.lua"),
            include_str!("../../../../lua/penalty.lua"),
            include_str!("../../../../lua/override.lua"),
            $(include_str!(concat!("../../../../lua/", $file)),)*
        )
    };
}

/// The script a single Redis runs per request: the algorithm files of
/// `lua/` joined, then the shared dispatcher and `check.lua`.
pub(super) const CHECK_LUA: &str = lua!("dispatch.lua", "check.lua");

/// The cluster script: the algorithms, their refunds, and the per-slot
/// entry point (instead of `check.lua`). A single Redis runs its `refund`
/// mode too.
pub(super) const CLUSTER_LUA: &str = lua!("refund.lua", "dispatch.lua", "cluster.lua");

/// The single-Redis check as a Redis Functions library (Redis ≥ 7,
/// `FUNCTION LOAD` then `FCALL`): the same files as [`CHECK_LUA`], loaded
/// once per Redis instead of run as a whole on every call, so the five
/// algorithms and the dispatcher are defined once and the parsed tier specs
/// and unit codes outlive a call. `{v}` in [`LIBRARY_HEAD`] and
/// [`LIBRARY_TAIL`] is the library's version (see [`Library`]).
const LIBRARY_BODY: &str = concat!(
    lua!("dispatch.lua"),
    "local function check_main()\n",
    include_str!("../../../../lua/check.lua"),
    "\nend\n",
);

/// The library's first lines: its name, and `KEYS` and `ARGV` as locals of
/// the library, which the registered function sets on every call (a Redis
/// Function receives them as arguments; the files read them as `EVAL`
/// scripts do).
const LIBRARY_HEAD: &str = "#!lua name=tiered_ratelimit_{v}\nlocal KEYS, ARGV\n";

/// The registration of the check as `trl_check_{v}`.
const LIBRARY_TAIL: &str = "redis.register_function('trl_check_{v}', \
     function(keys, args) KEYS = keys ARGV = args return check_main() end)\n";

/// The check as a Redis Functions library, versioned by the script's
/// content: library `tiered_ratelimit_<v>` with the function
/// `trl_check_<v>`, where `<v>` is the first 12 hex digits of the SHA1 of
/// [`CHECK_LUA`]. Two releases with different scripts load two libraries
/// side by side, so a rolling deploy never replaces the code an older
/// instance calls; a library of a release no instance runs any more can be
/// removed with `FUNCTION DELETE tiered_ratelimit_<v>` (docs/redis.md).
#[derive(Debug)]
pub(super) struct Library {
    /// The `FUNCTION LOAD` source.
    pub(super) source: String,
    /// The function's name, for `FCALL`.
    pub(super) function: String,
}

impl Library {
    /// The library for the script whose SHA1 is `sha` (hex).
    pub(super) fn new(sha: &str) -> Self {
        let v = sha.get(..12).unwrap_or(sha);
        let mut source = LIBRARY_HEAD.replace("{v}", v);
        source.push_str(LIBRARY_BODY);
        source.push_str(&LIBRARY_TAIL.replace("{v}", v));
        Self {
            source,
            function: format!("trl_check_{v}"),
        }
    }
}

/// The read-only script of a peek (`handle.peek`): the algorithms and the
/// dispatcher, then `peek.lua` (one tier, nothing charged).
pub(super) const PEEK_LUA: &str = lua!("dispatch.lua", "peek.lua");

/// The renewal of a concurrency lease (`lua/lease.lua`).
pub(super) const LEASE_LUA: &str = lua!("dispatch.lua", "lease.lua");

/// Tier flag: the tier is in shadow mode (its denial does not stop the
/// others from being charged).
pub(super) const SHADOW: u8 = 1;
/// Tier flag: return the charge's undo value (for a refund).
pub(super) const UNDO: u8 = 2;
/// Tier flag: a token or leaky bucket answers its state, one number,
/// instead of three (see [`short_flag`] and the module docs).
pub(super) const SHORT: u8 = 8;

/// The clock argument of a script call, on the stack: at most
/// `"<u64>:<u64>"`, 41 bytes.
#[derive(Clone, Copy)]
pub(super) struct ClockArg {
    buf: [u8; 41],
    len: u8,
}

impl ClockArg {
    /// `""`: the script reads Redis `TIME`.
    pub(super) const fn redis() -> Self {
        Self {
            buf: [0; 41],
            len: 0,
        }
    }

    /// `"d<deadline µs>"` (Redis's clock): Redis `TIME`, and nothing is
    /// written if the script starts after `deadline_us`.
    pub(super) fn deadline(deadline_us: i64) -> Self {
        let mut a = Self::redis();
        a.push(b"d");
        a.push(itoa::Buffer::new().format(deadline_us).as_bytes());
        a
    }

    /// `"<now µs>"`, or `"<now µs>:<ttl slack ms>"` when the slack is not 0:
    /// a test clock.
    pub(super) fn manual(now_us: u64, ttl_slack_ms: u64) -> Self {
        let mut a = Self::redis();
        a.push(itoa::Buffer::new().format(now_us).as_bytes());
        if ttl_slack_ms > 0 {
            a.push(b":");
            a.push(itoa::Buffer::new().format(ttl_slack_ms).as_bytes());
        }
        a
    }

    /// Appends `bytes`; the constructors never exceed the buffer (20 digits
    /// of a u64 or i64 with its sign, twice, and one separator).
    fn push(&mut self, bytes: &[u8]) {
        let at = usize::from(self.len);
        let end = (at + bytes.len()).min(self.buf.len());
        self.buf[at..end].copy_from_slice(&bytes[..end - at]);
        self.len = u8::try_from(end).unwrap_or(u8::MAX);
    }

    /// The argument's bytes.
    pub(super) fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// A limit as the scripts take it: the algorithm's number and p1..p4.
fn encode(limit: &Limit) -> (u8, [i64; 4]) {
    match *limit {
        Limit::FixedWindow(w) => (1, [int(w.limit), int(w.window_us), 0, 0]),
        Limit::SlidingWindowLog(w) => (2, [int(w.limit), int(w.window_us), 0, 0]),
        Limit::SlidingWindowCounter(w) => (3, [int(w.limit), int(w.window_us), 0, 0]),
        Limit::TokenBucket(b) => (4, [int(b.capacity), int(b.rate), int(b.unit), 0]),
        Limit::LeakyBucket(g) => (
            5,
            [
                int(g.bucket.capacity),
                int(g.bucket.rate),
                int(g.bucket.unit),
                g.max_delay_us.map_or(-1, int),
            ],
        ),
        Limit::Concurrency(c) => (6, [int(c.limit), int(c.lease_us), int(c.lease), 0]),
        Limit::Penalty(p) => (
            7,
            [
                int(penalty_packed(&p)),
                int(p.window_us),
                int(p.block_us),
                int(p.max_block_us),
            ],
        ),
        Limit::Override => (8, [0; 4]),
    }
}

/// A limit's p1..p4 as the scripts take them (an override's quota, stored
/// in Redis: see [`crate::handle::overrides`]).
pub(crate) fn params(limit: &Limit) -> [i64; 4] {
    encode(limit).1
}

/// A penalty box's p1: `violations + 1024 × backoff + 2^20 × memory in
/// whole seconds` (each part checked when the layer is built: violations
/// and backoff below 1024, memory below 2^32 s).
pub(crate) fn penalty_packed(p: &crate::algorithm::PenaltyBox) -> u64 {
    p.violations + (p.backoff << 10) + ((p.memory_us / 1_000_000) << 20)
}

/// Parameters are validated far below 2^53 when the layer is built.
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The seven numbers of one tier of a check: algorithm, p1..p4, cost, flags
/// ([`SHADOW`], [`UNDO`], [`SHORT`]).
pub(super) fn tier_args(check: &TierCheck, flags: u8) -> [i64; 7] {
    let (algorithm, p) = encode(&check.limit);
    [
        i64::from(algorithm),
        p[0],
        p[1],
        p[2],
        p[3],
        int(check.cost),
        i64::from(flags),
    ]
}

/// One tier's spec argument ([`tier_args`] separated by single spaces), on
/// the stack: at most seven 20-character numbers and six spaces.
#[derive(Clone, Copy)]
pub(super) struct TierSpec {
    buf: [u8; 146],
    len: u8,
}

impl TierSpec {
    /// The spec of `check` with these flags.
    pub(super) fn new(check: &TierCheck, flags: u8) -> Self {
        let mut spec = Self {
            buf: [0; 146],
            len: 0,
        };
        let mut at = 0;
        for (i, n) in tier_args(check, flags).into_iter().enumerate() {
            if i > 0 {
                spec.buf[at] = b' ';
                at += 1;
            }
            let mut b = itoa::Buffer::new();
            let digits = b.format(n).as_bytes();
            spec.buf[at..at + digits.len()].copy_from_slice(digits);
            at += digits.len();
        }
        // At most 7 × 20 + 6 = 146.
        spec.len = u8::try_from(at).unwrap_or(u8::MAX);
        spec
    }

    /// The argument's bytes.
    pub(super) fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

impl ::redis::ToRedisArgs for TierSpec {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + ::redis::RedisWrite,
    {
        out.write_arg(self.as_bytes());
    }
}

/// Writes one tier's spec argument ([`TierSpec`]) into `cmd`'s buffer.
pub(super) fn write_tier(cmd: &mut Cmd, check: &TierCheck, flags: u8) {
    cmd.arg(TierSpec::new(check, flags).as_bytes());
}

/// The eight `ARGV` of one key in the cluster script's `refund` mode:
/// algorithm, p1..p4, cost, charged_at (µs), undo.
pub(super) fn refund_args(check: &TierCheck, charge: &Charge) -> [i64; 8] {
    let (algorithm, p) = encode(&check.limit);
    [
        i64::from(algorithm),
        p[0],
        p[1],
        p[2],
        p[3],
        int(check.cost),
        int(charge.at_us),
        int(charge.undo),
    ]
}

/// A check reply, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum CheckReply {
    /// The script started after the call's deadline and wrote nothing.
    Late,
    /// The decisions; [`Verdict::charges`] is empty when nothing was
    /// charged, else one entry per tier (`None` for a tier that denied).
    Decided(Verdict),
}

/// One tier of a check as its reply is read: the limit and the cost the
/// call sent for it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReplyTier {
    /// The tier's algorithm and parameters, as sent.
    pub(super) limit: Limit,
    /// The cost sent (tokens).
    pub(super) cost: u64,
}

impl From<&TierCheck> for ReplyTier {
    fn from(c: &TierCheck) -> Self {
        Self {
            limit: c.limit,
            cost: c.cost,
        }
    }
}

/// Each tier of a check, for its reply (inline up to 4 tiers).
pub(super) type ReplyTiers = smallvec::SmallVec<[ReplyTier; 4]>;

/// The [`SHORT`] flag for a tier of this limit: token and leaky buckets
/// answer their state, one number, from which [`parse_check`] derives the
/// decision.
pub(super) fn short_flag(limit: &Limit) -> u8 {
    if matches!(limit, Limit::TokenBucket(_) | Limit::LeakyBucket(_)) {
        SHORT
    } else {
        0
    }
}

/// The numbers of a check's reply, read from the RESP array without an
/// intermediate `Vec` (inline up to 8: up to seven buckets answering short).
#[derive(Debug)]
pub(super) struct CheckValues(pub(super) smallvec::SmallVec<[i64; 8]>);

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

/// Numbers per tier in a check's long reply, and per trailer entry.
const PER_TIER: usize = 3;

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
pub(super) fn parse_check(
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
    for t in tiers {
        let r = *reply.get(at).ok_or_else(|| bad("length"))?;
        // r: remaining (or a bucket's state) when allowed, -(it + 1) when
        // denied (no overflow: -(i64::MIN + 1) is i64::MAX).
        let allowed = r >= 0;
        let v = if allowed { r } else { -(r + 1) }.unsigned_abs();
        if short && !overridden && short_flag(&t.limit) != 0 {
            at += 1;
            let (d, next_after_us, undo) = bucket_decision(&t.limit, v, t.cost);
            if d.allowed != allowed {
                return Err(bad("a bucket's state contradicts its decision"));
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
            decisions.push(Decision {
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
            .map(|(d, &(next_after_us, undo, _))| {
                d.allowed.then_some(Charge {
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

/// A bucket tier's decision from the state its script answered short
/// (`state`: a token bucket's units short of full, a leaky bucket's
/// backlog in ticks, both at the script's `now`), with what the long form
/// would have answered besides: the wait before another request of the
/// same cost would pass once this one is charged (0 when at once), and the
/// charge's undo value (tokens left in units; backlog after the charge in
/// ticks). The same arithmetic as `lua/token_bucket.lua` and
/// `lua/leaky_bucket.lua` (the model's, [`TokenBucket::check_missing`],
/// [`Gcra::check_backlog`]).
///
/// [`TokenBucket::check_missing`]: crate::algorithm::TokenBucket
/// [`Gcra::check_backlog`]: crate::algorithm::Gcra
fn bucket_decision(limit: &Limit, state: u64, cost: u64) -> (Decision, u64, u64) {
    match limit {
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
        // Only buckets are sent the short flag (short_flag).
        other => (other.check(None, 0, cost), 0, 0),
    }
}

#[cfg(test)]
mod tests;
