//! [`Detach`]: a future that runs in its caller's task and, dropped before it ends, in a
//! task of its own from there on.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use crate::BoxFuture;

/// Runs `future` where it is polled, with no task of its own, so an acquisition or a
/// release that is not cancelled costs no spawn and no hand-off between tasks (on a
/// busy runtime those were a third of a remote lock's time). Dropped before it ends,
/// the future moves into a task of its own and runs to its end there: a round trip is
/// never cut in the middle, and what it was granted is given back by the drop of its
/// output. Without a runtime (it is shutting down) it is dropped with it.
///
/// A panic of the future is its caller's answer `on_panic(message)`, as it would be
/// a task's: the caller, a request, goes on.
#[must_use = "futures do nothing unless polled"]
pub(crate) struct Detach<T: Send + 'static, P = fn(String) -> T> {
    /// The future and what a panic of it answers; `None` once it ended.
    running: Option<(BoxFuture<T>, P)>,
}

impl<T: Send + 'static, P: FnOnce(String) -> T + Unpin> Detach<T, P> {
    pub(crate) fn new(future: BoxFuture<T>, on_panic: P) -> Self {
        Self {
            running: Some((future, on_panic)),
        }
    }
}

impl<T: Send + 'static, P: FnOnce(String) -> T + Unpin> Future for Detach<T, P> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some((future, _)) = self.running.as_mut() else {
            panic!("Detach polled after it ended");
        };
        let polled = catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        if let Ok(Poll::Pending) = polled {
            return Poll::Pending;
        }
        let (_, on_panic) = self.running.take().expect("running until now");
        Poll::Ready(match polled {
            Ok(poll) => ready!(poll),
            Err(panic) => on_panic(message(&*panic)),
        })
    }
}

impl<T: Send + 'static, P> Drop for Detach<T, P> {
    fn drop(&mut self) {
        if let Some((future, _)) = self.running.take() {
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
            let inner = Box::pin(async move { tokio::task::id() == task });
            Detach::new(inner, |_| false).await
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
        let mut detach = Detach::new(future, |_| ());
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
        let future: BoxFuture<Result<(), String>> = Box::pin(async { panic!("boom") });
        let answer = Detach::new(future, Err).await;
        assert_eq!(answer, Err("boom".to_owned()));
    }
}
