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
use crate::held::HeldKey;
use crate::info::LockInfo;
use crate::key::Key;
use crate::layer::Shared;
use crate::locks::{Acquire, LockError};

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
            ticket: WaitTicket,
        },
        // The inner service runs under `guard` (`None` for a request let through
        // without a key).
        Running {
            #[pin]
            future: F,
            held: Option<HeldKey>,
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
    pub(crate) fn running(future: S::Future, held: Option<HeldKey>) -> Self {
        Self {
            state: State::Running { future, held },
        }
    }

    pub(crate) fn waiting(
        acquire: Acquire<Key>,
        service: S,
        request: Request<ReqBody>,
        ticket: WaitTicket,
    ) -> Self {
        Self {
            state: State::Waiting {
                acquire,
                call: Some((service, request)),
                ticket,
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
                    ticket,
                } => {
                    let result = ready!(Pin::new(acquire).poll(cx));
                    let waited = ticket.arrived.elapsed();
                    let shared = ticket.shared.clone();
                    let metrics = shared.metrics();
                    let guard = match result {
                        Ok(guard) => guard,
                        Err(error) => {
                            match error {
                                LockError::Timeout => metrics.wait_timeout.record(waited),
                                LockError::QueueFull => metrics.wait_queue_full.record(waited),
                                _ => {}
                            }
                            let response = shared.respond(shared.lock_rejection(&error));
                            state.set(State::Rejected { response: None });
                            return Poll::Ready(Ok(response.map(KeyedLockBody::full)));
                        }
                    };
                    metrics.acquired_contended.increment(1);
                    metrics.wait_acquired.record(waited);
                    let (mut service, mut request) = call.take().expect("polled after completion");
                    let info = LockInfo::new(guard.key().clone(), waited, None);
                    request.extensions_mut().insert(info);
                    let held = HeldKey::new(guard, shared);
                    let future = service.call(request);
                    state.set(State::Running {
                        future,
                        held: Some(held),
                    });
                }
                StateProj::Running { future, held } => {
                    let result = future.poll(cx);
                    if let Some(held) = held.as_mut() {
                        held.check_long_hold();
                    }
                    let result = ready!(result);
                    let held = held.take();
                    return Poll::Ready(result.map(|response| {
                        // Unless the key is held until the body ends, it is released
                        // here, as the handler finishes.
                        let held = held.filter(HeldKey::until_body_end);
                        response.map(|body| KeyedLockBody::inner(body, held))
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

/// A request waiting for its key: when it arrived, and its place in the `waiting`
/// gauge, which it leaves however the wait ends (guard, rejection or cancellation).
pub(crate) struct WaitTicket {
    arrived: Instant,
    shared: Arc<Shared>,
}

impl WaitTicket {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        shared.metrics().waiting.increment(1.0);
        Self {
            arrived: Instant::now(),
            shared,
        }
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.shared.metrics().waiting.decrement(1.0);
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
