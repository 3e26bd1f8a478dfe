//! The acquire loop of the engines whose lock is a record taken by a conditional write
//! (Redis, Redlock, DynamoDB, Azure Blob, S3): an attempt, and while the key is held or
//! the engine fails in passing, a wait and another attempt, until the wait ends. The
//! engine brings the attempt ([`Contend::attempt`]) and, if it has one, a way to hear
//! of a change sooner than by looking again ([`Contend::wait_for_change`]: Redis's
//! release messages); the loop owns the timing every such engine must get the same
//! way:
//!
//! - the first attempt gets a whole command timeout, so a zero wait still tries once;
//!   later ones end with the wait, so no acquisition outlives its wait by more than one
//!   command timeout;
//! - only the wait bounds the waiting (DESIGN rule 11): an attempt that failed in
//!   passing (no answer, throttled, a broken connection) is tried again after a pause,
//!   within the wait;
//! - a wait that ends while the engine's last word was a failure ends with that
//!   failure (503), not with a timeout (409, 429): an unreachable engine is not a busy
//!   key; one that ends while the key was held withdraws the contender first
//!   ([`Contend::withdraw`]), so it leaves no place in a queue behind;
//! - contenders that raced for a free key and all lost (Redlock's split votes) try
//!   again after a short random pause, even past the wait up to one command timeout
//!   from the start, so that one of them wins even a try-once acquisition;
//! - a grant after more than one attempt is [`contended`](Lease::contended).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, timeout_at, Instant};

use super::{deadline_after, jitter, Backoff, TtlBackend};
use crate::backend::Lease;
use crate::LockError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The longest pause before another attempt after a race that nobody won.
const RACE_PAUSE: Duration = Duration::from_millis(10);

/// What one attempt found; `G` is what a grant gives the caller.
pub(crate) enum Attempt<G = Lease> {
    /// Granted: the lease (or what carries it), its in-flight guard disarmed.
    Granted(G),
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
    Retry(BoxError),
    /// Failed for good: the acquisition ends with it.
    Failed(BoxError),
    /// Its calls reached `limit` unanswered: as if the loop had cut it there; with the
    /// engine's own account of what went unanswered, if it has one.
    OutOfTime(Option<BoxError>),
}

impl<G> Attempt<G> {
    /// The same outcome, with a grant turned into what `grant` makes of it.
    #[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
    pub(crate) fn map_grant<H>(self, grant: impl FnOnce(G) -> H) -> Attempt<H> {
        match self {
            Attempt::Granted(granted) => Attempt::Granted(grant(granted)),
            Attempt::Held { free_by } => Attempt::Held { free_by },
            Attempt::Raced { free_by } => Attempt::Raced { free_by },
            Attempt::HeldBack { until, refusal } => Attempt::HeldBack { until, refusal },
            Attempt::Retry(error) => Attempt::Retry(error),
            Attempt::Failed(error) => Attempt::Failed(error),
            Attempt::OutOfTime(error) => Attempt::OutOfTime(error),
        }
    }
}

/// What a grant gives the caller: a [`Lease`], or what carries one.
pub(crate) trait Grant: Send {
    /// The same, marked [`contended`](Lease::contended) if `contended`, as before
    /// otherwise.
    fn contended_if(self, contended: bool) -> Self;
}

impl Grant for Lease {
    fn contended_if(self, contended: bool) -> Self {
        match contended {
            true => self.with_contention(true),
            false => self,
        }
    }
}

/// An engine that looks for a replay record with the grant (Redis).
#[cfg(feature = "redis")]
impl Grant for crate::backend::Acquired {
    fn contended_if(self, contended: bool) -> Self {
        crate::backend::Acquired::contended_if(self, contended)
    }
}

/// When one attempt is sent and when its calls must end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Round {
    pub(crate) sent_at: Instant,
    pub(crate) limit: Instant,
}

/// An engine's side of the acquire loop; its [`timing`](TtlBackend::timing)'s command
/// timeout is the longest one attempt may take.
pub(crate) trait Contend: TtlBackend {
    /// What one acquisition contends for (an item's key, a blob).
    type Key: Send + Sync;
    /// What a grant gives the caller.
    type Grant: Grant;
    /// What one acquisition keeps from one attempt to the next (Redis: its token and
    /// its place in the key's queue); `()` where each attempt stands alone.
    type Contender: Send;

    /// The contender of an acquisition of `key` whose wait ends at `deadline`.
    fn contender(
        self: &Arc<Self>,
        key: &Self::Key,
        deadline: Instant,
    ) -> Result<Self::Contender, BoxError>;

    /// The pauses between attempts that found the key held: jittered, from short to
    /// the poll interval.
    fn pauses(&self) -> Backoff;

    /// The pauses before an attempt that failed is tried again; by default the same.
    fn retry_pauses(&self) -> Backoff {
        self.pauses()
    }

    /// One attempt on `key`, whose calls end by the round's limit (the loop cuts it
    /// there too). The attempt keeps its own in-flight guard (in the contender, if it
    /// outlives the attempt), so that a grant whose answer never came (an error, the
    /// limit, this future dropped) is given back.
    fn attempt(
        self: &Arc<Self>,
        contender: &mut Self::Contender,
        key: &Self::Key,
        round: Round,
    ) -> impl Future<Output = Attempt<Self::Grant>> + Send;

    /// Waits until `until`, or until the key may have changed (then the loop attempts
    /// again at once), or until a grant comes without an attempt (Redis: a release
    /// handed the key on). By default it sleeps until `until`.
    fn wait_for_change(
        self: &Arc<Self>,
        contender: &mut Self::Contender,
        key: &Self::Key,
        until: Instant,
    ) -> impl Future<Output = Option<Self::Grant>> + Send {
        let _ = (contender, key);
        async move {
            sleep_until(until).await;
            None
        }
    }

    /// Takes a contender whose wait ended while the key was held out of the engine's
    /// queue, before the caller hears of the timeout; dropping it is enough by default.
    fn withdraw(&self, contender: Self::Contender) -> impl Future<Output = ()> + Send {
        drop(contender);
        std::future::ready(())
    }

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
) -> Result<B::Grant, LockError> {
    let started = Instant::now();
    let deadline = deadline_after(wait);
    let command_timeout = backend.timing().command_timeout;
    let race_deadline = deadline.max(started + command_timeout);
    let mut contender = backend
        .contender(key, deadline)
        .map_err(|error| backend.named(error))?;
    let mut held_pauses = backend.pauses();
    let mut retry_pauses = backend.retry_pauses();
    // The last attempt's failure, if no attempt was answered since.
    let mut failing: Option<BoxError> = None;
    // The wait is over: a timeout if the key was held (the contender withdrawn), or the
    // last failure.
    macro_rules! out_of_time {
        () => {
            return Err(match failing {
                Some(error) => backend.named(error),
                None => {
                    backend.withdraw(contender).await;
                    LockError::Timeout
                }
            })
        };
    }
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
        let round = Round { sent_at, limit };
        let attempt = timeout_at(limit, backend.attempt(&mut contender, key, round)).await;
        let limited_by_wait = limit == until;
        until = deadline;
        let mut free_by = None;
        let mut pause = None;
        match attempt.unwrap_or(Attempt::OutOfTime(None)) {
            Attempt::Granted(grant) => return Ok(grant.contended_if(!first)),
            Attempt::Held { free_by: by } => {
                failing = None;
                free_by = by;
            }
            Attempt::Raced { free_by: by } => {
                failing = None;
                free_by = by;
                pause = Some(jitter(RACE_PAUSE));
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
                pause = Some(retry_pauses.pause());
            }
            Attempt::Failed(error) => return Err(backend.named(error)),
            // Cut by the wait: no answer to withdraw with, so dropped (its in-flight
            // guard gives back what it may hold).
            Attempt::OutOfTime(_) if limited_by_wait => {
                return Err(failing.map_or(LockError::Timeout, |error| backend.named(error)))
            }
            // No answer within a whole command timeout: tried again within the wait,
            // as a broken connection is.
            Attempt::OutOfTime(error) => {
                failing = Some(error.unwrap_or_else(|| backend.no_answer()));
                pause = Some(retry_pauses.pause());
            }
        }
        first = false;
        let now = Instant::now();
        if now >= until {
            out_of_time!();
        }
        let mut pause_until = now + pause.unwrap_or_else(|| held_pauses.pause());
        pause_until = pause_until.min(until);
        if let Some(by) = free_by.filter(|by| now < *by) {
            pause_until = pause_until.min(by);
        }
        let change = backend.wait_for_change(&mut contender, key, pause_until);
        if let Some(grant) = change.await {
            return Ok(grant.contended_if(true));
        }
        if Instant::now() >= until {
            out_of_time!();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
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

    /// How a scripted wait between attempts ends.
    #[derive(Clone, Copy, Debug)]
    enum Wake {
        /// At the end of the pause.
        Sleep,
        /// At once: the key may have changed.
        Early,
        /// At once, with a grant handed over.
        HandOff,
    }

    /// An engine whose attempts and waits follow a script (then `Held` and `Sleep`),
    /// and that records when each attempt was made and with what limit, and how its
    /// contenders ended.
    struct Scripted {
        script: Mutex<Vec<Step>>,
        wakes: Mutex<Vec<Wake>>,
        attempts: Mutex<Vec<(Instant, Instant)>>,
        withdrawn: AtomicUsize,
        dropped: Arc<AtomicUsize>,
    }

    fn scripted(steps: &[Step]) -> Arc<Scripted> {
        scripted_waking(steps, &[])
    }

    fn scripted_waking(steps: &[Step], wakes: &[Wake]) -> Arc<Scripted> {
        Arc::new(Scripted {
            script: Mutex::new(steps.iter().rev().copied().collect()),
            wakes: Mutex::new(wakes.iter().rev().copied().collect()),
            attempts: Mutex::default(),
            withdrawn: AtomicUsize::new(0),
            dropped: Arc::default(),
        })
    }

    /// A contender that counts its drop.
    struct Tracked(Arc<AtomicUsize>);

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn granted() -> Lease {
        Lease::new(None, LeaseSignal::new().1, Nothing)
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
        type Grant = Lease;
        type Contender = Tracked;

        fn contender(self: &Arc<Self>, _: &(), _: Instant) -> Result<Tracked, BoxError> {
            Ok(Tracked(self.dropped.clone()))
        }

        fn pauses(&self) -> Backoff {
            Backoff::new(Duration::from_millis(5), Duration::from_millis(20))
        }

        async fn attempt(self: &Arc<Self>, _: &mut Tracked, _: &(), round: Round) -> Attempt {
            let Round { sent_at, limit } = round;
            self.attempts.lock().unwrap().push((sent_at, limit));
            let step = self.script.lock().unwrap().pop().unwrap_or(Step::Held);
            match step {
                Step::Grant => Attempt::Granted(granted()),
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

        async fn wait_for_change(
            self: &Arc<Self>,
            _: &mut Tracked,
            _: &(),
            until: Instant,
        ) -> Option<Lease> {
            let wake = self.wakes.lock().unwrap().pop().unwrap_or(Wake::Sleep);
            match wake {
                Wake::Sleep => sleep_until(until).await,
                Wake::Early => {}
                Wake::HandOff => return Some(granted()),
            }
            None
        }

        async fn withdraw(&self, contender: Tracked) {
            self.withdrawn.fetch_add(1, Ordering::SeqCst);
            drop(contender);
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

    #[tokio::test(start_paused = true)]
    async fn a_grant_handed_over_during_a_wait_ends_it_contended() {
        let engine = scripted_waking(&[Step::Held], &[Wake::HandOff]);
        let lease = acquire(&engine, &(), Duration::from_secs(1)).await.unwrap();
        assert!(lease.contended());
        assert_eq!(engine.attempts.lock().unwrap().len(), 1);
        assert_eq!(engine.dropped.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_during_a_wait_is_attempted_at_once() {
        let engine = scripted_waking(&[Step::Held, Step::Grant], &[Wake::Early]);
        acquire(&engine, &(), Duration::from_secs(1)).await.unwrap();
        let attempts = engine.attempts.lock().unwrap().clone();
        assert_eq!(attempts.len(), 2);
        assert_eq!(attempts[0].0, attempts[1].0, "no pause after the change");
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_wait_that_ends_on_a_held_key_withdraws_the_contender() {
        let wait = Duration::from_millis(50);
        // Held until the wait's end: withdrawn, once.
        let engine = scripted(&[]);
        let result = acquire(&engine, &(), wait).await;
        assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
        assert_eq!(engine.withdrawn.load(Ordering::SeqCst), 1);
        assert_eq!(engine.dropped.load(Ordering::SeqCst), 1);
        // Failing, or cut mid-attempt by the wait: no answer to withdraw with, dropped.
        for steps in [&[Step::Retry; 100][..], &[Step::Held, Step::Silent]] {
            let engine = scripted(steps);
            acquire(&engine, &(), wait).await.unwrap_err();
            assert_eq!(engine.withdrawn.load(Ordering::SeqCst), 0, "{steps:?}");
            assert_eq!(engine.dropped.load(Ordering::SeqCst), 1, "{steps:?}");
        }
    }

    /// Dropped at each await (an attempt, a pause, a hold-back, a wait for a change),
    /// the acquisition drops its contender, which gives back what it may hold.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_acquisition_drops_its_contender_at_every_await() {
        let one_ms = Duration::from_millis(1);
        let cases: [(&[Step], &[Wake]); 4] = [
            (&[Step::Silent], &[]),
            (&[Step::Retry], &[]),
            (&[Step::HeldBackFor(Duration::from_millis(300))], &[]),
            (&[Step::Held], &[Wake::Sleep]),
        ];
        for (steps, wakes) in cases {
            let engine = scripted_waking(steps, wakes);
            let cut = tokio::time::timeout(one_ms, acquire(&engine, &(), Duration::from_secs(1)));
            assert!(cut.await.is_err(), "{steps:?} ended by itself");
            assert_eq!(engine.dropped.load(Ordering::SeqCst), 1, "{steps:?}");
            assert_eq!(engine.withdrawn.load(Ordering::SeqCst), 0, "{steps:?}");
        }
    }
}
