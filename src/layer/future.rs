//! [`ResponseFuture`]: waits for the key (through the layer's two-tier lock), then
//! readies the inner service and runs it under the key.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::KeyedLockBody;
use super::held::HeldKey;
use super::info::LockInfo;
use super::rejected::RejectionResponse;
use super::shared::Shared;
use super::trace;
use crate::backend::{LostReason, RetryLater};
use crate::distributed::{DistributedAcquire, DistributedGuard};
use crate::error::LockError;
use crate::reject::RejectionKind;
use crate::BoxFuture;

pin_project! {
    /// The response future of [`KeyedLock`](crate::KeyedLock).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody, S::Future, S::Error>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, F, E> {
        // Waiting for the key: in this process, then at the backend if there is one.
        // Boxed: only a contended request waits, and the future every request moves
        // around stays the size of the running state.
        Acquiring {
            waiting: Box<Waiting<S, ReqBody>>,
        },
        // The key is held (or not needed): the inner service is readied, then called.
        // Boxed: a service that is ready at once is called without this state.
        Readying {
            readying: Box<Readying<S, ReqBody>>,
        },
        // The inner service runs under `held` (`None` for a request let through
        // without a key). `lost` resolves if the lease is lost and the layer aborts then.
        Running {
            #[pin]
            future: F,
            held: Option<HeldKey>,
            lost: Option<BoxFuture<()>>,
        },
        // Answered by the layer; the body becomes `KeyedLockBody::full` when polled.
        Rejected {
            response: RejectionResponse,
        },
        // The inner service failed to get ready.
        Failed {
            error: Option<E>,
        },
    }
}

/// A request that may run: its service is made ready, then called.
struct Readying<S, ReqBody> {
    service: S,
    request: Option<Request<ReqBody>>,
    held: Option<HeldKey>,
    lost: Option<BoxFuture<()>>,
}

/// A wait for the key, and the request that runs once it is held.
struct Waiting<S, ReqBody> {
    // Declared first so it is dropped (and gives back what it got) before the ticket
    // in `pending` records a cancellation.
    acquire: DistributedAcquire,
    pending: Option<Pending<S, ReqBody>>,
}

/// A request that has not reached the inner service yet.
pub(crate) struct Pending<S, ReqBody> {
    /// A clone of the inner service, readied once the key is held.
    service: S,
    request: Request<ReqBody>,
    ticket: WaitTicket,
}

impl<S, ReqBody> Pending<S, ReqBody> {
    pub(crate) fn new(service: S, request: Request<ReqBody>, ticket: WaitTicket) -> Self {
        Self {
            service,
            request,
            ticket,
        }
    }
}

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    pub(crate) fn running(future: S::Future, held: Option<HeldKey>) -> Self {
        Self {
            state: State::Running {
                future,
                held,
                lost: None,
            },
        }
    }

    pub(crate) fn acquiring(acquire: DistributedAcquire, pending: Pending<S, ReqBody>) -> Self {
        Self {
            state: State::Acquiring {
                waiting: Box::new(Waiting {
                    acquire,
                    pending: Some(pending),
                }),
            },
        }
    }

    pub(crate) fn readying(
        service: S,
        request: Request<ReqBody>,
        held: Option<HeldKey>,
        lost: Option<BoxFuture<()>>,
    ) -> Self {
        Self {
            state: State::Readying {
                readying: Box::new(Readying {
                    service,
                    request: Some(request),
                    held,
                    lost,
                }),
            },
        }
    }

    pub(crate) fn failed(error: S::Error) -> Self {
        Self {
            state: State::Failed { error: Some(error) },
        }
    }

    pub(crate) fn rejected(response: RejectionResponse) -> Self {
        Self {
            state: State::Rejected { response },
        }
    }
}

/// The request under its key, ready to ready the inner service: the end of every
/// successful wait.
fn start<S, ReqBody>(
    pending: Pending<S, ReqBody>,
    #[cfg_attr(not(feature = "replay"), allow(unused_mut))] mut guard: DistributedGuard,
) -> Readying<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    let Pending {
        service,
        mut request,
        mut ticket,
    } = pending;
    // What the acquisition found of the request's replay record, for the replay layer.
    #[cfg(feature = "replay")]
    if let Some(found) = guard.take_record_found() {
        request.extensions_mut().insert(found);
    }
    let shared = ticket.shared.clone();
    let waited = ticket.acquired(guard.contended());
    if let Some(error) = guard.failed_open() {
        // Fail open: run under the local lock only, and say so.
        shared.metrics().rejected(RejectionKind::Backend);
        tracing::warn!(layer = shared.name(), %error, "lock backend failed; running under the local lock only");
    }
    let signal = guard.lease().cloned();
    let lost = signal
        .clone()
        .filter(|_| shared.config.abort_on_lease_lost)
        .map(|signal| Box::pin(async move { signal.lost().await }) as BoxFuture<()>);
    let key = guard.key_ref().clone();
    let token = guard.fencing_token();
    let span = trace::hold_span(
        &shared,
        request.extensions(),
        &key,
        guard.is_shared(),
        token,
    );
    LockInfo::new(&shared.tag, key, waited, guard.is_shared(), token, signal)
        .insert_into(request.extensions_mut());
    let held = HeldKey::distributed(guard, shared, span);
    Readying {
        service,
        request: Some(request),
        held: Some(held),
        lost,
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
            let next = match state.as_mut().project() {
                StateProj::Acquiring { waiting } => {
                    let Waiting { acquire, pending } = &mut **waiting;
                    let result = {
                        let ticket = &pending.as_ref().expect("polled after completion").ticket;
                        let _entered = ticket.span.enter();
                        ready!(Pin::new(acquire).poll(cx))
                    };
                    let mut pending = waiting.pending.take().expect("polled after completion");
                    match result {
                        Ok(guard) => State::Readying {
                            readying: Box::new(start(pending, guard)),
                        },
                        Err(error) => {
                            // A `RetryLater` is logged by its backend, not per request.
                            match &error {
                                LockError::Backend(cause) if !cause.is::<RetryLater>() => {
                                    let layer = pending.ticket.shared.name();
                                    tracing::warn!(layer, error = %cause, "lock backend failed; answering 503");
                                }
                                _ => {}
                            }
                            State::Rejected {
                                response: pending.ticket.reject(&error),
                            }
                        }
                    }
                }
                StateProj::Readying { readying } => {
                    let Readying {
                        service,
                        request,
                        held,
                        lost,
                    } = &mut **readying;
                    if let Some(rejection) = poll_lease_lost(lost, held, cx) {
                        rejection
                    } else {
                        let _entered = held.as_ref().and_then(HeldKey::enter);
                        match ready!(service.poll_ready(cx)) {
                            Ok(()) => {
                                let request = request.take().expect("polled after completion");
                                let future = service.call(request);
                                drop(_entered);
                                State::Running {
                                    future,
                                    held: held.take(),
                                    lost: lost.take(),
                                }
                            }
                            Err(error) => State::Failed { error: Some(error) },
                        }
                    }
                }
                StateProj::Running { future, held, lost } => {
                    match poll_lease_lost(lost, held, cx) {
                        // Abort: the inner future is dropped with this state.
                        Some(rejection) => rejection,
                        None => return poll_running(future, held, cx),
                    }
                }
                StateProj::Failed { error } => {
                    return Poll::Ready(Err(error.take().expect("polled after completion")));
                }
                StateProj::Rejected { response } => {
                    let response = ready!(response.poll(cx));
                    return Poll::Ready(Ok(response.map(KeyedLockBody::full)));
                }
            };
            state.set(next);
        }
    }
}

/// The rejection to answer with if the lease was lost and the layer aborts then.
fn poll_lease_lost<S, ReqBody, F, E>(
    lost: &mut Option<BoxFuture<()>>,
    held: &Option<HeldKey>,
    cx: &mut Context<'_>,
) -> Option<State<S, ReqBody, F, E>> {
    let lost = lost.as_mut()?.as_mut().poll(cx).is_ready();
    lost.then(|| {
        let held = held.as_ref().expect("a lease implies a hold");
        // Resolved once lost, so a reason is known; a passed deadline's otherwise.
        let reason = held.lost_reason().unwrap_or(LostReason::Expired);
        let shared = held.shared();
        State::Rejected {
            response: shared.respond(shared.lease_lost_rejection(reason)),
        }
    })
}

fn poll_running<F, ResBody, E>(
    future: Pin<&mut F>,
    held: &mut Option<HeldKey>,
    cx: &mut Context<'_>,
) -> Poll<Result<Response<KeyedLockBody<ResBody>>, E>>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
{
    let result = {
        let _entered = held.as_ref().and_then(HeldKey::enter);
        future.poll(cx)
    };
    if let Some(held) = held.as_mut() {
        held.check_long_hold();
    }
    let result = ready!(result);
    let held = held.take();
    Poll::Ready(result.map(|response| {
        // Unless the key is held until the body ends, it is released here, as the
        // handler finishes.
        let held = held.filter(HeldKey::until_body_end).map(Box::new);
        response.map(|body| KeyedLockBody::inner(body, held))
    }))
}

/// A request waiting for its key: when it arrived, and its place in the `waiting`
/// gauge, which it leaves however the wait ends (guard, rejection or cancellation).
pub(crate) struct WaitTicket {
    arrived: Instant,
    shared: Arc<Shared>,
    /// Whether the request queued behind another in this process.
    contended: bool,
    /// Whether the wait ended with a guard or a rejection; if not, it was cancelled.
    ended: bool,
    /// `keyed_lock.wait`, entered while the wait is polled; its `outcome` is recorded
    /// when the wait ends.
    span: tracing::Span,
}

impl WaitTicket {
    pub(crate) fn new(shared: Arc<Shared>, contended: bool, span: tracing::Span) -> Self {
        shared.metrics().waiting.increment(1.0);
        Self {
            arrived: Instant::now(),
            shared,
            contended,
            ended: false,
            span,
        }
    }

    /// Records an acquisition, `contended` as its guard says; returns the time waited.
    fn acquired(&mut self, contended: bool) -> std::time::Duration {
        self.ended = true;
        let waited = self.arrived.elapsed();
        let metrics = self.shared.metrics();
        match self.contended || contended {
            true => metrics.acquired_contended.increment(1),
            false => metrics.acquired_uncontended.increment(1),
        }
        metrics.wait_acquired.record(waited);
        self.span.record("outcome", "acquired");
        waited
    }

    /// Records a failed wait and answers it.
    fn reject(&mut self, error: &LockError) -> RejectionResponse {
        self.ended = true;
        let metrics = self.shared.metrics();
        let waited = self.arrived.elapsed();
        match error {
            LockError::Timeout => metrics.wait_timeout.record(waited),
            LockError::QueueFull => metrics.wait_queue_full.record(waited),
            _ => {}
        }
        self.span
            .record("outcome", RejectionKind::of(error).as_str());
        self.shared.respond(self.shared.lock_rejection(error))
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        let metrics = self.shared.metrics();
        metrics.waiting.decrement(1.0);
        if !self.ended {
            // The request was dropped while it waited (its client went away). Whatever
            // it queued for or was handed is released by now: its lock futures and
            // guards are dropped before the ticket.
            metrics.wait_cancelled.record(self.arrived.elapsed());
            self.span.record("outcome", "cancelled");
        }
    }
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Acquiring { .. } => "acquiring",
            State::Readying { .. } => "readying",
            State::Failed { .. } => "failed",
            State::Running { .. } => "running",
            State::Rejected { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
