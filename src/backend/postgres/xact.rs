//! Taking a transaction-scoped lock ([`LockScope::Transaction`](super::LockScope)):
//! `pg_advisory_xact_lock` inside a transaction that stays open until release, so a
//! transaction pooler keeps the server session pinned to this connection meanwhile.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use super::acquire::{is_transient, whole_millis, Grant};
use super::client_check::set_client_check_sql;
use super::error::PgError;
use super::lease::Held;
use super::session::{last_row, Session};
use super::Inner;
use crate::backend::session::within_the_wait;
use crate::backend::Lease;
use crate::error::LockError;

/// A transaction-local setting: whether the lock was free when the wait began.
const FREE_AT_TRY: &str = "tower_keyed_lock.free_at_try";

impl Inner {
    /// Takes the transaction lock `id`, waiting until `deadline` (fencing prepared):
    /// attempts until one is granted, fails for good, or the wait ends; one that failed
    /// in passing is tried again on a fresh connection ([`within_the_wait`]).
    pub(super) async fn acquire_in_transaction(
        self: Arc<Self>,
        id: i64,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let attempt = || self.clone().attempt_in_transaction(id, deadline);
        let (lease, retried) =
            within_the_wait(&self.reached, deadline, is_transient, attempt).await?;
        let contended = retried || lease.contended();
        Ok(lease.with_contention(contended))
    }

    /// One attempt of [`acquire_in_transaction`](Self::acquire_in_transaction): the
    /// lock statement, waiting in PostgreSQL's queue until `deadline`, then what a
    /// grant needs. Marks the server reached once it answered.
    async fn attempt_in_transaction(
        self: Arc<Self>,
        id: i64,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let token = self.token_recording_holder_sql();
        // A partitioned holder's transaction is ended by the server at this limit;
        // a live holder's liveness checks keep it shorter.
        let limit = self.server_idle_limit().as_millis();
        let begin = format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = '{limit}ms'");
        let sql = || {
            // `lock_timeout = 0` would mean "wait forever": no wait left tries once.
            let millis = whole_millis(deadline.saturating_duration_since(Instant::now()));
            if millis == 0 {
                format!(
                    "{begin}; SELECT pid, locked, CASE WHEN locked THEN {token} END \
                     FROM (SELECT pg_backend_pid() AS pid, \
                           pg_try_advisory_xact_lock({id}) AS locked) AS try"
                )
            } else {
                // PostgreSQL's own queue, bounded by the wait. A try first, its answer kept
                // for the last row, says whether the lock was held (then the wait was
                // contended); a transaction lock taken twice is still one, ended with
                // the transaction. Where the server allows it, the wait ends with a
                // closed client connection too (see `client_check.rs`).
                let client_check = match self.sets_client_check() {
                    true => format!(", {}", set_client_check_sql(true)),
                    false => String::new(),
                };
                format!(
                    "{begin}; SELECT set_config('{FREE_AT_TRY}', \
                                       pg_try_advisory_xact_lock({id})::text, true){client_check}; \
                     SET LOCAL lock_timeout = '{millis}ms'; \
                     SELECT pg_advisory_xact_lock({id}); SET LOCAL lock_timeout TO DEFAULT; \
                     SELECT pg_backend_pid(), true, {token}, current_setting('{FREE_AT_TRY}')"
                )
            }
        };
        let limit = deadline.saturating_duration_since(Instant::now())
            + self.settings.timing.command_timeout;
        let (session, sent, answer) = self.first_query(deadline, sql, limit).await?;
        let answered = self.settings.timing.answered(sent);
        // On every early return below, `session` is dropped: closed, not pooled, so
        // its transaction and lock end.
        let (grant, waited) = match answer {
            Ok(answer) => {
                self.reached.mark();
                let row = last_row(&answer)
                    .ok_or_else(|| PgError::message("no answer to the lock").into_lock_error())?;
                // Only the wait's answer has the fourth column.
                let waited = row.try_get(3).ok().flatten() == Some("false");
                (Grant::parse(row).map_err(PgError::into_lock_error)?, waited)
            }
            Err(PgError {
                code: Some(code), ..
            }) if code == SqlState::LOCK_NOT_AVAILABLE => {
                return Err(self.roll_back(session).await);
            }
            Err(error) => return Err(error.into_lock_error()),
        };
        if grant.locked != Some(true) {
            return Err(self.roll_back(session).await);
        }
        // PostgreSQL's idle-in-transaction limit runs from the grant, which a late
        // answer does not date: it counts only once a round trip confirms it in time.
        // (Nothing resets a session inside an open transaction: it counts as checked.)
        let since = match answered.counts_from(true) {
            Some(since) => since,
            None => self.confirm_in_transaction(&session, id, grant.pid).await?,
        };
        let held = Held {
            id,
            shared: false,
            key: None,
            pid: grant.pid,
        };
        let lease = self.hold(session, held, grant.token, since);
        Ok(lease.with_contention(waited))
    }

    /// Confirms within the command timeout that the transaction holding `id` is still
    /// there on server process `pid`; returns when the round trip was sent. Not
    /// confirmed, the grant is given back (the caller drops the session: closed).
    async fn confirm_in_transaction(
        &self,
        session: &Session,
        id: i64,
        pid: i32,
    ) -> Result<Instant, LockError> {
        let sent = Instant::now();
        let answer = self
            .round_trip(session.simple_query("SELECT pg_backend_pid()"))
            .await
            .map_err(|error| PgError::unconfirmed(id, error))?;
        match last_row(&answer).and_then(|row| row.get(0)?.parse::<i32>().ok()) {
            Some(answered_by) if answered_by == pid => Ok(sent),
            _ => Err(
                PgError::message("PostgreSQL answered the lock confirmation oddly")
                    .into_lock_error(),
            ),
        }
    }

    /// Ends the transaction of a lock not granted and pools the session again.
    async fn roll_back(&self, session: Session) -> LockError {
        if self
            .round_trip(session.simple_query("ROLLBACK"))
            .await
            .is_ok()
        {
            session.give_back();
        }
        LockError::Timeout
    }
}
