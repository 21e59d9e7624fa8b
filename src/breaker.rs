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
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Permit::Call;
        }
        if self.now_ms() + 1 < until {
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
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            State::Closed
        } else if self.now_ms() + 1 < until {
            State::Open
        } else {
            State::HalfOpen
        }
    }

    pub(crate) fn success(&self, permit: Permit) {
        self.consecutive.store(0, Ordering::Release);
        if permit == Permit::Probe || self.open_until_ms.load(Ordering::Acquire) != 0 {
            if self.open_until_ms.swap(0, Ordering::AcqRel) != 0 {
                tracing::info!("rate limiter backend is back: circuit closed");
                crate::observe::set_circuit_state(State::Closed as u8);
            }
            self.probing.store(false, Ordering::Release);
        }
    }

    pub(crate) fn failure(&self, permit: Permit) {
        if self.config.failures == 0 {
            return;
        }
        let n = self.consecutive.fetch_add(1, Ordering::AcqRel) + 1;
        if permit == Permit::Probe || n >= self.config.failures {
            let interval =
                u64::try_from(self.config.probe_interval.as_millis()).unwrap_or(u64::MAX);
            let was = self.open_until_ms.swap(
                self.now_ms().saturating_add(interval).saturating_add(1),
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
