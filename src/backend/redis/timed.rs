//! A check's timeout, as a named future.

use crate::backend::Verdict;
use crate::error::BackendError;
use std::time::Duration;

/// `fut`, failing with [`BackendError::Timeout`] `timeout` after its first
/// poll (a future awaited later than it was built, as a caller that builds
/// many before awaiting any does, gets its whole timeout; its command is
/// sent on that poll too). No timeout: no timer at all. The timer is made
/// on that first poll, so a check can be built outside a runtime (a service
/// called on one thread, its future awaited on a runtime).
pub(super) fn with_timeout<F>(timeout: Option<Duration>, fut: F) -> Timed<F>
where
    F: std::future::Future<Output = Result<Verdict, BackendError>>,
{
    Timed {
        fut,
        sleep: None,
        limit: timeout,
    }
}

pin_project_lite::pin_project! {
    /// [`with_timeout`]'s future: a named type rather than an `async`
    /// block, which would keep room for `fut` twice (once captured, once
    /// awaited) in a future that is built and boxed per request.
    pub(super) struct Timed<F> {
        #[pin]
        fut: F,
        #[pin]
        sleep: Option<tokio::time::Sleep>,
        limit: Option<Duration>,
    }
}

impl<F> std::future::Future for Timed<F>
where
    F: std::future::Future<Output = Result<Verdict, BackendError>>,
{
    type Output = Result<Verdict, BackendError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let mut this = self.project();
        if let std::task::Poll::Ready(r) = this.fut.poll(cx) {
            return std::task::Poll::Ready(r);
        }
        let Some(limit) = *this.limit else {
            return std::task::Poll::Pending;
        };
        if this.sleep.is_none() {
            this.sleep.set(Some(tokio::time::sleep(limit)));
        }
        match this.sleep.as_pin_mut().map(|sleep| sleep.poll(cx)) {
            Some(std::task::Poll::Ready(())) => {
                std::task::Poll::Ready(Err(BackendError::Timeout(limit)))
            }
            _ => std::task::Poll::Pending,
        }
    }
}
