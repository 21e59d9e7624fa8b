//! A circuit breaker in front of the backend: after `failures` consecutive
//! failures it stops calling the backend for `probe_interval`, answering with
//! the failure policy at once; then one request probes, and success closes it.
//! During an outage a request then costs microseconds, not the timeout.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Circuit breaker settings (defaults: 5 failures, 500 ms probe interval, so
/// limiting resumes within about half a second of the backend's return).
///
/// In a policy file, the `[circuit_breaker]` table (or an inline
/// `circuit_breaker = { failures = 5, probe_interval = "500ms" }`), each
/// field optional, `probe_interval` in humantime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitBreaker {
    /// Consecutive backend failures that open the circuit (0 disables it).
    pub failures: u32,
    /// How long the circuit stays open before one request probes.
    #[serde(with = "humantime_serde")]
    pub probe_interval: Duration,
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        Self {
            failures: 5,
            probe_interval: Duration::from_millis(500),
        }
    }
}

/// The breaker's state, as a gauge value: 0 closed, 1 open, 2 half-open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

pub(crate) struct Breaker {
    config: CircuitBreaker,
    origin: Instant,
    consecutive: AtomicU32,
    /// 1 + the milliseconds since `origin` until which the circuit is open;
    /// 0 = closed.
    open_until_ms: AtomicU64,
    probing: AtomicBool,
}

/// What the breaker lets a request do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Permit {
    /// Call the backend.
    #[default]
    Call,
    /// Call the backend as the single probe of a half-open circuit.
    Probe,
    /// Do not call the backend.
    Reject,
}

impl State {
    /// `closed`, `open` or `half_open`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Self {
            config,
            origin: Instant::now(),
            consecutive: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn permit(&self) -> Permit {
        self.permit_with(|| self.now_ms())
    }

    /// [`permit`](Self::permit) with the clock passed in (milliseconds since
    /// `origin`), so tests drive time; it is read only when the circuit is
    /// not closed, so the closed fast path reads no clock at all.
    #[inline]
    fn permit_with(&self, now_ms: impl FnOnce() -> u64) -> Permit {
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Permit::Call;
        }
        if now_ms() + 1 < until {
            return Permit::Reject;
        }
        if self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            Permit::Probe
        } else {
            Permit::Reject
        }
    }

    pub(crate) fn state(&self) -> State {
        self.state_with(|| self.now_ms())
    }

    #[inline]
    fn state_with(&self, now_ms: impl FnOnce() -> u64) -> State {
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            State::Closed
        } else if now_ms() + 1 < until {
            State::Open
        } else {
            State::HalfOpen
        }
    }

    /// A call answered. Inline, and on a closed circuit with no failure
    /// counted a read of two atomics and no write (every request's path:
    /// no store to a line the other cores share).
    #[inline]
    pub(crate) fn success(&self, permit: Permit) {
        if self.consecutive.load(Ordering::Acquire) != 0 {
            self.consecutive.store(0, Ordering::Release);
        }
        if permit == Permit::Probe || self.open_until_ms.load(Ordering::Acquire) != 0 {
            self.close();
        }
    }

    /// The circuit closes after a success.
    #[cold]
    #[inline(never)]
    fn close(&self) {
        if self.open_until_ms.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!("rate limiter backend is back: circuit closed");
            crate::observe::set_circuit_state(State::Closed as u8);
        }
        self.probing.store(false, Ordering::Release);
    }

    pub(crate) fn failure(&self, permit: Permit) {
        self.failure_with(permit, || self.now_ms());
    }

    #[inline]
    fn failure_with(&self, permit: Permit, now_ms: impl FnOnce() -> u64) {
        if self.config.failures == 0 {
            return;
        }
        let n = self.consecutive.fetch_add(1, Ordering::AcqRel) + 1;
        if permit == Permit::Probe || n >= self.config.failures {
            let interval =
                u64::try_from(self.config.probe_interval.as_millis()).unwrap_or(u64::MAX);
            let was = self.open_until_ms.swap(
                now_ms().saturating_add(interval).saturating_add(1),
                Ordering::AcqRel,
            );
            self.probing.store(false, Ordering::Release);
            if was == 0 {
                tracing::warn!(
                    failures = n,
                    probe_interval = ?self.config.probe_interval,
                    "rate limiter backend failing: circuit open, deciding by the failure policy without calling it"
                );
                crate::observe::set_circuit_state(State::Open as u8);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_n_failures_then_probes_once() {
        let b = Breaker::new(CircuitBreaker {
            failures: 3,
            probe_interval: Duration::from_millis(0),
        });
        for _ in 0..2 {
            assert_eq!(b.permit(), Permit::Call);
            b.failure(Permit::Call);
        }
        assert_eq!(b.state(), State::Closed);
        b.failure(Permit::Call);
        // Interval 0: immediately half-open; exactly one probe.
        assert_eq!(b.permit(), Permit::Probe);
        assert_eq!(b.permit(), Permit::Reject);
        b.failure(Permit::Probe);
        assert_eq!(b.permit(), Permit::Probe);
        b.success(Permit::Probe);
        assert_eq!(b.state(), State::Closed);
        assert_eq!(b.permit(), Permit::Call);
    }

    /// A breaker with `failures` and a 500 ms probe interval; the tests drive
    /// its clock through the `_with` methods (milliseconds since `origin`).
    fn breaker(failures: u32) -> Breaker {
        Breaker::new(CircuitBreaker {
            failures,
            probe_interval: Duration::from_millis(500),
        })
    }

    /// A clock the closed fast path must never read.
    fn no_clock() -> u64 {
        panic!("a closed circuit read the clock")
    }

    #[test]
    fn closed_until_n_consecutive_failures_then_open_for_the_interval() {
        let b = breaker(3);
        b.failure_with(Permit::Call, || 10);
        b.failure_with(Permit::Call, || 20);
        assert_eq!(b.state_with(no_clock), State::Closed);
        assert_eq!(b.permit_with(no_clock), Permit::Call);
        b.failure_with(Permit::Call, || 30);
        assert_eq!(b.state_with(|| 30), State::Open);
        assert_eq!(b.permit_with(|| 30), Permit::Reject);
        // Open for exactly 500 ms from the failure that opened it: [30, 530).
        assert_eq!(b.state_with(|| 529), State::Open);
        assert_eq!(b.permit_with(|| 529), Permit::Reject);
        assert_eq!(b.state_with(|| 530), State::HalfOpen);
    }

    #[test]
    fn a_success_resets_the_consecutive_count() {
        let b = breaker(3);
        b.failure_with(Permit::Call, || 0);
        b.failure_with(Permit::Call, || 1);
        b.success(Permit::Call);
        b.failure_with(Permit::Call, || 2);
        b.failure_with(Permit::Call, || 3);
        assert_eq!(b.state_with(no_clock), State::Closed);
        assert_eq!(b.permit_with(no_clock), Permit::Call);
        b.failure_with(Permit::Call, || 4);
        assert_eq!(b.state_with(|| 4), State::Open);
    }

    #[test]
    fn half_open_permits_exactly_one_probe() {
        let b = breaker(1);
        b.failure_with(Permit::Call, || 0);
        assert_eq!(b.state_with(|| 500), State::HalfOpen);
        assert_eq!(b.permit_with(|| 500), Permit::Probe);
        // While the probe is out, everyone else is rejected, however late.
        assert_eq!(b.permit_with(|| 500), Permit::Reject);
        assert_eq!(b.permit_with(|| 501), Permit::Reject);
        assert_eq!(b.permit_with(|| 60_000), Permit::Reject);
        assert_eq!(b.state_with(|| 60_000), State::HalfOpen);
    }

    #[test]
    fn probe_success_closes_and_rearms_the_count() {
        let b = breaker(2);
        b.failure_with(Permit::Call, || 0);
        b.failure_with(Permit::Call, || 0);
        assert_eq!(b.permit_with(|| 500), Permit::Probe);
        b.success(Permit::Probe);
        assert_eq!(b.state_with(no_clock), State::Closed);
        assert_eq!(b.permit_with(no_clock), Permit::Call);
        // Closed again: it takes the full 2 consecutive failures to reopen.
        b.failure_with(Permit::Call, || 600);
        assert_eq!(b.state_with(no_clock), State::Closed);
        b.failure_with(Permit::Call, || 700);
        assert_eq!(b.state_with(|| 700), State::Open);
        assert_eq!(b.permit_with(|| 1199), Permit::Reject);
        // The probe flag was released on close: the next half-open probes.
        assert_eq!(b.permit_with(|| 1200), Permit::Probe);
    }

    #[test]
    fn probe_failure_reopens_for_a_fresh_interval() {
        let b = breaker(1);
        b.failure_with(Permit::Call, || 0);
        assert_eq!(b.permit_with(|| 800), Permit::Probe);
        b.failure_with(Permit::Probe, || 900);
        // Open again for 500 ms from the probe's failure: [900, 1400).
        assert_eq!(b.state_with(|| 900), State::Open);
        assert_eq!(b.permit_with(|| 1399), Permit::Reject);
        assert_eq!(b.state_with(|| 1400), State::HalfOpen);
        assert_eq!(b.permit_with(|| 1400), Permit::Probe);
        assert_eq!(b.permit_with(|| 1400), Permit::Reject);
    }

    #[test]
    fn a_late_success_closes_an_open_circuit() {
        // A call admitted before the circuit opened that then succeeds shows
        // the backend is back: the circuit closes without waiting to probe.
        let b = breaker(1);
        b.failure_with(Permit::Call, || 0);
        assert_eq!(b.state_with(|| 100), State::Open);
        b.success(Permit::Call);
        assert_eq!(b.state_with(no_clock), State::Closed);
        assert_eq!(b.permit_with(no_clock), Permit::Call);
    }

    #[test]
    fn zero_failures_disables_the_breaker() {
        let b = breaker(0);
        for t in 0..100 {
            b.failure_with(Permit::Call, || t);
        }
        b.failure_with(Permit::Probe, || 100);
        assert_eq!(b.state_with(no_clock), State::Closed);
        assert_eq!(b.permit_with(no_clock), Permit::Call);
    }

    #[test]
    fn state_gauge_values_and_labels() {
        assert_eq!(
            [State::Closed, State::Open, State::HalfOpen].map(|s| (s as u8, s.label())),
            [(0, "closed"), (1, "open"), (2, "half_open")]
        );
    }

    #[test]
    fn open_rejects_until_the_interval_passes() {
        let b = Breaker::new(CircuitBreaker {
            failures: 1,
            probe_interval: Duration::from_secs(3600),
        });
        b.failure(Permit::Call);
        assert_eq!(b.state(), State::Open);
        assert_eq!(b.permit(), Permit::Reject);
    }
}
