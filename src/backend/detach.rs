//! [`Detach`]: a future that runs in its caller's task and, dropped before it ends, in a
//! task of its own from there on.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use crate::error::LockError;
use crate::BoxFuture;

/// Runs `future` where it is polled, with no task of its own, so an acquisition or a
/// release that is not cancelled costs no spawn and no hand-off between tasks (on a
/// busy runtime those were a third of a remote lock's time). Dropped before it ends,
/// the future moves into a task of its own and runs to its end there: a round trip is
/// never cut in the middle, and what it was granted is given back by the drop of its
/// output. Without a runtime (it is shutting down) it is dropped with it.
///
/// A panic of the future is its caller's answer [`PanicAnswer::to_panic`], as it
/// would be a task's: the caller, a request, goes on.
#[must_use = "futures do nothing unless polled"]
pub(crate) struct Detach<T: PanicAnswer + Send + 'static> {
    /// `None` once it ended. Nothing else is kept: this sits in every request's future.
    future: Option<BoxFuture<T>>,
}

/// What a [`Detach`]ed future answers when it panics.
pub(crate) trait PanicAnswer {
    fn to_panic(message: String) -> Self;
}

/// An acquisition: a backend error that names the panic.
impl<T> PanicAnswer for Result<T, LockError> {
    fn to_panic(message: String) -> Self {
        let message = format!("the lock backend panicked: {message}");
        Err(LockError::Backend(message.into()))
    }
}

/// A release: nothing to answer (the lease runs out by itself).
impl PanicAnswer for () {
    fn to_panic(_: String) -> Self {}
}

/// An answer the caller makes of its own when there is none.
impl<T> PanicAnswer for Option<T> {
    fn to_panic(_: String) -> Self {
        None
    }
}

impl<T: PanicAnswer + Send + 'static> Detach<T> {
    pub(crate) fn new(future: BoxFuture<T>) -> Self {
        Self {
            future: Some(future),
        }
    }
}

impl<T: PanicAnswer + Send + 'static> Future for Detach<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            panic!("Detach polled after it ended");
        };
        let answer = match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(poll) => ready!(poll),
            Err(panic) => T::to_panic(message(&*panic)),
        };
        self.future = None;
        Poll::Ready(answer)
    }
}

impl<T: PanicAnswer + Send + 'static> Drop for Detach<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(future);
            }
        }
    }
}

/// What a panic said, as `panic!` was given it.
fn message(panic: &(dyn Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(text), _) => (*text).to_owned(),
        (_, Some(text)) => text.clone(),
        _ => "a panic".to_owned(),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_future_run_to_its_end_runs_in_the_callers_task() {
        let in_place = tokio::spawn(async {
            let task = tokio::task::id();
            let inner = Box::pin(async move { Some(tokio::task::id() == task) });
            Detach::new(inner).await.unwrap_or(false)
        });
        assert!(in_place.await.unwrap());
    }

    #[tokio::test]
    async fn a_future_dropped_midway_runs_to_its_end_in_a_task_of_its_own() {
        let ended = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let future = {
            let ended = ended.clone();
            Box::pin(async move {
                let _ = rx.await;
                ended.store(true, Ordering::SeqCst);
            })
        };
        let mut detach = Detach::new(future);
        // Polled once (parked on the channel), then dropped.
        assert!(tokio::time::timeout(Duration::from_millis(10), &mut detach)
            .await
            .is_err());
        drop(detach);
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), async {
            while !ended.load(Ordering::SeqCst) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the detached future ran to its end");
    }

    #[tokio::test]
    async fn a_panic_is_the_callers_answer() {
        let future: BoxFuture<Result<(), LockError>> = Box::pin(async { panic!("boom") });
        let answer = Detach::new(future).await;
        let error = answer.unwrap_err().to_string();
        assert!(error.contains("boom"), "{error}");
    }
}
