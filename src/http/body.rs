//! The body type of the layer's responses.

use bytes::Bytes;
use pin_project_lite::pin_project;
use std::pin::Pin;
use std::task::{Context, Poll};

pin_project! {
    /// The body of a response from the layer: the inner service's body, or
    /// a complete body the layer produced (429 or 503). `Inner.body` is the
    /// inner body; `Full.data` holds the bytes until they are sent.
    #[project = BodyProj]
    #[allow(missing_docs)]
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
        /// holds: released when the body has ended or is dropped.
        Leased {
            #[pin]
            body: B,
            lease: Option<BodyLease>,
        },
    }
}

/// The concurrency slots a response holds (see
/// [`Tier::concurrency`](crate::Tier::concurrency)): released when dropped.
pub struct BodyLease(pub(crate) Box<crate::engine::slots::Slots>);

impl std::fmt::Debug for BodyLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody::Full {
            data: (!data.is_empty()).then_some(data),
        }
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
            BodyProj::Leased { body, lease } => {
                let frame = body.poll_frame(cx);
                // The end of the body (or its error) ends the request.
                if matches!(frame, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
                    lease.take();
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
            ResponseBody::Inner { body } | ResponseBody::Leased { body, .. } => {
                body.is_end_stream()
            }
            ResponseBody::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ResponseBody::Inner { body } | ResponseBody::Leased { body, .. } => body.size_hint(),
            ResponseBody::Full { data } => {
                http_body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
