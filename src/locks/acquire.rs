//! The future returned by [`KeyedLocks::lock`](super::KeyedLocks::lock).

use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use super::{Attempt, Handle, KeyGuard, LockError, Mode, Waiter};
use crate::sync::Arc;

/// Waits for a key; resolves to its [`KeyGuard`].
///
/// A named, `Unpin` future so middleware can store it without boxing. Dropping it
/// before it resolves gives back anything it was handed.
#[must_use = "futures do nothing unless polled"]
pub struct Acquire<K: Eq + Hash> {
    /// The table and the key, until the future resolves: then both move into the guard
    /// (no second reference count on the table per lock).
    wanted: Option<(Arc<Handle<K>>, K)>,
    /// The key's table hash, computed once for the attempt, a withdrawal and the guard.
    hash: u64,
    queued: Option<Arc<Waiter>>,
    timeout: Option<Duration>,
    mode: Mode,
    /// Created only once the future has to wait, so the uncontended path never touches
    /// the timer.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<K: Eq + Hash> Acquire<K> {
    pub(super) fn new(
        inner: Arc<Handle<K>>,
        key: K,
        timeout: Option<Duration>,
        mode: Mode,
    ) -> Self {
        Self {
            hash: inner.table.hash(&key),
            wanted: Some((inner, key)),
            queued: None,
            timeout,
            mode,
            deadline: None,
        }
    }

    fn resolve(&mut self, result: Result<(), LockError>) -> Poll<Result<KeyGuard<K>, LockError>> {
        self.queued = None;
        let (inner, key) = self.wanted.take().expect("Acquire polled after completion");
        Poll::Ready(result.map(|()| KeyGuard::new(inner, key, self.hash, self.mode)))
    }
}

// The key is never pinned: it moves into the guard by value.
impl<K: Eq + Hash> Unpin for Acquire<K> {}

impl<K: Eq + Hash + Clone> Future for Acquire<K> {
    type Output = Result<KeyGuard<K>, LockError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &this.queued {
            Some(waiter) => {
                if waiter.poll_granted(cx.waker()) {
                    return this.resolve(Ok(()));
                }
            }
            None => {
                let (inner, _) = this
                    .wanted
                    .as_ref()
                    .expect("Acquire polled after completion");
                let try_once = this.timeout == Some(Duration::ZERO);
                let waker = (!try_once).then(|| cx.waker());
                match inner.attempt(this.hash, this.mode, waker) {
                    Ok(Attempt::Acquired) => return this.resolve(Ok(())),
                    Ok(Attempt::Queued(waiter)) => this.queued = Some(waiter),
                    Ok(Attempt::Busy) => return this.resolve(Err(LockError::Timeout)),
                    Ok(Attempt::QueueFull) => return this.resolve(Err(LockError::QueueFull)),
                    Err(error) => return this.resolve(Err(error)),
                }
                if let Some(timeout) = this.timeout {
                    this.deadline = Some(Box::pin(tokio::time::sleep(timeout)));
                }
            }
        }

        let Some(deadline) = &mut this.deadline else {
            return Poll::Pending;
        };
        if deadline.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // Out of time, unless the permit was handed over at this very moment: then
        // the work can go ahead rather than be thrown away.
        let waiter = this
            .queued
            .take()
            .expect("a deadline implies a queued waiter");
        if waiter.is_granted() {
            return this.resolve(Ok(()));
        }
        let (inner, _) = this.wanted.as_ref().expect("checked above");
        inner.withdraw(this.hash, &waiter);
        this.resolve(Err(LockError::Timeout))
    }
}

impl<K: Eq + Hash> Drop for Acquire<K> {
    fn drop(&mut self) {
        if let (Some(waiter), Some((inner, _))) = (self.queued.take(), &self.wanted) {
            inner.withdraw(self.hash, &waiter);
        }
    }
}

impl<K: Eq + Hash + fmt::Debug> fmt::Debug for Acquire<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquire")
            .field("key", &self.wanted.as_ref().map(|(_, key)| key))
            .field("queued", &self.queued.is_some())
            .field("timeout", &self.timeout)
            .field("shared", &(self.mode == Mode::Shared))
            .finish()
    }
}
