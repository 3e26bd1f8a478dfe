//! The crate's one "inner or full" response body: the inner service's body, or a short
//! body of the crate's own (a rejection, a replayed or buffered response). The lock
//! layer, the body-reading layer and the replay layer each wrap it in their public body
//! type, adding only what is theirs (the held key, a partly read body).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    #[project = InnerOrFullProj]
    pub(crate) enum InnerOrFull<B> {
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
        Self::Inner { body }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self::Full {
            data: (!data.is_empty()).then_some(data),
        }
    }
}

impl<B: Body<Data = Bytes>> Body for InnerOrFull<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            InnerOrFullProj::Inner { body } => body.poll_frame(cx),
            InnerOrFullProj::Full { data } => {
                Poll::Ready(data.take().map(|data| Ok(Frame::data(data))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Inner { body } => body.is_end_stream(),
            Self::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Inner { body } => body.size_hint(),
            Self::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B> std::fmt::Debug for InnerOrFull<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Inner { .. } => f.write_str("Inner"),
            Self::Full { data } => f.debug_tuple("Full").field(data).finish(),
        }
    }
}
