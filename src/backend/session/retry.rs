//! Only the wait bounds the waiting (DESIGN rule 11), for the session-lock engines: an
//! attempt that failed in passing (a dead pooled connection, a connect or a statement
//! left unanswered, a server restarting) is tried again after a jittered pause, on a
//! fresh session, until the wait ends.
//!
//! The one exception is a server that never answered the backend: an address nothing
//! listens on, or a server down since the start, is told at once (503) rather than
//! waited out. Once it answered, an outage is a passing one, whatever its length: a
//! wait that ends inside it ends with its last failure (503), as on the TTL engines.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::backoff::Backoff;
use crate::LockError;

/// The first pause before a failed attempt is tried again; it doubles per failure.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// The longest pause between attempts.
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Whether the server ever answered this backend; shared by all its acquisitions. The
/// engine marks it where a round trip is answered.
#[derive(Debug, Default)]
pub(crate) struct Reached(AtomicBool);

impl Reached {
    /// The server answered a round trip.
    pub(crate) fn mark(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn ever(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Runs `attempt` until it succeeds, fails for good, or the wait ends at `deadline`
/// (see the module docs); `is_transient` says which failures are worth another attempt.
/// Also returns whether an attempt failed before the one that succeeded: a grant then
/// was contended. Each attempt owns its session: a failed one drops it (closed, never
/// pooled), which frees whatever the server granted it.
pub(crate) async fn within_the_wait<T, F>(
    reached: &Reached,
    deadline: Instant,
    is_transient: fn(&LockError) -> bool,
    mut attempt: impl FnMut() -> F,
) -> Result<(T, bool), LockError>
where
    F: Future<Output = Result<T, LockError>>,
{
    let mut backoff = Backoff::new(RETRY_PAUSE, MAX_RETRY_PAUSE);
    let mut retried = false;
    loop {
        let error = match attempt().await {
            Ok(done) => return Ok((done, retried)),
            Err(error) if is_transient(&error) && reached.ever() => error,
            Err(error) => return Err(error),
        };
        retried = true;
        let left = deadline.saturating_duration_since(Instant::now());
        // The last pause ends with the wait: nothing answered since the failure.
        let pause = backoff.pause().min(left);
        tracing::debug!(%error, ?pause, "lock attempt failed in passing; tried again within the wait");
        tokio::time::sleep(pause).await;
        if Instant::now() >= deadline {
            return Err(error);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    fn transient(error: &LockError) -> bool {
        matches!(error, LockError::Backend(error) if error.to_string() == "passing")
    }

    fn passing<T>() -> Result<T, LockError> {
        Err(LockError::Backend("passing".into()))
    }

    fn reached() -> Reached {
        let reached = Reached::default();
        reached.mark();
        reached
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_never_answered_is_told_at_once() {
        let attempts = AtomicUsize::new(0);
        let deadline = Instant::now() + Duration::from_secs(5);
        let outcome = within_the_wait(&Reached::default(), deadline, transient, || {
            attempts.fetch_add(1, Ordering::Relaxed);
            async { passing::<()>() }
        })
        .await;
        assert!(outcome.is_err());
        assert_eq!(attempts.load(Ordering::Relaxed), 1);
        assert!(Instant::now() < deadline, "waited out");
    }

    /// The loop on attempts that fail in passing `failures` times, then succeed with
    /// their number; each attempt first marks `reached` if `answers` (its server
    /// answered before the failure).
    async fn failing_then_granted(
        reached: &Reached,
        failures: usize,
        answers: bool,
    ) -> (usize, bool) {
        let attempts = AtomicUsize::new(0);
        let deadline = Instant::now() + Duration::from_secs(5);
        let outcome = within_the_wait(reached, deadline, transient, || {
            let n = attempts.fetch_add(1, Ordering::Relaxed);
            if answers {
                reached.mark();
            }
            async move {
                if n < failures {
                    passing()
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        outcome.unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_passing_failure_is_tried_again_until_it_succeeds_and_counts_as_contended() {
        assert_eq!(failing_then_granted(&reached(), 3, false).await, (3, true));
        assert_eq!(failing_then_granted(&reached(), 0, false).await, (0, false));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_during_the_wait_makes_its_failures_passing_ones() {
        // The server answered the first attempt, then its connection broke.
        let never_before = Reached::default();
        assert_eq!(
            failing_then_granted(&never_before, 1, true).await,
            (1, true)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_that_outlasts_the_wait_ends_it_with_the_failure_not_later() {
        let deadline = Instant::now() + Duration::from_secs(2);
        let outcome = within_the_wait(&reached(), deadline, transient, || async {
            passing::<()>()
        })
        .await;
        assert!(matches!(outcome, Err(LockError::Backend(_))));
        assert_eq!(Instant::now(), deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lasting_failure_or_a_timeout_is_told_at_once() {
        let deadline = Instant::now() + Duration::from_secs(5);
        let refused = within_the_wait(&reached(), deadline, transient, || async {
            Err::<(), _>(LockError::Backend("refused login".into()))
        })
        .await;
        assert!(matches!(refused, Err(LockError::Backend(_))));
        let busy = within_the_wait(&reached(), deadline, transient, || async {
            Err::<(), _>(LockError::Timeout)
        })
        .await;
        assert!(matches!(busy, Err(LockError::Timeout)));
        assert_eq!(Instant::now(), deadline - Duration::from_secs(5));
    }
}
