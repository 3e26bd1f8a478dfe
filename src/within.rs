//! A time limit that arms its timer only for a future that is not ready at once: a
//! body already buffered, a store in memory, answer without a clock read or a timer
//! entry.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

/// `future`'s output, or `None` when it was not ready within `limit`.
pub(crate) async fn within<F: Future>(limit: Duration, future: F) -> Option<F::Output> {
    let mut future = pin!(future);
    if let Poll::Ready(output) = poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await {
        return Some(output);
    }
    tokio::time::timeout(limit, future).await.ok()
}
