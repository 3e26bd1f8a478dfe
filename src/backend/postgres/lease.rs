//! A held lock, as the session-lock core (`backend/session`) runs it: PostgreSQL's
//! liveness check (closed? still the same server process?), and the unlock or
//! rollback on release.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, Instant, MissedTickBehavior};

use super::error::SHARED_SESSION;
#[cfg(feature = "replay")]
use super::replay::RecordWriting;
use super::session::{last_row, Session};
use super::{Inner, LockScope};
use crate::backend::session::{self, Checked, SessionLock};
use crate::backend::{Lease, LeaseLostSender, LostReason};

/// How often a held connection is looked at (no round trip: whether its connection task
/// ended), so a session that ended raises the lost-lease signal within this period.
pub(super) const CLOSED_CHECK_PERIOD: Duration = Duration::from_millis(5);

/// A lock held on a session: its lock id, whether it is held shared, a permit's key
/// lock id held shared beside it, and the server process that holds them.
pub(super) struct Held {
    pub(super) id: i64,
    pub(super) shared: bool,
    pub(super) key: Option<i64>,
    pub(super) pid: i32,
}

impl fmt::Display for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.id)
    }
}

impl Inner {
    /// Hands the locked session to the session-lock core (see [`session::hold`]);
    /// `since` is when the round trip that counts for the grant was sent.
    pub(super) fn hold(
        self: Arc<Self>,
        session: Session,
        held: Held,
        token: Option<u64>,
        since: Instant,
    ) -> Lease {
        let timing = self.settings.timing;
        session::hold(self, timing, session, held, token, since)
    }

    /// Unlocks a session lock; `Ok` when the session is known to hold nothing now.
    pub(super) async fn unlock_session(
        &self,
        session: &Session,
        held: &Held,
    ) -> Result<(), LostReason> {
        let Held {
            id,
            shared,
            key,
            pid,
        } = *held;
        let answer = match key {
            None => self.unlock_prepared(session, held).await,
            Some(_) => self
                .round_trip(session.simple_query(&Inner::unlock_sql(id, shared, key, pid)))
                .await
                .map(|answer| last_row(&answer).map(|row| row.get(0) == Some("t"))),
        };
        match answer {
            Ok(Some(true)) => Ok(()),
            Ok(Some(false)) => {
                tracing::warn!(lock_id = id, "PostgreSQL lock was not held at release");
                Err(LostReason::NotOwner)
            }
            Ok(None) => {
                tracing::error!(lock_id = id, "PostgreSQL unlock failed: {SHARED_SESSION}");
                Err(LostReason::NotOwner)
            }
            Err(error) => {
                tracing::debug!(lock_id = id, %error, "unlock failed; closing the connection");
                Err(LostReason::Unreachable)
            }
        }
    }
}

impl SessionLock for Inner {
    type Session = Session;
    type Held = Held;
    type Release = Release;

    const ENGINE: &'static str = "PostgreSQL";
    const SHARED_SESSION: &'static str = SHARED_SESSION;
    // A checked release reports a lease lost before it; what the unlock found is
    // logged.
    const REPORTS_RELEASE: bool = false;

    /// `SELECT pg_backend_pid()` once due; until then the connection is looked at every
    /// [`CLOSED_CHECK_PERIOD`]: a session that ended is noticed at once, not at the
    /// next check.
    async fn check(
        &self,
        session: &mut Session,
        held: &Held,
        deadline: Instant,
        lost: &LeaseLostSender,
    ) -> Checked {
        let due = self.settings.timing.check_due(deadline);
        let mut looks = tokio::time::interval(CLOSED_CHECK_PERIOD);
        looks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut due = std::pin::pin!(sleep_until(due));
        loop {
            tokio::select! {
                biased;
                _ = looks.tick() => {
                    if session.is_closed() {
                        return Checked::Failed("its connection closed".into());
                    }
                }
                () = &mut due => break,
            }
        }
        let sent = Instant::now();
        lost.asking();
        let answer = self
            .round_trip(session.simple_query("SELECT pg_backend_pid()"))
            .await;
        let answered_by =
            answer.map(|answer| last_row(&answer).and_then(|row| row.get(0)?.parse::<i32>().ok()));
        match answered_by {
            Ok(Some(now)) if now == held.pid => Checked::Alive(sent),
            Ok(_) => Checked::NotOwner,
            Err(error) => Checked::Failed(error.into()),
        }
    }

    /// The unlock, after writing a replay record if the release brought one; a
    /// transaction lock ends with its transaction.
    async fn unlock(
        &self,
        session: &mut Session,
        held: &Held,
        release: Release,
    ) -> Result<(), LostReason> {
        match (self.scope, release) {
            #[cfg(feature = "replay")]
            (LockScope::Session, Release::Write(write)) => {
                let unlock = self.unlock_session(session, held);
                self.write_and_unlock(session, write, unlock).await
            }
            (LockScope::Session, _) => self.unlock_session(session, held).await,
            // Ending the transaction ends its lock (a lease of this scope is never
            // asked to write a record).
            (LockScope::Transaction, _) => self
                .round_trip(session.simple_query("ROLLBACK"))
                .await
                .map(drop)
                .map_err(|error| {
                    tracing::debug!(lock_id = held.id, %error, "rollback failed");
                    LostReason::Unreachable
                }),
        }
    }

    fn give_back(&self, session: Session) {
        session.give_back();
    }

    fn holds(&self) -> &session::Holds<Self> {
        &self.holds
    }

    fn is_closed(&self, session: &Session) -> bool {
        session.is_closed()
    }

    /// A session lock's not held shared: its unlock can carry the record of this backend's
    /// replay store.
    #[cfg(feature = "replay")]
    fn writes_records(&self, held: &Held) -> Option<usize> {
        (self.scope == LockScope::Session && !held.shared).then(|| self.engine_id())
    }

    #[cfg(feature = "replay")]
    fn release_writing(
        record: crate::backend::RecordWrite,
        writer: usize,
    ) -> Option<(Release, session::Written)> {
        let (writing, written) = RecordWriting::for_release(record, writer)?;
        Some((Release::Write(writing), written))
    }
}

/// How the holding task ends a hold.
#[derive(Default)]
pub(super) enum Release {
    /// Unlock (also when the release was dropped unsent).
    #[default]
    Unlock,
    /// Write a replay record, then unlock, in one round trip.
    #[cfg(feature = "replay")]
    Write(RecordWriting),
}
