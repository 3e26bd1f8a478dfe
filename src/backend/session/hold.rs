//! A lock held on a session: the task that watches the session until release, and the
//! release that stops it.
//!
//! The task runs the engine's liveness check again and again: each answer from the
//! holding session moves the lease's deadline to one interval plus one command timeout
//! past it; a session that ended, broke, went unanswered or answers for another raises
//! the lost signal at once (the engine's check fails the moment the session ends, not
//! at the next interval). "Lost" is also a fact of the clock: the deadline lives in the
//! signal, so a holder whose runtime stalls past it knows without this task.
//!
//! On release the pending check is ended (abandoned, or interrupted and read to its
//! end, as the engine needs), then the engine unlocks with a statement that says
//! whether the lock was held. Only a session known to hold nothing goes back to the
//! pool; any other is closed, so the server frees whatever it holds. If the runtime
//! drops the task instead, the session's drop closes it too.

use std::pin::pin;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Checked, SessionLock, Timing};
#[cfg(feature = "replay")]
use crate::backend::RecordWrite;
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};
#[cfg(feature = "replay")]
use crate::LockError;

/// How a hold ended: `Ok` when the unlock answered that this session gave the lock up,
/// else why the lock was not (or no longer) this holder's.
type Ended = Result<(), LostReason>;

/// Hands the locked `session` to a task that watches it, with `timing`, until the
/// lease is released. `since` is when the last round trip known to have reset the
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
    let (stop, stopped) = oneshot::channel();
    #[cfg(feature = "replay")]
    let writes_records = engine.writes_records(&held);
    let watched = Watched {
        timing,
        deadline,
        lost,
    };
    let task = tokio::spawn(watch(engine, session, held, watched, stopped));
    Lease::new(
        token,
        signal,
        SessionRelease::<E> {
            stop: Mutex::new(Some(stop)),
            task,
            #[cfg(feature = "replay")]
            writes_records,
        },
    )
}

/// What the holding task keeps of a lease: its timing, its deadline, and the sender of
/// its lost signal.
struct Watched {
    timing: Timing,
    deadline: Instant,
    lost: LeaseLostSender,
}

/// Watches the held session until release or loss, then gives it back to the pool if
/// it is known to hold nothing, or closes it.
async fn watch<E: SessionLock>(
    engine: Arc<E>,
    mut session: E::Session,
    held: E::Held,
    watched: Watched,
    stop: oneshot::Receiver<E::Release>,
) -> Ended {
    let ended = hold_until_released(&*engine, &mut session, &held, watched, stop).await;
    match ended {
        Ok(()) => engine.give_back(session),
        // A record write still in `stop` was dropped with it, which tells its writer.
        Err(reason) => engine.close(session, &held, reason).await,
    }
    ended
}

/// Checks the session until release (then unlocks) or loss (then raises the signal).
async fn hold_until_released<E: SessionLock>(
    engine: &E,
    session: &mut E::Session,
    held: &E::Held,
    watched: Watched,
    mut stop: oneshot::Receiver<E::Release>,
) -> Ended {
    let Watched {
        timing,
        mut deadline,
        lost,
    } = watched;
    let engine_name = E::ENGINE;
    loop {
        if Instant::now() >= deadline {
            tracing::warn!(lock = %held, "{engine_name} lock lost: its holder stalled past its deadline");
            lost.lose_at_deadline();
            return Err(LostReason::Expired);
        }
        let (checked, release) = {
            let mut check = pin!(engine.check(session, held, deadline));
            // An answer already there is read first; `stop` fires on release, and on
            // its sender's drop (a plain unlock).
            tokio::select! {
                biased;
                checked = &mut check => (checked, None),
                release = &mut stop => {
                    let checked = engine.end_check(check, held).await;
                    (checked, Some(release.unwrap_or_default()))
                }
            }
        };
        match (checked, release) {
            (Checked::Alive(alive_at), None) => {
                deadline = timing.valid_until(alive_at);
                if !lost.extend(deadline) {
                    tracing::warn!(lock = %held, "{engine_name} lock lost: its holder stalled past its deadline");
                    return Err(LostReason::Expired);
                }
            }
            (Checked::Quiet, None) => {}
            (Checked::Alive(_) | Checked::Quiet, Some(release)) => {
                return engine.unlock(session, held, release).await;
            }
            // Told even at release: a holder that reads the signal learns the truth.
            (Checked::NotOwner, _) => {
                tracing::error!(lock = %held, "{engine_name} lock lost: {}", E::SHARED_SESSION);
                lost.lose(LostReason::NotOwner);
                return Err(LostReason::NotOwner);
            }
            (Checked::Failed(error), None) => {
                tracing::warn!(lock = %held, %error, "{engine_name} lock lost: its connection failed");
                lost.lose(LostReason::Unreachable);
                return Err(LostReason::Unreachable);
            }
            // Closed on return, which frees the lock.
            (Checked::Failed(error), Some(_)) => {
                tracing::debug!(lock = %held, %error, "{engine_name} release: the connection failed; closing it");
                return Err(LostReason::Unreachable);
            }
        }
    }
}

/// Ends a lease: stops its watch task, which then unlocks.
struct SessionRelease<E: SessionLock> {
    /// Taken by the release, or by a record's write, which releases too.
    stop: Mutex<Option<oneshot::Sender<E::Release>>>,
    task: JoinHandle<Ended>,
    /// The backend whose replay store may write its record with the release.
    #[cfg(feature = "replay")]
    writes_records: Option<usize>,
}

impl<E: SessionLock> SessionRelease<E> {
    fn take_stop(&self) -> Option<oneshot::Sender<E::Release>> {
        self.stop
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Stops the watch task (unless a record's write did already) and waits for its end.
    fn stop_and_wait(self) -> BoxFuture<Ended> {
        if let Some(stop) = self.take_stop() {
            let _ = stop.send(E::Release::default());
        }
        let task = self.task;
        Box::pin(async move { task.await.unwrap_or(Err(LostReason::Unreachable)) })
    }
}

impl<E: SessionLock> ReleaseLease for SessionRelease<E> {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let ended = (*self).stop_and_wait();
        Box::pin(async move {
            let _ = ended.await;
        })
    }

    /// `Err` when the lock was gone before the release (the session ended, or was found
    /// not holding it), or, for an engine whose unlock reports it, when the unlock
    /// found it not held or could not confirm it (then the session was closed, which
    /// frees the lock).
    fn release_checked(self: Box<Self>) -> BoxFuture<Result<(), LostReason>> {
        let ended = (*self).stop_and_wait();
        Box::pin(async move {
            let ended = ended.await;
            match E::REPORTS_RELEASE {
                true => ended,
                false => Ok(()),
            }
        })
    }

    /// For a record of the replay store of this lease's backend: the write and the
    /// unlock go together on the lock's session. The watch task takes it from here: a
    /// caller that stops waiting leaves neither half undone.
    #[cfg(feature = "replay")]
    fn release_writing(&self, record: RecordWrite) -> Option<BoxFuture<Result<bool, LockError>>> {
        let writer = self.writes_records?;
        let (release, written) = E::release_writing(record, writer)?;
        let stop = self.take_stop()?;
        // A lease lost already has no watch task to take it: the answer's sender is
        // dropped with the message, which tells the writer.
        let _ = stop.send(release);
        Some(written)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::time::Duration;

    use super::*;

    /// An engine whose checks answer from a script (then never), and which writes down
    /// what the core asked of it.
    struct Scripted {
        checks: Mutex<VecDeque<Checked>>,
        unlock: Result<(), LostReason>,
        asked: Mutex<Vec<&'static str>>,
    }

    impl Scripted {
        fn new(checks: impl IntoIterator<Item = Checked>, unlock: Ended) -> Arc<Self> {
            Arc::new(Scripted {
                checks: Mutex::new(checks.into_iter().collect()),
                unlock,
                asked: Mutex::default(),
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

        async fn check(&self, (): &mut (), _: &&'static str, _: Instant) -> Checked {
            let next = self.checks.lock().unwrap().pop_front();
            match next {
                Some(checked) => checked,
                None => std::future::pending().await,
            }
        }

        async fn unlock(&self, (): &mut (), _: &&'static str, (): ()) -> Ended {
            self.asked.lock().unwrap().push("unlock");
            self.unlock
        }

        fn give_back(&self, (): ()) {
            self.asked.lock().unwrap().push("give back");
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
}
