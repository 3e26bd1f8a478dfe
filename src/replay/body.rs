//! The response body of the replay layer.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of every response that passes through the
    /// [`ReplayLayer`](super::ReplayLayer): bytes the layer holds (a replayed or a
    /// buffered response, a rejection), then the rest of the inner body if the layer
    /// stopped reading it (a body over the store limit).
    pub struct ReplayBody<B>
    where
        B: Body,
    {
        head: Option<Bytes>,
        // A frame read past the head that is not data (trailers), or the inner error.
        pending: Option<Result<Frame<Bytes>, B::Error>>,
        // Boxed so the layer can read part of it and hand on the rest.
        rest: Option<Pin<Box<B>>>,
    }
}

impl<B: Body> ReplayBody<B> {
    /// Bytes held by the layer, and nothing after them.
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self::partial(bytes, None, None)
    }

    /// The inner body untouched.
    pub(crate) fn inner(body: B) -> Self {
        Self::partial(Bytes::new(), None, Some(Box::pin(body)))
    }

    /// The data already read, one frame read past it, then the rest of the body.
    pub(crate) fn partial(
        head: Bytes,
        pending: Option<Result<Frame<Bytes>, B::Error>>,
        rest: Option<Pin<Box<B>>>,
    ) -> Self {
        Self {
            head: (!head.is_empty()).then_some(head),
            pending,
            rest,
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ReplayBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Some(pending) = this.pending.take() {
            return Poll::Ready(Some(pending));
        }
        match this.rest {
            Some(rest) => rest.as_mut().poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none()
            && self.pending.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.head.as_ref().map_or(0, |head| head.len() as u64);
        match (&self.rest, &self.pending) {
            (None, None) => SizeHint::with_exact(held),
            (Some(rest), None) => {
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + held);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + held);
                }
                hint
            }
            // A trailers frame or an error still to come: only a lower bound.
            (_, Some(_)) => {
                let mut hint = SizeHint::new();
                hint.set_lower(held);
                hint
            }
        }
    }
}

impl<B: Body> std::fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayBody")
            .field("head", &self.head)
            .field("more", &(self.pending.is_some() || self.rest.is_some()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn head_then_rest() {
        let body = ReplayBody::partial(
            Bytes::from_static(b"ab"),
            Some(Ok(Frame::data(Bytes::from_static(b"c")))),
            Some(Box::pin(Full::new(Bytes::from_static(b"de")))),
        );
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcde");
    }

    #[tokio::test]
    async fn full_has_an_exact_size() {
        let body = ReplayBody::<Full<Bytes>>::full(Bytes::from_static(b"abc"));
        assert_eq!(body.size_hint().exact(), Some(3));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abc");
        assert!(ReplayBody::<Full<Bytes>>::full(Bytes::new()).is_end_stream());
    }
}
