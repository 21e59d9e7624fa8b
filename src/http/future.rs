//! [`ResponseFuture`]: the engine's decision (when it must wait for the
//! backend), then the inner service, then the headers.

use crate::engine::{Allow, Decision, Pending};
use crate::http::body::ResponseBody;
use crate::http::front::Front;
use crate::http::priced::{AtHead, Pricing};
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
        /// A fleet-wide control key's settings are not read yet (the
        /// instance just started): wait for the first read, at most the
        /// backend timeout, then decide under them.
        Loading {
            wait: Pin<Box<dyn Future<Output = ()> + Send>>,
            service: S,
            request: Option<Request<ReqBody>>,
            front: Arc<Front>,
        },
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
            pricing: Option<Box<Pricing>>,
        },
        /// The inner service runs; its response gets the allowed request's
        /// headers, and its status settles the refunds (issued as soon as
        /// the response is available; the headers describe the state before
        /// them).
        Calling {
            #[pin]
            future: S::Future,
            allow: Allow,
            // Its reservation on priced tiers, settled at the head or when
            // the body ends.
            pricing: Option<Box<Pricing>>,
        },
        /// The actual was in the response head: its settle lands on Redis
        /// (at most the backend timeout) before the head goes out.
        Settling {
            landing: crate::engine::Landing,
            response: Option<S::Response>,
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
    pub(crate) fn call(future: S::Future, allow: Allow, pricing: Option<Box<Pricing>>) -> Self {
        Self {
            state: State::Calling {
                future,
                allow,
                pricing,
            },
        }
    }

    pub(crate) fn load(
        wait: Pin<Box<dyn Future<Output = ()> + Send>>,
        service: S,
        request: Request<ReqBody>,
        front: Arc<Front>,
    ) -> Self {
        Self {
            state: State::Loading {
                wait,
                service,
                request: Some(request),
                front,
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
        allow: Allow,
        service: S,
        request: Request<ReqBody>,
        pricing: Option<Box<Pricing>>,
    ) -> Self {
        Self {
            state: State::Delaying {
                sleep: tokio::time::sleep(allow.delay),
                service,
                request,
                allow,
                pricing,
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
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Loading { wait, service, .. } => {
                    ready!(wait.as_mut().poll(cx));
                    // Ready the service after the wait, as a tower caller
                    // would, then decide as `call` does.
                    ready!(service.poll_ready(cx))?;
                    let StateOwned::Loading {
                        service,
                        request,
                        front,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Loading");
                    };
                    let request = request.expect("Loading holds the request");
                    let mut svc = crate::http::service::RateLimitService::new(service, front);
                    let ResponseFuture { state } = svc.call_now(request);
                    this.state.set(state);
                }
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
                    let mut request = Request::from_parts(parts, body);
                    let next = match decision {
                        Decision::Allow(mut allow) => {
                            let pricing = front.pricing(&mut allow, &mut request);
                            if allow.delay.is_zero() {
                                State::Calling {
                                    future: service.call(request),
                                    allow,
                                    pricing,
                                }
                            } else {
                                // Readiness is not held through the delay:
                                // the readied service is dropped, an
                                // unreadied clone is polled ready after it.
                                let unreadied = service.clone();
                                drop(service);
                                State::Delaying {
                                    sleep: tokio::time::sleep(allow.delay),
                                    service: unreadied,
                                    request,
                                    allow,
                                    pricing,
                                }
                            }
                        }
                        Decision::Block(_) => unreachable!("answered above"),
                    };
                    this.state.set(next);
                }
                StateProj::Delaying { sleep, service, .. } => {
                    ready!(sleep.poll(cx));
                    // The service was not readied before the wait (see
                    // above): ready it now, as a tower caller would.
                    ready!(service.poll_ready(cx))?;
                    let StateOwned::Delaying {
                        mut service,
                        request,
                        allow,
                        pricing,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Delaying");
                    };
                    this.state.set(State::Calling {
                        future: service.call(request),
                        allow,
                        pricing,
                    });
                }
                StateProj::Calling {
                    future,
                    allow,
                    pricing,
                } => {
                    // An inner error has no status: nothing is refunded (and
                    // a reservation stays at its estimate).
                    let res = ready!(future.poll(cx))?;
                    if let Some(r) = allow.refunds.take() {
                        r.settle(failed(&res));
                    }
                    // With the actual known now, settled before the head
                    // goes out (and the headers show the tier after it).
                    let pricing = match pricing
                        .take()
                        .map(|p| p.at_head(res.headers(), allow.headers.as_mut()))
                    {
                        Some(AtHead::Later(p)) => Some(p),
                        Some(AtHead::Settled(Some(landing))) => {
                            let StateOwned::Calling { allow, .. } =
                                this.state.as_mut().project_replace(State::Done)
                            else {
                                unreachable!("state was Calling");
                            };
                            this.state.set(State::Settling {
                                landing,
                                response: Some(res),
                                allow,
                            });
                            continue;
                        }
                        Some(AtHead::Settled(None)) | None => None,
                    };
                    let res = finish(res, allow, pricing);
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res));
                }
                StateProj::Settling {
                    landing,
                    response,
                    allow,
                } => {
                    ready!(landing.as_mut().poll(cx));
                    let res = response.take().expect("Settling holds the response");
                    let res = finish(res, allow, None);
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res));
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

/// The allowed request's response: its headers written, and its body
/// holding the request's concurrency slots and its reservation on priced
/// tiers still to settle (if any) until it ends.
fn finish<B>(
    mut res: Response<B>,
    allow: &mut Allow,
    pricing: Option<Box<Pricing>>,
) -> Response<ResponseBody<B>> {
    if let Some(h) = allow.headers.take() {
        h.write(res.headers_mut());
    }
    let slots = allow.slots.take();
    res.map(|body| {
        if slots.is_none() && pricing.is_none() {
            return ResponseBody::Inner { body };
        }
        ResponseBody::Held {
            body,
            hold: Some(crate::http::body::BodyHold { slots, pricing }),
        }
    })
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
