//! A held lock: the task that watches its connection (closed? still the same server
//! process?) until release, and the unlock or rollback on release.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

#[cfg(feature = "replay")]
use super::error::PgError;
use super::error::SHARED_SESSION;
use super::session::{last_row, Session};
use super::{Inner, LockScope};
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};
#[cfg(feature = "replay")]
use crate::backend::{Place, RecordWrite};
#[cfg(feature = "replay")]
use crate::error::LockError;

/// How often a held connection is looked at (no round trip: whether its connection task
/// ended), so a session that ended raises the lost-lease signal within this period.
const CLOSED_CHECK_PERIOD: Duration = Duration::from_millis(5);

impl Inner {
    /// Hands the locked session (server process `pid`) to a task that watches it until
    /// the lease is released. `since` is when the last round trip known to have reset
    /// the server's idle limit was sent (it answered within the command timeout): the
    /// liveness checks count from there, so the holder is told a command timeout
    /// before that limit can run out.
    /// `lock` is the lock id, whether it is held shared, and a permit's key lock id
    /// held shared beside it.
    pub(super) fn hold(
        self: Arc<Self>,
        session: Session,
        (id, shared, key): (i64, bool, Option<i64>),
        pid: i32,
        token: Option<u64>,
        since: Instant,
    ) -> Lease {
        // Told at the next check's timeout at the latest, unless it answers in time:
        // the same instant on the clock, so a holder whose runtime stalls knows it too.
        let (lost, signal) = LeaseSignal::with_deadline(self.valid_until(since));
        let (stop, stopped) = oneshot::channel();
        #[cfg(feature = "replay")]
        let writes_records =
            (self.scope == LockScope::Session && !shared).then(|| self.engine_id());
        let lock = (id, shared, key);
        let task = tokio::spawn(self.watch(session, lock, pid, since, lost, stopped));
        Lease::new(
            token,
            signal,
            PgRelease {
                stop: Mutex::new(Some(stop)),
                task,
                #[cfg(feature = "replay")]
                writes_records,
            },
        )
    }

    /// Watches the held connection until the lease is released (or dropped), then
    /// unlocks, after writing a replay record if the release brought one. If the
    /// runtime drops this task instead, `session`'s drop closes the connection, which
    /// frees the lock. `lock` is the lock id, whether it is held shared, and a permit's
    /// key lock id held shared beside it.
    async fn watch(
        self: Arc<Self>,
        session: Session,
        (id, shared, key): (i64, bool, Option<i64>),
        pid: i32,
        since: Instant,
        lost: LeaseLostSender,
        mut stop: oneshot::Receiver<Stop>,
    ) {
        let stop = match self
            .stays_alive(&session, id, pid, since, &lost, &mut stop)
            .await
        {
            Ok(stop) => stop,
            Err(reason) => {
                // The session ended (so PostgreSQL freed the lock), went silent, or is
                // not the one that holds the lock: another instance may hold the key
                // now, or soon. Dropping `session` closes our end too; a record write
                // still in `stop` is dropped with it, which tells its writer.
                lost.lose(reason);
                return;
            }
        };
        let released = match (self.scope, stop) {
            #[cfg(feature = "replay")]
            (LockScope::Session, Stop::Write(write)) => {
                self.write_and_unlock(&session, (id, shared, key, pid), write)
                    .await
            }
            (LockScope::Session, _) => self.unlock(&session, (id, shared, key), pid).await,
            // Ending the transaction ends its lock (a lease of this scope is never
            // asked to write a record).
            (LockScope::Transaction, _) => self
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

    /// Returns `Ok` with how to release when `stop` fires (the lease is released),
    /// `Err` with the reason when the lock is lost. Between liveness checks the
    /// connection is looked at every [`CLOSED_CHECK_PERIOD`]: a session that ended is
    /// noticed at once, not at the next check.
    async fn stays_alive(
        &self,
        session: &Session,
        id: i64,
        pid: i32,
        since: Instant,
        lost: &LeaseLostSender,
        stop: &mut oneshot::Receiver<Stop>,
    ) -> Result<Stop, LostReason> {
        let interval = self.liveness_interval;
        let mut checks = tokio::time::interval_at(since + interval, interval);
        checks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut looks = tokio::time::interval(CLOSED_CHECK_PERIOD);
        looks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            // `stop` fires on release, and on its sender's drop (a plain unlock).
            tokio::select! {
                biased;
                stopped = &mut *stop => return Ok(stopped.unwrap_or(Stop::Unlock)),
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
                        stopped = &mut *stop => return Ok(stopped.unwrap_or(Stop::Unlock)),
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
    /// counts as held: the next liveness check's timeout, one command timeout before
    /// the server's idle limit can end the session.
    fn valid_until(&self, sent: Instant) -> Instant {
        sent + self.liveness_interval + self.command_timeout
    }

    /// Unlocks a session lock; `Ok` when the session is known to hold nothing now.
    async fn unlock(
        &self,
        session: &Session,
        (id, shared, key): (i64, bool, Option<i64>),
        pid: i32,
    ) -> Result<(), ()> {
        let answer = match key {
            None => self.unlock_prepared(session, id, shared, pid).await,
            Some(_) => self
                .round_trip(session.simple_query(&Inner::unlock_sql(id, shared, key, pid)))
                .await
                .map(|answer| last_row(&answer).map(|row| row.get(0) == Some("t"))),
        };
        match answer {
            Ok(Some(true)) => Ok(()),
            Ok(Some(false)) => {
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

#[cfg(feature = "replay")]
impl Inner {
    /// Writes a replay record and unlocks `(id, shared, key, pid)` in one round trip: two
    /// simple queries sent together. Two messages, not one: statements of one message
    /// share an implicit transaction, and a session lock's unlock takes effect at
    /// once, before that transaction commits, so the next holder's try could miss the
    /// record; as two, the write commits before the unlock runs, and a write that
    /// fails leaves the unlock to run all the same. The writer hears only once both
    /// answered. `Ok` when the session is known to hold nothing now.
    async fn write_and_unlock(
        &self,
        session: &Session,
        (id, shared, key, pid): (i64, bool, Option<i64>, i32),
        write: RecordWriting,
    ) -> Result<(), ()> {
        // Both requests are queued by their first poll, the write first.
        let (written, released) = tokio::join!(
            self.round_trip(session.simple_query(&write.sql)),
            self.unlock(session, (id, shared, key), pid),
        );
        let written = written
            .map(|answer| {
                answer.iter().any(|message| {
                    matches!(
                        message,
                        tokio_postgres::SimpleQueryMessage::CommandComplete(1)
                    )
                })
            })
            .map_err(PgError::into_lock_error);
        let _ = write.written.send(written);
        released
    }
}

/// Ends a lease: stops its watch task, which then unlocks.
struct PgRelease {
    /// Taken by the release, or by a record's write, which releases too.
    stop: Mutex<Option<oneshot::Sender<Stop>>>,
    task: JoinHandle<()>,
    /// The backend (`engine_id`) whose replay store may write its record with the
    /// unlock: an exclusive session lock's; `None` for the others.
    #[cfg(feature = "replay")]
    writes_records: Option<usize>,
}

/// How the watch task ends a hold.
enum Stop {
    /// Unlock (also when the release was dropped unsent).
    Unlock,
    /// Write a replay record, then unlock, in one round trip.
    #[cfg(feature = "replay")]
    Write(RecordWriting),
}

/// A replay record's write, run on the held session with its unlock, and who waits
/// for whether it was done.
#[cfg(feature = "replay")]
struct RecordWriting {
    sql: String,
    written: oneshot::Sender<Result<bool, LockError>>,
}

impl PgRelease {
    fn take_stop(&self) -> Option<oneshot::Sender<Stop>> {
        self.stop
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

impl ReleaseLease for PgRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        // Already taken by a record's write, which unlocks too: only the wait is left.
        if let Some(stop) = self.take_stop() {
            let _ = stop.send(Stop::Unlock);
        }
        let task = self.task;
        Box::pin(async move {
            let _ = task.await;
        })
    }

    /// For a record of the PostgreSQL store looked up by this lease's backend, on an
    /// exclusive session lock: the write and the unlock are sent together on the lock's
    /// session (see `write_and_unlock`). The watch task takes it from here: a caller
    /// that stops waiting leaves neither half undone.
    #[cfg(feature = "replay")]
    fn release_writing(&self, record: RecordWrite) -> Option<BoxFuture<Result<bool, LockError>>> {
        #[allow(irrefutable_let_patterns)]
        let Place::Postgres { engine, sql } = record.place
        else {
            return None;
        };
        if self.writes_records != Some(engine) {
            return None;
        }
        let stop = self.take_stop()?;
        let (written, answer) = oneshot::channel();
        // A lease lost already has no watch task to take it: the answer's sender is
        // dropped with the message.
        let _ = stop.send(Stop::Write(RecordWriting { sql, written }));
        Some(Box::pin(async move {
            answer.await.unwrap_or_else(|_| {
                Err(
                    PgError::message("the lock was lost before its record was written")
                        .into_lock_error(),
                )
            })
        }))
    }
}
