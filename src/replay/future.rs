//! [`ReplayFuture`]: the response future of the replay layer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The response future of [`Replay`](super::Replay).
///
/// Dropping it at any await (a client that went away) stores nothing unless the
/// inner service already answered: the store write runs in a task of its own, so a
/// completed handler's record is not lost to a disconnect in the last round trip.
pub struct ReplayFuture<T>(Step<T>);

enum Step<T> {
    /// Answered when the service was called (a replay from memory of a whole body):
    /// no future to box.
    Ready(Option<T>),
    Running(Pin<Box<dyn Future<Output = T> + Send>>),
}

impl<T> ReplayFuture<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self(Step::Running(Box::pin(future)))
    }

    pub(crate) fn ready(output: T) -> Self {
        Self(Step::Ready(Some(output)))
    }
}

// The output is moved out, never pinned: the future may move whatever `T` is.
impl<T> Unpin for ReplayFuture<T> {}

impl<T> Future for ReplayFuture<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.get_mut().0 {
            Step::Ready(output) => Poll::Ready(output.take().expect("polled after completion")),
            Step::Running(future) => future.as_mut().poll(cx),
        }
    }
}

impl<T> std::fmt::Debug for ReplayFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayFuture")
    }
}
