//! The acquire loop of the engines whose lock is a record taken by a conditional write
//! and waited for by looking again (DynamoDB, Azure Blob, S3, Redlock): an attempt,
//! and while the key is held or the engine fails in passing, a pause and another
//! attempt, until the wait ends. The engine brings the attempt ([`Contend::attempt`]);
//! the loop owns the timing every such engine must get the same way:
//!
//! - the first attempt gets a whole command timeout, so a zero wait still tries once;
//!   later ones end with the wait, so no acquisition outlives its wait by more than one
//!   command timeout;
//! - only the wait bounds the waiting (DESIGN rule 11): an attempt that failed in
//!   passing (no answer, throttled, a broken connection) is tried again after a pause,
//!   within the wait;
//! - a wait that ends while the engine's last word was a failure ends with that
//!   failure (503), not with a timeout (409, 429): an unreachable engine is not a busy
//!   key;
//! - contenders that raced for a free key and all lost (Redlock's split votes) try
//!   again after a short random pause, even past the wait up to one command timeout
//!   from the start, so that one of them wins even a try-once acquisition;
//! - a grant after more than one attempt is [`contended`](Lease::contended).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, sleep_until, timeout_at, Instant};

use super::{deadline_after, jitter, Backoff, TtlBackend};
use crate::backend::Lease;
use crate::LockError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The longest pause before another attempt after a race that nobody won.
const RACE_PAUSE: Duration = Duration::from_millis(10);

/// What one attempt found.
pub(crate) enum Attempt {
    /// Granted: the lease, its in-flight guard disarmed.
    Granted(Lease),
    /// Held by another; the next attempt waits no longer than `free_by` if it is set
    /// (when the holder, as seen, may be taken over).
    Held { free_by: Option<Instant> },
    /// Free, but other contenders' attempts split it and none got it: tried again soon
    /// (no later than `free_by`, if set), even past the wait (see the module docs).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Raced { free_by: Option<Instant> },
    /// The engine grants nothing before `until` (a restart guard): the next attempt
    /// waits for it if the wait allows, else the acquisition ends with `refusal`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    HeldBack { until: Instant, refusal: BoxError },
    /// Failed in passing: tried again within the wait; the acquisition ends with it if
    /// the wait ends first.
    #[cfg_attr(
        not(any(feature = "dynamodb", feature = "azure-blob", feature = "s3")),
        allow(dead_code)
    )]
    Retry(BoxError),
    /// Failed for good: the acquisition ends with it.
    Failed(BoxError),
    /// Its calls reached `limit` unanswered: as if the loop had cut it there; with the
    /// engine's own account of what went unanswered, if it has one.
    OutOfTime(Option<BoxError>),
}

/// An engine's side of the acquire loop; its [`timing`](TtlBackend::timing)'s command
/// timeout is the longest one attempt may take.
pub(crate) trait Contend: TtlBackend {
    /// What one acquisition contends for (an item's key, a blob).
    type Key: Send + Sync;

    /// The pauses between attempts: jittered, from short to the poll interval.
    fn pauses(&self) -> Backoff;

    /// One attempt on `key`, whose calls end by `limit` (the loop cuts it there too).
    /// The attempt keeps its own in-flight guard, so that a grant whose answer never
    /// came (an error, `limit`, this future dropped) is given back.
    fn attempt(
        self: &Arc<Self>,
        key: &Self::Key,
        limit: Instant,
    ) -> impl Future<Output = Attempt> + Send;

    /// An engine failure as the caller sees it: the engine and where it is, then why.
    fn named(&self, error: BoxError) -> LockError;

    /// An attempt's own error for a command timeout.
    fn no_answer(&self) -> BoxError;
}

/// Acquires `key` on `backend`, attempting until granted or the wait ends.
pub(crate) async fn acquire<B: Contend>(
    backend: &Arc<B>,
    key: &B::Key,
    wait: Duration,
) -> Result<Lease, LockError> {
    let started = Instant::now();
    let deadline = deadline_after(wait);
    let command_timeout = backend.timing().command_timeout;
    let race_deadline = deadline.max(started + command_timeout);
    let mut backoff = backend.pauses();
    // The last attempt's failure, if no attempt was answered since.
    let mut failing: Option<BoxError> = None;
    let out_of_time = |failing: Option<BoxError>| match failing {
        Some(error) => backend.named(error),
        None => LockError::Timeout,
    };
    let mut first = true;
    // When the next pause, and the attempt after it, must end: the wait's end, or after
    // a race the race's.
    let mut until = deadline;
    loop {
        let sent_at = Instant::now();
        let limit = match first {
            true => sent_at + command_timeout,
            false => (sent_at + command_timeout).min(until),
        };
        let attempt = timeout_at(limit, backend.attempt(key, limit)).await;
        let limited_by_wait = limit == until;
        until = deadline;
        let mut free_by = None;
        let mut raced = false;
        match attempt.unwrap_or(Attempt::OutOfTime(None)) {
            Attempt::Granted(lease) => return Ok(lease.with_contention(!first)),
            Attempt::Held { free_by: by } => {
                failing = None;
                free_by = by;
            }
            Attempt::Raced { free_by: by } => {
                failing = None;
                free_by = by;
                raced = true;
                until = race_deadline;
            }
            Attempt::HeldBack {
                until: held_until,
                refusal,
            } => {
                if held_until >= deadline {
                    return Err(backend.named(refusal));
                }
                failing = None;
                first = false;
                sleep_until(held_until).await;
                continue;
            }
            Attempt::Retry(error) => {
                tracing::debug!(%error, "lock attempt failed; tried again within the wait");
                failing = Some(error);
            }
            Attempt::Failed(error) => return Err(backend.named(error)),
            Attempt::OutOfTime(_) if limited_by_wait => return Err(out_of_time(failing)),
            // No answer within a whole command timeout: tried again within the wait,
            // as a broken connection is.
            Attempt::OutOfTime(error) => {
                failing = Some(error.unwrap_or_else(|| backend.no_answer()));
            }
        }
        first = false;
        let now = Instant::now();
        if now >= until {
            return Err(out_of_time(failing));
        }
        let mut pause = match raced {
            true => jitter(RACE_PAUSE),
            false => backoff.pause(),
        };
        pause = pause.min(until - now);
        if let Some(by) = free_by.filter(|by| now < *by) {
            pause = pause.min(by - now);
        }
        sleep(pause).await;
        if Instant::now() >= until {
            return Err(out_of_time(failing));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::backend::ttl::{GiveBack, Renewal, Timing};
    use crate::backend::{BoxFuture, LeaseSignal, ReleaseLease};

    const COMMAND_TIMEOUT: Duration = Duration::from_millis(100);

    /// What a scripted attempt does.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        Grant,
        Held,
        Raced,
        HeldBackFor(Duration),
        Retry,
        Silent,
    }

    /// An engine whose attempts follow a script (then `Held`), and that records when
    /// each was made and with what limit.
    struct Scripted {
        script: Mutex<Vec<Step>>,
        attempts: Mutex<Vec<(Instant, Instant)>>,
    }

    fn scripted(steps: &[Step]) -> Arc<Scripted> {
        Arc::new(Scripted {
            script: Mutex::new(steps.iter().rev().copied().collect()),
            attempts: Mutex::default(),
        })
    }

    struct Nothing;

    impl ReleaseLease for Nothing {
        fn release(self: Box<Self>) -> BoxFuture<()> {
            Box::pin(async {})
        }
    }

    impl TtlBackend for Scripted {
        type Target = ();

        fn timing(&self) -> Timing {
            Timing::new(Duration::from_secs(1), Duration::ZERO, COMMAND_TIMEOUT)
        }

        async fn renew(&self, _: &(), _: &str, _: Duration, _: Instant, _: Instant) -> Renewal {
            Renewal::Unknown
        }

        async fn try_give_back(&self, _: &(), _: &str) -> GiveBack {
            GiveBack::Cleared
        }

        fn engine(&self) -> &'static str {
            "scripted"
        }
    }

    impl Contend for Scripted {
        type Key = ();

        fn pauses(&self) -> Backoff {
            Backoff::new(Duration::from_millis(5), Duration::from_millis(20))
        }

        async fn attempt(self: &Arc<Self>, _: &(), limit: Instant) -> Attempt {
            self.attempts.lock().unwrap().push((Instant::now(), limit));
            let step = self.script.lock().unwrap().pop().unwrap_or(Step::Held);
            match step {
                Step::Grant => Attempt::Granted(Lease::new(None, LeaseSignal::new().1, Nothing)),
                Step::Held => Attempt::Held { free_by: None },
                Step::Raced => Attempt::Raced { free_by: None },
                Step::HeldBackFor(wait) => Attempt::HeldBack {
                    until: Instant::now() + wait,
                    refusal: "held back".into(),
                },
                Step::Retry => Attempt::Retry("failed in passing".into()),
                Step::Silent => std::future::pending().await,
            }
        }

        fn named(&self, error: BoxError) -> LockError {
            LockError::Backend(error)
        }

        fn no_answer(&self) -> BoxError {
            "no answer".into()
        }
    }

    fn failed_with(result: Result<Lease, LockError>, what: &str) -> bool {
        matches!(result, Err(LockError::Backend(error)) if error.to_string() == what)
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_attempt_grant_is_uncontended_and_a_later_one_contended() {
        let engine = scripted(&[Step::Grant]);
        let lease = acquire(&engine, &(), Duration::ZERO).await.unwrap();
        assert!(!lease.contended());

        let engine = scripted(&[Step::Held, Step::Retry, Step::Grant]);
        let lease = acquire(&engine, &(), Duration::from_secs(1)).await.unwrap();
        assert!(lease.contended());
        assert_eq!(engine.attempts.lock().unwrap().len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_wait_tries_once_with_a_whole_command_timeout() {
        let engine = scripted(&[Step::Held]);
        let started = Instant::now();
        let result = acquire(&engine, &(), Duration::ZERO).await;
        assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
        let attempts = engine.attempts.lock().unwrap().clone();
        assert_eq!(attempts, vec![(started, started + COMMAND_TIMEOUT)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_ends_on_a_failure_ends_with_it_and_never_past_the_wait() {
        let engine = scripted(&[Step::Retry; 100]);
        let started = Instant::now();
        let wait = Duration::from_millis(50);
        let result = acquire(&engine, &(), wait).await;
        assert!(failed_with(result, "failed in passing"));
        assert!(Instant::now() <= started + wait);
        // Silent, then cut by the wait: a timeout, at the wait's end.
        let engine = scripted(&[Step::Held, Step::Silent]);
        let started = Instant::now();
        let result = acquire(&engine, &(), wait).await;
        assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
        assert_eq!(Instant::now(), started + wait);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_first_attempt_is_tried_again_within_the_wait() {
        let engine = scripted(&[Step::Silent, Step::Grant]);
        let lease = acquire(&engine, &(), Duration::from_secs(1)).await.unwrap();
        assert!(lease.contended());
        let attempts = engine.attempts.lock().unwrap().clone();
        assert_eq!(attempts.len(), 2);
        assert!(
            attempts[1].0 >= attempts[0].1,
            "tried again before the first was cut"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_race_is_tried_again_past_the_wait_up_to_a_command_timeout() {
        let engine = scripted(&[Step::Raced, Step::Raced, Step::Grant]);
        let started = Instant::now();
        let lease = acquire(&engine, &(), Duration::ZERO).await.unwrap();
        assert!(lease.contended());
        for (sent, limit) in engine.attempts.lock().unwrap().iter().skip(1) {
            assert!(*sent < started + COMMAND_TIMEOUT);
            assert!(*limit <= started + COMMAND_TIMEOUT);
        }
        // Races that go on end with a timeout at that bound.
        let engine = scripted(&[Step::Raced; 1000]);
        let started = Instant::now();
        let result = acquire(&engine, &(), Duration::ZERO).await;
        assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
        assert!(Instant::now() <= started + COMMAND_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn held_back_waits_within_the_wait_and_refuses_beyond_it() {
        let hold_back = Duration::from_millis(300);
        let engine = scripted(&[Step::HeldBackFor(hold_back), Step::Grant]);
        let started = Instant::now();
        let lease = acquire(&engine, &(), Duration::from_secs(1)).await.unwrap();
        assert!(lease.contended());
        assert_eq!(engine.attempts.lock().unwrap()[1].0, started + hold_back);

        let engine = scripted(&[Step::HeldBackFor(hold_back)]);
        let started = Instant::now();
        let result = acquire(&engine, &(), Duration::from_millis(200)).await;
        assert!(failed_with(result, "held back"));
        assert_eq!(Instant::now(), started, "refused at once, not waited out");
    }
}
