//! [`ReplayFuture`]: the response future of the replay layer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The response future of [`Replay`](super::Replay).
///
/// Dropping it at any await (a client that went away) stores nothing unless the
/// inner service already answered: the store write runs in a task of its own, so a
/// completed handler's record is not lost to a disconnect in the last round trip.
pub struct ReplayFuture<T>(Pin<Box<dyn Future<Output = T> + Send>>);

impl<T> ReplayFuture<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self(Box::pin(future))
    }
}

impl<T> Future for ReplayFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.0.as_mut().poll(cx)
    }
}

impl<T> std::fmt::Debug for ReplayFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayFuture")
    }
}
