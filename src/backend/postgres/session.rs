//! Pooled connections: taking one within the wait, round trips bounded by the network
//! timeout, and closing a connection whose state is unknown instead of pooling it.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use deadpool_postgres::{Object, PoolError, TimeoutType, Timeouts};
use tokio::time::{timeout, Instant};
use tokio_postgres::{SimpleQueryMessage, SimpleQueryRow};

use super::error::{PgError, CONNECT};
use super::Inner;
use crate::backend::session::bounded;
use crate::error::LockError;

/// A pooled connection whose session may hold a lock. Dropped, it is taken out of the
/// pool and closed — PostgreSQL then ends the session and frees its locks; only
/// [`give_back`](Self::give_back), for a session known to hold nothing, pools it again.
pub(super) struct Session(Option<Object>);

impl Session {
    pub(super) fn give_back(mut self) {
        drop(self.0.take());
    }

    /// Whether the connection served an earlier request.
    pub(super) fn reused(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|object| Object::metrics(object).recycle_count > 0)
    }
}

impl std::ops::Deref for Session {
    type Target = deadpool_postgres::ClientWrapper;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("a session until dropped")
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            // Detached from the pool; dropping the client aborts its connection task,
            // which closes the socket.
            drop(Object::take(object));
        }
    }
}

impl Inner {
    /// A pooled connection, waiting for one at most until `deadline` (then
    /// [`LockError::Timeout`]: the pool is exhausted) plus the command timeout to open
    /// a new one.
    pub(super) async fn session(&self, deadline: Instant) -> Result<Session, LockError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let timeouts = Timeouts {
            // Zero means "try once" to deadpool, as to the layer.
            wait: Some(wait),
            create: Some(self.settings.timing.command_timeout),
            recycle: Some(self.settings.timing.command_timeout),
        };
        let mut got = Err(PoolError::NoRuntimeSpecified);
        if !self.pool_without_runtime.load(Ordering::Relaxed) {
            got = self.pool.timeout_get(&timeouts).await;
        }
        if let Err(PoolError::NoRuntimeSpecified) = got {
            // A pool built without a runtime cannot time out itself (and gives up before
            // it connects): bound it from here. A full pool means waiting for a slot,
            // else for a connection at most.
            self.pool_without_runtime.store(true, Ordering::Relaxed);
            let untimed = Timeouts {
                wait: wait.is_zero().then_some(Duration::ZERO),
                ..Timeouts::new()
            };
            let status = self.pool.status();
            let limit = match status.available == 0 && status.size >= status.max_size {
                true => wait,
                false => wait + self.settings.timing.command_timeout,
            };
            got = match timeout(limit, self.pool.timeout_get(&untimed)).await {
                Ok(got) => got,
                Err(_) => return Err(LockError::Timeout),
            };
        }
        match got {
            Ok(object) => Ok(Session(Some(object))),
            Err(PoolError::Timeout(TimeoutType::Wait)) => Err(LockError::Timeout),
            Err(error) => Err(PgError::new(CONNECT, error)
                .at(self.address.clone())
                .into_lock_error()),
        }
    }

    /// Takes a pooled session and runs its first statement, `sql()` (made once the
    /// session is there, so it can use the time left), within `limit`; also returns
    /// when the answered statement was sent. A
    /// reused connection that died while idle (a server restart) and was not noticed
    /// yet fails at once as closed: its session, and any lock of it, is gone, so the
    /// statement runs once more on a fresh connection.
    pub(super) async fn first_query(
        &self,
        deadline: Instant,
        sql: impl Fn() -> String,
        limit: Duration,
    ) -> Result<(Session, Instant, Result<Vec<SimpleQueryMessage>, PgError>), LockError> {
        let session = self.session(deadline).await?;
        let sent = Instant::now();
        match self
            .round_trip_within(limit, session.simple_query(&sql()))
            .await
        {
            Err(error) if error.closed && session.reused() => {
                drop(session);
                let session = self.session(deadline).await?;
                let sent = Instant::now();
                let answer = self
                    .round_trip_within(limit, session.simple_query(&sql()))
                    .await;
                Ok((session, sent, answer))
            }
            answer => Ok((session, sent, answer)),
        }
    }

    /// Runs one round trip within the command timeout.
    pub(super) fn round_trip<T>(
        &self,
        query: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> impl Future<Output = Result<T, PgError>> {
        self.round_trip_within(self.settings.timing.command_timeout, query)
    }

    /// Runs one round trip within `limit`.
    pub(super) fn round_trip_within<T>(
        &self,
        limit: Duration,
        query: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> impl Future<Output = Result<T, PgError>> {
        bounded(limit, query, |answer| match answer {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(PgError::new("PostgreSQL statement failed", error)),
            Err(_) => Err(PgError::unanswered("PostgreSQL did not answer in time")),
        })
    }
}

/// The last row of a simple-query answer: what its last `SELECT` returned.
pub(super) fn last_row(messages: &[SimpleQueryMessage]) -> Option<&SimpleQueryRow> {
    messages.iter().rev().find_map(|message| match message {
        SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    })
}
