//! The body type of the layer's responses.

use bytes::Bytes;
use pin_project_lite::pin_project;
use std::pin::Pin;
use std::task::{Context, Poll};

pin_project! {
    /// The body of a response from the layer: the inner service's body, or
    /// a complete body the layer produced (429 or 503). `Inner.body` is the
    /// inner body; `Full.data` holds the bytes until they are sent.
    ///
    /// Non-exhaustive: the layer may gain response kinds in a minor release.
    #[project = BodyProj]
    #[allow(missing_docs)]
    #[non_exhaustive]
    pub enum ResponseBody<B> {
        /// The inner service's body, untouched.
        Inner {
            #[pin]
            body: B,
        },
        /// A body built by the layer.
        Full {
            data: Option<Bytes>,
        },
        /// The inner service's body, with the concurrency slots its request
        /// holds (released when the body has ended or is dropped) and its
        /// reservation on priced tiers (settled when the body ends; at the
        /// estimate when it errors or is dropped first).
        Held {
            #[pin]
            body: B,
            hold: Option<BodyHold>,
        },
    }
}

/// What a response body holds until it ends: the concurrency slots of its
/// request (see [`Tier::concurrency`](crate::Tier::concurrency)), released
/// when dropped; and its reservation on priced tiers (see
/// [`Tier::priced`](crate::Tier::priced)), settled when the body ends (read
/// to its end: with the actual reported or in a trailer) and left at the
/// estimate when it is dropped first.
#[derive(Debug)]
pub struct BodyHold {
    pub(crate) slots: Option<Box<crate::engine::Slots>>,
    pub(crate) pricing: Option<Box<crate::http::priced::Pricing>>,
}

impl BodyHold {
    /// The body ended: settle, then release the slots.
    fn end(&mut self) {
        if let Some(p) = self.pricing.take() {
            p.settle();
        }
        self.slots.take();
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody::Full {
            data: (!data.is_empty()).then_some(data),
        }
    }
}

/// A complete body (the companion [`JsonBodyLayer`](crate::priced::JsonBodyLayer)'s
/// own answers, `413` and `400`).
impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        ResponseBody::full(data)
    }
}

impl<B> http_body::Body for ResponseBody<B>
where
    B: http_body::Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        match self.project() {
            BodyProj::Inner { body } => body.poll_frame(cx),
            BodyProj::Held { mut body, hold } => {
                let frame = body.as_mut().poll_frame(cx);
                match &frame {
                    // The end of the body ends the request: settle, release.
                    Poll::Ready(None) => {
                        if let Some(l) = hold.as_mut() {
                            l.end();
                        }
                        hold.take();
                    }
                    // An error too, the reservation left at its estimate.
                    Poll::Ready(Some(Err(_))) => {
                        hold.take();
                    }
                    Poll::Ready(Some(Ok(f))) => {
                        if let (Some(t), Some(p)) = (
                            f.trailers_ref(),
                            hold.as_mut().and_then(|l| l.pricing.as_mut()),
                        ) {
                            p.trailers(t);
                        }
                        // Trailers are a body's last frame (hyper polls no
                        // further), and a server may stop polling a body
                        // that says it has ended: either is its end.
                        if f.is_trailers() || body.is_end_stream() {
                            if let Some(l) = hold.as_mut() {
                                l.end();
                            }
                        }
                    }
                    Poll::Pending => {}
                }
                frame
            }
            BodyProj::Full { data } => {
                Poll::Ready(data.take().map(|d| Ok(http_body::Frame::data(d))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Inner { body } | ResponseBody::Held { body, .. } => body.is_end_stream(),
            ResponseBody::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ResponseBody::Inner { body } | ResponseBody::Held { body, .. } => body.size_hint(),
            ResponseBody::Full { data } => {
                http_body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
