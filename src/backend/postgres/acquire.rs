//! Taking a lock: `pg_try_advisory_lock`, then the wait in PostgreSQL's own queue, and
//! the fencing token of each grant.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout, Instant};
use tokio_postgres::error::SqlState;
use tokio_postgres::SimpleQueryMessage;

use super::error::PgError;
use super::session::Session;
use super::{Fencing, Inner};
use crate::backend::Lease;
use crate::locks::LockError;

/// Whether this session holds the lock (`$1` the high, `$2` the low 32 bits of the id).
const HOLDS_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks \
    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
    AND objsubid = 1 AND classid::bigint = $1 AND objid::bigint = $2)";

impl Inner {
    pub(super) async fn acquire(
        self: Arc<Self>,
        id: i64,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let deadline = Instant::now() + wait;
        let mut session = self.session(deadline).await?;
        if let Some(fencing) = &self.fencing {
            self.create_sequence(fencing, &session).await?;
        }
        let tried = match self.try_lock(&session, id).await {
            // A pooled connection that died while idle (a server restart) and was not
            // noticed yet: the session is gone, and its locks with it, so one more try
            // on a fresh connection is safe.
            Err(error) if error.closed && session.reused() => {
                drop(session);
                session = self.session(deadline).await?;
                self.try_lock(&session, id).await
            }
            tried => tried,
        };
        // On every early return below, `session` is dropped: closed, not pooled.
        let token = match tried.map_err(PgError::into_lock_error)? {
            Some(token) => token,
            None => match self.wait_lock(&session, id, deadline).await? {
                Some(token) => token,
                None => {
                    session.give_back();
                    return Err(LockError::Timeout);
                }
            },
        };
        Ok(self.hold(session, id, token))
    }

    /// Creates the fencing sequence once per backend (and again after a failure).
    async fn create_sequence(&self, fencing: &Fencing, session: &Session) -> Result<(), LockError> {
        let create = async {
            let sql = format!("CREATE SEQUENCE IF NOT EXISTS {}", fencing.sequence);
            match self.round_trip(session.batch_execute(&sql)).await {
                Ok(()) => Ok(()),
                // Another instance created it at the same moment, or we may not create
                // it but it may exist (`nextval` will tell).
                Err(PgError {
                    code: Some(code), ..
                }) if code == SqlState::UNIQUE_VIOLATION
                    || code == SqlState::DUPLICATE_TABLE
                    || code == SqlState::INSUFFICIENT_PRIVILEGE =>
                {
                    Ok(())
                }
                Err(error) => Err(error),
            }
        };
        fencing
            .created
            .get_or_try_init(|| create)
            .await
            .map(|_| ())
            .map_err(PgError::into_lock_error)
    }

    /// `pg_try_advisory_lock`: `Some(token)` when granted.
    async fn try_lock(&self, session: &Session, id: i64) -> Result<Option<Option<u64>>, PgError> {
        let sql = match &self.fencing {
            Some(fencing) => &*fencing.try_sql,
            None => "SELECT pg_try_advisory_lock($1)",
        };
        let row = self
            .round_trip(async {
                let statement = session.prepare_cached(sql).await?;
                session.query_one(&statement, &[&id]).await
            })
            .await?;
        Ok(match &self.fencing {
            Some(_) => row.get::<_, Option<i64>>(0).map(|token| Some(token as u64)),
            None => row.get::<_, bool>(0).then_some(None),
        })
    }

    /// Waits in PostgreSQL's own queue until granted (`Some(token)`) or `deadline`
    /// (`None`). Returns `None` with the session unlocked and clean.
    async fn wait_lock(
        &self,
        session: &Session,
        id: i64,
        deadline: Instant,
    ) -> Result<Option<Option<u64>>, LockError> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        // `lock_timeout = 0` would mean "wait forever".
        let millis = remaining.as_millis();
        if millis == 0 {
            return Ok(None);
        }
        let nextval = match &self.fencing {
            Some(fencing) => format!("; SELECT nextval('{}')", fencing.sequence),
            None => String::new(),
        };
        // One simple-protocol message is one implicit transaction: the setting is
        // transaction-local, so it cannot leak to the next user of the connection,
        // while the session lock outlives the transaction. `id` and `millis` are
        // numbers we made, so formatting them in is safe.
        let sql = format!(
            "SELECT set_config('lock_timeout', '{millis}ms', true); \
             SELECT pg_advisory_lock({id}){nextval}"
        );
        let answer = timeout(remaining + self.network_timeout, session.simple_query(&sql)).await;
        match answer {
            Ok(Ok(messages)) => Ok(Some(self.fencing.as_ref().and(last_value(&messages)))),
            Ok(Err(error)) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                // The lock may have been granted as the timeout fired: PostgreSQL then
                // keeps the session lock although the statement failed.
                match self.holds(session, id).await {
                    Ok(false) => Ok(None),
                    Ok(true) => match &self.fencing {
                        Some(fencing) => {
                            let sql = format!("SELECT nextval('{}')", fencing.sequence);
                            let token = self
                                .round_trip(session.query_one(&sql, &[]))
                                .await
                                .map_err(PgError::into_lock_error)?;
                            Ok(Some(Some(token.get::<_, i64>(0) as u64)))
                        }
                        None => Ok(Some(None)),
                    },
                    // Unknown: the caller's drop closes the session, which frees the
                    // lock if it was granted. The wait is over either way.
                    Err(_) => Err(LockError::Timeout),
                }
            }
            Ok(Err(error)) => Err(PgError::new("pg_advisory_lock failed", error).into_lock_error()),
            Err(_) => Err(
                PgError::message("PostgreSQL did not answer the lock wait in time")
                    .into_lock_error(),
            ),
        }
    }

    /// Whether this session holds the advisory lock `id` (per `pg_locks`).
    async fn holds(&self, session: &Session, id: i64) -> Result<bool, PgError> {
        let bits = id as u64;
        let (high, low) = ((bits >> 32) as i64, (bits & 0xffff_ffff) as i64);
        let row = self
            .round_trip(session.query_one(HOLDS_SQL, &[&high, &low]))
            .await?;
        Ok(row.get(0))
    }
}

/// The most recent value in a simple-query answer: the fencing token.
fn last_value(messages: &[SimpleQueryMessage]) -> Option<u64> {
    messages.iter().rev().find_map(|message| match message {
        SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
        _ => None,
    })
}
