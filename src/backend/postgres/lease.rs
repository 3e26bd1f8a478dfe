//! A held lock: the task that watches its connection (closed? still the same server
//! process?) until release, and the unlock or rollback on release.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::error::SHARED_SESSION;
use super::session::{last_row, Session};
use super::{Inner, LockScope};
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};

/// How often a held connection is looked at (no round trip: whether its connection task
/// ended), so a session that ended raises the lost-lease signal within this period.
const CLOSED_CHECK_PERIOD: Duration = Duration::from_millis(5);

impl Inner {
    /// Hands the locked session (server process `pid`) to a task that watches it until
    /// the lease is released. `since` is when the last round trip known to have reset
    /// the server's idle limit was sent (it answered within the network timeout): the
    /// liveness checks count from there, so the holder is told a network timeout
    /// before that limit can run out.
    pub(super) fn hold(
        self: Arc<Self>,
        session: Session,
        id: i64,
        shared: bool,
        pid: i32,
        token: Option<u64>,
        since: Instant,
    ) -> Lease {
        // Told at the next check's timeout at the latest, unless it answers in time:
        // the same instant on the clock, so a holder whose runtime stalls knows it too.
        let (lost, signal) = LeaseSignal::with_deadline(self.valid_until(since));
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(self.watch(session, (id, shared), pid, since, lost, stopped));
        Lease::new(token, signal, PgRelease { stop, task })
    }

    /// Watches the held connection until the lease is released (or dropped), then
    /// unlocks. If the runtime drops this task instead, `session`'s drop closes the
    /// connection, which frees the lock. `lock` is the lock id, and whether it is held
    /// shared.
    async fn watch(
        self: Arc<Self>,
        session: Session,
        (id, shared): (i64, bool),
        pid: i32,
        since: Instant,
        lost: LeaseLostSender,
        mut stop: oneshot::Receiver<()>,
    ) {
        if let Err(reason) = self
            .stays_alive(&session, id, pid, since, &lost, &mut stop)
            .await
        {
            // The session ended (so PostgreSQL freed the lock), went silent, or is not
            // the one that holds the lock: another instance may hold the key now, or
            // soon. Dropping `session` closes our end too.
            lost.lose(reason);
            return;
        }
        let released = match self.scope {
            LockScope::Session => self.unlock(&session, id, shared, pid).await,
            // Ending the transaction ends its lock.
            LockScope::Transaction => self
                .round_trip(session.simple_query("ROLLBACK"))
                .await
                .map(drop)
                .map_err(|error| tracing::debug!(lock_id = id, %error, "rollback failed")),
        };
        // Only a connection known to hold nothing goes back; otherwise `session` is
        // dropped here: closed, so PostgreSQL ends the session and frees its locks.
        if released.is_ok() {
            session.give_back();
        }
    }

    /// Returns `Ok` when `stop` fires (the lease is released), `Err` with the reason
    /// when the lock is lost. Between liveness checks the connection is looked at every
    /// [`CLOSED_CHECK_PERIOD`]: a session that ended is noticed at once, not at the
    /// next check.
    async fn stays_alive(
        &self,
        session: &Session,
        id: i64,
        pid: i32,
        since: Instant,
        lost: &LeaseLostSender,
        stop: &mut oneshot::Receiver<()>,
    ) -> Result<(), LostReason> {
        let interval = self.liveness_interval;
        let mut checks = tokio::time::interval_at(since + interval, interval);
        checks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut looks = tokio::time::interval(CLOSED_CHECK_PERIOD);
        looks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            // `stop` fires on release, and on its sender's drop.
            tokio::select! {
                biased;
                _ = &mut *stop => return Ok(()),
                _ = looks.tick() => {
                    if session.is_closed() {
                        tracing::warn!(lock_id = id, "PostgreSQL lock lost: its connection closed");
                        return Err(LostReason::Unreachable);
                    }
                }
                _ = checks.tick() => {
                    let sent = Instant::now();
                    let check = self.round_trip(session.simple_query("SELECT pg_backend_pid()"));
                    let answer = tokio::select! {
                        biased;
                        _ = &mut *stop => return Ok(()),
                        answer = check => answer,
                    };
                    let answered_by = answer.map(|answer| {
                        last_row(&answer).and_then(|row| row.get(0)?.parse::<i32>().ok())
                    });
                    match answered_by {
                        Ok(Some(now)) if now == pid => {
                            if !lost.extend(self.valid_until(sent)) {
                                tracing::warn!(lock_id = id, "PostgreSQL lock lost: its holder stalled past its deadline");
                                return Err(LostReason::Expired);
                            }
                        }
                        Ok(_) => {
                            tracing::error!(lock_id = id, "PostgreSQL lock lost: {SHARED_SESSION}");
                            return Err(LostReason::NotOwner);
                        }
                        Err(error) => {
                            tracing::warn!(lock_id = id, %error, "PostgreSQL lock lost: its connection failed");
                            return Err(LostReason::Unreachable);
                        }
                    }
                }
            }
        }
    }

    /// Until when a session whose idle limit was reset by a round trip sent at `sent`
    /// counts as held: the next liveness check's timeout, one network timeout before
    /// the server's idle limit can end the session.
    fn valid_until(&self, sent: Instant) -> Instant {
        sent + self.liveness_interval + self.network_timeout
    }

    /// Unlocks a session lock; `Ok` when the session is known to hold nothing now.
    async fn unlock(&self, session: &Session, id: i64, shared: bool, pid: i32) -> Result<(), ()> {
        let answer = self
            .round_trip(session.simple_query(&Inner::unlock_sql(id, shared, pid)))
            .await;
        match answer.as_deref().map(last_row) {
            Ok(Some(row)) if row.get(0) == Some("t") => Ok(()),
            Ok(Some(_)) => {
                tracing::warn!(lock_id = id, "PostgreSQL lock was not held at release");
                Err(())
            }
            Ok(None) => {
                tracing::error!(lock_id = id, "PostgreSQL unlock failed: {SHARED_SESSION}");
                Err(())
            }
            Err(error) => {
                tracing::debug!(lock_id = id, %error, "unlock failed; closing the connection");
                Err(())
            }
        }
    }
}

/// Ends a lease: stops its watch task, which then unlocks.
struct PgRelease {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ReleaseLease for PgRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let PgRelease { stop, task } = *self;
        let _ = stop.send(());
        Box::pin(async move {
            let _ = task.await;
        })
    }
}
