//! Taking a transaction-scoped lock ([`LockScope::Transaction`](super::LockScope)):
//! `pg_advisory_xact_lock` inside a transaction that stays open until release, so a
//! transaction pooler keeps the server session pinned to this connection meanwhile.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use super::acquire::{whole_millis, Grant};
use super::error::PgError;
use super::session::{last_row, Session};
use super::Inner;
use crate::backend::Lease;
use crate::locks::LockError;

impl Inner {
    pub(super) async fn acquire_in_transaction(
        self: Arc<Self>,
        id: i64,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let deadline = Instant::now() + wait;
        self.prepare_fencing(deadline).await?;
        let token = self.token_sql();
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
                // PostgreSQL's own queue, bounded by the wait.
                format!(
                    "{begin}; SET LOCAL lock_timeout = '{millis}ms'; \
                     SELECT pg_advisory_xact_lock({id}); SET LOCAL lock_timeout TO DEFAULT; \
                     SELECT pg_backend_pid(), true, {token}"
                )
            }
        };
        let (session, answer) = self
            .first_query(deadline, sql, wait + self.network_timeout)
            .await?;
        // On every early return below, `session` is dropped: closed, not pooled, so
        // its transaction and lock end.
        let grant = match answer {
            Ok(answer) => {
                let row = last_row(&answer)
                    .ok_or_else(|| PgError::message("no answer to the lock").into_lock_error())?;
                Grant::parse(row).map_err(PgError::into_lock_error)?
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
        Ok(self.hold(session, id, grant.pid, grant.token))
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
