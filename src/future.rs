//! [`ResponseFuture`]: the check (when the backend is remote), then the inner
//! service, then the headers.

use crate::backend::{CheckFuture, TierCheck, Verdict};
use crate::engine::check::{resume, Resumed, Started};
use crate::engine::decide::{Outcome, Refunds};
use crate::engine::outcome::outcome;
use crate::engine::plan::Meta;
use crate::engine::runtime::Shared;
use crate::error::BackendError;
use crate::response::{RateLimitHeaders, ResponseBody};
use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;
use tower_service::Service;

pin_project! {
    /// The response future of [`RateLimitService`](crate::service::RateLimitService).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        /// Waiting for another request's answer on a lapsed deny-cache key
        /// (bounded by the backend timeout); then the cache again, then the
        /// backend.
        Waiting {
            #[pin]
            wait: Pin<Box<dyn Future<Output = ()> + Send>>,
            // Boxed: a rare state, kept from growing every request's future.
            waiter: Box<Waiter<S, ReqBody>>,
        },
        /// Waiting for the backend (bounded by the backend timeout).
        Checking {
            #[pin]
            check: CheckFuture,
            service: S,
            request: Request<ReqBody>,
            shared: Arc<Shared>,
            meta: Meta,
        },
        /// A shaping tier queued the request: wait for its slot.
        Delaying {
            #[pin]
            sleep: tokio::time::Sleep,
            service: S,
            request: Request<ReqBody>,
            headers: Option<RateLimitHeaders>,
            refunds: Option<Box<Refunds>>,
        },
        /// The inner service runs; its response gets `headers`, and its
        /// status decides `refunds` (issued as soon as the response is
        /// available; the headers describe the state before them).
        Calling {
            #[pin]
            future: S::Future,
            headers: Option<RateLimitHeaders>,
            refunds: Option<Box<Refunds>>,
        },
        /// The layer answers by itself (429 or 503).
        Responding {
            response: Option<Response<Bytes>>,
        },
        Done,
    }
}

/// What a request waiting for another's probe keeps until it resumes.
pub(crate) struct Waiter<S, ReqBody> {
    pub(crate) service: S,
    pub(crate) request: Request<ReqBody>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) checks: Vec<TierCheck>,
    pub(crate) meta: Meta,
    /// When the request reached the layer.
    pub(crate) started: Instant,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn call(
        future: S::Future,
        headers: Option<RateLimitHeaders>,
        refunds: Option<Box<Refunds>>,
    ) -> Self {
        Self {
            state: State::Calling {
                future,
                headers,
                refunds,
            },
        }
    }

    pub(crate) fn respond(response: Response<Bytes>) -> Self {
        Self {
            state: State::Responding {
                response: Some(response),
            },
        }
    }

    pub(crate) fn delay(
        delay: std::time::Duration,
        service: S,
        request: Request<ReqBody>,
        headers: Option<RateLimitHeaders>,
        refunds: Option<Box<Refunds>>,
    ) -> Self {
        Self {
            state: State::Delaying {
                sleep: tokio::time::sleep(delay),
                service,
                request,
                headers,
                refunds,
            },
        }
    }

    pub(crate) fn wait(
        wait: Pin<Box<dyn Future<Output = ()> + Send>>,
        waiter: Waiter<S, ReqBody>,
    ) -> Self {
        Self {
            state: State::Waiting {
                wait,
                waiter: Box::new(waiter),
            },
        }
    }

    pub(crate) fn check(
        check: CheckFuture,
        service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared>,
        meta: Meta,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                service,
                request,
                shared,
                meta,
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Waiting { wait, .. } => {
                    ready!(wait.poll(cx));
                    let StateOwned::Waiting { waiter, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Waiting");
                    };
                    let Waiter {
                        service,
                        request,
                        shared,
                        checks,
                        meta,
                        started,
                    } = *waiter;
                    let next = match resume(&shared, checks, meta, started) {
                        Resumed::Respond(res) => State::Responding {
                            response: Some(res),
                        },
                        Resumed::Started(Started::Pending(check), meta) => State::Checking {
                            check,
                            service,
                            request,
                            shared,
                            meta,
                        },
                        Resumed::Started(Started::Ready(result), meta) => {
                            decided(&shared, &meta, result, service, request)
                        }
                    };
                    this.state.set(next);
                }
                StateProj::Checking {
                    check,
                    shared,
                    meta,
                    ..
                } => {
                    let result = ready!(check.poll(cx));
                    let (shared, meta) = (shared.clone(), std::mem::take(meta));
                    let StateOwned::Checking {
                        service, request, ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Checking");
                    };
                    this.state
                        .set(decided(&shared, &meta, result, service, request));
                }
                StateProj::Delaying { sleep, .. } => {
                    ready!(sleep.poll(cx));
                    let StateOwned::Delaying {
                        mut service,
                        request,
                        headers,
                        refunds,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Delaying");
                    };
                    this.state.set(State::Calling {
                        future: service.call(request),
                        headers,
                        refunds,
                    });
                }
                StateProj::Calling {
                    future,
                    headers,
                    refunds,
                } => {
                    // An inner error has no status: nothing is refunded.
                    let mut res = ready!(future.poll(cx))?;
                    if let Some(r) = refunds.take() {
                        r.issue(res.status());
                    }
                    if let Some(h) = headers.take() {
                        h.write(res.headers_mut());
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(|body| ResponseBody::Inner { body })));
                }
                StateProj::Responding { response } => {
                    let res = response.take().unwrap_or_default();
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(ResponseBody::full)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// The state after the backend's answer (or error): call the inner service
/// (after a shaping delay), or answer.
fn decided<S, ReqBody>(
    shared: &Shared,
    meta: &Meta,
    result: Result<Verdict, BackendError>,
    mut service: S,
    request: Request<ReqBody>,
) -> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    let (parts, body) = request.into_parts();
    let decided = outcome(shared, meta, result, &parts);
    let request = Request::from_parts(parts, body);
    match decided {
        Outcome::Pass(headers, delay, refunds) if delay.is_zero() => State::Calling {
            future: service.call(request),
            headers,
            refunds,
        },
        Outcome::Pass(headers, delay, refunds) => State::Delaying {
            sleep: tokio::time::sleep(delay),
            service,
            request,
            headers,
            refunds,
        },
        Outcome::Respond(res) => State::Responding {
            response: Some(res),
        },
    }
}
