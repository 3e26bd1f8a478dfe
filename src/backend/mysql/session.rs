//! The backend's own pool of connections: taking one within the wait, round trips
//! bounded by the command timeout, and closing a connection whose state is unknown
//! instead of pooling it.
//!
//! `mysql_async`'s pool is not used: a connection dropped mid-statement goes back to it
//! through a recycler that first reads the pending answer (a `GET_LOCK` that may still
//! be granted) or resets the session, and it has no way to take one connection out and
//! close it. Here a [`Session`] is closed unless it is explicitly given back.
//!
//! Beside the pooled connections, the pool keeps one control connection, opened on
//! first use, for releases and closes alone: [`Pool::interrupt`], the `KILL QUERY` that
//! ends a holder's pending statement when its lock is released, or a dropped session's
//! (a cancelled wait), and [`Pool::holds`], which sees a closed holder's session end.
//! It never holds a lock and never serves one, so releasing moves no lock connection in
//! or out of the pool.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Row};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{timeout, timeout_at, Instant};

use super::error::MyError;
use crate::backend::session::Reached;
use crate::locks::LockError;

/// Connections to one server, at most `max` at once (held, waiting, or idle in the
/// pool).
pub(super) struct Pool {
    opts: Opts,
    idle: Mutex<Vec<Idle>>,
    permits: Arc<Semaphore>,
    max: usize,
    /// The control connection (see the module docs), with when it was last used.
    control: tokio::sync::Mutex<Option<(Conn, Instant)>>,
    /// Whether the server ever accepted a connection (see `session::retry`).
    pub(super) reached: Reached,
}

/// The server's error for a statement ended by `KILL QUERY` (`ER_QUERY_INTERRUPTED`):
/// the session lives on, and the connection is in step with it.
pub(super) const QUERY_INTERRUPTED: u16 = 1317;

/// A pooled connection: when it was given back, and what is known of its session.
struct Idle {
    conn: Conn,
    since: Instant,
    state: SessionState,
}

/// What the backend learned of a server session.
#[derive(Clone, Copy, Debug)]
pub(super) struct SessionState {
    /// `CONNECTION_ID()` as the session first answered it: every later statement on
    /// this connection must be answered by the same session.
    pub(super) id: Option<u64>,
    /// Whether the server's handshake named session `id` too: nothing in between hands
    /// this connection's statements to another session, so `KILL QUERY id` ends this
    /// connection's own statement (see [`Session`]'s drop).
    pub(super) direct: bool,
    /// Whether a round trip of its own found the session still holding a lock after the
    /// granting statement: nothing resets this session between statements.
    pub(super) checked: bool,
}

/// A connection whose session may hold a lock. Dropped, it is closed — the server then
/// ends the session and frees its locks; only [`give_back`](Self::give_back), for a
/// session known to hold nothing, pools it again. A statement still running when it is
/// dropped is interrupted first: a `GET_LOCK` left queued would be granted the lock at
/// its holder's release, and the next holder would wait for this close to free it.
pub(super) struct Session {
    conn: Option<Conn>,
    pub(super) state: SessionState,
    /// Set while a statement is in flight, and left set if it did not end well (cut by
    /// a timeout or a dropped future, or the connection failed; an error answer from
    /// the server ends a statement well): the connection's state is unknown —
    /// an answer may still be on its way and would be read as the next statement's —
    /// so it is never used again nor pooled, only closed.
    unknown: bool,
    pool: Arc<Pool>,
    close_within: Duration,
    /// How the control connection that interrupts a statement on drop is kept and
    /// opened (see [`Pool::interrupt`]).
    max_idle: Duration,
    setup: String,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    pub(super) fn new(opts: Opts, max: usize) -> Self {
        Pool {
            opts,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max)),
            max,
            control: tokio::sync::Mutex::new(None),
            reached: Reached::default(),
        }
    }

    /// The server's address for errors: host and port, never the credentials.
    pub(super) fn address(&self) -> String {
        format!("{}:{}", self.opts.ip_or_hostname(), self.opts.tcp_port())
    }

    pub(super) fn opts(&self) -> &Opts {
        &self.opts
    }

    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// Connections idle in the pool now.
    pub(super) fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A connection, waiting for a free slot at most until `deadline` (then
    /// [`LockError::Timeout`]: the pool is exhausted), plus `command_timeout` to open
    /// a new one. A pooled connection idle for `max_idle` or longer is closed instead
    /// of reused: the server may be about to end it (its `wait_timeout`). A new one
    /// runs `setup` first.
    pub(super) async fn get(
        self: &Arc<Self>,
        deadline: Instant,
        command_timeout: Duration,
        max_idle: Duration,
        setup: String,
    ) -> Result<Session, LockError> {
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => match timeout_at(deadline, self.permits.clone().acquire_owned()).await {
                Ok(Ok(permit)) => permit,
                _ => return Err(LockError::Timeout),
            },
        };
        let pooled = loop {
            let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match idle {
                Some(idle) if idle.since.elapsed() < max_idle => break Some(idle),
                // Too old: the server may end it any moment.
                Some(idle) => close(idle.conn, command_timeout),
                None => break None,
            }
        };
        let (conn, state) = match pooled {
            Some(idle) => (idle.conn, idle.state),
            None => self.connect(command_timeout, &setup).await?,
        };
        Ok(Session {
            conn: Some(conn),
            state,
            unknown: false,
            pool: self.clone(),
            close_within: command_timeout,
            max_idle,
            setup,
            _permit: permit,
        })
    }

    /// A new connection that ran `setup`, within `command_timeout`, and its session as
    /// `CONNECTION_ID()` answers in the same round trip.
    async fn connect(
        &self,
        command_timeout: Duration,
        setup: &str,
    ) -> Result<(Conn, SessionState), MyError> {
        let connect = async {
            let mut conn = Conn::new(self.opts.clone()).await?;
            let mut id = None;
            let mut answer = conn
                .query_iter(format!("{setup}; SELECT CONNECTION_ID()"))
                .await?;
            while !answer.is_empty() {
                let rows: Vec<Row> = answer.collect().await?;
                id = rows.first().and_then(|row| number(row, 0)).or(id);
            }
            drop(answer);
            let id = id.map(|id| id as u64);
            let direct = id == Some(u64::from(conn.id()));
            let state = SessionState {
                id,
                direct,
                checked: false,
            };
            Ok::<_, mysql_async::Error>((conn, state))
        };
        match timeout(command_timeout, connect).await {
            Ok(Ok(connected)) => {
                self.reached.mark();
                Ok(connected)
            }
            Ok(Err(error)) => Err(MyError::new(
                format!("cannot connect to MySQL at {}", self.address()),
                error,
            )),
            Err(_) => Err(MyError::unanswered(format!(
                "MySQL at {} did not accept a connection in time",
                self.address()
            ))),
        }
    }

    /// Ends the statement that session `id` runs now (`KILL QUERY id`) on the control
    /// connection, within `command_timeout` (plus a connect, `setup` first, if the
    /// control connection is missing or was idle `max_idle`). `Ok` once the server
    /// answered: the `KILL QUERY` was carried out, so a statement that session starts
    /// after its current one ends runs uninterrupted (a `KILL QUERY` that finds the
    /// session idle is forgotten at its next statement). `Err` when that is not known.
    /// Only the session the lock was granted to is named: one whose statements are
    /// answered by another session is never interrupted, it is closed.
    pub(super) async fn interrupt(
        &self,
        id: u64,
        command_timeout: Duration,
        max_idle: Duration,
        setup: &str,
    ) -> Result<(), MyError> {
        let kill = format!("KILL QUERY {id}");
        let answer = self.on_control("KILL QUERY", &kill, command_timeout, max_idle, setup);
        answer.await.map(|_| ())
    }

    /// Whether session `id` still holds the lock named by the SQL literal `name`, asked
    /// on the control connection (as [`interrupt`](Self::interrupt)).
    pub(super) async fn holds(
        &self,
        id: u64,
        name: &str,
        command_timeout: Duration,
        max_idle: Duration,
        setup: &str,
    ) -> Result<bool, MyError> {
        let ask = format!("SELECT IS_USED_LOCK({name}) <=> {id}");
        let answer = self.on_control("IS_USED_LOCK", &ask, command_timeout, max_idle, setup);
        let row = answer.await?;
        Ok(row.as_ref().and_then(|row| number(row, 0)) == Some(1))
    }

    /// Runs `sql` (`what`, for errors) on the control connection within
    /// `command_timeout` (plus a connect, `setup` first, if it is missing or was idle
    /// `max_idle`); its first row.
    async fn on_control(
        &self,
        what: &'static str,
        sql: &str,
        command_timeout: Duration,
        max_idle: Duration,
        setup: &str,
    ) -> Result<Option<Row>, MyError> {
        // One statement at a time on the control connection: releases take turns.
        let mut control = match timeout(command_timeout, self.control.lock()).await {
            Ok(control) => control,
            Err(_) => return Err(MyError::message("the control connection stayed busy")),
        };
        let mut conn = match control.take() {
            Some((conn, since)) if since.elapsed() < max_idle => conn,
            Some((conn, _)) => {
                close(conn, command_timeout);
                self.connect(command_timeout, setup).await?.0
            }
            None => self.connect(command_timeout, setup).await?.0,
        };
        match timeout(command_timeout, conn.query_first::<Row, _>(sql)).await {
            Ok(Ok(row)) => {
                *control = Some((conn, Instant::now()));
                Ok(row)
            }
            // An error answer (1094: no such session, it ended) leaves the connection
            // in step: kept.
            Ok(Err(error @ mysql_async::Error::Server(_))) => {
                *control = Some((conn, Instant::now()));
                Err(MyError::new(format!("{what} failed"), error))
            }
            Ok(Err(error)) => {
                close(conn, command_timeout);
                Err(MyError::new(format!("{what} failed"), error))
            }
            Err(_) => {
                close(conn, command_timeout);
                Err(MyError::message(format!("{what} was not answered in time")))
            }
        }
    }
}

impl Session {
    /// Returns the connection to the pool: only for a session known to hold no lock.
    /// One whose last statement did not end well is closed instead.
    pub(super) fn give_back(mut self) {
        if self.unknown {
            return;
        }
        if let Some(conn) = self.conn.take() {
            let idle = Idle {
                conn,
                since: Instant::now(),
                state: self.state,
            };
            self.pool
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(idle);
        }
    }

    /// Runs `sql` (text protocol; several statements allowed) within `limit` and
    /// returns the rows of every result set, in order. Fails at once on a connection
    /// whose earlier statement did not end well.
    pub(super) async fn rows(&mut self, sql: &str, limit: Duration) -> Result<Vec<Row>, MyError> {
        if self.unknown {
            return Err(MyError::message(
                "the connection is in an unknown state (a statement was cut short)",
            ));
        }
        // Cleared only when the answer was read in full: a cut or a failure leaves it.
        self.unknown = true;
        let conn = self.conn.as_mut().expect("a session until dropped");
        let query = async {
            let mut result = conn.query_iter(sql).await?;
            let mut rows = Vec::new();
            while !result.is_empty() {
                rows.extend(result.collect::<Row>().await?);
            }
            Ok::<_, mysql_async::Error>(rows)
        };
        match timeout(limit, query).await {
            Ok(Ok(rows)) => {
                self.unknown = false;
                Ok(rows)
            }
            // An error answer ends the statement (and any that followed it in `sql`):
            // the connection is in step with its session.
            Ok(Err(error @ mysql_async::Error::Server(_))) => {
                self.unknown = false;
                Err(MyError::new("MySQL statement failed", error))
            }
            Ok(Err(error)) => Err(MyError::new("MySQL statement failed", error)),
            Err(_) => Err(MyError::unanswered("MySQL did not answer in time")),
        }
    }

    /// Whether `id` is the session this connection has always talked to; learns it on
    /// the first answer.
    pub(super) fn same_session(&mut self, id: u64) -> bool {
        *self.state.id.get_or_insert(id) == id
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        // Only a session known to be this connection's own is named.
        let running = match self.unknown && self.state.direct {
            true => self.state.id,
            false => None,
        };
        match (running, tokio::runtime::Handle::try_current()) {
            (Some(id), Ok(runtime)) => {
                let pool = self.pool.clone();
                let (within, max_idle) = (self.close_within, self.max_idle);
                let setup = std::mem::take(&mut self.setup);
                runtime.spawn(async move {
                    let _ = pool.interrupt(id, within, max_idle, &setup).await;
                    let _ = timeout(within, conn.disconnect()).await;
                });
            }
            _ => close(conn, self.close_within),
        }
    }
}

/// Closes `conn` without pooling it: `COM_QUIT` once any pending answer is read, within
/// `limit`; past it (a silent path) the socket is simply dropped. Either way the server
/// ends the session and frees its locks. Without a runtime the socket is dropped at
/// once.
fn close(conn: Conn, limit: Duration) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                let _ = timeout(limit, conn.disconnect()).await;
            });
        }
        Err(_) => drop(conn),
    }
}

/// Column `index` of `row` as a number; `None` for NULL or anything else.
pub(super) fn number(row: &Row, index: usize) -> Option<i64> {
    row.get_opt::<Option<i64>, usize>(index)
        .and_then(Result::ok)
        .flatten()
}
