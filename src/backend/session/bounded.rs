//! A future run within a time limit, its outcome mapped, as one small combinator.
//!
//! An `async fn` that takes a future and awaits it keeps two slots for it (its
//! argument, then the awaited value), and every layer of such wrappers doubles what
//! the caller's future carries; moving that future (into a box, a task, the next
//! wrapper) copies all of it. An acquisition wrapped a few times grew to 15 kB,
//! copied several times per lock. This holds the limited future once.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::error::Elapsed;
use tokio::time::{timeout, Timeout};

pin_project! {
    /// `future` within a limit, its outcome (or [`Elapsed`]) passed through `map`: see
    /// [`bounded`].
    pub(crate) struct Bounded<F, M> {
        #[pin]
        limited: Timeout<F>,
        map: Option<M>,
    }
}

/// Runs `future` for at most `limit` from now, then `map`s its outcome, or
/// `Err(Elapsed)` when the limit passed first (the future is dropped then). Called on a
/// runtime, as [`timeout`] is.
pub(crate) fn bounded<F, M, T>(limit: Duration, future: F, map: M) -> Bounded<F, M>
where
    F: Future,
    M: FnOnce(Result<F::Output, Elapsed>) -> T,
{
    Bounded {
        limited: timeout(limit, future),
        map: Some(map),
    }
}

impl<F, M, T> Future for Bounded<F, M>
where
    F: Future,
    M: FnOnce(Result<F::Output, Elapsed>) -> T,
{
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.project();
        let outcome = ready!(this.limited.poll(cx));
        let map = this
            .map
            .take()
            .expect("a Bounded polled after it completed");
        Poll::Ready(map(outcome))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn maps_the_outcome_or_the_elapsed_limit() {
        let done = bounded(Duration::from_secs(1), async { 7 }, |outcome| outcome.ok());
        assert_eq!(done.await, Some(7));
        let slow = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            7
        };
        let cut = bounded(Duration::from_secs(1), slow, |outcome| outcome.ok());
        assert_eq!(cut.await, None);
    }

    #[tokio::test]
    async fn holds_the_future_once() {
        // 4 kB held across an await.
        let holding = || async {
            let held = [1u8; 4096];
            tokio::task::yield_now().await;
            held[0]
        };
        let plain = std::mem::size_of_val(&timeout(Duration::ZERO, holding()));
        let wrapped = bounded(Duration::ZERO, holding(), |outcome| outcome.ok());
        assert!(std::mem::size_of_val(&wrapped) < plain + 64);
    }
}
