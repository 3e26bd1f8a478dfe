//! The check that a server session belongs to its client connection alone, which
//! session locks need: once per backend with [`LockScope::Session`](super::LockScope),
//! when it is built or on its first acquisition. A transaction or statement pooler
//! (PgBouncer `pool_mode=transaction` or `statement`) fails it every time.
//!
//! # The probe
//!
//! On a fresh connection, one statement reads the server process id, sets a session
//! marker (a random value) and sets `idle_session_timeout` to an idle limit `T` (20 ms
//! at first): PostgreSQL ends that session once it sits idle that long. The client then
//! sends nothing and watches its connection:
//!
//! - **Its own session** (a direct connection, PgBouncer `pool_mode=session`): the
//!   server session is tied to the client connection until the client leaves, so when
//!   PostgreSQL ends it the client connection closes too (PgBouncer closes the client
//!   of a server connection that died while linked). Closed while idle: accepted.
//! - **A transaction or statement pooler**: the statement's end released the server
//!   session to the pool; the client connection is tied to nothing. When PostgreSQL
//!   ends the session, the pooler drops that server connection and the client's
//!   connection stays open (PgBouncer logs "got packet 'E' from server when not
//!   linked"). A pooler that resets sessions after each transaction
//!   (`server_reset_query_always`) clears the marker and the limit with `DISCARD ALL`
//!   instead, and the session lives on. Either way the connection is not closed, so it
//!   is not accepted; and its next statement runs on a session without this probe's
//!   marker — another one, a new one (even if the operating system gave it the same
//!   pid), or one reset — which refuses it. The pool's size does not matter: the
//!   client's own next statement is what lands elsewhere.
//!
//! Why "not closed" holds for a pooler, by causality rather than timing: PgBouncer lets
//! go of the server session when it has passed the statement's end (`ReadyForQuery`) on
//! to the client, before the client can receive it; PostgreSQL can end the session no
//! earlier than `T` after it went idle, which is after the statement was sent. So when
//! the client receives the answer within `T` of sending the statement, the pooler had
//! let go before the session could end, and the end cannot close the client. A round
//! trip slower than `T` proves nothing (a stalled pooler could read the answer and the
//! end together, and close the client as if linked): the probe starts again on a fresh
//! connection with a longer limit. Every later statement of the probe is held to the
//! same bound.
//!
//! When neither happens within a grace (a loaded server ends the session late, or the
//! pooler's other clients keep that session busy so it is never idle), the probe asks
//! again: the next statement found the session still there with its marker, and a
//! second connection looks for the marker too — seeing it means sharing, refused; the
//! grace doubles, up to four command timeouts in all. A statement that met the
//! session's end says nothing either way: the probe starts again on a fresh
//! connection. Still undecided at the end, the setup is refused as unconfirmed (not
//! kept: the next acquisition tries again).
//!
//! Costs: one connection opened and ended by the server per backend (behind a
//! transaction pooler, one of the pooler's server connections, which it opens again),
//! two round trips, and the wait for the close (`T` and a millisecond or two on a
//! direct connection). PostgreSQL before 14 has no `idle_session_timeout`: the probe is
//! skipped with a warning, and only the checks made while acquiring and holding
//! guard against a pooler.

use std::time::Duration;

use tokio::time::Instant;

use super::error::PgError;
use super::session::{last_row, Session};
use super::Inner;
use crate::backend::backoff::random;
use crate::backend::SetupError;

/// The session setting that names the probe (a random value), so its next statement
/// can tell whether it runs on the same server session.
const PROBE_MARKER: &str = "tower_keyed_lock.probe";

/// The first idle limit of a probed session; raised when a round trip takes longer.
const FIRST_IDLE_LIMIT: Duration = Duration::from_millis(20);

/// Fresh connections a probe may start on before it gives up undecided.
const PROBE_STARTS: usize = 8;

/// How often the probed connection is looked at (no round trip) while it waits.
const LOOK_PERIOD: Duration = Duration::from_millis(1);

/// What the probe found, kept for the backend's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sessions {
    /// Each session belongs to its client connection.
    Own,
    /// Shared with other clients, or reset between transactions: a transaction pooler.
    Shared,
    /// Not checked: the server has no `idle_session_timeout` (before PostgreSQL 14).
    Unchecked,
}

/// What one probe on one connection found.
enum Probed {
    Found(Sessions),
    /// A statement met the session's end: try a fresh connection.
    Inconclusive,
    /// A round trip on the probed session took this long, more than its idle limit:
    /// try a fresh connection with a longer one.
    Slow(Duration),
}

/// Why session locks are refused behind a transaction pooler.
fn shared_sessions() -> SetupError {
    SetupError::Unsafe(
        "session locks need a PostgreSQL session of their own, and these sessions are shared \
         with other clients or reset between transactions (a session PostgreSQL ended left \
         its client connection open, and the client's next statement ran on another \
         session): a transaction or statement pooler is in between, such as PgBouncer in \
         pool_mode=transaction or pool_mode=statement. Use LockScope::Transaction \
         (PostgresBackendBuilder::lock_scope), or session pooling (pool_mode=session), or a direct \
         connection"
            .to_owned(),
    )
}

/// Why session locks are refused when the probe could not tell.
fn unconfirmed(limit: Duration) -> SetupError {
    SetupError::Unsafe(format!(
        "could not confirm within {limit:?} that PostgreSQL sessions belong to their client \
         connections (a session PostgreSQL ended did not close its connection, and the \
         session kept answering): if a transaction pooler is in between, such as PgBouncer \
         in pool_mode=transaction, use LockScope::Transaction or session pooling \
         (pool_mode=session); else the server is slow, and the next acquisition checks \
         again"
    ))
}

impl Inner {
    /// Refuses session locks when sessions are not the client's own; probes once per
    /// backend (again after an error or an undecided probe).
    pub(super) async fn check_own_sessions(&self) -> Result<(), SetupError> {
        let found = match self.sessions.get() {
            Some(found) => found,
            // Boxed: the probe's future is not carried by every acquisition's.
            None => Box::pin(self.sessions.get_or_try_init(|| self.probe_sessions())).await?,
        };
        match found {
            Sessions::Shared => Err(shared_sessions()),
            Sessions::Own | Sessions::Unchecked => Ok(()),
        }
    }

    async fn probe_sessions(&self) -> Result<Sessions, SetupError> {
        let limit = 4 * self.settings.timing.command_timeout;
        let deadline = Instant::now() + limit;
        let mut idle_limit = FIRST_IDLE_LIMIT.min(self.settings.timing.command_timeout);
        for _ in 0..PROBE_STARTS {
            if Instant::now() >= deadline {
                break;
            }
            match self.probe(deadline, idle_limit).await? {
                Probed::Found(Sessions::Shared) => {
                    tracing::error!("{}", shared_sessions());
                    return Ok(Sessions::Shared);
                }
                Probed::Found(Sessions::Unchecked) => {
                    tracing::warn!(
                        "PostgreSQL has no idle_session_timeout (before 14): not checked \
                         whether a transaction pooler is in between; session locks need a \
                         direct connection or session pooling"
                    );
                    return Ok(Sessions::Unchecked);
                }
                Probed::Found(found) => return Ok(found),
                Probed::Inconclusive => {}
                Probed::Slow(round_trip) => {
                    idle_limit = (2 * idle_limit).max(2 * round_trip);
                    if idle_limit > limit {
                        break;
                    }
                }
            }
        }
        Err(unconfirmed(limit))
    }

    /// One probe on a fresh connection, whose session PostgreSQL ends once idle for
    /// `idle_limit` (see the module docs), until `deadline`.
    async fn probe(&self, deadline: Instant, idle_limit: Duration) -> Result<Probed, SetupError> {
        let marker = format!("{:016x}", random());
        let session = self
            .session(deadline)
            .await
            .map_err(|error| self.setup_failed_with(error))?;
        let first = format!(
            "SELECT pg_backend_pid(), set_config('{PROBE_MARKER}', '{marker}', false), \
                    CASE WHEN current_setting('idle_session_timeout', true) IS NOT NULL \
                         THEN set_config('idle_session_timeout', '{}ms', false) END",
            idle_limit.as_millis().max(1)
        );
        let sent = Instant::now();
        let answer = match self.round_trip(session.simple_query(&first)).await {
            Ok(answer) => answer,
            // PostgreSQL refused the statement: say why. Not a FATAL answer: that
            // ended the session (one a transaction pooler handed over after an earlier
            // probe's idle limit ended it), and says nothing of this setup.
            Err(error) if error.code.is_some() && !error.closed && !session.is_closed() => {
                return Err(self.setup_failed(error))
            }
            // A pooled connection whose session had ended, one the pooler closed as it
            // linked it to a session that ended, or no answer in time (the dropped
            // session is closed): nothing learned.
            Err(_) => return Ok(Probed::Inconclusive),
        };
        if let Some(slow) = slower_than(sent, idle_limit) {
            return Ok(Probed::Slow(slow));
        }
        let row =
            last_row(&answer).ok_or_else(|| self.setup_failed(PgError::message(ODD_ANSWER)))?;
        let pid = row
            .get(0)
            .ok_or_else(|| self.setup_failed(PgError::message(ODD_ANSWER)))?
            .to_owned();
        if row.get(2).is_none() {
            session.give_back();
            return Ok(Probed::Found(Sessions::Unchecked));
        }
        let again = format!("SELECT pg_backend_pid(), current_setting('{PROBE_MARKER}', true)");
        let look = format!("SELECT current_setting('{PROBE_MARKER}', true)");
        let mut other: Option<Session> = None;
        let mut grace = 2 * idle_limit;
        loop {
            if closed_within(&session, grace, deadline).await {
                return Ok(Probed::Found(Sessions::Own));
            }
            if Instant::now() >= deadline {
                return Ok(Probed::Inconclusive);
            }
            let sent = Instant::now();
            let answer = match self.round_trip(session.simple_query(&again)).await {
                Ok(answer) => answer,
                // The session ended as the statement went (or the statement waited
                // for a busy pooler): nothing learned on this connection.
                Err(_) => return Ok(Probed::Inconclusive),
            };
            let row =
                last_row(&answer).ok_or_else(|| self.setup_failed(PgError::message(ODD_ANSWER)))?;
            if row.get(0) != Some(pid.as_str()) || row.get(1) != Some(marker.as_str()) {
                return Ok(Probed::Found(Sessions::Shared));
            }
            // The same session answered, too slowly to rule out that a pooler saw it
            // end before it let go of this connection.
            if let Some(slow) = slower_than(sent, idle_limit) {
                return Ok(Probed::Slow(slow));
            }
            // Still the same session, with the marker: does another client see it?
            if other.is_none() {
                // Not past a command timeout: a pool of one has no second connection.
                let until = (Instant::now() + self.settings.timing.command_timeout).min(deadline);
                other = self.session(until).await.ok();
            }
            if let Some(looking) = &other {
                match self.round_trip(looking.simple_query(&look)).await {
                    Ok(answer) if last_row(&answer).and_then(|row| row.get(0)) == Some(&marker) => {
                        return Ok(Probed::Found(Sessions::Shared));
                    }
                    Ok(_) => {}
                    // Waiting for a server connection (a full session pool), or failed:
                    // closed, and nothing learned.
                    Err(_) => other = None,
                }
            }
            grace = (grace * 2).min(self.settings.timing.command_timeout);
        }
    }
}

/// How long the round trip sent at `sent` took, if longer than `idle_limit`.
fn slower_than(sent: Instant, idle_limit: Duration) -> Option<Duration> {
    let took = sent.elapsed();
    (took > idle_limit).then_some(took)
}

/// Whether `session`'s connection closes within `grace` (or by `deadline`).
async fn closed_within(session: &Session, grace: Duration, deadline: Instant) -> bool {
    let until = (Instant::now() + grace).min(deadline);
    loop {
        if session.is_closed() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(LOOK_PERIOD).await;
    }
}

/// What a session check that made no sense of PostgreSQL's answer says.
const ODD_ANSWER: &str = "PostgreSQL answered the session check oddly";
