//! A lock held on a session: the lease handed out, and its release, which unlocks on
//! the caller's task while the lock is still young in the backend's `Holds`, or stops
//! its holding task (`watch`), which then unlocks.

use std::sync::Arc;

use tokio::time::Instant;

use super::holds::{Holds, Taken, YoungLease};
use super::watch::{end, expired, Ended, Watched};
use super::{SessionLock, Timing};
#[cfg(feature = "replay")]
use crate::backend::RecordWrite;
use crate::backend::{BoxFuture, Lease, LeaseSignal, LostReason, ReleaseLease};
#[cfg(feature = "replay")]
use crate::LockError;

/// Adds the locked `session` to the backend's [`Holds`], watched with `timing` until
/// the lease is released. `since` is when the last round trip known to have reset the
/// server's idle limit was sent (it answered within the command timeout): the lease
/// counts from there, so the holder is told a command timeout before that limit can
/// end the session.
pub(crate) fn hold<E: SessionLock>(
    engine: Arc<E>,
    timing: Timing,
    session: E::Session,
    held: E::Held,
    token: Option<u64>,
    since: Instant,
) -> Lease {
    // Lost at the next check's timeout unless it answers in time: an instant on the
    // clock, so a holder whose runtime stalls knows it too.
    let deadline = timing.valid_until(since);
    let (lost, signal) = LeaseSignal::with_deadline(deadline);
    #[cfg(feature = "replay")]
    let writes_records = engine.writes_records(&held);
    let holds = engine.holds().clone();
    let id = holds.add(YoungLease {
        engine,
        session,
        held,
        watched: Watched::new(timing, deadline, lost),
        due: timing.check_due(deadline),
    });
    Lease::new(
        token,
        signal,
        SessionRelease {
            holds,
            id,
            #[cfg(feature = "replay")]
            writes_records,
        },
    )
}

/// Releases a lock that has no holding task, on the caller's task: unlocks, unless the
/// lease is past its deadline.
async fn release_young<E: SessionLock>(lease: YoungLease<E>, release: E::Release) -> Ended {
    let YoungLease {
        engine,
        mut session,
        held,
        watched,
        due: _,
    } = lease;
    let ended = match expired::<E>(&held, &watched) {
        Some(ended) => ended,
        None => engine.unlock(&mut session, &held, release).await,
    };
    drop(watched);
    end(&*engine, session, &held, ended).await
}

/// Ends a lease: unlocks a young one on the caller's task, or stops its holding task,
/// which then unlocks.
struct SessionRelease<E: SessionLock> {
    holds: Holds<E>,
    id: u64,
    /// The backend whose replay store may write its record with the release.
    #[cfg(feature = "replay")]
    writes_records: Option<usize>,
}

impl<E: SessionLock> SessionRelease<E> {
    /// Ends the hold (unless a record's write did already) and waits for its end.
    fn end(&self) -> BoxFuture<Ended> {
        match self.holds.take(self.id) {
            Some(Taken::Young(lease)) => Box::pin(release_young(lease, E::Release::default())),
            Some(Taken::Running(running)) => {
                if let Some(stop) = running.stop {
                    let _ = stop.send(E::Release::default());
                }
                let task = running.task;
                Box::pin(async move { task.await.unwrap_or(Err(LostReason::Unreachable)) })
            }
            None => Box::pin(std::future::ready(Err(LostReason::Unreachable))),
        }
    }
}

/// Without a release (its runtime is gone): a young session is closed, which frees the
/// lock; a holding task's stop is dropped, which unlocks.
impl<E: SessionLock> Drop for SessionRelease<E> {
    fn drop(&mut self) {
        drop(self.holds.take(self.id));
    }
}

impl<E: SessionLock> ReleaseLease for SessionRelease<E> {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let ended = self.end();
        Box::pin(async move {
            let _ = ended.await;
        })
    }

    /// `Err` when the lock was gone before the release (the session ended, or was found
    /// not holding it), or, for an engine whose unlock reports it, when the unlock
    /// found it not held or could not confirm it (then the session was closed, which
    /// frees the lock).
    fn release_checked(self: Box<Self>) -> BoxFuture<Result<(), LostReason>> {
        let ended = self.end();
        Box::pin(async move {
            let ended = ended.await;
            match E::REPORTS_RELEASE {
                true => ended,
                false => Ok(()),
            }
        })
    }

    /// For a record of the replay store of this lease's backend: the write and the
    /// unlock go together on the lock's session. The holding task (a young lease gets
    /// one now) takes it from here: a caller that stops waiting leaves neither half
    /// undone.
    #[cfg(feature = "replay")]
    fn release_writing(&self, record: RecordWrite) -> Option<BoxFuture<Result<bool, LockError>>> {
        let writer = self.writes_records?;
        let (release, written) = E::release_writing(record, writer)?;
        let stop = self.holds.stop(self.id)?;
        // A lease lost already has no watch task to take it: the answer's sender is
        // dropped with the message, which tells the writer.
        let _ = stop.send(release);
        Some(written)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicBool;
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::backend::session::holds::IDLE_LOOKS;
    use crate::backend::session::Checked;
    use crate::backend::LeaseLostSender;

    /// An engine whose checks answer from a script (then go out and are never answered,
    /// given up at the deadline), and which writes down what the core asked of it.
    struct Scripted {
        checks: Mutex<VecDeque<Checked>>,
        unlock: Result<(), LostReason>,
        asked: Mutex<Vec<&'static str>>,
        holds: Holds<Scripted>,
        /// What `is_closed` answers.
        closed: AtomicBool,
    }

    impl Scripted {
        /// Each lease handed to its task at once.
        fn new(checks: impl IntoIterator<Item = Checked>, unlock: Ended) -> Arc<Self> {
            Self::looking(checks, unlock, None)
        }

        /// Young leases looked at every `looks`.
        fn looking(
            checks: impl IntoIterator<Item = Checked>,
            unlock: Ended,
            looks: Option<Duration>,
        ) -> Arc<Self> {
            Arc::new(Scripted {
                checks: Mutex::new(checks.into_iter().collect()),
                unlock,
                asked: Mutex::default(),
                holds: Holds::new(looks),
                closed: AtomicBool::new(false),
            })
        }

        fn asked(&self) -> Vec<&'static str> {
            self.asked.lock().unwrap().clone()
        }
    }

    impl SessionLock for Scripted {
        type Session = ();
        type Held = &'static str;
        type Release = ();

        const ENGINE: &'static str = "Scripted";
        const SHARED_SESSION: &'static str = "shared";

        async fn check(
            &self,
            (): &mut (),
            _: &&'static str,
            deadline: Instant,
            lost: &LeaseLostSender,
        ) -> Checked {
            let next = self.checks.lock().unwrap().pop_front();
            match next {
                Some(checked) => checked,
                // Sent, and never answered: given up at the deadline, as the engines do.
                None => {
                    lost.asking();
                    tokio::time::sleep_until(deadline).await;
                    Checked::Failed("no answer".into())
                }
            }
        }

        async fn unlock(&self, (): &mut (), _: &&'static str, (): ()) -> Ended {
            self.asked.lock().unwrap().push("unlock");
            self.unlock
        }

        fn give_back(&self, (): ()) {
            self.asked.lock().unwrap().push("give back");
        }

        fn holds(&self) -> &Holds<Self> {
            &self.holds
        }

        fn is_closed(&self, (): &()) -> bool {
            self.closed.load(SeqCst)
        }

        async fn close(&self, (): (), _: &&'static str, _: LostReason) {
            self.asked.lock().unwrap().push("close");
        }
    }

    const TIMING: Timing = Timing {
        liveness_interval: Duration::from_millis(100),
        command_timeout: Duration::from_millis(50),
    };

    #[tokio::test(start_paused = true)]
    async fn an_answer_moves_the_deadline_and_a_clean_unlock_pools_the_session() {
        let since = Instant::now();
        let alive_at = since + Duration::from_millis(80);
        let engine = Scripted::new([Checked::Alive(alive_at)], Ok(()));
        let lease = hold(engine.clone(), TIMING, (), "k", Some(7), since);
        assert_eq!(
            lease.signal().valid_until(),
            Some(TIMING.valid_until(since))
        );
        tokio::task::yield_now().await;
        assert_eq!(
            lease.signal().valid_until(),
            Some(TIMING.valid_until(alive_at))
        );
        assert_eq!(lease.fencing_token(), Some(7));
        assert_eq!(lease.release_checked().await, Ok(()));
        assert_eq!(engine.asked(), ["unlock", "give back"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_found_not_holding_raises_the_signal_and_is_closed() {
        let engine = Scripted::new([Checked::NotOwner], Ok(()));
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        tokio::task::yield_now().await;
        assert_eq!(lease.signal().lost_reason(), Some(LostReason::NotOwner));
        assert_eq!(lease.release_checked().await, Err(LostReason::NotOwner));
        assert_eq!(engine.asked(), ["close"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_broken_session_is_unreachable_and_never_unlocked() {
        let engine = Scripted::new([Checked::Failed("reset".into())], Ok(()));
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        tokio::task::yield_now().await;
        assert_eq!(lease.signal().lost_reason(), Some(LostReason::Unreachable));
        lease.release().await;
        assert_eq!(engine.asked(), ["close"]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unlock_that_finds_the_lock_gone_closes_the_session_and_says_so() {
        let engine = Scripted::new([], Err(LostReason::NotOwner));
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        assert_eq!(lease.release_checked().await, Err(LostReason::NotOwner));
        assert_eq!(engine.asked(), ["unlock", "close"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_that_stalled_past_its_deadline_is_lost_and_its_session_closed() {
        let since = Instant::now();
        let engine = Scripted::new([Checked::Alive(since)], Ok(()));
        let lease = hold(engine.clone(), TIMING, (), "k", None, since);
        // The holding task first runs past the deadline (a stalled runtime): no check
        // is sent, the lease is lost by the clock, and the session is closed, not
        // unlocked.
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(lease.signal().lost_reason(), Some(LostReason::Expired));
        lease.release().await;
        assert_eq!(engine.asked(), ["close"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_unanswered_at_the_deadline_is_lost_as_unreachable_and_its_session_closed() {
        let engine = Scripted::new([], Ok(()));
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        // The check went out and its answer never came: the engine's, not a stall.
        lease.signal().lost().await;
        assert_eq!(lease.signal().lost_reason(), Some(LostReason::Unreachable));
        lease.release().await;
        assert_eq!(engine.asked(), ["close"]);
    }

    const LOOKS: Option<Duration> = Some(Duration::from_millis(5));

    #[tokio::test(start_paused = true)]
    async fn a_young_lease_released_before_its_check_unlocks_without_a_task() {
        let engine = Scripted::looking([], Ok(()), LOOKS);
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(engine.holds.counts(), (1, 0), "young, no task");
        assert_eq!(lease.release_checked().await, Ok(()));
        assert_eq!(engine.asked(), ["unlock", "give back"]);
        assert_eq!(engine.holds.counts(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_young_lease_gets_its_task_when_its_check_is_due() {
        let since = Instant::now();
        let alive_at = since + Duration::from_millis(100);
        let engine = Scripted::looking([Checked::Alive(alive_at)], Ok(()), LOOKS);
        let lease = hold(engine.clone(), TIMING, (), "k", None, since);
        let due = TIMING.check_due(TIMING.valid_until(since));
        tokio::time::sleep_until(due - Duration::from_millis(1)).await;
        assert_eq!(engine.holds.counts(), (1, 0));
        tokio::time::sleep_until(due + LOOKS.unwrap()).await;
        assert_eq!(engine.holds.counts(), (0, 1), "handed over within a look");
        assert_eq!(
            lease.signal().valid_until(),
            Some(TIMING.valid_until(alive_at))
        );
        assert_eq!(lease.release_checked().await, Ok(()));
        assert_eq!(engine.asked(), ["unlock", "give back"]);
        assert_eq!(engine.holds.counts(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_young_session_that_ends_is_lost_within_a_look() {
        let engine = Scripted::looking([Checked::Failed("closed".into())], Ok(()), LOOKS);
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        tokio::time::advance(Duration::from_millis(20)).await;
        engine.closed.store(true, SeqCst);
        tokio::time::sleep(2 * LOOKS.unwrap()).await;
        assert_eq!(lease.signal().lost_reason(), Some(LostReason::Unreachable));
        lease.release().await;
        assert_eq!(engine.asked(), ["close"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_young_lease_past_its_deadline_is_closed_not_unlocked() {
        // Looked at too rarely to be handed over: released young, by a holder whose
        // runtime stalled past the deadline.
        let engine = Scripted::looking([], Ok(()), Some(Duration::from_secs(3600)));
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(engine.holds.counts(), (1, 0));
        assert_eq!(lease.release_checked().await, Err(LostReason::Expired));
        assert_eq!(engine.asked(), ["close"]);
    }

    /// It outlives a short gap between locks (no spawn per lock of a steady stream),
    /// and ends once none was young for a while.
    #[tokio::test(start_paused = true)]
    async fn the_looking_task_ends_a_while_after_the_last_young_lease_and_comes_back() {
        let engine = Scripted::looking([], Ok(()), LOOKS);
        let looks = LOOKS.unwrap();
        for _ in 0..2 {
            let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
            lease.release().await;
            tokio::time::sleep(2 * looks).await;
            assert!(engine.holds.is_looking(), "ended at the first gap");
            tokio::time::sleep(IDLE_LOOKS * looks).await;
            assert!(!engine.holds.is_looking(), "still looking with none young");
        }
        let lease = hold(engine.clone(), TIMING, (), "k", None, Instant::now());
        assert!(engine.holds.is_looking());
        lease.release().await;
    }
}
