//! [`ResponseFuture`]: the engine's decision (when it must wait for the
//! backend), then the inner service, then the headers.

use crate::engine::{Allow, Decision, Pending};
use crate::http::body::ResponseBody;
use crate::http::front::Front;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use pin_project_lite::pin_project;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tower_service::Service;

pin_project! {
    /// The response future of [`RateLimitService`](crate::http::service::RateLimitService).
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
        /// The engine waits for a probe or the backend (bounded by the
        /// backend timeout); the request's head is its facts meanwhile.
        Deciding {
            pending: Pending,
            service: S,
            parts: Parts,
            body: ReqBody,
            front: Arc<Front>,
        },
        /// A shaping tier queued the request: wait for its slot.
        Delaying {
            #[pin]
            sleep: tokio::time::Sleep,
            service: S,
            request: Request<ReqBody>,
            allow: Allow,
        },
        /// The inner service runs; its response gets the allowed request's
        /// headers, and its status settles the refunds (issued as soon as
        /// the response is available; the headers describe the state before
        /// them).
        Calling {
            #[pin]
            future: S::Future,
            allow: Allow,
        },
        /// The layer answers by itself (429, 403 or 503).
        Responding {
            response: Option<Response<Bytes>>,
        },
        Done,
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn call(future: S::Future, allow: Allow) -> Self {
        Self {
            state: State::Calling { future, allow },
        }
    }

    pub(crate) fn respond(response: Response<Bytes>) -> Self {
        Self {
            state: State::Responding {
                response: Some(response),
            },
        }
    }

    pub(crate) fn delay(allow: Allow, service: S, request: Request<ReqBody>) -> Self {
        Self {
            state: State::Delaying {
                sleep: tokio::time::sleep(allow.delay),
                service,
                request,
                allow,
            },
        }
    }

    pub(crate) fn decide(
        pending: Pending,
        service: S,
        parts: Parts,
        body: ReqBody,
        front: Arc<Front>,
    ) -> Self {
        Self {
            state: State::Deciding {
                pending,
                service,
                parts,
                body,
                front,
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
                StateProj::Deciding {
                    pending,
                    parts,
                    front,
                    ..
                } => {
                    let decision =
                        ready!(pending.poll_decide(cx, &front.engine, &front.facts(parts)));
                    let StateOwned::Deciding {
                        mut service,
                        parts,
                        body,
                        front,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Deciding");
                    };
                    if let Decision::Block(block) = decision {
                        this.state.set(State::Responding {
                            response: Some(front.respond(block, &parts)),
                        });
                        continue;
                    }
                    let request = Request::from_parts(parts, body);
                    let next = match decision {
                        Decision::Allow(allow) if allow.delay.is_zero() => State::Calling {
                            future: service.call(request),
                            allow,
                        },
                        Decision::Allow(allow) => State::Delaying {
                            sleep: tokio::time::sleep(allow.delay),
                            service,
                            request,
                            allow,
                        },
                        Decision::Block(_) => unreachable!("answered above"),
                    };
                    this.state.set(next);
                }
                StateProj::Delaying { sleep, .. } => {
                    ready!(sleep.poll(cx));
                    let StateOwned::Delaying {
                        mut service,
                        request,
                        allow,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Delaying");
                    };
                    this.state.set(State::Calling {
                        future: service.call(request),
                        allow,
                    });
                }
                StateProj::Calling { future, allow } => {
                    // An inner error has no status: nothing is refunded.
                    let mut res = ready!(future.poll(cx))?;
                    if let Some(r) = allow.refunds.take() {
                        r.settle(failed(&res));
                    }
                    if let Some(h) = allow.headers.take() {
                        h.write(res.headers_mut());
                    }
                    let leases = allow.leases.take();
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(|body| match leases {
                        None => ResponseBody::Inner { body },
                        Some(l) => ResponseBody::Leased {
                            body,
                            lease: Some(crate::http::body::BodyLease(l)),
                        },
                    })));
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

/// Whether the inner service's response counts as failed for refunds by
/// result: HTTP status ≥ 400, or (feature `grpc`) a gRPC error status in its
/// headers.
fn failed<B>(res: &Response<B>) -> bool {
    #[cfg(feature = "grpc")]
    return crate::http::grpc::failed(res.status(), res.headers());
    #[cfg(not(feature = "grpc"))]
    return res.status().as_u16() >= 400;
}
