//! A held lock, as the session-lock core (`backend/session`) runs it: the statement
//! kept pending on its session until release (failed the moment the session ends;
//! answered every liveness interval with a check: still the same session? still
//! holding the lock?), then the interrupt of that statement and the checked
//! `RELEASE_LOCK`.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::acquire::Granted;
use super::error::{MyError, SHARED_SESSION};
use super::lock_name::hex_literal;
use super::session::{number, Session, QUERY_INTERRUPTED};
use super::Inner;
use crate::backend::session::{self, Checked, SessionLock};
use crate::backend::{Lease, LeaseLostSender, LostReason};

/// A lock held on a session: its name (and the name as an SQL literal), and the
/// session's `CONNECTION_ID()`.
pub(super) struct Held {
    name: String,
    literal: String,
    id: u64,
}

impl fmt::Display for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl Inner {
    /// Hands the locked session (`CONNECTION_ID()` `id`) to the core's holding task
    /// (see [`session::hold`]). The lease counts from `granted.since`, the sending of
    /// the last round trip known to have reset the server's idle limit.
    pub(super) fn hold(
        self: Arc<Self>,
        session: Session,
        name: String,
        id: u64,
        granted: Granted,
    ) -> Lease {
        let literal = hex_literal(&name);
        let held = Held { name, literal, id };
        let timing = self.settings.timing;
        session::hold(self, timing, session, held, granted.token, granted.since)
    }

    /// Closes `session` (`id`), which may still hold the lock named by `literal`, and
    /// returns once the server shows it no longer does, or after one command timeout,
    /// or at the first look that fails (the server is gone, and its locks with it). A
    /// closed session's locks are freed as the server ends it, a moment after the
    /// close: without this wait a release would return before another instance can
    /// take the key.
    async fn close_until_freed(&self, session: Session, literal: &str, id: u64) {
        drop(session);
        let give_up = Instant::now() + self.settings.timing.command_timeout;
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

    /// Interrupts the statement of session `id` (see [`Pool::interrupt`]).
    ///
    /// [`Pool::interrupt`]: super::session::Pool::interrupt
    async fn interrupt(&self, id: u64) -> Result<(), MyError> {
        let (limit, max_idle) = (self.settings.timing.command_timeout, self.max_pooled_idle());
        let setup = self.session_setup();
        self.pool.interrupt(id, limit, max_idle, &setup).await
    }
}

impl SessionLock for Inner {
    type Session = Session;
    type Held = Held;
    type Release = ();

    const ENGINE: &'static str = "MySQL";
    const SHARED_SESSION: &'static str = SHARED_SESSION;

    /// The statement kept pending, `SELECT SLEEP(<until the check is due>),
    /// CONNECTION_ID(), IS_USED_LOCK(name) <=> CONNECTION_ID()`, answered by the
    /// deadline. While it runs, the session's end (`KILL`, a reset, a server restart or
    /// crash) fails it at once: the server shuts the connection down, and the driver,
    /// which is reading its answer, sees it. The answer counts from the end of its
    /// sleep, one command timeout before the deadline (where a check sent at the same
    /// instant would be due to answer), so an answer one command timeout late still
    /// comes in time.
    async fn check(
        &self,
        session: &mut Session,
        held: &Held,
        deadline: Instant,
        lost: &LeaseLostSender,
    ) -> Checked {
        let sent = Instant::now();
        lost.asking();
        let limit = deadline.saturating_duration_since(sent);
        let sleep = self
            .settings
            .timing
            .check_due(deadline)
            .saturating_duration_since(sent);
        let pending = format!(
            "SELECT SLEEP({}), CONNECTION_ID(), IS_USED_LOCK({}) <=> CONNECTION_ID()",
            seconds(sleep),
            held.literal,
        );
        let row = match session.rows(&pending, limit).await {
            Ok(rows) => rows.into_iter().last(),
            // Ended by a `KILL QUERY`: ours on release, else someone's; the session
            // lives on, and this answer tells nothing more.
            Err(error) if error.code == Some(QUERY_INTERRUPTED) => None,
            Err(error) => return Checked::Failed(error.into()),
        };
        let Some(row) = row else {
            return Checked::Quiet;
        };
        let answered_by = number(&row, 1);
        let holds = number(&row, 2) == Some(1);
        if answered_by != Some(held.id as i64) || !holds {
            return Checked::NotOwner;
        }
        // A full sleep (0) ended no earlier than `sent + sleep`: the server's idle
        // limit runs from after then. An interrupted one (1) counts from its sending
        // only.
        match number(&row, 0) {
            Some(0) => Checked::Alive(sent + sleep),
            _ => Checked::Alive(sent),
        }
    }

    /// A statement cut short would leave the connection unusable (closed, the lock
    /// freed only once the server notices), so it is interrupted (`KILL QUERY` on the
    /// pool's control connection) and read to its end. The `KILL QUERY` is awaited
    /// too: answered, it cannot land on `RELEASE_LOCK`.
    async fn end_check<F>(&self, pending: Pin<&mut F>, held: &Held) -> Checked
    where
        F: std::future::Future<Output = Checked> + Send,
    {
        let (checked, interrupted) = tokio::join!(pending, self.interrupt(held.id));
        if let Err(error) = interrupted {
            tracing::debug!(lock = %held, %error, "MySQL release: the pending statement was not interrupted");
        }
        checked
    }

    /// `RELEASE_LOCK` on the same session, once the pending statement and its
    /// interrupt have answered.
    async fn unlock(&self, session: &mut Session, held: &Held, (): ()) -> Result<(), LostReason> {
        let release = format!("SELECT CONNECTION_ID(), RELEASE_LOCK({})", held.literal);
        let timeout = self.settings.timing.command_timeout;
        match session.rows(&release, timeout).await {
            Ok(rows) => {
                let row = rows.last();
                let answered_by = row.and_then(|row| number(row, 0));
                match row.and_then(|row| number(row, 1)) {
                    Some(1) if answered_by == Some(held.id as i64) => Ok(()),
                    Some(1) => {
                        tracing::error!(lock = %held, "MySQL release: {SHARED_SESSION}");
                        Err(LostReason::NotOwner)
                    }
                    // 0: another session holds it; NULL: nobody does. Either way this
                    // session had lost it: closed, not pooled.
                    _ => {
                        tracing::warn!(lock = %held, "MySQL lock was not held at release");
                        Err(LostReason::NotOwner)
                    }
                }
            }
            Err(error) => {
                tracing::debug!(lock = %held, %error, "RELEASE_LOCK failed; closing the connection");
                Err(LostReason::Unreachable)
            }
        }
    }

    fn give_back(&self, session: Session) {
        session.give_back();
    }

    fn holds(&self) -> &session::Holds<Self> {
        &self.holds
    }

    /// Found not holding the lock (or sharing its session): nothing of ours to wait
    /// for. Otherwise the session may still hold it: closed, and waited for until the
    /// server shows it freed.
    async fn close(&self, session: Session, held: &Held, reason: LostReason) {
        match reason {
            LostReason::NotOwner => drop(session),
            _ => {
                self.close_until_freed(session, &held.literal, held.id)
                    .await
            }
        }
    }
}

/// `duration` as seconds with microseconds, as `SLEEP` takes it.
fn seconds(duration: Duration) -> String {
    let micros = duration.as_micros().max(1);
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
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
