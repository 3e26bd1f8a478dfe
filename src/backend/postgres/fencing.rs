//! The fencing sequence: created on first use (safely when instances start together),
//! and refused when its values could go backwards between two sessions (a cache, a
//! cycle, a negative step or start).

use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use super::error::{PgError, UNSAFE_SEQUENCE};
use super::schema::create_if_missing;
use super::session::last_row;
use super::Inner;
use crate::error::LockError;

impl Inner {
    /// The SQL of the next fencing token: `nextval` of the sequence, or NULL without
    /// fencing.
    pub(super) fn token_sql(&self) -> String {
        match &self.fencing {
            Some(fencing) => format!("nextval('{}')", fencing.sequence),
            None => "NULL::bigint".to_owned(),
        }
    }

    /// The SQL of a reader's fencing token: the last token the sequence issued (that
    /// of the last writer of the key or of a later grant of another key), without
    /// taking one; NULL before the first, or without fencing.
    pub(super) fn read_token_sql(&self) -> String {
        match &self.fencing {
            Some(fencing) => format!(
                "(SELECT CASE WHEN is_called THEN last_value END FROM {})",
                fencing.sequence
            ),
            None => "NULL::bigint".to_owned(),
        }
    }

    /// Creates the fencing sequence if it is missing and checks that its values strictly
    /// increase across sessions; once per backend (again after a failure, so a fixed
    /// sequence is taken up without a restart).
    pub(super) async fn prepare_fencing(&self, deadline: Instant) -> Result<(), LockError> {
        let Some(fencing) = &self.fencing else {
            return Ok(());
        };
        if fencing.checked.initialized() {
            return Ok(());
        }
        let prepare = async {
            let session = self.session(deadline).await?;
            let sequence = &fencing.sequence;
            let create = format!("CREATE SEQUENCE {sequence}");
            // Two round trips when it is missing: the look, then the creation.
            let created = self.round_trip_within(
                2 * self.settings.timing.command_timeout,
                create_if_missing(&session, sequence, &create),
            );
            match created.await {
                Ok(()) => {}
                // We may not create it but it may exist (the check below will tell).
                Err(PgError {
                    code: Some(code), ..
                }) if code == SqlState::INSUFFICIENT_PRIVILEGE => {}
                Err(error) => return Err(error.into_lock_error()),
            }
            // A session takes `CACHE` values at a time: with two sessions, tokens
            // interleave out of order (1, 21, 2, ...). A cycle wraps around.
            let check = format!(
                "SELECT seqcache = 1 AND NOT seqcycle AND seqincrement > 0 AND seqmin >= 0, \
                 seqcache, seqcycle, seqincrement, seqmin \
                 FROM pg_sequence WHERE seqrelid = '{sequence}'::regclass"
            );
            let answer = self
                .round_trip(session.simple_query(&check))
                .await
                .map_err(PgError::into_lock_error)?;
            let row = last_row(&answer).ok_or_else(|| {
                PgError::message("the fencing sequence is not a sequence").into_lock_error()
            })?;
            if row.get(0) != Some("t") {
                let found = |i| row.get(i).unwrap_or("?");
                tracing::error!(
                    sequence = &**sequence,
                    cache = found(1),
                    cycle = found(2),
                    increment = found(3),
                    min_value = found(4),
                    "refusing the fencing sequence: its tokens could go backwards; \
                     ALTER SEQUENCE ... CACHE 1 NO CYCLE INCREMENT BY 1 MINVALUE 0"
                );
                return Err(PgError::message(UNSAFE_SEQUENCE).into_lock_error());
            }
            session.give_back();
            Ok(())
        };
        // Boxed: the preparation's future is not carried by every acquisition's.
        Box::pin(fencing.checked.get_or_try_init(|| prepare))
            .await
            .map(|_| ())
    }
}
