//! The wire format between this crate and its Lua scripts: which files make
//! each script, what a call's `ARGV` holds, and the one reply layout both
//! check entry points (`lua/check.lua` on a single Redis, `lua/cluster.lua`'s
//! `check` mode on one hash slot of a cluster) return. Everything either
//! side writes or reads is encoded or parsed here.
//!
//! # Arguments
//!
//! ```text
//! clock     "" = Redis TIME; "-<deadline>" = Redis TIME, and a script that
//!           starts after the deadline writes nothing and answers "late";
//!           "<now>[:<ttl slack ms>]" = a test clock (ManualClock)
//! per tier  one argument, its spec: seven integers separated by single
//!           spaces, "<algorithm> <p1> <p2> <p3> <p4> <cost> <flags>":
//!           algorithm (1 fixed window, 2 sliding window log, 3 sliding
//!           window counter, 4 token bucket, 5 leaky bucket, 6 concurrency,
//!           7 penalty box, 8 a per-key override's read), p1..p4, cost,
//!           flags (+1 shadow, +2 undo wanted, +4 repeat: the key was
//!           listed before in this call, charge it on what that listing
//!           stored, +8 short: a bucket or a fixed or calendar window
//!           answers its state, one number; a sliding log without +2 its
//!           remaining, when it allows).
//!           The candidates of one live check may go as ONE "tier": the
//!           live key itself (the pack in its value) or `<live key>{c}`
//!           ([`pack_key`]) and the spec "10 <live> <k>" then seven
//!           numbers a candidate, "<algorithm> <p1> <p2> <p3> <p4> <cost>
//!           <tag>" ([`packs`], [`write_pack`]); it answers each
//!           candidate's reply in turn, and the trailer's `i` counts them.
//!           One argument rather than seven: the script keeps parsed specs
//!           by their string (as a Redis Function, across calls), so a tier
//!           costs Redis one table lookup instead of seven conversions
//! refund    eight numbers per key: algorithm, p1..p4, cost, charged_at, undo;
//!           an override's read (algorithm 8) just before a key makes that
//!           key's refund or debt run under the override it reads
//! ```
//!
//! `p1..p4`: windows `limit, window_us, 0, 0`; token bucket `capacity, rate,
//! unit, 0`; leaky bucket `capacity, rate, unit, max_delay_us` (−1 = police);
//! concurrency (algorithm 6) `limit, ttl_us, slot id, 0`; a penalty box
//! (algorithm 7) `violations + 1024 × backoff + 2^20 × memory_s, window_us,
//! block_us, max_block_us`; an override's read (algorithm 8) `0, 0, 0, 0`
//! (its reply's r: 0 none, 1 unlimited, 2 blocked, 3 + a quota's capacity;
//! see `lua/override.lua` and [`handle`](crate::handle#per-key-overrides)).
//!
//! # The check reply
//!
//! ```text
//! { now_us,
//!   then per tier, in call order: s (one number: a bucket answering
//!   short, or an allowing sliding log's remaining) or r, reset_after_us,
//!   w (three: every other tier),
//!   then a trailer, three per entry: i, delay_us, undo }
//! late: { now_us }
//! ```
//!
//! All times are microseconds; `now_us` is Unix epoch µs, the others are
//! relative to it.
//!
//! **Short** (a token or leaky bucket, a fixed or calendar window, sent the
//! flag +8, [`short_flag`], with no override applied to it: see below): `s`
//! is the tier's state at `now_us` before this request, the units a bucket
//! is short of full (token bucket) or its backlog in ticks (leaky bucket),
//! the count in the window of `now_us` (windows), and `-(s + 1)` when the
//! tier denies. The client derives the decision, the wait for the next
//! request, the shaping delay and the undo value from it, the limit and
//! the cost, with the model's own arithmetic ([`parse_check`]), so the
//! script divides nothing and answers one number where it answered three.
//! A sliding log sent +8 and not +2 (no undo value asked for) answers short
//! when it allows: `s` is its remaining (its reset is its window, its wait
//! 0); when it denies it answers long (its reset and retry need the times of
//! its oldest entries), which its `r < 0` tells the client.
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
//! empty when nothing was charged; a tier an unlimited override let through
//! has no charge, as in the memory backend). As few numbers as possible: redis-rs
//! parses each number of a reply (about 1 000 instructions apiece), and
//! Redis converts each from Lua (`perf/README.md`, "Redis CPU").
//!
//! "Late" cannot be confused with a check's reply: every tier answers at
//! least one number, so a reply of one value is late for `n ≥ 1` tiers
//! (with no tier there is nothing to write, late or not).

/// The globals the files of `lua/` read on a check's path, which every
/// script and the library read as locals of their own: a local is an
/// upvalue read, where a global is a table lookup, and in a Redis
/// Function a miss in the library's own globals table and a lookup in its
/// metatable's `__index` (Redis 7's function sandbox). Bound once per
/// call in a script ([`script!`]), at a function's first call in the
/// library (at `FUNCTION LOAD` only the library API is a global there).
/// Measured (`perf/redis_floors.sh`, one token bucket tier, the layer's
/// call): 72,587 → 70,743 Redis instructions. `struct`, read by the
/// candidates' packs alone, is left a global. Then the three functions
/// the files call most, as locals of their own: `rcall`, `floor` and
/// `format` (see [`lua_shorts!`]).
macro_rules! lua_globals {
    () => {
        "redis, string, math, table, tonumber, tostring, type, unpack, pairs, ipairs"
    };
}

/// `rcall = redis.call`, `floor = math.floor`, `format = string.format`:
/// the files of `lua/` that [`lua!`] joins call these by the short name
/// (an upvalue read, where `redis.call` is also a field lookup).
macro_rules! lua_shorts {
    () => {
        "rcall, floor, format = redis.call, math.floor, string.format"
    };
}

/// A script of the files of `lua/` (see [`lua!`]), with the globals of
/// [`lua_globals!`] read into locals first.
macro_rules! script {
    ($($file:literal),* $(,)?) => {
        concat!(
            "local ", lua_globals!(), " = ", lua_globals!(), "\nlocal ", lua_shorts!(), "\n",
            lua!($($file),*)
        )
    };
}

/// The files of `lua/` every script starts with (the shared helpers and
/// the seven algorithms, the overrides' reader), joined, then the named files of `lua/`, in order.
macro_rules! lua {
    ($($file:literal),* $(,)?) => {
        concat!(
            include_str!("../../../../lua/common.lua"),
            include_str!("../../../../lua/fixed_window.lua"),
            include_str!("../../../../lua/calendar.lua"),
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
pub(super) const CHECK_LUA: &str = script!("dispatch.lua", "check.lua");

/// The cluster script: the algorithms, their refunds, and the per-slot
/// entry point (instead of `check.lua`). A single Redis runs its `refund`
/// mode too.
pub(super) const CLUSTER_LUA: &str = script!("refund.lua", "dispatch.lua", "cluster.lua");

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
    "local function batch_main()\n",
    include_str!("../../../../lua/batch.lua"),
    "\nend\n",
);

/// Group commit on a single Redis: the checks of several requests in one
/// call (`lua/batch.lua`; `batch.rs` sends it), as an `EVALSHA` script.
/// `KEYS` and `ARGV` are made locals first, so that `batch.lua` can give
/// each request its own `KEYS` (the library has them as locals already).
pub(super) const BATCH_LUA: &str = concat!(
    "local KEYS, ARGV = KEYS, ARGV\n",
    script!("dispatch.lua", "batch.lua"),
);

/// The library's first lines: its name; `KEYS` and `ARGV` as locals of
/// the library, which the registered function sets on every call (a Redis
/// Function receives them as arguments; the files read them as `EVAL`
/// scripts do); `register_function`, read while the library API is the
/// global `redis`; and the globals of [`lua_globals!`] as locals, which a
/// registered function binds at its first call (`globals()` reads them as
/// globals: it comes before the locals of the same names).
const LIBRARY_HEAD: &str = concat!(
    "#!lua name=tiered_ratelimit_{v}\nlocal KEYS, ARGV\n",
    "local register = redis.register_function\n",
    "local function globals() return ",
    lua_globals!(),
    " end\nlocal ",
    lua_globals!(),
    "\nlocal rcall, floor, format\n"
);

/// The registration of the check as `trl_check_{v}` and of group commit
/// as `trl_batch_{v}`, each binding the globals at its first call.
const LIBRARY_TAIL: &str = concat!(
    "register('trl_check_{v}', function(keys, args) KEYS = keys ARGV = args if not redis then ",
    lua_globals!(),
    " = globals() ",
    lua_shorts!(),
    " end return check_main() end)\n",
    "register('trl_batch_{v}', function(keys, args) KEYS = keys ARGV = args if not redis then ",
    lua_globals!(),
    " = globals() ",
    lua_shorts!(),
    " end return batch_main() end)\n"
);

/// The check as a Redis Functions library, versioned by the script's
/// content: library `tiered_ratelimit_<v>` with the function
/// `trl_check_<v>` (and the group commit's `trl_batch_<v>`), where `<v>`
/// is the first 12 hex digits of the SHA1 of the library's source (its
/// version left as `{v}`). Two releases with different scripts load two libraries
/// side by side, so a rolling deploy never replaces the code an older
/// instance calls; a library of a release no instance runs any more can be
/// removed with `FUNCTION DELETE tiered_ratelimit_<v>` (docs/redis.md).
#[derive(Debug)]
pub(super) struct Library {
    /// The `FUNCTION LOAD` source.
    pub(super) source: String,
    /// The function's name, for `FCALL`.
    pub(super) function: String,
    /// The group commit's function (`lua/batch.lua`), for `FCALL`.
    pub(super) batch_function: String,
}

impl Library {
    /// The library, versioned by the SHA1 of its whole source before the
    /// version is put in (a change to any part is a new library).
    pub(super) fn new() -> Self {
        let script = ::redis::Script::new(&[LIBRARY_HEAD, LIBRARY_BODY, LIBRARY_TAIL].concat());
        let sha = script.get_hash();
        let v = sha.get(..12).unwrap_or(sha);
        let mut source = LIBRARY_HEAD.replace("{v}", v);
        source.push_str(LIBRARY_BODY);
        source.push_str(&LIBRARY_TAIL.replace("{v}", v));
        Self {
            source,
            function: format!("trl_check_{v}"),
            batch_function: format!("trl_batch_{v}"),
        }
    }
}

/// The read-only script of a peek (`handle.peek`): the algorithms and the
/// dispatcher, then `peek.lua` (one tier, nothing charged).
pub(super) const PEEK_LUA: &str = script!("dispatch.lua", "peek.lua");

/// The renewal of a concurrency slot (`lua/slot.lua`).
pub(super) const SLOT_LUA: &str = script!("dispatch.lua", "slot.lua");

mod args;
mod reply;

pub(crate) use args::params;
pub(in crate::backend::redis) use args::*;
pub(in crate::backend::redis) use reply::*;

#[cfg(test)]
mod tests;
