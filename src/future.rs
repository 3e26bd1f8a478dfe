//! [`ResponseFuture`]: waits for the key, then runs the inner service under it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::KeyedLockBody;
use crate::info::LockInfo;
use crate::key::Key;
use crate::layer::Shared;
use crate::locks::{Acquire, KeyGuard};

pin_project! {
    /// The response future of [`KeyedLock`](crate::KeyedLock).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody, S::Future>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, F> {
        // Queued for the key; `call` holds the readied service and the request.
        Waiting {
            acquire: Acquire<Key>,
            call: Option<(S, Request<ReqBody>)>,
            arrived: Instant,
            shared: Arc<Shared>,
        },
        // The inner service runs under `guard` (`None` for a request let through
        // without a key).
        Running {
            #[pin]
            future: F,
            guard: Option<KeyGuard<Key>>,
            shared: Arc<Shared>,
        },
        // Answered by the layer; the body becomes `KeyedLockBody::full` when polled.
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    pub(crate) fn running(
        future: S::Future,
        guard: Option<KeyGuard<Key>>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            state: State::Running {
                future,
                guard,
                shared,
            },
        }
    }

    pub(crate) fn waiting(
        acquire: Acquire<Key>,
        service: S,
        request: Request<ReqBody>,
        arrived: Instant,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            state: State::Waiting {
                acquire,
                call: Some((service, request)),
                arrived,
                shared,
            },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<KeyedLockBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Waiting {
                    acquire,
                    call,
                    arrived,
                    shared,
                } => {
                    let shared = shared.clone();
                    let guard = match ready!(Pin::new(acquire).poll(cx)) {
                        Ok(guard) => guard,
                        Err(error) => {
                            let response = shared.respond(shared.lock_rejection(&error));
                            state.set(State::Rejected { response: None });
                            return Poll::Ready(Ok(response.map(KeyedLockBody::full)));
                        }
                    };
                    let (mut service, mut request) = call.take().expect("polled after completion");
                    let info = LockInfo::new(guard.key().clone(), arrived.elapsed(), None);
                    request.extensions_mut().insert(info);
                    let future = service.call(request);
                    state.set(State::Running {
                        future,
                        guard: Some(guard),
                        shared,
                    });
                }
                StateProj::Running {
                    future,
                    guard,
                    shared,
                } => {
                    let result = ready!(future.poll(cx));
                    let guard = guard.take();
                    return Poll::Ready(result.map(|response| {
                        // Without `hold_until_body_end` the guard drops here, as the
                        // handler finishes.
                        let guard = guard.filter(|_| shared.hold_until_body_end);
                        response.map(|body| KeyedLockBody::inner(body, guard))
                    }));
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(KeyedLockBody::full)));
                }
            }
        }
    }
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Waiting { .. } => "waiting",
            State::Running { .. } => "running",
            State::Rejected { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
