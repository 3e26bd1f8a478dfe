//! The response body of the replay layer.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::body::InnerOrFull;
use crate::body::PollFrame;

pin_project! {
    /// The body of every response that passes through the
    /// [`ReplayLayer`](super::ReplayLayer): the inner body, bytes the layer holds (a
    /// replayed or a buffered response, a rejection), or the bytes it read of a body
    /// it stopped reading (a body over the store limit) and then the rest of it.
    pub struct ReplayBody<B>
    where
        B: Body,
    {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B>
    where
        B: Body,
    {
        Whole {
            #[pin]
            body: InnerOrFull<B>,
        },
        Partial {
            head: Option<Bytes>,
            // A frame read past the head that is not data (trailers), or the inner error.
            pending: Option<Result<Frame<Bytes>, B::Error>>,
            // Boxed so the layer can read part of it and hand on the rest.
            rest: Option<Pin<Box<B>>>,
        },
    }
}

impl<B: Body> ReplayBody<B> {
    /// Bytes held by the layer, and nothing after them.
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Whole {
                body: InnerOrFull::full(bytes),
            },
        }
    }

    /// The inner body untouched.
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Whole {
                body: InnerOrFull::inner(body),
            },
        }
    }

    /// The data already read, one frame read past it, then the rest of the body.
    pub(crate) fn partial(
        head: Bytes,
        pending: Option<Result<Frame<Bytes>, B::Error>>,
        rest: Option<Pin<Box<B>>>,
    ) -> Self {
        Self {
            kind: Kind::Partial {
                head: (!head.is_empty()).then_some(head),
                pending,
                rest,
            },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ReplayBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PollFrame<B::Error> {
        let (head, pending, rest) = match self.project().kind.project() {
            KindProj::Whole { body } => return body.poll_frame(cx),
            KindProj::Partial {
                head,
                pending,
                rest,
            } => (head, pending, rest),
        };
        if let Some(head) = head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Some(pending) = pending.take() {
            return Poll::Ready(Some(pending));
        }
        match rest {
            Some(rest) => rest.as_mut().poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Whole { body } => body.is_end_stream(),
            Kind::Partial {
                head,
                pending,
                rest,
            } => {
                head.is_none()
                    && pending.is_none()
                    && rest.as_ref().is_none_or(|rest| rest.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        let (head, pending, rest) = match &self.kind {
            Kind::Whole { body } => return body.size_hint(),
            Kind::Partial {
                head,
                pending,
                rest,
            } => (head, pending, rest),
        };
        let held = head.as_ref().map_or(0, |head| head.len() as u64);
        match (rest, pending) {
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
        match &self.kind {
            Kind::Whole { body } => f.debug_tuple("ReplayBody").field(body).finish(),
            Kind::Partial {
                head,
                pending,
                rest,
            } => f
                .debug_struct("ReplayBody")
                .field("head", head)
                .field("more", &(pending.is_some() || rest.is_some()))
                .finish(),
        }
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
