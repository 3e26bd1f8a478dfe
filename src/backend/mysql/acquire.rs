//! Taking a lock: `GET_LOCK` with the remaining wait, on a session checked to be the
//! client's own, then the fencing token and, where needed, a round trip that confirms
//! the grant.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::error::{is_transient, MyError};
use super::lock_name::hex_literal;
use super::session::{number, Session};
use super::Inner;
use crate::backend::session::{within_the_wait, Answered};
use crate::backend::Lease;
use crate::locks::LockError;

/// A lock granted, and the round trip that counts for it.
pub(super) struct Granted {
    pub(super) token: Option<u64>,
    /// When the round trip that counts for the grant was sent: it answered within the
    /// command timeout, so the server's idle limit runs from after this instant.
    pub(super) since: Instant,
}

impl Inner {
    /// Takes `name` within `wait`: attempts (see [`attempt`](Self::attempt)) until one
    /// is granted, fails for good, or the wait ends; one that failed in passing is tried
    /// again on a fresh connection ([`within_the_wait`]).
    pub(super) async fn acquire(
        self: Arc<Self>,
        name: String,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let deadline = deadline_after(wait);
        let attempt = || self.clone().attempt(&name, deadline);
        let (lease, retried) =
            within_the_wait(&self.pool.reached, deadline, is_transient, attempt).await?;
        let contended = retried || lease.contended();
        Ok(lease.with_contention(contended))
    }

    /// One attempt: `GET_LOCK` with the remaining wait on a session, then what a grant
    /// needs ([`after_grant`](Self::after_grant)). On every failure the session is
    /// dropped: closed, not pooled.
    async fn attempt(self: Arc<Self>, name: &str, deadline: Instant) -> Result<Lease, LockError> {
        let server = self.prepare(deadline).await?;
        let literal = hex_literal(name);
        let mut session = self.session(deadline).await?;
        // A session that already holds this lock would be granted it again (GET_LOCK is
        // re-entrant): only a session shared with another client can be found so.
        // `IS_FREE_LOCK`, evaluated before the `GET_LOCK` to its right, says whether the
        // grant waited for another holder.
        let sql = |remaining: Duration| {
            format!(
                "SELECT CONNECTION_ID(), IS_FREE_LOCK({literal}), \
                 IF(IS_USED_LOCK({literal}) <=> CONNECTION_ID(), -1, GET_LOCK({literal}, {secs}))",
                secs = server.wait_argument(remaining),
            )
        };
        // Whether a statement found the lock held (or ran more than once): contended.
        let mut contended = false;
        let (sent, id) = loop {
            let sent = Instant::now();
            let remaining = deadline.saturating_duration_since(sent);
            let answer = session
                .rows(
                    &sql(remaining),
                    remaining + self.settings.timing.command_timeout,
                )
                .await;
            let rows = answer.map_err(|error| {
                tracing::debug!(lock = %name, %error, "GET_LOCK failed; closing the connection");
                error.into_lock_error()
            })?;
            let row = rows
                .last()
                .ok_or_else(|| MyError::message("GET_LOCK answered no row"))?;
            let id = number(row, 0).ok_or_else(|| MyError::message("GET_LOCK answered oddly"))?;
            if !session.same_session(id as u64) {
                return Err(MyError::shared_session().into());
            }
            contended |= number(row, 1) != Some(1);
            match number(row, 2) {
                Some(1) => break (sent, id),
                Some(0) => {
                    // Not granted: nothing is held, the session is clean.
                    let left = deadline.saturating_duration_since(Instant::now());
                    // Never before the deadline: a wait ends in `Timeout` only once over.
                    if left.is_zero() {
                        session.give_back();
                        return Err(LockError::Timeout);
                    }
                    contended = true;
                    // The server waited less than asked: a MySQL server waits whole
                    // seconds, so the last fraction of the wait is polled.
                    if sent.elapsed() < POLL {
                        tokio::time::sleep(POLL.min(left)).await;
                    }
                }
                Some(-1) => return Err(MyError::shared_session().into()),
                // NULL: an error in the server (the session was killed, out of memory).
                _ => return Err(MyError::message("GET_LOCK failed in the server").into()),
            }
        };
        let answered = self.settings.timing.answered(sent);
        let granted = self
            .after_grant(&mut session, &literal, id as u64, answered)
            .await?;
        Ok(self
            .hold(session, name.to_owned(), id as u64, granted)
            .with_contention(contended))
    }

    /// What follows a grant on `session` (`CONNECTION_ID()` `id`), `answered` by its
    /// statement: the fencing token, taken in a round trip of its own right after the
    /// grant, and a check that the session still holds the lock — needed unless the
    /// grant counts by itself ([`Answered::counts_from`]: its answer came in time, on a
    /// session checked before, since a proxy may reset sessions between statements).
    /// Not confirmed within the command timeout, the grant is given back: the caller
    /// drops the session, which closes it.
    async fn after_grant(
        &self,
        session: &mut Session,
        literal: &str,
        id: u64,
        answered: Answered,
    ) -> Result<Granted, LockError> {
        let check = format!(
            "SELECT CONNECTION_ID(), IS_USED_LOCK({literal}) <=> CONNECTION_ID(), LAST_INSERT_ID()"
        );
        let counted = answered.counts_from(session.state.checked);
        let sql = match (&self.fencing, counted) {
            (Some(fencing), _) => format!("{}; {check}", fencing.increment_sql()),
            (None, Some(since)) => return Ok(Granted { token: None, since }),
            (None, None) => check,
        };
        let confirm_sent = Instant::now();
        let rows = session
            .rows(&sql, self.settings.timing.command_timeout)
            .await
            .map_err(|error| {
                tracing::warn!(%error, "MySQL lock grant not confirmed in time; given back");
                MyError::because(
                    "MySQL did not confirm the lock grant within the command timeout (the \
                     server could free it before the holder would hear of it): given back",
                    error,
                )
            })?;
        let row = rows
            .last()
            .ok_or_else(|| MyError::message("MySQL answered no row"))?;
        let same = number(row, 0).is_some_and(|now| session.same_session(now as u64));
        if !same || number(row, 1) != Some(1) || number(row, 0) != Some(id as i64) {
            return Err(MyError::shared_session().into());
        }
        session.state.checked = true;
        let token = match self.fencing {
            Some(_) => Some(
                number(row, 2)
                    .filter(|token| *token > 0)
                    .ok_or_else(|| MyError::message("the fencing counter answered no token"))?
                    as u64,
            ),
            None => None,
        };
        Ok(Granted {
            token,
            since: confirm_sent,
        })
    }

    /// A pooled session within `deadline` (plus the command timeout to connect).
    pub(super) async fn session(&self, deadline: Instant) -> Result<Session, LockError> {
        self.pool
            .get(
                deadline,
                self.settings.timing.command_timeout,
                self.max_pooled_idle(),
                self.session_setup(),
            )
            .await
    }

    /// The statement every new connection runs: the server-side limits of a cut-off
    /// session (see `Inner::server_idle_limit`), and autocommit, so the fencing counter
    /// is committed by the statement that increments it.
    pub(super) fn session_setup(&self) -> String {
        let limit = self.server_idle_limit().as_secs();
        format!(
            "SET SESSION wait_timeout = {limit}, net_read_timeout = {limit}, \
             net_write_timeout = {limit}, autocommit = 1"
        )
    }
}

/// How often the last fraction of a wait is polled on a server that waits whole
/// seconds only (MySQL), and the shortest `GET_LOCK` that counts as having waited.
const POLL: Duration = Duration::from_millis(25);

/// When a wait that starts now ends; a wait too long for the clock ends in a year.
fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    let year = Duration::from_secs(365 * 24 * 3600);
    now.checked_add(wait.min(year)).unwrap_or(now + year)
}
