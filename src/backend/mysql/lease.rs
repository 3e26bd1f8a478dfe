//! A held lock: the statement kept pending on its session until release (failed the
//! moment the session ends; answered every liveness interval with a check: still the
//! same session? still holding the lock?), then the interrupt of that statement and
//! the checked `RELEASE_LOCK`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::acquire::Granted;
use super::error::SHARED_SESSION;
use super::lock_name::hex_literal;
use super::session::{number, Session, QUERY_INTERRUPTED};
use super::Inner;
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};

/// How a hold ended: `Ok` when `RELEASE_LOCK` answered that this session gave the lock
/// up, else why the lock was not (or no longer) this holder's.
type Ended = Result<(), LostReason>;

impl Inner {
    /// Hands the locked session (`CONNECTION_ID()` `id`) to a task that watches it until
    /// the lease is released. The lease counts from `granted.since`, the sending of the
    /// last round trip known to have reset the server's idle limit, so the holder is
    /// told a command timeout before that limit can end the session.
    pub(super) fn hold(
        self: Arc<Self>,
        session: Session,
        name: String,
        id: u64,
        granted: Granted,
    ) -> Lease {
        // Lost at the next answer's timeout unless it comes in time: an instant on the
        // clock, so a holder whose runtime stalls knows it too.
        let deadline = self.valid_until(granted.since);
        let (lost, signal) = LeaseSignal::with_deadline(deadline);
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(self.watch(session, name, id, deadline, lost, stopped));
        Lease::new(granted.token, signal, MyRelease { stop, task })
    }

    /// Keeps a statement pending on the held session until the lease is released (or
    /// dropped), then releases the lock. If the runtime drops this task instead,
    /// `session`'s drop closes the connection, which frees the lock.
    ///
    /// The statement, `SELECT SLEEP(<until the next check is due>), CONNECTION_ID(),
    /// IS_USED_LOCK(name) <=> CONNECTION_ID()`, is sent again as soon as it answers.
    /// While it runs, the session's end (`KILL`, a reset, a server restart or crash)
    /// fails it at once: the server shuts the connection down, and the driver, which
    /// is reading its answer, sees it. Every answer is a liveness check, counted from
    /// the end of its sleep: the sleep ends one command timeout before the lease's
    /// `deadline` (where a check sent at the same instant would be due to answer), so
    /// an answer one command timeout late still comes in time. On release the
    /// statement is interrupted (`KILL QUERY` on the pool's control connection) and
    /// `RELEASE_LOCK` follows on the same connection once both the statement and the
    /// `KILL QUERY` have answered.
    ///
    /// A session that does not go back to the pool is closed; one that may still hold
    /// the lock, once the server no longer shows it holding it (see
    /// [`close_until_freed`](Self::close_until_freed)).
    async fn watch(
        self: Arc<Self>,
        mut session: Session,
        name: String,
        id: u64,
        deadline: Instant,
        lost: LeaseLostSender,
        stop: oneshot::Receiver<()>,
    ) -> Ended {
        let literal = hex_literal(&name);
        let ended = self
            .hold_and_release(&mut session, &name, &literal, id, deadline, lost, stop)
            .await;
        match ended {
            Ok(()) => session.give_back(),
            // Found not holding it (or sharing its session): nothing of ours to wait for.
            Err(LostReason::NotOwner) => drop(session),
            Err(_) => self.close_until_freed(session, &literal, id).await,
        }
        ended
    }

    /// Closes `session` (`id`), which may still hold the lock named by `literal`, and
    /// returns once the server shows it no longer does, or after one command timeout,
    /// or at the first look that fails (the server is gone, and its locks with it). A
    /// closed session's locks are freed as the server ends it, a moment after the
    /// close: without this wait a release would return before another instance can
    /// take the key.
    async fn close_until_freed(&self, session: Session, literal: &str, id: u64) {
        drop(session);
        let give_up = Instant::now() + self.command_timeout;
        let setup = self.session_setup();
        loop {
            let left = give_up.saturating_duration_since(Instant::now());
            let holds = self
                .pool
                .holds(id, literal, left, self.max_pooled_idle(), &setup);
            match holds.await {
                Ok(true) if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(_) => return,
                Err(error) => {
                    tracing::debug!(%error, "MySQL release: could not see the closed session end");
                    return;
                }
            }
        }
    }

    /// Keeps the session's statement pending until release or loss (see
    /// [`watch`](Self::watch)); `Ok` only when `RELEASE_LOCK` gave the lock up, and
    /// the session can then go back to the pool.
    #[allow(clippy::too_many_arguments)]
    async fn hold_and_release(
        &self,
        session: &mut Session,
        name: &str,
        literal: &str,
        id: u64,
        mut deadline: Instant,
        lost: LeaseLostSender,
        mut stop: oneshot::Receiver<()>,
    ) -> Ended {
        loop {
            let sent = Instant::now();
            let Some(limit) = deadline
                .checked_duration_since(sent)
                .filter(|d| !d.is_zero())
            else {
                tracing::warn!(lock = %name, "MySQL lock lost: its holder stalled past its deadline");
                lost.lose_at_deadline();
                return Err(LostReason::Expired);
            };
            let sleep = limit.saturating_sub(self.command_timeout);
            let pending = format!(
                "SELECT SLEEP({}), CONNECTION_ID(), IS_USED_LOCK({literal}) <=> CONNECTION_ID()",
                seconds(sleep)
            );
            let (answer, released) = {
                // Answered by the deadline, or the lease is lost.
                let statement = session.rows(&pending, limit);
                tokio::pin!(statement);
                // `stop` fires on release, and on its sender's drop.
                tokio::select! {
                    biased;
                    answer = &mut statement => (answer, false),
                    _ = &mut stop => {
                        // A statement cut short would leave the connection unusable
                        // (closed, the lock freed only once the server notices), so it
                        // is interrupted and read to its end. The `KILL QUERY` is
                        // awaited too: answered, it cannot land on `RELEASE_LOCK`.
                        let interrupt = self.interrupt(id);
                        let (answer, interrupted) = tokio::join!(statement, interrupt);
                        if let Err(error) = interrupted {
                            tracing::debug!(lock = %name, %error, "MySQL release: the pending statement was not interrupted");
                        }
                        (answer, true)
                    }
                }
            };
            let row = match answer {
                Ok(rows) => rows.into_iter().last(),
                // Ended by a `KILL QUERY`: ours on release, else someone's; the session
                // lives on, and this answer tells nothing more.
                Err(error) if error.code == Some(QUERY_INTERRUPTED) => None,
                Err(error) => {
                    // Closed on return, which frees the lock.
                    if !released {
                        tracing::warn!(lock = %name, %error, "MySQL lock lost: its connection failed");
                        lost.lose(LostReason::Unreachable);
                    } else {
                        tracing::debug!(lock = %name, %error, "MySQL release: the connection failed; closing it");
                    }
                    return Err(LostReason::Unreachable);
                }
            };
            if let Some(row) = row {
                let answered_by = number(&row, 1);
                let held = number(&row, 2) == Some(1);
                if answered_by != Some(id as i64) || !held {
                    tracing::error!(lock = %name, "MySQL lock lost: {SHARED_SESSION}");
                    lost.lose(LostReason::NotOwner);
                    return Err(LostReason::NotOwner);
                }
                // A full sleep (0) ended no earlier than `sent + sleep`: the server's
                // idle limit runs from after then. An interrupted one (1) counts from
                // its sending only.
                let alive_at = match number(&row, 0) {
                    Some(0) => sent + sleep,
                    _ => sent,
                };
                if !released {
                    deadline = self.valid_until(alive_at);
                    if !lost.extend(deadline) {
                        tracing::warn!(lock = %name, "MySQL lock lost: its holder stalled past its deadline");
                        return Err(LostReason::Expired);
                    }
                }
            }
            if released {
                break;
            }
        }
        // Released: only a session known to hold nothing goes back to the pool
        // (`Ok`); otherwise it is closed, so the server frees its locks.
        let release = format!("SELECT CONNECTION_ID(), RELEASE_LOCK({literal})");
        match session.rows(&release, self.command_timeout).await {
            Ok(rows) => {
                let row = rows.last();
                let answered_by = row.and_then(|row| number(row, 0));
                match row.and_then(|row| number(row, 1)) {
                    Some(1) if answered_by == Some(id as i64) => Ok(()),
                    Some(1) => {
                        tracing::error!(lock = %name, "MySQL release: {SHARED_SESSION}");
                        Err(LostReason::NotOwner)
                    }
                    // 0: another session holds it; NULL: nobody does. Either way this
                    // session had lost it: closed, not pooled.
                    _ => {
                        tracing::warn!(lock = %name, "MySQL lock was not held at release");
                        Err(LostReason::NotOwner)
                    }
                }
            }
            Err(error) => {
                tracing::debug!(lock = %name, %error, "RELEASE_LOCK failed; closing the connection");
                Err(LostReason::Unreachable)
            }
        }
    }

    /// Interrupts the statement of session `id` (see [`Pool::interrupt`]).
    ///
    /// [`Pool::interrupt`]: super::session::Pool::interrupt
    async fn interrupt(&self, id: u64) -> Result<(), super::error::MyError> {
        self.pool
            .interrupt(
                id,
                self.command_timeout,
                self.max_pooled_idle(),
                &self.session_setup(),
            )
            .await
    }

    /// Until when a session known alive at `alive_at` (its idle limit reset by a round
    /// trip sent then, or by a statement that ran until then) counts as held: the next
    /// answer's timeout, at least one command timeout before the server's idle limit
    /// can end the session.
    fn valid_until(&self, alive_at: Instant) -> Instant {
        alive_at + self.liveness_interval + self.command_timeout
    }
}

/// `duration` as seconds with microseconds, as `SLEEP` takes it.
fn seconds(duration: Duration) -> String {
    let micros = duration.as_micros().max(1);
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// Ends a lease: stops its watch task, which then releases the lock.
struct MyRelease {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Ended>,
}

impl ReleaseLease for MyRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let release = self.release_checked();
        Box::pin(async move {
            let _ = release.await;
        })
    }

    /// `Err` when the lock was gone before the release (the session ended, was found
    /// not holding it, or `RELEASE_LOCK` answered that it did not hold it), or when the
    /// release could not confirm it (then the connection was closed, which frees the
    /// lock).
    fn release_checked(self: Box<Self>) -> BoxFuture<Result<(), LostReason>> {
        let MyRelease { stop, task } = *self;
        let _ = stop.send(());
        Box::pin(async move { task.await.unwrap_or(Err(LostReason::Unreachable)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeps_are_seconds_with_microseconds_never_zero() {
        assert_eq!(seconds(Duration::from_millis(1500)), "1.500000");
        assert_eq!(seconds(Duration::from_nanos(1)), "0.000001");
        // Zero would be a statement that answers at once, again and again.
        assert_eq!(seconds(Duration::ZERO), "0.000001");
    }
}
