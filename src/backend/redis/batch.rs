//! Group commit on a single Redis (or a Sentinel primary): while a check's
//! call is in flight on the backend's connection, the checks of requests
//! that arrive meanwhile wait in a queue, and when the call returns they
//! are sent together, as **one** call of `lua/batch.lua`, at most
//! [`DEFAULT_MAX_BATCH`] requests a call (more queued: several calls, sent
//! at once from one task, written in arrival order). No timer: a request that finds nothing in flight is sent at
//! once, alone, as the ordinary check (`check.rs`), so at low load nothing
//! changes — one call per request, no added latency — and under load
//! Redis's fixed cost of a call (its I/O, the function call, `TIME`) is
//! shared by every request in it.
//!
//! Each request in a call keeps what it had alone: it is decided in arrival
//! order on the state the requests before it left, all or nothing on its
//! own keys; it carries its own deadline in Redis's clock (a request that
//! reaches Redis after it writes nothing and answers "late", which its
//! caller's failure policy handles); it gets its own reply, and a request
//! whose caller stopped waiting while queued is not sent at all. What a
//! call shares is its fate when the call itself fails (a broken
//! connection): every request in it gets that error.
//!
//! A request is admitted on its future's first poll, when it would be
//! sent, not when it is built: a caller that builds several checks and
//! awaits them in turn never queues one behind a check not yet sent. A
//! queued request waits as its built command; the batch takes its keys,
//! deadline and specs from it. With a test clock the call's clock is read
//! when the call is sent. In the script, a request whose tiers are all
//! fixed windows is decided increment-first (`check_incr` in
//! `lua/dispatch.lua`, as alone) and answers its counts inline in the
//! call's reply ([`wire::BatchValues`], split by each request's number of
//! tiers).
//!
//! A cluster sends each request's calls per slot, not through this queue
//! (`cluster.rs`).

use super::{wire, RedisBackend};
use crate::backend::{Shadow, Verdict};
use crate::error::BackendError;
use ::redis::Cmd;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use tokio::sync::oneshot;

/// The most requests one group commit call carries, by default: Redis runs
/// nothing else while a script runs, and 32 requests of four tiers take
/// ~0.5–0.7 ms of it (`perf/README.md`, "Group commit").
pub(crate) const DEFAULT_MAX_BATCH: usize = 32;

/// One backend's group commit: how many calls are in flight, and the
/// requests waiting for the next.
pub(super) struct Batcher {
    state: Mutex<State>,
    /// The most requests a call carries; 1 turns group commit off.
    max: AtomicUsize,
}

impl Default for Batcher {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            max: AtomicUsize::new(DEFAULT_MAX_BATCH),
        }
    }
}

impl Batcher {
    pub(super) fn set_max(&self, max: usize) {
        self.max.store(max.max(1), Ordering::Relaxed);
    }
}

#[derive(Default)]
struct State {
    /// Check calls on the connection whose reply has not come yet.
    in_flight: usize,
    queue: Vec<Queued>,
}

/// A request's check waiting for the next call: its command as built to
/// be sent alone (the batch takes its keys, deadline and specs from it).
pub(super) struct Queued {
    cmd: Cmd,
    tiers: wire::ReplyTiers,
    flags: u8,
    shadow: Shadow,
    tx: oneshot::Sender<Result<Verdict, BackendError>>,
}

/// What [`RedisBackend::enter`] decided for a check on its first poll.
pub(super) enum Entry {
    /// Send it now, alone, and drop the [`Release`] (if any: none when
    /// group commit is off) when its call is over.
    Send(Option<Release>),
    /// Queued: its verdict comes on this channel.
    Queued(oneshot::Receiver<Result<Verdict, BackendError>>),
}

/// Calls [`RedisBackend::call_done`] when dropped: when a call's reply
/// came, or when the caller of a request sent alone stopped waiting (its
/// call may still be in Redis's queue; the next one goes out meanwhile).
pub(super) struct Release(RedisBackend);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.call_done();
    }
}

impl RedisBackend {
    /// The most requests one group commit call carries (default 32);
    /// `1` turns group commit off, so every request is its own call as it
    /// arrives. See `docs/redis.md`, "Group commit". A cluster backend
    /// sends each request's calls per slot as they come and ignores it.
    /// The setting belongs to the connection, so it applies to every
    /// clone of this backend.
    ///
    /// Group commit: while a check's call is in flight on the connection,
    /// the checks of requests arriving meanwhile wait and go together as
    /// one call when it returns (each still all or nothing on its own keys,
    /// decided in arrival order, with its own deadline and reply). A
    /// request that finds nothing in flight is sent at once, alone: no
    /// timer, no added latency at low load.
    #[must_use]
    pub fn with_max_batch(self, max: usize) -> Self {
        self.inner.batcher.set_max(max);
        self
    }

    /// A check's command on its first poll (when it would be sent): sent
    /// now when no call is in flight (or group commit is off), else taken
    /// (`cmd` and `tiers` left empty) and queued for the next call. By
    /// reference: moved in and out, they would take their room twice in
    /// every check's future.
    pub(super) fn enter(
        &self,
        cmd: &mut Cmd,
        tiers: &mut wire::ReplyTiers,
        flags: u8,
        shadow: Shadow,
    ) -> Entry {
        let b = &self.inner.batcher;
        if b.max.load(Ordering::Relaxed) <= 1 {
            return Entry::Send(None);
        }
        let mut st = lock(&b.state);
        if st.in_flight == 0 {
            st.in_flight = 1;
            return Entry::Send(Some(Release(self.clone())));
        }
        let (tx, rx) = oneshot::channel();
        st.queue.push(Queued {
            cmd: std::mem::take(cmd),
            tiers: std::mem::take(tiers),
            flags,
            shadow,
            tx,
        });
        Entry::Queued(rx)
    }

    /// A call's reply came (or its caller left): when it was the last in
    /// flight, everything queued goes out, [`DEFAULT_MAX_BATCH`] requests
    /// a call at most, each call in a task of its own.
    fn call_done(&self) {
        let b = &self.inner.batcher;
        let calls = {
            let mut st = lock(&b.state);
            st.in_flight = st.in_flight.saturating_sub(1);
            if st.in_flight > 0 || st.queue.is_empty() {
                return;
            }
            let queue = std::mem::take(&mut st.queue);
            let calls = group(queue, b.max.load(Ordering::Relaxed));
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                // No runtime to send them from: their receivers see the
                // senders dropped (BackendError::NoRuntime).
                return;
            };
            st.in_flight = calls.len();
            (rt, calls)
        };
        let (rt, calls) = calls;
        rt.spawn(self.clone().send_all(calls));
    }

    /// The calls, all at once, from one task that writes them on the
    /// connection in order (each is written on its first poll), so that
    /// Redis decides every request in arrival order.
    async fn send_all(self, calls: Vec<Vec<Queued>>) {
        let mut sends: Vec<_> = calls
            .into_iter()
            .map(|call| Some(Box::pin(self.send(call))))
            .collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for slot in &mut sends {
                if let Some(f) = slot {
                    if f.as_mut().poll(cx).is_ready() {
                        *slot = None;
                    } else {
                        pending = true;
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
    }

    /// One call of queued requests: a request alone as its own command,
    /// more as one call of `lua/batch.lua`.
    async fn send(&self, mut call: Vec<Queued>) {
        let _release = Release(self.clone());
        let sent = self.local_us();
        if call.len() == 1 {
            if let Some(q) = call.pop() {
                let r = self.call_check(q.cmd, sent, &q.tiers, q.flags, q.shadow);
                let _ = q.tx.send(r.await);
            }
            return;
        }
        let cmd = match self.batch_cmd(&call) {
            Ok(cmd) => cmd,
            Err(e) => return fail(call, &e),
        };
        let replies = match self.connection().await {
            Ok(mut conn) => self
                .eval::<wire::BatchValues>(&cmd, &self.inner.batch_script, &mut conn)
                .await
                .map_err(|e| self.error(e)),
            Err(e) => Err(e),
        };
        let replies = match replies {
            Ok(r) => {
                let now = r.now();
                match r.replies(call.iter().map(|q| q.tiers.len())) {
                    Some(replies) => {
                        if self.clock.is_none() {
                            if let Some(now) = now {
                                self.calibrate(sent, now);
                            }
                        }
                        replies
                    }
                    None => {
                        let e = BackendError::Reply(format!(
                            "a group commit of {} requests answered another layout",
                            call.len()
                        ));
                        return fail(call, &e);
                    }
                }
            }
            Err(e) => return fail(call, &e),
        };
        for (q, reply) in call.into_iter().zip(replies) {
            let verdict = match reply {
                Ok(values) => self.verdict(&values, &q.tiers, q.flags, q.shadow),
                Err(message) => Err(BackendError::Reply(message)),
            };
            let _ = q.tx.send(verdict);
        }
    }

    /// The group commit's `FCALL` (or `EVALSHA`): every request's keys, the
    /// hour's sets, the call's clock and how many sets, then per request
    /// its number of tiers, its deadline and its specs (`lua/batch.lua`),
    /// each taken from the request's own command.
    fn batch_cmd(&self, call: &[Queued]) -> Result<Cmd, BackendError> {
        let parts = call
            .iter()
            .map(|q| Parts::of(&q.cmd, q.tiers.len()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cmd = if self.inner.functions.load(Ordering::Relaxed) {
            let mut cmd = ::redis::cmd("FCALL");
            cmd.arg(&self.inner.library.batch_function);
            cmd
        } else {
            let mut cmd = ::redis::cmd("EVALSHA");
            cmd.arg(self.inner.batch_script.get_hash());
            cmd
        };
        // One refused-keys set per call (`group`); the shadow-limited set
        // of any request that sends it (the same hour's).
        let refused = parts.iter().find_map(|p| p.sets.first());
        let shadowed = parts.iter().find_map(|p| p.sets.get(1));
        let sets = usize::from(refused.is_some()) + usize::from(shadowed.is_some());
        let keys: usize = parts.iter().map(|p| p.keys.len()).sum();
        cmd.arg(keys + sets);
        for p in &parts {
            for k in &p.keys {
                cmd.arg(*k);
            }
        }
        for set in refused.into_iter().chain(shadowed) {
            cmd.arg(*set);
        }
        cmd.arg(self.clock_arg().as_bytes());
        cmd.arg(sets);
        for p in &parts {
            cmd.arg(p.keys.len()).arg(p.deadline);
            for spec in &p.specs {
                cmd.arg(*spec);
            }
        }
        Ok(cmd)
    }
}

/// A queued request's part of a batch, read from its command as built to
/// go alone: `FCALL <name> <numkeys> <keys…> <sets…> <clock> <specs…>`
/// (`check_cmd`; `EVALSHA <sha> …` alike).
struct Parts<'a> {
    keys: Vec<&'a [u8]>,
    /// The refused-keys set, then the shadow-limited set, if sent.
    sets: Vec<&'a [u8]>,
    /// The deadline in Redis's clock (µs; 0 = none): the clock argument's
    /// "-<deadline>" (a test clock is the call's clock argument).
    deadline: i64,
    specs: Vec<&'a [u8]>,
}

impl<'a> Parts<'a> {
    fn of(cmd: &'a Cmd, tiers: usize) -> Result<Self, BackendError> {
        let bad = || BackendError::Reply("a queued check's command has another layout".into());
        let args: Vec<&[u8]> = cmd
            .args_iter()
            .map(|a| match a {
                ::redis::Arg::Simple(b) => Ok(b),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?;
        let numkeys: usize = args
            .get(2)
            .and_then(|n| std::str::from_utf8(n).ok()?.parse().ok())
            .ok_or_else(bad)?;
        // One key and one spec per tier, or per pack of candidates
        // (`wire::packs`): up to `tiers` of each.
        let specs = args.get(4 + numkeys..).ok_or_else(bad)?;
        let sent = specs.len();
        let keys = args.get(3..3 + sent).ok_or_else(bad)?;
        let sets = args.get(3 + sent..3 + numkeys).ok_or_else(bad)?;
        let clock = args.get(3 + numkeys).ok_or_else(bad)?;
        if sent > tiers || sets.len() > 2 {
            return Err(bad());
        }
        let deadline = match clock.strip_prefix(b"-") {
            Some(d) => std::str::from_utf8(d)
                .ok()
                .and_then(|d| d.parse().ok())
                .ok_or_else(bad)?,
            None => 0,
        };
        Ok(Self {
            keys: keys.to_vec(),
            sets: sets.to_vec(),
            deadline,
            specs: specs.to_vec(),
        })
    }
}

/// The flags a check's reply is parsed with.
pub(super) fn flags(undo: bool) -> u8 {
    wire::SHORT | if undo { wire::UNDO } else { 0 }
}

/// The queued requests whose callers still wait, as calls: those of one
/// refused-keys set together (all of them, but at an hour's turn), in
/// arrival order, at most `max` a call.
fn group(queue: Vec<Queued>, max: usize) -> Vec<Vec<Queued>> {
    let mut calls: Vec<Vec<Queued>> = Vec::new();
    // Per set, the call being filled.
    let mut open: Vec<(Option<Vec<u8>>, usize)> = Vec::new();
    for q in queue.into_iter().filter(|q| !q.tx.is_closed()) {
        let set = Parts::of(&q.cmd, q.tiers.len())
            .ok()
            .and_then(|p| p.sets.first().map(|s| s.to_vec()));
        match open.iter_mut().find(|(s, _)| *s == set) {
            Some((_, c)) if calls[*c].len() < max => calls[*c].push(q),
            Some((_, c)) => {
                *c = calls.len();
                calls.push(vec![q]);
            }
            None => {
                open.push((set, calls.len()));
                calls.push(vec![q]);
            }
        }
    }
    calls
}

/// Every request of a failed call gets its error.
fn fail(call: Vec<Queued>, e: &BackendError) {
    for q in call {
        let _ = q.tx.send(Err(e.clone()));
    }
}

/// A queued request's verdict, when its call answers.
pub(super) async fn queued(
    rx: oneshot::Receiver<Result<Verdict, BackendError>>,
) -> Result<Verdict, BackendError> {
    rx.await.unwrap_or(Err(BackendError::NoRuntime))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
