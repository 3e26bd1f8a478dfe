//! The future returned by [`KeyedLocks::lock`](super::KeyedLocks::lock).

use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use super::{Attempt, Inner, KeyGuard, LockError, Waiter};
use crate::sync::Arc;

/// Waits for a key; resolves to its [`KeyGuard`].
///
/// A named, `Unpin` future so middleware can store it without boxing. Dropping it
/// before it resolves gives back anything it was handed.
#[must_use = "futures do nothing unless polled"]
pub struct Acquire<K: Eq + Hash> {
    inner: Arc<Inner<K>>,
    /// `Some` until the future resolves; then moved into the guard.
    key: Option<K>,
    queued: Option<Arc<Waiter>>,
    timeout: Option<Duration>,
    /// Created only once the future has to wait, so the uncontended path never touches
    /// the timer.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<K: Eq + Hash> Acquire<K> {
    pub(super) fn new(inner: Arc<Inner<K>>, key: K, timeout: Option<Duration>) -> Self {
        Self {
            inner,
            key: Some(key),
            queued: None,
            timeout,
            deadline: None,
        }
    }

    fn guard(&mut self) -> KeyGuard<K> {
        self.queued = None;
        let key = self.key.take().expect("Acquire polled after completion");
        KeyGuard::new(self.inner.clone(), key)
    }
}

// The key is never pinned: it moves into the guard by value.
impl<K: Eq + Hash> Unpin for Acquire<K> {}

impl<K: Eq + Hash + Clone> Future for Acquire<K> {
    type Output = Result<KeyGuard<K>, LockError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let key = this.key.as_ref().expect("Acquire polled after completion");

        match &this.queued {
            Some(waiter) => {
                if waiter.poll_granted(cx.waker()) {
                    return Poll::Ready(Ok(this.guard()));
                }
            }
            None => {
                let try_once = this.timeout == Some(Duration::ZERO);
                let waker = (!try_once).then(|| cx.waker());
                match this.inner.attempt(key, waker) {
                    Ok(Attempt::Acquired) => return Poll::Ready(Ok(this.guard())),
                    Ok(Attempt::Queued(waiter)) => this.queued = Some(waiter),
                    Ok(Attempt::Busy) => {
                        this.key = None;
                        return Poll::Ready(Err(LockError::Timeout));
                    }
                    Ok(Attempt::QueueFull) => {
                        this.key = None;
                        return Poll::Ready(Err(LockError::QueueFull));
                    }
                    Err(error) => {
                        this.key = None;
                        return Poll::Ready(Err(error));
                    }
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
            return Poll::Ready(Ok(this.guard()));
        }
        let key = this.key.take().expect("checked above");
        this.inner.withdraw(&key, &waiter);
        Poll::Ready(Err(LockError::Timeout))
    }
}

impl<K: Eq + Hash> Drop for Acquire<K> {
    fn drop(&mut self) {
        if let (Some(waiter), Some(key)) = (self.queued.take(), &self.key) {
            self.inner.withdraw(key, &waiter);
        }
    }
}

impl<K: Eq + Hash + fmt::Debug> fmt::Debug for Acquire<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquire")
            .field("key", &self.key)
            .field("queued", &self.queued.is_some())
            .field("timeout", &self.timeout)
            .finish()
    }
}
