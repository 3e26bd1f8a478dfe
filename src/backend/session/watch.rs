//! The task that watches a held session until release, one per lock once its first
//! liveness check is due (see `holds`).
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
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{Checked, SessionLock, Timing};
use crate::backend::{LeaseLostSender, LostReason};

/// How a hold ended: `Ok` when the unlock answered that this session gave the lock up,
/// else why the lock was not (or no longer) this holder's.
pub(super) type Ended = Result<(), LostReason>;

/// What the holding task keeps of a lease: its timing, its deadline, and the sender of
/// its lost signal.
pub(super) struct Watched {
    timing: Timing,
    deadline: Instant,
    lost: LeaseLostSender,
}

impl Watched {
    pub(super) fn new(timing: Timing, deadline: Instant, lost: LeaseLostSender) -> Self {
        Watched {
            timing,
            deadline,
            lost,
        }
    }
}

/// Watches the held session until release or loss, then gives it back to the pool if
/// it is known to hold nothing, or closes it.
pub(super) async fn watch<E: SessionLock>(
    engine: Arc<E>,
    mut session: E::Session,
    held: E::Held,
    watched: Watched,
    stop: oneshot::Receiver<E::Release>,
) -> Ended {
    let ended = hold_until_released(&*engine, &mut session, &held, watched, stop).await;
    end(&*engine, session, &held, ended).await
}

/// Gives a session whose hold `ended` back to the pool if it is known to hold nothing,
/// or closes it.
pub(super) async fn end<E: SessionLock>(
    engine: &E,
    session: E::Session,
    held: &E::Held,
    ended: Ended,
) -> Ended {
    match ended {
        Ok(()) => engine.give_back(session),
        // A record write still in `stop` was dropped with it, which tells its writer.
        Err(reason) => engine.close(session, held, reason).await,
    }
    ended
}

/// A lease past its deadline is lost (by the clock, whatever the session would say):
/// its signal is raised, and its session will be closed, not unlocked.
pub(super) fn expired<E: SessionLock>(held: &E::Held, watched: &Watched) -> Option<Ended> {
    if Instant::now() < watched.deadline {
        return None;
    }
    watched.lost.lose_at_deadline();
    Some(Err(lost_at_deadline::<E>(held, &watched.lost)))
}

/// Why a lease whose deadline passed was lost, as its signal says, logged: a check still
/// unanswered at the deadline, or a holder that stalled past it.
fn lost_at_deadline<E: SessionLock>(held: &E::Held, lost: &LeaseLostSender) -> LostReason {
    let reason = lost.raised_for().unwrap_or(LostReason::Expired);
    match reason {
        LostReason::Unreachable => tracing::warn!(
            lock = %held,
            "{} lock lost: its liveness check went unanswered until its deadline",
            E::ENGINE
        ),
        _ => {
            tracing::warn!(lock = %held, "{} lock lost: its holder stalled past its deadline", E::ENGINE)
        }
    }
    reason
}

/// Checks the session until release (then unlocks) or loss (then raises the signal).
async fn hold_until_released<E: SessionLock>(
    engine: &E,
    session: &mut E::Session,
    held: &E::Held,
    mut watched: Watched,
    mut stop: oneshot::Receiver<E::Release>,
) -> Ended {
    let engine_name = E::ENGINE;
    loop {
        if let Some(ended) = expired::<E>(held, &watched) {
            return ended;
        }
        let (checked, release) = {
            let mut check = pin!(engine.check(session, held, watched.deadline, &watched.lost));
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
        let lost = &watched.lost;
        match (checked, release) {
            (Checked::Alive(alive_at), None) => {
                watched.deadline = watched.timing.valid_until(alive_at);
                if !lost.extend(watched.deadline) {
                    return Err(lost_at_deadline::<E>(held, lost));
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
