//! The scripts' arguments: tier flags, the clock argument, each tier's
//! parameters as integers, and a refund's arguments.

use crate::algorithm::Limit;
use crate::backend::{Charge, TierCheck};
use ::redis::Cmd;

/// Tier flag: the tier is in shadow mode (its denial does not stop the
/// others from being charged).
pub(in crate::backend::redis) const SHADOW: u8 = 1;
/// Tier flag: return the charge's undo value (for a refund).
pub(in crate::backend::redis) const UNDO: u8 = 2;
/// Tier flag: the tier's key was listed before in the same call, so its
/// charge lands on what the earlier listing stored (each listing is decided
/// on the state before the call and charged in turn, as the model and the
/// memory backend do; lua/dispatch.lua). See [`listing_flag`].
pub(in crate::backend::redis) const REPEAT: u8 = 4;

/// The [`REPEAT`] or [`SHORT`] flag of a tier on `key` of `limit`, after
/// the tiers on `earlier` keys of the same call: [`REPEAT`] when its key is
/// listed before (a `Backend::check` caller's list; the layer's keys carry
/// their tier's name and never repeat), and then it answers in full, never
/// short, so that its undo value (the one its charge on the earlier
/// listing's state returned) comes back in the reply's trailer; else
/// [`short_flag`](super::short_flag).
pub(in crate::backend::redis) fn listing_flag<'a>(
    earlier: impl IntoIterator<Item = &'a str>,
    key: &str,
    limit: &Limit,
) -> u8 {
    if earlier.into_iter().any(|e| e == key) {
        REPEAT
    } else {
        super::short_flag(limit)
    }
}

/// Tier flag: a bucket or a fixed or calendar window answers its state, one number,
/// instead of three (see [`short_flag`] and the module docs).
pub(in crate::backend::redis) const SHORT: u8 = 8;

/// Tier flag: a candidate quota (`docs/rollout.md`, "Candidate quotas"):
/// its denial rejects nothing, and it is charged when it allows and every
/// enforced check but its tier's live one allows. The live check's
/// position in the call (from 1) rides above it, times [`LIVE_AT`] (see
/// [`candidate_flags`]).
pub(in crate::backend::redis) const CANDIDATE: u8 = 16;
/// A candidate's flags carry its live check's position (from 1) times this.
const LIVE_AT: i64 = 32;

/// The flags of a candidate check whose tier's live check is at `live`
/// (from 0) in the call, with the other `flags`.
pub(in crate::backend::redis) fn candidate_flags(flags: u8, live: usize) -> i64 {
    let live = i64::try_from(live).unwrap_or(i64::MAX / LIVE_AT - 1);
    i64::from(flags | CANDIDATE) + (live + 1) * LIVE_AT
}

/// The clock argument of a script call, on the stack: at most
/// `"<u64>:<u64>"`, 41 bytes.
#[derive(Clone, Copy)]
pub(in crate::backend::redis) struct ClockArg {
    buf: [u8; 41],
    len: u8,
}

impl ClockArg {
    /// `""`: the script reads Redis `TIME`.
    pub(in crate::backend::redis) const fn redis() -> Self {
        Self {
            buf: [0; 41],
            len: 0,
        }
    }

    /// `"-<deadline µs>"` (Redis's clock): Redis `TIME`, and nothing is
    /// written if the script starts after `deadline_us`.
    pub(in crate::backend::redis) fn deadline(deadline_us: i64) -> Self {
        let mut a = Self::redis();
        a.push(b"-");
        // At least 1: "-0" would read as a test clock of 0.
        a.push(itoa::Buffer::new().format(deadline_us.max(1)).as_bytes());
        a
    }

    /// `"<now µs>"`, or `"<now µs>:<ttl slack ms>"` when the slack is not 0:
    /// a test clock.
    pub(in crate::backend::redis) fn manual(now_us: u64, ttl_slack_ms: u64) -> Self {
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
    pub(in crate::backend::redis) fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// A limit as the scripts take it: the algorithm's number and p1..p4.
pub(in crate::backend::redis) fn encode(limit: &Limit) -> (u8, [i64; 4]) {
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
        Limit::Concurrency(c) => (6, [int(c.limit), int(c.ttl_us), int(c.slot), 0]),
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
        Limit::Calendar(c) => (
            9,
            [
                int(c.limit),
                int(c.bounds[0]),
                int(c.bounds[1]),
                int(c.bounds[2]),
            ],
        ),
    }
}

/// A limit's p1..p4 as the scripts take them (an override's quota, stored
/// in Redis: see [`handle`](crate::handle#per-key-overrides)).
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
pub(in crate::backend::redis) fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The seven numbers of one tier of a check: algorithm, p1..p4, cost, flags
/// ([`SHADOW`], [`UNDO`], [`SHORT`]).
#[cfg(test)]
pub(in crate::backend::redis) fn tier_args(check: &TierCheck, flags: u8) -> [i64; 7] {
    tier_args_flagged(check, i64::from(flags))
}

/// [`tier_args`] with flags as the script reads them (a candidate's carry
/// its live check's position: [`candidate_flags`]).
fn tier_args_flagged(check: &TierCheck, flags: i64) -> [i64; 7] {
    let (algorithm, p) = encode(&check.limit);
    [
        i64::from(algorithm),
        p[0],
        p[1],
        p[2],
        p[3],
        int(check.cost),
        flags,
    ]
}

/// The home suffix of a tier whose quota is not its configured one
/// (`check.home`) in a way its stored values show: the configured unit of a
/// token or leaky bucket of another unit, the configured window length of
/// a fixed window or sliding window counter of another length, the
/// configured calendar's boundaries for a calendar of other boundaries.
/// Up to three numbers (`lua/dispatch.lua`'s `tier_spec`); none when the
/// stored values mean the same under both (another limit or burst only:
/// they name their rate).
pub(in crate::backend::redis) fn home_suffix(check: &TierCheck) -> ([u64; 3], usize) {
    match (&check.limit, &check.home) {
        (Limit::TokenBucket(b), Some(Limit::TokenBucket(h))) if b.unit != h.unit => {
            ([h.unit, 0, 0], 1)
        }
        (Limit::LeakyBucket(g), Some(Limit::LeakyBucket(h))) if g.bucket.unit != h.bucket.unit => {
            ([h.bucket.unit, 0, 0], 1)
        }
        (Limit::FixedWindow(w), Some(Limit::FixedWindow(h)))
        | (Limit::SlidingWindowCounter(w), Some(Limit::SlidingWindowCounter(h)))
            if w.window_us != h.window_us =>
        {
            ([h.window_us, 0, 0], 1)
        }
        (Limit::Calendar(c), Some(Limit::Calendar(h))) if c.bounds != h.bounds => (h.bounds, 3),
        _ => ([0; 3], 0),
    }
}

/// One tier's spec argument ([`tier_args`] separated by single spaces, then
/// its [`home_suffix`]), on the stack: at most ten 20-character numbers and
/// nine spaces.
#[derive(Clone, Copy)]
pub(in crate::backend::redis) struct TierSpec {
    buf: [u8; 209],
    len: u8,
}

impl TierSpec {
    /// The spec of `check` with these flags.
    pub(in crate::backend::redis) fn new(check: &TierCheck, flags: u8) -> Self {
        Self::flagged(check, i64::from(flags))
    }

    /// The spec of `check` with flags as the script reads them
    /// ([`candidate_flags`]).
    pub(in crate::backend::redis) fn flagged(check: &TierCheck, flags: i64) -> Self {
        let mut spec = Self {
            buf: [0; 209],
            len: 0,
        };
        let mut at = 0;
        let (home, homes) = home_suffix(check);
        let home = home[..homes].iter().map(|&h| int(h));
        for (i, n) in tier_args_flagged(check, flags)
            .into_iter()
            .chain(home)
            .enumerate()
        {
            if i > 0 {
                spec.buf[at] = b' ';
                at += 1;
            }
            let mut b = itoa::Buffer::new();
            let digits = b.format(n).as_bytes();
            spec.buf[at..at + digits.len()].copy_from_slice(digits);
            at += digits.len();
        }
        // At most 10 × 20 + 9 = 209.
        spec.len = u8::try_from(at).unwrap_or(u8::MAX);
        spec
    }

    /// The argument's bytes.
    pub(in crate::backend::redis) fn as_bytes(&self) -> &[u8] {
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
pub(in crate::backend::redis) fn write_tier(cmd: &mut Cmd, check: &TierCheck, flags: u8) {
    cmd.arg(TierSpec::new(check, flags).as_bytes());
}

/// Writes a candidate check's spec, its live check at `live` (from 0).
pub(in crate::backend::redis) fn write_candidate(
    cmd: &mut Cmd,
    check: &TierCheck,
    flags: u8,
    live: usize,
) {
    cmd.arg(TierSpec::flagged(check, candidate_flags(flags, live)).as_bytes());
}

/// The eight `ARGV` of one key in the cluster script's `refund` mode:
/// algorithm, p1..p4, cost, charged_at (µs), undo.
/// A `debt` (a priced request's cost above its estimate) is sent as a
/// negative cost. A bucket's p4, a fixed window's or counter's p3, is its
/// [`home_suffix`] (0: none; a refund never reads the leaky bucket's
/// maximum delay): a refund gives back only on a value of its own quota.
pub(in crate::backend::redis) fn refund_args(
    check: &TierCheck,
    charge: &Charge,
    debt: bool,
) -> [i64; 8] {
    let (algorithm, mut p) = encode(&check.limit);
    let (home, homes) = home_suffix(check);
    let h = if homes == 1 { int(home[0]) } else { 0 };
    match check.limit {
        Limit::TokenBucket(_) | Limit::LeakyBucket(_) => p[3] = h,
        Limit::FixedWindow(_) | Limit::SlidingWindowCounter(_) => p[2] = h,
        _ => {}
    }
    let cost = if debt {
        -int(check.cost)
    } else {
        int(check.cost)
    };
    [
        i64::from(algorithm),
        p[0],
        p[1],
        p[2],
        p[3],
        cost,
        int(charge.at_us),
        int(charge.undo),
    ]
}

/// A pack of candidate quotas' spec algorithm (`lua/dispatch.lua`,
/// `pack_spec`).
const PACK: i64 = 10;

/// What a tier key's candidates pack is named by: `<tier key>{c}`
/// (docs/redis.md, "Stored values").
pub(crate) const PACK_SUFFIX: &str = "{c}";

/// The candidates of one live check sent packed: the live check's index
/// and the candidates' indices.
pub(in crate::backend::redis) type Pack = (usize, std::ops::Range<usize>);

/// How one candidate check, or the candidates of one live check, are sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::backend::redis) enum Sent {
    /// On its own key, as any tier.
    Own(usize),
    /// Packed ([`write_pack`]).
    Pack(Pack),
}

/// How a check's candidates (the last `live_of.len()` checks, each of the
/// live check at its index in `live_of`) are sent, in order: the
/// candidates of one live check packed in ONE key `<live key>{c}` with one
/// spec ([`write_pack`]) when every one of them can be (its key is its
/// live check's then a suffix, its live check's candidates are listed
/// together, and it is a token bucket of rate 1, a policing leaky bucket
/// of rate 1, a fixed or calendar window or a sliding window counter, of
/// its configured quota); else each on its own key, as any tier (a
/// sliding log's state is a sorted set: docs/rollout.md, "Candidate
/// quotas"). Whether a live check's candidates are packed depends on
/// them alone, so a candidate's state has one place whatever else the
/// request checks.
pub(in crate::backend::redis) fn packs(
    checks: &[TierCheck],
    live_of: &[u8],
) -> smallvec::SmallVec<[Sent; 4]> {
    let mut sent: smallvec::SmallVec<[Sent; 4]> = smallvec::SmallVec::new();
    let Some(n) = checks.len().checked_sub(live_of.len()) else {
        return sent;
    };
    let mut j = 0;
    while j < live_of.len() {
        let of = live_of[j];
        let end = j + live_of[j..].iter().take_while(|&&l| l == of).count();
        let (of, group) = (usize::from(of), n + j..n + end);
        let again = live_of[end..].contains(&live_of[j]) || live_of[..j].contains(&live_of[j]);
        let packed = !again
            && checks
                .get(of)
                .filter(|_| of < n)
                .is_some_and(|live| checks[group.clone()].iter().all(|c| packable(&live.key, c)));
        if packed {
            sent.push(Sent::Pack((of, group)));
        } else {
            sent.extend(group.map(Sent::Own));
        }
        j = end;
    }
    sent
}

/// Whether candidate `c` of the live check on `live` can be packed.
fn packable(live: &str, c: &TierCheck) -> bool {
    c.home.is_none()
        && c.key.len() > live.len()
        && c.key.starts_with(live)
        && match c.limit {
            Limit::TokenBucket(b) => b.rate == 1,
            Limit::LeakyBucket(g) => g.bucket.rate == 1 && g.max_delay_us.is_none(),
            Limit::FixedWindow(_) | Limit::Calendar(_) | Limit::SlidingWindowCounter(_) => true,
            _ => false,
        }
}

/// The key the candidates pack of `checks[of]` is sent with, the first
/// `live` of `checks` being the live checks: the live check's own key when
/// its value is a string of one `SET` (a token or leaky bucket, a fixed or
/// calendar window, a sliding window counter) and no other live check has
/// that key (the pack then follows the live value and a `\0` in it, and
/// is written by the live value's own `SET`: no key and no write of its
/// own; `lua/dispatch.lua`, `candidate_inline`); else `<live>{c}`
/// (docs/redis.md, "Stored values").
pub(in crate::backend::redis) fn pack_key(
    checks: &[TierCheck],
    of: usize,
    live: usize,
) -> smallvec::SmallVec<[u8; 64]> {
    let mut k = smallvec::SmallVec::new();
    let Some(c) = checks.get(of) else {
        return k;
    };
    k.extend_from_slice(c.key.as_bytes());
    if !holds_pack(checks, of, live) {
        k.extend_from_slice(PACK_SUFFIX.as_bytes());
    }
    k
}

/// Whether the candidates pack of `checks[of]` lives in the live check's
/// own value ([`pack_key`]).
fn holds_pack(checks: &[TierCheck], of: usize, live: usize) -> bool {
    checks.get(of).is_some_and(|c| {
        matches!(
            c.limit,
            Limit::TokenBucket(_)
                | Limit::LeakyBucket(_)
                | Limit::FixedWindow(_)
                | Limit::Calendar(_)
                | Limit::SlidingWindowCounter(_)
        ) && checks[..live.min(checks.len())]
            .iter()
            .enumerate()
            .all(|(j, other)| j == of || other.key != c.key)
    })
}

/// How many of the last of `sent` (a call's candidates, [`packs`]) are
/// carried in their live check's spec ([`write_tier_with_pack`]): the
/// packs at the end of the call that their tier key holds, in the order
/// of their live checks. They have no key and no spec of their own, and
/// the script answers them after every check it was sent, in that order
/// (`lua/dispatch.lua`, `check_plain` and `check_request`): the reply's
/// layout and the trailer's numbering are the same as with each sent on
/// its own. The first `live` of `checks` are the live checks.
pub(in crate::backend::redis) fn embedded_packs(
    checks: &[TierCheck],
    sent: &[Sent],
    live: usize,
) -> usize {
    let mut n = 0;
    let mut before = usize::MAX;
    for s in sent.iter().rev() {
        match s {
            Sent::Pack((of, _)) if *of < before && holds_pack(checks, *of, live) => {
                before = *of;
                n += 1;
            }
            _ => break,
        }
    }
    n
}

/// A candidate's tag in its pack: the FNV-1a hash of its key past its
/// live key (`{c:80/1m}`), below 2^52 (exact in the script's doubles).
pub(in crate::backend::redis) fn pack_tag(suffix: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in suffix.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    int(h & ((1 << 52) - 1))
}

/// Writes the spec of `pack` of `checks`, its live check at `at` (from 0)
/// in the call: `"10 <at + 1> <k>"` then per candidate `"<algorithm> <p1>
/// <p2> <p3> <p4> <cost> <tag>"` (`lua/dispatch.lua`, `pack_spec`).
pub(in crate::backend::redis) fn write_pack(
    cmd: &mut Cmd,
    checks: &[TierCheck],
    pack: &Pack,
    at: usize,
) {
    let mut spec: smallvec::SmallVec<[u8; 256]> = smallvec::SmallVec::new();
    push_pack(&mut spec, checks, pack, at);
    cmd.arg(&spec[..]);
}

/// Writes the spec of live check `check` (as [`write_tier`]) carrying the
/// candidates `pack` of `checks`, its live check at `at` (from 0):
/// `"<spec> c <pack spec>"` ([`write_pack`]; `lua/dispatch.lua`,
/// `tier_spec`). The pack is in the tier key's value ([`pack_key`]).
pub(in crate::backend::redis) fn write_tier_with_pack(
    cmd: &mut Cmd,
    check: &TierCheck,
    flags: u8,
    checks: &[TierCheck],
    pack: &Pack,
    at: usize,
) {
    let mut spec: smallvec::SmallVec<[u8; 256]> = smallvec::SmallVec::new();
    spec.extend_from_slice(TierSpec::new(check, flags).as_bytes());
    spec.extend_from_slice(b" c ");
    push_pack(&mut spec, checks, pack, at);
    cmd.arg(&spec[..]);
}

/// Appends the spec of `pack` ([`write_pack`]) to `spec`.
fn push_pack(
    spec: &mut smallvec::SmallVec<[u8; 256]>,
    checks: &[TierCheck],
    pack: &Pack,
    at: usize,
) {
    let (of, range) = pack;
    let live = checks.get(*of).map_or(0, |c| c.key.len());
    let start = spec.len();
    let mut push = |n: i64| {
        if spec.len() > start {
            spec.push(b' ');
        }
        spec.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    };
    push(PACK);
    push(int(at as u64 + 1));
    push(int(range.len() as u64));
    for c in &checks[range.clone()] {
        let (algorithm, p) = encode(&c.limit);
        push(i64::from(algorithm));
        for x in p {
            push(x);
        }
        push(int(c.cost));
        push(pack_tag(c.key.get(live..).unwrap_or("")));
    }
}
