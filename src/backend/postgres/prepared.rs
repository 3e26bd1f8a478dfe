//! The session lock's common path as prepared statements: the try and the unlock of an
//! exclusive or shared lock (no permit, no replay record), each one `Bind`/`Execute`
//! round trip on a statement prepared once per connection (the pool's statement cache).
//! Parsing and planning the granting statement on every acquisition cost more than the
//! round trip itself; the other statements (the wait, the confirmation, the checks) are
//! simple queries, as is everything behind a transaction pooler (`LockScope::Transaction`).
//!
//! A session-scope backend reaches these statements only after its pooler check (see
//! `pooler.rs`) found every server session to be its client's own, so a statement
//! prepared on a connection is there for as long as the connection: a pooler put in
//! between later that hands the session to another client makes the statement fail
//! (unknown to that server process), and the acquisition or the unlock fails with it —
//! never a grant on someone else's session.

use tokio::time::Instant;

use super::acquire::{shared_suffix, Grant, CHECKED_MARKER, LEASE_MARKER};
use super::error::PgError;
use super::holder::RESET_NAME;
use super::lease::Held;
use super::session::Session;
use super::Inner;
use crate::error::LockError;

/// The SQL of the prepared statements of one backend (its sequence, instance id and
/// limits are in the text), made once.
#[derive(Debug)]
pub(super) struct Statements {
    /// `[exclusive, shared]`: `$1` the lock id, `$2` the marker; one row `pid, locked,
    /// token, checked`.
    try_lock: [String; 2],
    /// `[exclusive, shared]`: `$1` the lock id, `$2` the granting server process; a row
    /// (whether it was held) only on that process.
    unlock: [String; 2],
    /// `[exclusive, shared]`: the wait in PostgreSQL's queue, `$1` the lock id, `$2` the
    /// marker, `$3` the `lock_timeout`, `$4` the server process of the try; one row
    /// `pid, true, token` once granted, none on another server process.
    wait: [String; 2],
}

impl Statements {
    pub(super) fn new(inner: &Inner) -> Self {
        let try_lock = |shared: bool| {
            let suffix = shared_suffix(shared);
            // The server-side limits are set once per session: a session is marked
            // checked only after a try on it set them (see `acquire.rs`).
            let limits = inner.limits_sql("NOT checked AND ");
            format!(
                "SELECT pid, locked, CASE WHEN locked THEN {granted} END, checked, {limits} \
                 FROM (SELECT pg_backend_pid() AS pid, \
                       current_setting('{CHECKED_MARKER}', true) IS NOT DISTINCT FROM 'on' \
                           AS checked, \
                       CASE WHEN coalesce(current_setting('{LEASE_MARKER}', true), '') <> '' \
                            THEN NULL ELSE pg_try_advisory_lock{suffix}($1) END AS locked) \
                 AS try",
                granted = inner.granted("$2::text", shared),
            )
        };
        let unlock = |shared: bool| {
            let suffix = shared_suffix(shared);
            format!(
                "SELECT pg_advisory_unlock{suffix}($1), \
                        set_config('{LEASE_MARKER}', NULL, false), {RESET_NAME} \
                 WHERE pg_backend_pid() = $2"
            )
        };
        // The innermost subquery sets the wait's limit first: `OFFSET 0` keeps it from
        // being pulled up, and the filter on its column keeps it evaluated, before the
        // lock in the list above it; the one below `waited` keeps the grant's
        // expressions from running before the lock is granted.
        let wait = |shared: bool| {
            let suffix = shared_suffix(shared);
            format!(
                "SELECT pg_backend_pid(), true, {granted} \
                 FROM (SELECT pg_advisory_lock{suffix}($1) \
                       FROM (SELECT set_config('lock_timeout', $3::text, true) AS set OFFSET 0) \
                            AS timeout \
                       WHERE timeout.set IS NOT NULL AND pg_backend_pid() = $4 OFFSET 0) \
                 AS waited",
                granted = inner.granted("$2::text", shared),
            )
        };
        Self {
            try_lock: [try_lock(false), try_lock(true)],
            unlock: [unlock(false), unlock(true)],
            wait: [wait(false), wait(true)],
        }
    }
}

impl Inner {
    fn statements(&self) -> &Statements {
        self.statements
            .get_or_init(|| std::sync::Arc::new(Statements::new(self)))
    }

    /// Takes a pooled session and tries the lock `id` on it with `marker`: the grant
    /// (`locked` `None` for a session found holding another client's lock) and whether
    /// the session was checked; also returns when the try was sent. A reused
    /// connection found closed is replaced once, as in `first_query`.
    pub(super) async fn try_prepared(
        &self,
        id: i64,
        shared: bool,
        marker: &str,
        deadline: Instant,
    ) -> Result<(Session, Instant, Result<(Grant, bool), PgError>), LockError> {
        let sql = &self.statements().try_lock[usize::from(shared)];
        let mut session = self.session(deadline).await?;
        let mut replaced = false;
        loop {
            let (sent, answer) = self.try_on(&session, sql, id, marker).await;
            match answer {
                Err(error) if error.closed && session.reused() && !replaced => {
                    drop(session);
                    session = self.session(deadline).await?;
                    replaced = true;
                }
                answer => return Ok((session, sent, answer)),
            }
        }
    }

    async fn try_on(
        &self,
        session: &Session,
        sql: &str,
        id: i64,
        marker: &str,
    ) -> (Instant, Result<(Grant, bool), PgError>) {
        let statement = match self.round_trip(session.prepare_cached(sql)).await {
            Ok(statement) => statement,
            Err(error) => return (Instant::now(), Err(error)),
        };
        let sent = Instant::now();
        let answer = self
            .round_trip(session.query_opt(&statement, &[&id, &marker]))
            .await;
        let parsed = answer.and_then(|row| {
            let row = row.ok_or_else(PgError::shared_session)?;
            let malformed =
                |error| PgError::new("PostgreSQL answered the lock statement oddly", error);
            let token: Option<i64> = row.try_get(2).map_err(malformed)?;
            let grant = Grant {
                pid: row.try_get(0).map_err(malformed)?,
                locked: row.try_get(1).map_err(malformed)?,
                token: token.and_then(|token| u64::try_from(token).ok()),
            };
            Ok((grant, row.try_get(3).map_err(malformed)?))
        });
        (sent, parsed)
    }

    /// Waits in PostgreSQL's queue for `held` (its lock id, on its server process) at
    /// most `millis` (the `lock_timeout`), then takes the grant's token and marks the
    /// session with `marker`: the row, or none on another server process.
    pub(super) async fn wait_prepared(
        &self,
        session: &Session,
        held: &Held,
        marker: &str,
        millis: u128,
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        let Held {
            id, shared, pid, ..
        } = *held;
        let sql = &self.statements().wait[usize::from(shared)];
        let statement = session.prepare_cached(sql).await?;
        let limit = format!("{millis}ms");
        session
            .query_opt(&statement, &[&id, &marker, &limit, &pid])
            .await
    }

    /// Unlocks `held` (its lock id, on its server process) and clears the session's
    /// marker and holder record: `Some(held)`, or `None` when another server process
    /// answered (left alone).
    pub(super) async fn unlock_prepared(
        &self,
        session: &Session,
        held: &Held,
    ) -> Result<Option<bool>, PgError> {
        let Held {
            id, shared, pid, ..
        } = *held;
        let sql = &self.statements().unlock[usize::from(shared)];
        let statement = self.round_trip(session.prepare_cached(sql)).await?;
        let row = self
            .round_trip(session.query_opt(&statement, &[&id, &pid]))
            .await?;
        row.map(|row| row.try_get::<_, Option<bool>>(0))
            .transpose()
            .map(|held| held.map(|held| held == Some(true)))
            .map_err(|error| PgError::new("PostgreSQL answered the unlock oddly", error))
    }
}
