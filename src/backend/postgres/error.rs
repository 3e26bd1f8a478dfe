//! The backend's error: what failed, with the PostgreSQL or pool error behind it.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

use tokio_postgres::error::SqlState;

use crate::error::LockError;

/// Why a session lock cannot work through a transaction pooler, for errors and logs.
pub(super) const SHARED_SESSION: &str = "the PostgreSQL session is shared with other clients \
    or reset between transactions (its statements ran on different server processes, it \
    already held a lock of another client, or its lock was gone once the granting \
    transaction ended, as with server_reset_query_always): a transaction pooler such as \
    PgBouncer in pool_mode=transaction is in between. Session locks need a direct \
    connection or session pooling; behind a transaction pooler use LockScope::Transaction";

/// What a failure to connect says (then where, then why).
pub(super) const CONNECT: &str = "cannot connect to PostgreSQL";

/// What a fencing sequence that could issue tokens out of order is refused with.
pub(super) const UNSAFE_SEQUENCE: &str = "the fencing sequence can issue tokens out of order: \
    it needs CACHE 1, NO CYCLE, a positive INCREMENT and MINVALUE >= 0 \
    (ALTER SEQUENCE ... CACHE 1 NO CYCLE)";

/// A backend failure: what failed, and the PostgreSQL or pool error behind it.
#[derive(Debug)]
pub(super) struct PgError {
    pub(super) what: &'static str,
    pub(super) code: Option<SqlState>,
    /// Whether the connection was found closed.
    pub(super) closed: bool,
    /// Whether a round trip went unanswered within its limit (no source then).
    pub(super) unanswered: bool,
    /// The server's address, for errors about reaching it.
    at: Option<Arc<str>>,
    source: Option<Box<dyn Error + Send + Sync>>,
}

impl PgError {
    pub(super) fn new(what: &'static str, source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        let source = source.into();
        // A pool's connect error carries the server's answer (a refused login) too.
        let postgres = source.downcast_ref::<tokio_postgres::Error>().or_else(|| {
            match source.downcast_ref::<deadpool_postgres::PoolError>() {
                Some(deadpool_postgres::PoolError::Backend(error)) => Some(error),
                _ => None,
            }
        });
        // A FATAL answer ends the session: the server closes it after saying why
        // (`idle_session_timeout` on a session idle in the pool, a shutdown), which
        // the client may not have seen yet when it picked the connection.
        let (code, closed) = match postgres {
            Some(error) => (
                error.code().cloned(),
                error.is_closed() || ends_session(error),
            ),
            None => (None, false),
        };
        Self {
            what,
            code,
            closed,
            unanswered: false,
            at: None,
            source: Some(source),
        }
    }

    pub(super) fn message(what: &'static str) -> Self {
        Self {
            what,
            code: None,
            closed: false,
            unanswered: false,
            at: None,
            source: None,
        }
    }

    /// A round trip that went unanswered within its limit: `what`.
    pub(super) fn unanswered(what: &'static str) -> Self {
        Self {
            unanswered: true,
            ..Self::message(what)
        }
    }

    /// The same error, naming the server's `address` after what failed (when known).
    pub(super) fn at(mut self, address: Option<Arc<str>>) -> Self {
        self.at = address;
        self
    }

    /// The session's statements ran on two server processes, or the session was found
    /// holding another client's lock: a transaction pooler shares server sessions.
    pub(super) fn shared_session() -> Self {
        Self::message(SHARED_SESSION)
    }

    /// A grant whose confirming round trip to lock `id` failed or did not answer within
    /// the command timeout: the server may end the session before the holder's first
    /// liveness check, so the grant is given back.
    pub(super) fn unconfirmed(id: i64, error: PgError) -> LockError {
        tracing::warn!(lock_id = id, %error, "PostgreSQL lock grant not confirmed in time; given back");
        let transient = error.is_transient();
        Self {
            unanswered: transient,
            ..Self::message(
                "PostgreSQL did not confirm the lock grant within the command timeout (the \
             server could free it before the holder would hear of it): given back",
            )
        }
        .into_lock_error()
    }

    /// Whether this is a failure of the path or of the server's availability, worth
    /// another attempt: an error of the connection or the pool (no SQL state), an
    /// unanswered round trip, a connection exception (`08`), a server shutting down or
    /// starting (`57P01`-`57P03`), a session ended idle (`57P05`), a cancelled statement (`57014`). Not an answer: a
    /// refused login, a missing table, a malformed answer, a transaction pooler under a
    /// session lock.
    pub(super) fn is_transient(&self) -> bool {
        match &self.code {
            Some(code) => {
                let code = code.code();
                code.starts_with("08")
                    || matches!(code, "57P01" | "57P02" | "57P03" | "57P05" | "57014")
            }
            None => self.closed || self.source.is_some() || self.unanswered,
        }
    }

    pub(super) fn into_lock_error(self) -> LockError {
        LockError::Backend(Box::new(self))
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what)?;
        if let Some(address) = &self.at {
            write!(f, " at {address}")?;
        }
        // The whole chain of causes: a connect error's own text is only "error
        // connecting to server"; why ("Connection refused") is its source's.
        let mut shown = String::new();
        let mut cause = self.source.as_deref().map(|e| e as &(dyn Error + 'static));
        while let Some(error) = cause {
            let text = error.to_string();
            if !shown.contains(&text) {
                write!(f, ": {text}")?;
                shown.push_str(&text);
            }
            cause = error.source();
        }
        Ok(())
    }
}

impl Error for PgError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

/// Whether the server ended the session with this answer (severity `FATAL`).
fn ends_session(error: &tokio_postgres::Error) -> bool {
    error
        .as_db_error()
        .is_some_and(|db| db.parsed_severity() == Some(tokio_postgres::error::Severity::Fatal))
}
