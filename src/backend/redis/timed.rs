//! A check's timeout, as a named future.

use crate::backend::Verdict;
use crate::error::BackendError;
use std::time::Duration;

/// `fut`, failing with [`BackendError::Timeout`] `timeout` after its first
/// poll (no timeout: a deadline tokio puts in the far future). The timer is
/// made on that first poll, so a check can be built outside a runtime (a
/// service called on one thread, its future awaited on a runtime).
pub(super) fn with_timeout<F>(timeout: Option<Duration>, fut: F) -> Timed<F>
where
    F: std::future::Future<Output = Result<Verdict, BackendError>>,
{
    Timed {
        fut,
        sleep: None,
        limit: timeout.unwrap_or(Duration::MAX),
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
        limit: Duration,
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
        if this.sleep.is_none() {
            this.sleep.set(Some(tokio::time::sleep(*this.limit)));
        }
        match this.sleep.as_pin_mut().map(|sleep| sleep.poll(cx)) {
            Some(std::task::Poll::Ready(())) => {
                std::task::Poll::Ready(Err(BackendError::Timeout(*this.limit)))
            }
            _ => std::task::Poll::Pending,
        }
    }
}
