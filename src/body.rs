//! The crate's one "inner or full" response body: the inner service's body, or a short
//! body of the crate's own (a rejection, a replayed or buffered response). The
//! body-reading layer answers with it as it is (`buffer::ResponseBody`); the lock layer
//! and the replay layer wrap it, adding only what is theirs (the held key, a partly
//! read body).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// What `Body::poll_frame` returns for a body of `Bytes` with errors `E`.
pub(crate) type PollFrame<E> = Poll<Option<Result<Frame<Bytes>, E>>>;

pin_project! {
    /// A response body: the inner service's body, or a short body of the layer's own
    /// (a rejection).
    pub struct InnerOrFull<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        // `None` once sent, or from the start for an empty body.
        Full { data: Option<Bytes> },
    }
}

impl<B> InnerOrFull<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for InnerOrFull<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame<B::Error> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Full { data } => Poll::Ready(data.take().map(|data| Ok(Frame::data(data)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B> std::fmt::Debug for InnerOrFull<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f.write_str("Inner"),
            Kind::Full { data } => f.debug_tuple("Full").field(data).finish(),
        }
    }
}
