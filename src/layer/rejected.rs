//! A rejection's response: the layer's own at once, or a user handler's, whose body is
//! read into the layer's small full body before it is answered.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::response::Parts;
use http::Response;
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;

use crate::reject::Rejection;
use crate::BoxFuture;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A user's `on_rejection` handler, its body type erased.
pub(crate) type RejectionHandler =
    Arc<dyn Fn(Rejection) -> Response<UnsyncBoxBody<Bytes, BoxError>> + Send + Sync>;

/// Erases the body type of `handler`'s responses.
pub(crate) fn erase<F, B>(handler: F) -> RejectionHandler
where
    F: Fn(Rejection) -> Response<B> + Send + Sync + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    Arc::new(move |rejection| {
        handler(rejection).map(|body| body.map_err(Into::into).boxed_unsync())
    })
}

/// The response to a rejected request, ready or still reading the handler's body.
pub(crate) enum RejectionResponse {
    Ready(Option<Response<Bytes>>),
    Reading(Box<Reading>),
}

/// A handler's response whose body is being read. A body that fails is replaced by the
/// default response to `rejection`: a rejection is always answered.
pub(crate) struct Reading {
    parts: Option<Parts>,
    body: BoxFuture<Result<Bytes, BoxError>>,
    rejection: Option<Rejection>,
}

impl RejectionResponse {
    /// The default answer to `rejection`.
    pub(crate) fn ready(rejection: Rejection) -> Self {
        Self::Ready(Some(rejection.into_response()))
    }

    /// `handler`'s answer to `rejection`.
    pub(crate) fn from_handler(handler: &RejectionHandler, rejection: Rejection) -> Self {
        let (parts, body) = handler(rejection.clone()).into_parts();
        Self::Reading(Box::new(Reading {
            parts: Some(parts),
            // Bodies of `String`, `Full` or axum's `Json` are read in this first poll.
            body: Box::pin(async move { Ok(body.collect().await?.to_bytes()) }),
            rejection: Some(rejection),
        }))
    }

    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Response<Bytes>> {
        let taken = "polled after completion";
        match self {
            Self::Ready(response) => Poll::Ready(response.take().expect(taken)),
            Self::Reading(reading) => {
                let read = std::task::ready!(reading.body.as_mut().poll(cx));
                let rejection = reading.rejection.take().expect(taken);
                Poll::Ready(match read {
                    Ok(bytes) => Response::from_parts(reading.parts.take().expect(taken), bytes),
                    Err(error) => {
                        tracing::error!(
                            %error,
                            reason = rejection.kind().as_str(),
                            "the on_rejection handler's body failed; answering the default rejection"
                        );
                        rejection.into_response()
                    }
                })
            }
        }
    }
}
