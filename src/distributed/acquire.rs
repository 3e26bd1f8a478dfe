//! [`DistributedAcquire`]: the future that takes a key locally, then at the backend.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use super::guard::DistributedGuard;
use super::guard::Looked;
use super::Inner;
use crate::backend::{Acquired, Detach, Lease, LockMode, RecordLookup, SHARED_LOCKS};
use crate::error::LockError;
use crate::key::Key;
use crate::locks::{Acquire, KeyGuard, Mode};
use crate::rejection_kind::RejectionKind;

/// The remote wait of an acquisition without a time limit. Backends add the wait to
/// `Instant::now()`, which must not overflow; a year is "until it is free".
const NO_LIMIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Resolves to a [`DistributedGuard`] once the key is held in this process and, when
/// there is a backend, remotely; made by [`DistributedLocks`](super::DistributedLocks).
///
/// Dropping it at any point gives back what it acquired: a local place in the queue or
/// a local permit at once, and a remote grant as soon as the detached remote attempt
/// ends.
#[must_use = "futures do nothing unless polled"]
pub struct DistributedAcquire {
    locks: Arc<Inner>,
    state: State,
    /// When the acquisition began: the remote tier gets what is left of `timeout`.
    started: Instant,
    /// `None`: no limit. `Some(ZERO)`: try once, and a held key is `Busy`.
    timeout: Option<Duration>,
    /// Counted in the `waiting` gauge of metered locks, until it resolves or is dropped.
    counted: bool,
    /// It queued behind another holder in this process.
    queued_locally: bool,
    /// `keyed_lock.wait` of metered locks (a layer has its own), entered while polled;
    /// its `outcome` is recorded when the acquisition ends.
    span: tracing::Span,
    /// A replay record the remote acquisition looks for first (the layer's, with
    /// [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay)).
    lookup: Option<RecordLookup>,
}

enum State {
    /// Refused before any lock was touched (an invalid key, a mode the backend lacks).
    Refused(Option<LockError>),
    /// Queued in this process.
    Local(Acquire<Key>),
    /// Held in this process, and there is no backend: ready.
    Held(Option<KeyGuard<Key>>),
    /// Held in this process; waiting at the backend.
    Remote {
        local: Option<KeyGuard<Key>>,
        remote: Detach<Result<Acquired, LockError>>,
        /// `keyed_lock.remote`, entered while the remote acquisition is polled.
        span: tracing::Span,
    },
    Done,
}

impl DistributedAcquire {
    pub(super) fn new(locks: Arc<Inner>, key: &str, timeout: Option<Duration>, mode: Mode) -> Self {
        match Key::new(key, locks.max_key_len) {
            Ok(key) => Self::for_key(locks, key, timeout, mode),
            Err(error) => Self::refused(locks, LockError::InvalidKey(error), timeout),
        }
    }

    pub(super) fn for_key(
        locks: Arc<Inner>,
        key: Key,
        timeout: Option<Duration>,
        mode: Mode,
    ) -> Self {
        // A backend that cannot hold a key shared refuses it: never silently taken
        // exclusively or in this process only.
        let unshared =
            |backend: &Arc<dyn crate::backend::LockBackend>| !backend.supports(LockMode::Shared);
        if mode == Mode::Shared && locks.backend.as_ref().is_some_and(unshared) {
            return Self::refused(locks, LockError::Unsupported(SHARED_LOCKS), timeout);
        }
        if locks.shutdown.is_started() {
            return Self::refused(locks, LockError::ShuttingDown, timeout);
        }
        let local = locks.local.acquire(key, timeout, mode);
        Self::with_state(locks, State::Local(local), timeout)
    }

    fn refused(locks: Arc<Inner>, error: LockError, timeout: Option<Duration>) -> Self {
        Self::with_state(locks, State::Refused(Some(error)), timeout)
    }

    pub(super) fn after_local(
        locks: Arc<Inner>,
        local: KeyGuard<Key>,
        timeout: Option<Duration>,
        lookup: Option<RecordLookup>,
    ) -> Self {
        if locks.shutdown.is_started() {
            return Self::refused(locks, LockError::ShuttingDown, timeout);
        }
        let mut this = Self::with_state(locks, State::Done, timeout).looking_up(lookup);
        this.state = this.held_locally(local);
        this
    }

    /// Looks for `lookup`'s replay record in the remote acquisition, where the backend
    /// can (before the key is held locally).
    pub(super) fn looking_up(mut self, lookup: Option<RecordLookup>) -> Self {
        self.lookup = lookup;
        self
    }

    fn with_state(locks: Arc<Inner>, state: State, timeout: Option<Duration>) -> Self {
        let (counted, span) = match locks.metrics() {
            Some(metrics) => {
                metrics.waiting.increment(1.0);
                let span = tracing::debug_span!(
                    "keyed_lock.wait",
                    name = &*locks.name,
                    outcome = tracing::field::Empty,
                );
                (true, span)
            }
            None => (false, tracing::Span::none()),
        };
        Self {
            locks,
            state,
            started: Instant::now(),
            timeout,
            counted,
            queued_locally: false,
            span,
            lookup: None,
        }
    }

    /// Records how the acquisition ended, in metered locks.
    fn record(&mut self, result: &Result<DistributedGuard, LockError>) {
        if !std::mem::take(&mut self.counted) {
            return;
        }
        let Some(metrics) = self.locks.metrics() else {
            return;
        };
        metrics.waiting.decrement(1.0);
        let waited = self.started.elapsed();
        let outcome = match result {
            Ok(_) => "acquired",
            Err(error) => RejectionKind::of(error).as_str(),
        };
        self.span.record("outcome", outcome);
        match result {
            Ok(guard) => {
                metrics.wait_acquired.record(waited);
                match guard.contended() {
                    true => metrics.acquired_contended.increment(1),
                    false => metrics.acquired_uncontended.increment(1),
                }
            }
            Err(error) => {
                match error {
                    LockError::Timeout | LockError::Busy => metrics.wait_timeout.record(waited),
                    LockError::QueueFull => metrics.wait_queue_full.record(waited),
                    _ => {}
                }
                metrics.rejected(RejectionKind::of(error));
            }
        }
    }

    fn try_once(&self) -> bool {
        self.timeout == Some(Duration::ZERO)
    }

    /// The next state once the key is held in this process.
    fn held_locally(&self, local: KeyGuard<Key>) -> State {
        match &self.locks.backend {
            Some(backend) => {
                let wait = match self.timeout {
                    Some(timeout) => timeout.saturating_sub(self.started.elapsed()),
                    None => NO_LIMIT,
                };
                let span = tracing::debug_span!(
                    "keyed_lock.remote",
                    name = &*self.locks.name,
                    engine = backend.engine(),
                    outcome = tracing::field::Empty,
                    fencing_token = tracing::field::Empty,
                );
                // Each local holder holds remotely in the same way: shared beside the
                // other readers, or one of the permits (the build checked the backend
                // has them).
                let mode = match local.is_shared() {
                    true => LockMode::Shared,
                    false => LockMode::permits(self.locks.permits),
                };
                let (name, key) = (&self.locks.name, local.key());
                let unless_recorded = match (&self.lookup, mode) {
                    (Some(lookup), LockMode::Exclusive) => {
                        backend.acquire_unless_recorded(name, key, wait, lookup)
                    }
                    _ => None,
                };
                let remote = unless_recorded.unwrap_or_else(|| {
                    let acquire = backend.acquire_mode(name, key, mode, wait);
                    Box::pin(async move { acquire.await.map(Acquired::Granted) })
                });
                State::Remote {
                    // Dropped midway, the attempt runs on detached: if it still gets
                    // the lease, that task drops the unclaimed output, which releases
                    // it; no cancellation leaves a remote lock held or a locked
                    // connection in a pool.
                    remote: Detach::new(remote),
                    local: Some(local),
                    span,
                }
            }
            None => State::Held(Some(local)),
        }
    }

    fn guard(
        &self,
        local: KeyGuard<Key>,
        lease: Option<Lease>,
        failed: Option<LockError>,
    ) -> DistributedGuard {
        DistributedGuard::new(self.locks.clone(), local, lease, failed)
            .queued_locally(self.queued_locally)
    }

    /// The guard of a remote acquisition's answer: the key held (and whether the
    /// replay record was found absent with the grant), or held in this process only,
    /// with the record the acquisition found.
    fn remote_guard(&self, local: KeyGuard<Key>, acquired: Acquired) -> DistributedGuard {
        match acquired {
            Acquired::Granted(lease) => self.guard(local, Some(lease), None),
            Acquired::NotRecorded(lease) => {
                self.guard(local, Some(lease), None).looked(Looked::Absent)
            }
            Acquired::Recorded(record) => {
                self.guard(local, None, None).looked(Looked::Stored(record))
            }
        }
    }
}

// Every field is Unpin: the local acquisition is, and the remote one is boxed (in a
// `Detach`).
impl Unpin for DistributedAcquire {}

impl Future for DistributedAcquire {
    type Output = Result<DistributedGuard, LockError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        // A clone to enter, as `poll_state` borrows all of `this` (free when disabled).
        let result = ready!(this.span.clone().in_scope(|| this.poll_state(cx)));
        this.record(&result);
        Poll::Ready(result)
    }
}

impl Drop for DistributedAcquire {
    fn drop(&mut self) {
        if let (true, Some(metrics)) = (self.counted, self.locks.metrics()) {
            metrics.waiting.decrement(1.0);
            metrics.wait_cancelled.record(self.started.elapsed());
            self.span.record("outcome", "cancelled");
        }
    }
}

impl DistributedAcquire {
    fn poll_state(&mut self, cx: &mut Context<'_>) -> Poll<Result<DistributedGuard, LockError>> {
        let this = self;
        loop {
            // Once the locks shut down nothing more is granted, not even to a caller
            // already waiting: what it holds so far (a place in the queue, the local
            // key, a remote attempt) is given back as the state drops.
            if this.locks.shutdown.is_started()
                && matches!(
                    this.state,
                    State::Local(_) | State::Held(_) | State::Remote { .. }
                )
            {
                this.state = State::Done;
                return Poll::Ready(Err(LockError::ShuttingDown));
            }
            match &mut this.state {
                State::Refused(error) => {
                    let error = error.take().expect("polled after completion");
                    this.state = State::Done;
                    return Poll::Ready(Err(error));
                }
                State::Local(acquire) => {
                    let result = match Pin::new(acquire).poll(cx) {
                        Poll::Ready(result) => result,
                        // Queued after a shutdown's wake-up sweep passed this key: the
                        // flag, read again after queueing, is set then (the key's shard
                        // lock orders the two).
                        Poll::Pending if this.locks.shutdown.is_started() => {
                            this.state = State::Done;
                            return Poll::Ready(Err(LockError::ShuttingDown));
                        }
                        Poll::Pending => {
                            this.queued_locally = true;
                            return Poll::Pending;
                        }
                    };
                    this.state = State::Done;
                    let local = match result {
                        Ok(local) => local,
                        Err(LockError::Timeout) if this.try_once() => {
                            return Poll::Ready(Err(LockError::Busy))
                        }
                        Err(error) => return Poll::Ready(Err(error)),
                    };
                    this.state = this.held_locally(local);
                }
                State::Held(local) => {
                    let local = local.take().expect("polled after completion");
                    this.state = State::Done;
                    return Poll::Ready(Ok(this.guard(local, None, None)));
                }
                State::Remote {
                    local,
                    remote,
                    span,
                } => {
                    let result = ready!(span.in_scope(|| Pin::new(&mut *remote).poll(cx)));
                    match &result {
                        Ok(Acquired::Granted(lease) | Acquired::NotRecorded(lease)) => {
                            span.record("outcome", "acquired");
                            span.record("fencing_token", lease.fencing_token());
                        }
                        Ok(Acquired::Recorded(_)) => {
                            span.record("outcome", "recorded");
                        }
                        Err(error) => {
                            span.record("outcome", RejectionKind::of(error).as_str());
                            if let LockError::Backend(error) = error {
                                this.locks.last_error.record(error);
                            }
                        }
                    }
                    let local = local.take().expect("polled after completion");
                    this.state = State::Done;
                    return Poll::Ready(match result {
                        Ok(acquired) => Ok(this.remote_guard(local, acquired)),
                        Err(LockError::Timeout) if this.try_once() => Err(LockError::Busy),
                        Err(error @ LockError::Backend(_)) if this.locks.fail_open => {
                            Ok(this.guard(local, None, Some(error)))
                        }
                        // The local guard is dropped here, before the caller hears.
                        Err(error) => Err(error),
                    });
                }
                State::Done => panic!("DistributedAcquire polled after completion"),
            }
        }
    }
}

impl fmt::Debug for DistributedAcquire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Refused(_) => "refused",
            State::Local(_) => "local",
            State::Held(_) => "held",
            State::Remote { .. } => "remote",
            State::Done => "done",
        };
        f.debug_struct("DistributedAcquire")
            .field("name", &self.locks.name)
            .field("state", &state)
            .field("timeout", &self.timeout)
            .finish()
    }
}
