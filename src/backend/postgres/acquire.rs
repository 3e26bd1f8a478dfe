//! Taking a session lock: `pg_try_advisory_lock`, then the wait in PostgreSQL's own
//! queue, with the fencing token, the server process id and the session's limits set in
//! the statement that grants it; then, where needed, a round trip that confirms it.
//!
//! The try of an exclusive or shared lock is a prepared statement (`prepared.rs`); the
//! others are simple queries (numbers and a checked sequence name formatted in). The
//! checks below are what tells a transaction pooler apart.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout, Instant};
use tokio_postgres::error::SqlState;
use tokio_postgres::{SimpleQueryMessage, SimpleQueryRow};

use super::client_check::{set_client_check_sql, CLIENT_CHECK};
use super::error::PgError;
use super::holder::RESET_NAME;
use super::lease::Held;
use super::request::Request;
use super::session::{last_row, Session};
use super::Inner;
use crate::backend::backoff::random;
use crate::backend::session::{within_the_wait, Answered};
use crate::backend::{Acquired, Lease};
use crate::error::LockError;

/// A session-level setting that names the lock a session holds for this crate, and the
/// acquisition (`<lock id>/<random>`). Set in the granting statement and cleared by the
/// unlock, so a session found with it set before a try is shared with another client:
/// a transaction pooler.
pub(super) const LEASE_MARKER: &str = "tower_keyed_lock.lease";

/// A session-level setting, `on` once a confirming round trip found the session still
/// holding a lock and its marker after the granting transaction had ended: nothing
/// resets this session between transactions (a pooler's `server_reset_query`, with
/// `server_reset_query_always`, would clear both, and this setting with them).
pub(super) const CHECKED_MARKER: &str = "tower_keyed_lock.checked";

impl Inner {
    /// The server-side limits set on every session that tries a lock, for the rest of
    /// its life, as `(setting, its set_config)`: a session cut off from its client,
    /// holding a lock or not, ends once idle that long (see `Inner::server_idle_limit`);
    /// where the server allows it, one whose client closed the connection mid-statement
    /// ends within [`CLIENT_CHECK_INTERVAL`](super::client_check::CLIENT_CHECK_INTERVAL)
    /// (see `client_check.rs`).
    fn session_limits(&self) -> Vec<(&'static str, String)> {
        let idle = |name| {
            let millis = self.server_idle_limit().as_millis();
            (name, format!("set_config('{name}', '{millis}ms', false)"))
        };
        let mut limits = vec![idle("idle_session_timeout"), idle("tcp_user_timeout")];
        if self.sets_client_check() {
            limits.push((CLIENT_CHECK, set_client_check_sql(false)));
        }
        limits
    }

    /// Sets each of [`session_limits`](Self::session_limits) the server has for the
    /// session, where the SQL condition `only_if` (empty: always) holds: one column
    /// each. `current_setting(.., true)` is NULL on a server without the setting, which
    /// skips it.
    pub(super) fn limits_sql(&self, only_if: &str) -> String {
        self.session_limits()
            .into_iter()
            .map(|(name, set)| {
                format!(
                    "CASE WHEN {only_if}current_setting('{name}', true) IS NOT NULL THEN {set} END"
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a granting statement answered: its row is `pid, locked, token`.
pub(super) struct Grant {
    pub(super) pid: i32,
    /// `None`: the session was found holding another client's lock.
    pub(super) locked: Option<bool>,
    pub(super) token: Option<u64>,
}

/// A lock granted, and the round trip that counts for it.
struct Granted {
    token: Option<u64>,
    /// The granting statement.
    answered: Answered,
    /// Whether it waited in PostgreSQL's queue (after a try that found the lock held).
    waited: bool,
}

impl Grant {
    pub(super) fn parse(row: &SimpleQueryRow) -> Result<Grant, PgError> {
        let malformed = || PgError::message("PostgreSQL answered the lock statement oddly");
        let pid = row
            .get(0)
            .and_then(|pid| pid.parse().ok())
            .ok_or_else(malformed)?;
        Ok(Grant {
            pid,
            locked: row.get(1).map(|locked| locked == "t"),
            token: row.get(2).and_then(|token| token.parse().ok()),
        })
    }
}

impl Inner {
    /// Takes the session lock `id` (`shared` beside other shared holders, else alone),
    /// and with it `key` (a permit's key lock id, see `permits.rs`) in shared mode,
    /// both or neither; waiting until `deadline` (fencing prepared).
    pub(super) async fn acquire(
        self: Arc<Self>,
        id: i64,
        shared: bool,
        key: Option<i64>,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let request = Request {
            id,
            shared,
            key,
            deadline,
            record: None,
        };
        self.acquire_unless_recorded(request).await?.into_lease()
    }

    /// [`acquire`](Self::acquire) of `request`, and when its `record` is given (an SQL
    /// expression whose value is a replay record's bytes, or NULL) the try takes nothing if
    /// the record is stored, and reads it again in a statement of its own after the try, in
    /// the same round trip: that statement's snapshot is taken after the try, so a record
    /// whose writer released the lock after the try's snapshot but before its lock is seen
    /// too (the lock the try took then is given back). A stored record is answered. A grant
    /// after a wait has not looked: [`Acquired::Granted`].
    ///
    /// With `key` (a permit), the try takes `key` in shared mode first, then `id`, and
    /// gives `key` back if `id` was taken: both or neither, in the try's one statement
    /// (`CASE` evaluates its branches in order).
    ///
    /// Only the wait bounds the waiting (see [`within_the_wait`]): an attempt that
    /// fails on a transient error (a broken connection, an unanswered statement, a
    /// refused connect) before its grant was confirmed is tried again on a fresh pooled
    /// session after a jittered pause, behind whoever queued meanwhile, until
    /// `deadline`. The failed attempt's session is dropped, never pooled: closed, it
    /// frees any lock the server granted it, and no grant of it was counted.
    pub(super) async fn acquire_unless_recorded(
        self: Arc<Self>,
        request: Request<'_>,
    ) -> Result<Acquired, LockError> {
        let attempt = || self.clone().attempt(request);
        let (acquired, retried) =
            within_the_wait(&self.reached, request.deadline, is_transient, attempt).await?;
        Ok(acquired.contended_if(retried))
    }

    /// One attempt of [`acquire_unless_recorded`](Self::acquire_unless_recorded): a try,
    /// then a wait in PostgreSQL's queue on the same session. Marks the server reached
    /// once it answered the try.
    async fn attempt(self: Arc<Self>, request: Request<'_>) -> Result<Acquired, LockError> {
        let Request {
            id,
            shared,
            key,
            deadline,
            record,
        } = request;
        let marker = format!("{id}/{:016x}", random());
        let (session, sent, tried) = match (key, record) {
            // The common case: prepared statements (see `prepared.rs`).
            (None, None) => {
                let (session, sent, tried) =
                    self.try_prepared(id, shared, &marker, deadline).await?;
                let tried = tried.map(|(grant, checked)| (grant, checked, None));
                (session, sent, tried)
            }
            // Boxed: the common case's future does not carry this one.
            _ => Box::pin(self.try_simple(id, shared, key, &marker, deadline, record)).await?,
        };
        // On every early return below, `session` is dropped: closed, not pooled.
        let (grant, checked, stored) = tried.map_err(PgError::into_lock_error)?;
        self.reached.mark();
        let held = Held {
            id,
            shared,
            key,
            pid: grant.pid,
        };
        let granted = match grant.locked {
            None => {
                tracing::error!(lock_id = id, "{}", super::error::SHARED_SESSION);
                return Err(PgError::shared_session().into_lock_error());
            }
            // The record is stored, and the key was held: the session is clean.
            Some(false) if stored.is_some() => {
                session.give_back();
                return Ok(Acquired::Recorded(stored.unwrap_or_default()));
            }
            // The try answered within the command timeout (its limit).
            Some(true) => Granted {
                token: grant.token,
                answered: Answered { sent, prompt: true },
                waited: false,
            },
            Some(false) => match self.wait_lock(&session, &held, &marker, deadline).await? {
                Some(granted) => granted,
                None => {
                    session.give_back();
                    return Err(LockError::Timeout);
                }
            },
        };
        // PostgreSQL's idle limit runs from the grant, which the answer does not date:
        // a late answer counts only once a round trip confirms the grant in time. A
        // session not yet seen to keep its lock past a transaction's end is confirmed
        // too: a pooler may reset it after every transaction.
        let since = match granted.answered.counts_from(checked) {
            Some(since) => since,
            None => self.confirm(&session, &held, &marker).await?,
        };
        let waited = granted.waited;
        let lease = self
            .hold(session, held, granted.token, since)
            .with_contention(waited);
        Ok(match (stored, record.is_some() && !waited) {
            // Written and released just before the try: the lease is dropped, which
            // gives the lock back off the request's path.
            (Some(stored), _) => Acquired::Recorded(stored),
            (None, true) => Acquired::NotRecorded(lease),
            (None, false) => Acquired::Granted(lease),
        })
    }

    /// The try of [`attempt`](Self::attempt) as a simple query: for a permit (`key`)
    /// or a replay `record` to look for. Returns the session, when the try was sent,
    /// and the grant, whether the session was checked, and a stored record.
    #[allow(clippy::type_complexity)]
    async fn try_simple(
        &self,
        id: i64,
        shared: bool,
        key: Option<i64>,
        marker: &str,
        deadline: Instant,
        record: Option<&str>,
    ) -> Result<
        (
            Session,
            Instant,
            Result<(Grant, bool, Option<Vec<u8>>), PgError>,
        ),
        LockError,
    > {
        let suffix = shared_suffix(shared);
        let try_lock = match key {
            None => format!("pg_try_advisory_lock{suffix}({id})"),
            Some(key) => format!(
                "CASE WHEN pg_try_advisory_lock_shared({key}) \
                      THEN CASE WHEN pg_try_advisory_lock{suffix}({id}) THEN true \
                                ELSE NOT pg_advisory_unlock_shared({key}) END \
                      ELSE false END"
            ),
        };
        // A record stored already is seen by the try, which then takes nothing.
        let recorded = match record {
            Some(record) => format!("WHEN {record} IS NOT NULL THEN false"),
            None => String::new(),
        };
        let mut try_sql = format!(
            "SELECT pid, locked, CASE WHEN locked THEN {granted} END, \
                    current_setting('{CHECKED_MARKER}', true) IS NOT DISTINCT FROM 'on', {limits} \
             FROM (SELECT pg_backend_pid() AS pid, \
                   CASE WHEN coalesce(current_setting('{LEASE_MARKER}', true), '') <> '' \
                        THEN NULL {recorded} \
                        ELSE {try_lock} END AS locked) AS try",
            granted = self.granted(&format!("'{marker}'"), shared),
            limits = self.limits_sql(""),
        );
        // Read again after the try, for a record written just before the lock was.
        if let Some(record) = record {
            try_sql.push_str(&format!("; SELECT {record} AS stored"));
        }
        let (session, sent, tried) = self
            .first_query(
                deadline,
                || try_sql.clone(),
                self.settings.timing.command_timeout,
            )
            .await?;
        let tried = tried.and_then(|answer| {
            let mut rows = answer.iter().filter_map(|message| match message {
                SimpleQueryMessage::Row(row) => Some(row),
                _ => None,
            });
            let row = rows.next().ok_or_else(PgError::shared_session)?;
            let stored = match record {
                Some(_) => rows.next().ok_or_else(PgError::shared_session)?.get(0),
                None => None,
            };
            Ok((
                Grant::parse(row)?,
                row.get(3) == Some("t"),
                stored.map(bytea).transpose()?,
            ))
        });
        Ok((session, sent, tried))
    }

    /// The expression, evaluated once the lock is granted, that takes the fencing token,
    /// marks the session with `marker` (an SQL expression of type text) and records the holder (see `holder.rs`); its
    /// value is the token (NULL without fencing). A shared holder takes no new token: it
    /// reads the last one issued.
    pub(super) fn granted(&self, marker: &str, shared: bool) -> String {
        let token = match shared {
            true => self.read_token_sql(),
            false => self.token_sql(),
        };
        format!(
            "(SELECT token FROM (SELECT token, \
              set_config('{LEASE_MARKER}', {marker}, false), {holder} \
              FROM (SELECT {token} AS token) AS issued) AS granted)",
            holder = self.record_holder_sql("token", false),
        )
    }

    /// Confirms in a round trip of its own, within the command timeout, that the
    /// session (server process `held.pid`) still holds `held.id` with this
    /// acquisition's `marker` after the granting transaction ended; returns when it was
    /// sent, which the server's idle limit runs from at the earliest. Not confirmed, the
    /// grant is given back (the caller drops the session: closed). Marks the session
    /// checked.
    async fn confirm(
        &self,
        session: &Session,
        held: &Held,
        marker: &str,
    ) -> Result<Instant, LockError> {
        let Held { id, pid, .. } = *held;
        let sql = format!(
            "SELECT held, CASE WHEN held THEN set_config('{CHECKED_MARKER}', 'on', false) END \
             FROM (SELECT {holds} AND current_setting('{LEASE_MARKER}', true) = '{marker}' \
                   AS held WHERE pg_backend_pid() = {pid}) AS confirmed",
            holds = holds_sql(id, pid),
        );
        let sent = Instant::now();
        let answer = self.round_trip(session.simple_query(&sql)).await;
        let answer = answer.map_err(|error| PgError::unconfirmed(id, error))?;
        match last_row(&answer) {
            Some(row) if row.get(0) == Some("t") => Ok(sent),
            _ => {
                tracing::error!(lock_id = id, "{}", super::error::SHARED_SESSION);
                Err(PgError::shared_session().into_lock_error())
            }
        }
    }

    /// Waits in PostgreSQL's own queue for `held` until granted (`Some`) or `deadline`
    /// (`None`). Returns `None` with the session unlocked and clean. `held.pid` is the
    /// server process of the try: the wait must run on it too.
    async fn wait_lock(
        &self,
        session: &Session,
        held: &Held,
        marker: &str,
        deadline: Instant,
    ) -> Result<Option<Granted>, LockError> {
        let Held {
            id, shared, pid, ..
        } = *held;
        let remaining = deadline.saturating_duration_since(Instant::now());
        // `lock_timeout = 0` would mean "wait forever".
        let millis = whole_millis(remaining);
        if millis == 0 {
            return Ok(None);
        }
        // One prepared statement (see `prepared.rs`): `Bind`, `Execute` and `Sync` are
        // one implicit transaction, so the `lock_timeout` it sets first ends with it
        // and cannot leak to the next user of the connection, while the session lock
        // outlives the transaction. A transaction pooler may run it on another server
        // process than the try: then nothing is locked, and no row comes back. The
        // grant's token, marker and holder are taken in the statement that waits,
        // evaluated once its lock row comes: that statement is planned before the
        // wait, where a statement of its own would be planned after it, on the
        // hand-off's path (200 µs of a 0.6 ms hand-off, measured).
        let sent = Instant::now();
        let wait = self.wait_prepared(session, held, marker, millis);
        let answer = timeout(remaining + self.settings.timing.command_timeout, wait).await;
        match answer {
            Ok(Ok(row)) => Ok(Some(Granted {
                token: granted_row_token(row)?,
                answered: self.settings.timing.answered(sent),
                waited: true,
            })),
            Ok(Err(error)) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                // The lock may have been granted as the timeout fired: PostgreSQL then
                // keeps the session lock although the statement failed.
                match self.holds(session, id, pid).await {
                    Ok(false) => Ok(None),
                    Ok(true) => {
                        let sent = Instant::now();
                        let granted = self
                            .round_trip(
                                session.simple_query(&self.granted_sql(marker, pid, shared)),
                            )
                            .await
                            .map_err(PgError::into_lock_error)?;
                        Ok(Some(Granted {
                            token: self.granted_token(&granted)?,
                            answered: Answered { sent, prompt: true },
                            waited: true,
                        }))
                    }
                    // Unknown: the caller's drop closes the session, which frees the
                    // lock if it was granted. The wait is over either way.
                    Err(_) => Err(LockError::Timeout),
                }
            }
            Ok(Err(error)) => Err(PgError::new("pg_advisory_lock failed", error).into_lock_error()),
            Err(_) => Err(
                PgError::unanswered("PostgreSQL did not answer the lock wait in time")
                    .into_lock_error(),
            ),
        }
    }

    /// A statement for a session that was just granted a lock: the `Grant` row with the
    /// token, the session marked with `marker`; no row on another server process.
    fn granted_sql(&self, marker: &str, pid: i32, shared: bool) -> String {
        format!(
            "SELECT pg_backend_pid(), true, {granted} WHERE pg_backend_pid() = {pid}",
            granted = self.granted(&format!("'{marker}'"), shared)
        )
    }

    /// The token in a `granted_sql` answer; no row means a transaction pooler.
    fn granted_token(
        &self,
        messages: &[tokio_postgres::SimpleQueryMessage],
    ) -> Result<Option<u64>, LockError> {
        let row = last_row(messages).ok_or_else(|| {
            tracing::error!("{}", super::error::SHARED_SESSION);
            PgError::shared_session().into_lock_error()
        })?;
        Ok(Grant::parse(row).map_err(PgError::into_lock_error)?.token)
    }

    /// Whether this session (server process `pid`) holds the advisory lock `id`.
    async fn holds(&self, session: &Session, id: i64, pid: i32) -> Result<bool, PgError> {
        let sql = format!(
            "SELECT {holds} WHERE pg_backend_pid() = {pid}",
            holds = holds_sql(id, pid)
        );
        let answer = self.round_trip(session.simple_query(&sql)).await?;
        let row = last_row(&answer).ok_or_else(PgError::shared_session)?;
        Ok(row.get(0) == Some("t"))
    }

    /// The statement that unlocks `id` (and a permit's `key`, held shared beside it) on
    /// server process `pid` and clears the session's marker: its row says whether the
    /// lock was held; no row means another server process answered (a transaction
    /// pooler), which was left alone.
    pub(super) fn unlock_sql(id: i64, shared: bool, key: Option<i64>, pid: i32) -> String {
        let suffix = shared_suffix(shared);
        let key = match key {
            Some(key) => format!(", pg_advisory_unlock_shared({key})"),
            None => String::new(),
        };
        format!(
            "SELECT pg_advisory_unlock{suffix}({id}), set_config('{LEASE_MARKER}', NULL, false), \
                    {RESET_NAME}{key} \
             WHERE pg_backend_pid() = {pid}"
        )
    }
}

/// Whether an attempt's `error` is worth another attempt within the wait (see
/// [`PgError::is_transient`]).
pub(super) fn is_transient(error: &LockError) -> bool {
    match error {
        LockError::Backend(error) => error
            .downcast_ref::<PgError>()
            .is_some_and(PgError::is_transient),
        _ => false,
    }
}

/// A `bytea` in PostgreSQL's text output (`\x` and hex digits) as bytes.
fn bytea(text: &str) -> Result<Vec<u8>, PgError> {
    let malformed = || PgError::message("PostgreSQL answered a record that is not hex bytea");
    let hex = text.strip_prefix("\\x").ok_or_else(malformed)?;
    let digit = |c: u8| char::from(c).to_digit(16).ok_or_else(malformed);
    hex.as_bytes()
        .chunks(2)
        .map(|pair| match pair {
            [high, low] => Ok((digit(*high)? * 16 + digit(*low)?) as u8),
            _ => Err(malformed()),
        })
        .collect()
}

/// The suffix of the advisory lock functions for a shared hold (`pg_advisory_lock_shared`).
pub(super) fn shared_suffix(shared: bool) -> &'static str {
    match shared {
        true => "_shared",
        false => "",
    }
}

/// Whether server process `pid` holds the session-level advisory lock `id`, in SQL.
fn holds_sql(id: i64, pid: i32) -> String {
    let bits = id as u64;
    let (high, low) = (bits >> 32, bits & 0xffff_ffff);
    format!(
        "EXISTS (SELECT 1 FROM pg_locks \
         WHERE locktype = 'advisory' AND pid = {pid} AND granted AND objsubid = 1 \
         AND classid::bigint = {high} AND objid::bigint = {low})"
    )
}

/// `duration` in milliseconds, rounded up: a lock wait never ends before the deadline.
pub(super) fn whole_millis(duration: Duration) -> u128 {
    duration.as_micros().div_ceil(1000)
}

/// The token of the prepared wait's row; no row means a transaction pooler.
fn granted_row_token(row: Option<tokio_postgres::Row>) -> Result<Option<u64>, LockError> {
    let row = row.ok_or_else(|| {
        tracing::error!("{}", super::error::SHARED_SESSION);
        PgError::shared_session().into_lock_error()
    })?;
    let token: Option<i64> = row
        .try_get(2)
        .map_err(|error| PgError::new("PostgreSQL answered the lock wait oddly", error))
        .map_err(PgError::into_lock_error)?;
    Ok(token.and_then(|token| u64::try_from(token).ok()))
}
