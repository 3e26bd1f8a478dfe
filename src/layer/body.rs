//! [`KeyedLockBody`]: the response body of the lock layer.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, SizeHint};
use pin_project_lite::pin_project;

use super::held::HeldKey;
use crate::body::InnerOrFull;
use crate::body::PollFrame;

pin_project! {
    /// The body of every response that passes through the layer.
    ///
    /// Either the inner service's body — carrying the key's guard when the layer holds
    /// the key until the body ends — or a short body of the layer's own (a rejection).
    pub struct KeyedLockBody<B> {
        #[pin]
        body: InnerOrFull<B>,
        // Dropped at the end of the stream, on an error, or with the body. Boxed: only
        // `hold_until_body_end` puts it here, and every response body moves several
        // times on its way out.
        guard: Option<Box<HeldKey>>,
    }
}

impl<B> KeyedLockBody<B> {
    pub(crate) fn inner(body: B, guard: Option<Box<HeldKey>>) -> Self {
        Self {
            body: InnerOrFull::inner(body),
            guard,
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            body: InnerOrFull::full(data),
            guard: None,
        }
    }
}

impl<B: Body<Data = Bytes>> Body for KeyedLockBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame<B::Error> {
        let this = self.project();
        if let Some(held) = this.guard {
            held.check_long_hold();
        }
        let frame = ready!(this.body.poll_frame(cx));
        if !matches!(frame, Some(Ok(_))) {
            this.guard.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> std::fmt::Debug for KeyedLockBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedLockBody")
            .field("body", &self.body)
            .field("holds_key", &self.guard.is_some())
            .finish()
    }
}
