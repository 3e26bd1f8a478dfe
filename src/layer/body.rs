//! The response body of the layer: the inner body, or the layer's own rejection body.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::held::HeldKey;

pin_project! {
    /// The body of every response that passes through the layer.
    ///
    /// Either the inner service's body — carrying the key's guard when the layer holds
    /// the key until the body ends — or a short body of the layer's own (a rejection).
    pub struct KeyedLockBody<B> {
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
            // Dropped at the end of the stream, on an error, or with the body. Boxed:
            // only `hold_until_body_end` puts it here, and every response body moves
            // several times on its way out.
            guard: Option<Box<HeldKey>>,
        },
        Full { data: Option<Bytes> },
    }
}

impl<B> KeyedLockBody<B> {
    pub(crate) fn inner(body: B, guard: Option<Box<HeldKey>>) -> Self {
        Self {
            kind: Kind::Inner { body, guard },
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

impl<B: Body<Data = Bytes>> Body for KeyedLockBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body, guard } => {
                if let Some(held) = guard {
                    held.check_long_hold();
                }
                let frame = ready!(body.poll_frame(cx));
                if !matches!(frame, Some(Ok(_))) {
                    guard.take();
                }
                Poll::Ready(frame)
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|data| Ok(Frame::data(data)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B> std::fmt::Debug for KeyedLockBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { guard, .. } => f
                .debug_struct("KeyedLockBody::Inner")
                .field("holds_key", &guard.is_some())
                .finish(),
            Kind::Full { data } => f
                .debug_struct("KeyedLockBody::Full")
                .field("data", data)
                .finish(),
        }
    }
}
