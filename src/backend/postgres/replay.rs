//! What the PostgreSQL replay store needs of the backend whose database keeps its
//! records: the backend's identity (a lookup or write is read only by the backend it
//! was made for), and the release that writes a record with the unlock.

use std::future::Future;

use tokio::sync::oneshot;

use super::error::PgError;
use super::session::Session;
use super::{Inner, PostgresBackend};
use crate::backend::session;
use crate::backend::{LostReason, Place, RecordWrite};
use crate::error::LockError;

impl PostgresBackend {
    /// Which backend this is (its clones included): a replay record lookup is read
    /// only by the backend it was made for.
    pub(crate) fn engine_id(&self) -> usize {
        self.inner.engine_id()
    }
}

impl Inner {
    /// [`PostgresBackend::engine_id`], from a lease's side: where the backend's shared
    /// state lives.
    pub(super) fn engine_id(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }
}

impl Inner {
    /// Writes a replay record and unlocks (`unlock`, not polled yet) in one round trip:
    /// two simple queries sent together. Two messages, not one: statements of one message share an
    /// implicit transaction, and a session lock's unlock takes effect at once, before
    /// that transaction commits, so the next holder's try could miss the record; as
    /// two, the write commits before the unlock runs, and a write that fails leaves the
    /// unlock to run all the same. The writer hears only once both answered. `Ok` when
    /// the session is known to hold nothing now.
    pub(super) async fn write_and_unlock(
        &self,
        session: &Session,
        write: RecordWriting,
        unlock: impl Future<Output = Result<(), LostReason>>,
    ) -> Result<(), LostReason> {
        // Both requests are queued by their first poll, the write first.
        let (written, released) =
            tokio::join!(self.round_trip(session.simple_query(&write.sql)), unlock,);
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

/// A replay record's write, run on the held session with its unlock, and who waits
/// for whether it was done.
pub(super) struct RecordWriting {
    sql: String,
    written: oneshot::Sender<Result<bool, LockError>>,
}

impl RecordWriting {
    /// The release that writes `record` with the unlock, for a lease of the backend
    /// `writer`, and the future of whether it was written; `None` for a record made for
    /// another backend.
    pub(super) fn for_release(
        record: RecordWrite,
        writer: usize,
    ) -> Option<(Self, session::Written)> {
        #[allow(irrefutable_let_patterns)]
        let Place::Postgres { engine, sql } = record.place
        else {
            return None;
        };
        if engine != writer {
            return None;
        }
        let (written, answer) = oneshot::channel();
        let answer: session::Written = Box::pin(async move {
            answer.await.unwrap_or_else(|_| {
                Err(
                    PgError::message("the lock was lost before its record was written")
                        .into_lock_error(),
                )
            })
        });
        Some((RecordWriting { sql, written }, answer))
    }
}
