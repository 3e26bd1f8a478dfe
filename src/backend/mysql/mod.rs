//! MySQL / MariaDB backend: serializes a key across every instance that shares one
//! server, with named locks (`GET_LOCK`).
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_keyed_lock::backend::mysql::MySqlBackend;
//! use tower_keyed_lock::DistributedLocks;
//!
//! # async fn setup() -> Result<(), tower_keyed_lock::backend::SetupError> {
//! let backend = MySqlBackend::builder_from_url("mysql://app@db.internal/app")?
//!     .max_connections(32) // keys held (or waited for) at once by this instance
//!     .fencing(true)
//!     .build() // connects, and checks the server
//!     .await?;
//! let jobs = DistributedLocks::new("jobs", backend);
//! # let _ = jobs;
//! # Ok(())
//! # }
//! # async fn run(jobs: DistributedLocks) -> Result<(), tower_keyed_lock::LockError> {
//! let guard = jobs.lock_timeout("nightly-report", Duration::from_secs(2)).await?;
//! // ... write with guard.fencing_token() ...
//! guard.release().await;
//! # Ok(())
//! # }
//! ```
//!
//! In front of axum handlers, give it to the layer:
//!
//! ```
//! # #[cfg(feature = "axum")]
//! # {
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::backend::mysql::MySqlBackend;
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! let backend = MySqlBackend::builder_from_url("mysql://app@db.internal/app")
//!     .unwrap()
//!     .build_lazy(); // connects on first use
//! let app: Router = Router::new()
//!     .route("/orders/{order_id}/pay", post(|| async { "paid" }))
//!     .layer(
//!         KeyedLockLayer::by_path("order_id")
//!             .name("orders") // part of the lock name: give every layer its own name
//!             .wait_timeout(Duration::from_secs(2))
//!             .backend(backend),
//!     );
//! # }
//! ```
//!
//! # Key mapping
//!
//! A key becomes the lock name `<prefix>:<layer name>:<key>`
//! ([`prefix`](MySqlBackendBuilder::prefix), default [`DEFAULT_PREFIX`]); a name
//! longer than [`MAX_LOCK_NAME_LEN`] (64) bytes — MySQL's limit — becomes
//! `<prefix>#` and the first hex digits of a SHA-256 digest of the three parts, 64
//! characters in all: the same on every build and machine ([`lock_name`] has the
//! exact rule). The name is sent as a hex literal of its UTF-8 bytes, so no key needs
//! escaping, and another program takes the same lock with
//! `GET_LOCK('<the same name>', …)`. Names are compared byte for byte (`Abc` and `abc`
//! are two locks). Two keys share a hashed name only by a collision of 156 bits or
//! more of SHA-256. In Python:
//!
//! ```python
//! import hashlib, struct
//! def lock_name(prefix, name, key):
//!     plain = f"{prefix}:{name}:{key}"
//!     if len(plain.encode()) <= 64:
//!         return plain
//!     parts = [s.encode() for s in (prefix, name, key)]
//!     message = b"".join(struct.pack(">I", len(p)) + p for p in parts)
//!     hashed = prefix + "#" + hashlib.sha256(message).hexdigest()
//!     return hashed[:64]
//! ```
//!
//! # How a key is locked
//!
//! Requests first queue on the layer's in-process table; only the local winner comes
//! here. It takes a connection from the backend's own pool and runs, in one round trip,
//! `SELECT CONNECTION_ID(), GET_LOCK(name, <remaining wait>)`: it waits *inside the
//! server*, which grants the lock to the next waiter when it is released — nobody
//! polls. The wait is the request's remaining wait, in microseconds on MariaDB, so a
//! busy key answers `0` when the wait is over ([`LockError::Timeout`]) and the
//! connection goes back to the pool clean. MySQL takes the timeout in whole seconds:
//! there the backend asks for the whole seconds left, and polls the last fraction
//! (`GET_LOCK(name, 0)` every 25 ms) rather than wait past the deadline. A session that already holds the name (`IS_USED_LOCK`)
//! would be granted it again (`GET_LOCK` is re-entrant): the backend refuses it
//! instead (see [proxies](self#proxies)).
//!
//! A grant counts only from a round trip answered within the
//! [`command_timeout`](MySqlBackendBuilder::command_timeout): the server's idle limit runs
//! from the moment it grants, which a late answer does not date. A `GET_LOCK` that
//! waited answers later than that, so one more round trip confirms the grant
//! (`IS_USED_LOCK(name) = CONNECTION_ID()`); if it does not answer in time, the grant
//! is given back (the connection is closed) and the acquisition tries again (below).
//! The first grant on each connection is confirmed the same way. With
//! [fencing](self#fencing-tokens), the round trip that takes the token is that
//! confirmation.
//!
//! Only the wait bounds the waiting: once the server accepted a connection of the
//! backend, an attempt that fails in passing — a dead pooled connection, a connect or a
//! statement left unanswered, a broken connection, a server shutting down, a session
//! killed, too many connections — closes its connection and tries again on a fresh one
//! after a jittered pause (10 ms, doubling to 500 ms), until the wait ends; then it
//! fails with the last such error ([`LockError::Backend`], 503). A server that never
//! accepted a connection is told at once (503).
//!
//! While the lock is held, its connection always has a statement pending (see
//! [Timing](self#timing)). Release first ends it: `KILL QUERY <connection id>` on
//! the backend's control connection (one connection beside the pool, used for releases
//! only), then waits for both the statement's end and the `KILL QUERY`'s answer — so
//! the kill cannot land on what follows (a `KILL QUERY` that finds the session idle
//! is forgotten when its next statement starts). Then it runs `RELEASE_LOCK(name)` on
//! the same connection and checks its answer: `1` from the same session returns the
//! connection to the pool; anything else (the lock was not held, another session
//! answered, an error or a timeout) closes it. The server frees a closed session's
//! locks a moment after the close, so a release that closed a session which may still
//! hold the lock returns once the control connection no longer sees it held (at most
//! a command timeout later): another instance can then take the key at once. If the
//! `KILL QUERY` cannot be sent, the statement ends by itself within one liveness
//! interval. A connection whose state is unknown — a timeout or broken connection
//! while acquiring or releasing, a task dropped mid-statement — is never pooled nor
//! used again (its next answer may be the cut statement's): it is closed, and the
//! server frees every lock of a session that ends. Its statement is ended first with a
//! `KILL QUERY` on the control connection, so a cancelled wait leaves the server's
//! queue at once rather than when the server notices the close (about a second on
//! MariaDB), and is never granted the key first. (An error answer from the server
//! ends a statement cleanly.) The backend keeps its own pool for that: `mysql_async`'s
//! pool would read a dropped statement's pending answer (a `GET_LOCK` that may still
//! be granted) and return the connection.
//!
//! [`release_checked`](crate::DistributedGuard::release_checked) reports a lock that
//! was already gone: the session ended or was found not holding it before the
//! release, or `RELEASE_LOCK` answered that this session did not hold it.
//!
//! # Timing
//!
//! The holder keeps one statement pending on its session until release:
//! `SELECT SLEEP(<s>), CONNECTION_ID(), IS_USED_LOCK(name) <=> CONNECTION_ID()`, sent
//! again as soon as it answers. While it runs, the driver is reading its answer, so
//! the session's end — `KILL`, a connection reset, a server restart or crash — fails
//! it the moment the server shuts the connection: the holder is told at once (the
//! server fails the statement before it frees the lock; see `RELIABILITY.md`), not at
//! its next check. Each answer is also the liveness check, every
//! [`liveness_interval`](MySqlBackendBuilder::liveness_interval) (default
//! [`DEFAULT_LIVENESS_INTERVAL`], 1 s): the sleep `<s>` lasts until the next check is
//! due. A statement that fails, does not answer within one command timeout (default
//! [`DEFAULT_COMMAND_TIMEOUT`], 2 s) of that, is answered by another session or finds
//! the lock gone raises the lease-lost signal of [`LockInfo`](crate::LockInfo); the
//! layer counts it in `keyed_lock_lease_lost_total`, and
//! [`abort_on_lease_lost`](crate::KeyedLockLayer::abort_on_lease_lost) turns it into
//! 503. "Lost" is a fact of the clock: the lease's deadline is the end of the last
//! answered sleep (or the sending of the round trip that confirmed the grant) plus one
//! interval plus one command timeout, and
//! [`LeaseSignal::is_lost`](crate::LeaseSignal::is_lost) reads it even when no task
//! ran.
//!
//! A network that goes silent frees nothing by itself: the server does not know the
//! holder is gone. So every session the backend opens sets `wait_timeout`,
//! `net_read_timeout` and `net_write_timeout` to one liveness interval plus two
//! command timeouts, rounded up to whole seconds (the settings' unit): 5 s with the
//! defaults. A live holder is never idle that long (its pending statement keeps the
//! session busy); a holder cut off is told at most one interval plus one network
//! timeout after the end of its last answered sleep, at least one command timeout
//! *before* the server, counting that limit from the same end or later, ends the
//! session and frees the lock (measured: see `RELIABILITY.md`). The limit stays on
//! pooled connections too, so a partition strands no session; the pool closes a
//! connection idle for that limit less a command timeout rather than reuse it.
//!
//! A holder process that dies without closing its connection (a crash) is freed when
//! its pending sleep ends: the server notices the closed connection only when it
//! answers, at most one liveness interval later.
//!
//! An acquisition takes at most its wait plus one command timeout in all; a release
//! two round trips after the interrupt (at most one command timeout each), or, when
//! the interrupt cannot be sent, the rest of the pending sleep plus one round trip.
//!
//! # Fencing tokens
//!
//! With [`fencing(true)`](MySqlBackendBuilder::fencing), the holder takes a token right after
//! the grant, in the same session:
//! `INSERT INTO <table> (id, token) VALUES (1, LAST_INSERT_ID(1)) ON DUPLICATE KEY
//! UPDATE token = LAST_INSERT_ID(token + 1)`, one counter row in an InnoDB table
//! ([`fencing_table`](MySqlBackendBuilder::fencing_table), default
//! [`DEFAULT_FENCING_TABLE`]), committed by that statement (the backend's sessions run
//! with `autocommit = 1`). The next holder of a key is granted only after this one
//! released, so its increment comes later: the tokens of a key strictly increase from
//! holder to holder, and a committed increment survives a restart. The backend creates
//! the table on first use if it is missing (it looks first, so nothing warns when it
//! exists, and `CREATE TABLE IF NOT EXISTS` is serialized by the server's metadata
//! lock, so instances that start together do not collide), and refuses a table in an
//! engine that can forget its counter (anything but InnoDB) and a server with
//! `innodb_flush_log_at_trx_commit = 0` (a crash loses the last second of increments):
//! every acquisition fails with a [`LockError::Backend`] saying what to change.
//!
//! # Proxies
//!
//! A `GET_LOCK` lives in a server session, so it needs a direct connection, or a proxy
//! that pins one server session to each client connection. A proxy that multiplexes
//! sessions would hand the session — and its lock — to another client. The backend
//! refuses such a setup: every statement it sends also asks `CONNECTION_ID()`, and a
//! connection answered by two sessions, a session found already holding the name
//! before `GET_LOCK`, or a lock gone right after its grant fails the acquisition with
//! a [`LockError::Backend`] that names the cause, or raises the lost-lease signal of a
//! holder. A Galera node (`wsrep_on = ON`) is refused too: `GET_LOCK` is local to one
//! node.
//!
//! # Who holds a key
//!
//! [`holder`](LockBackend::holder) asks `IS_USED_LOCK(<name>)` (one round trip): it
//! tells whether the key is held, and by which server connection, but a named lock
//! carries no data, and no other session can read a holder's session variables. So
//! this backend answers held or free only: `instance`, `since`, `fencing_token` and
//! `lease_left` are `None`. Recording the holder would take a write of its own per
//! grant into a table (not atomic with `GET_LOCK`, which is not transactional), which
//! this backend does not do.
//!
//! # Pool size
//!
//! **Each key held, or waited for in the server, by this instance pins one
//! connection** until it is released. Size the pool
//! ([`max_connections`](MySqlBackendBuilder::max_connections), default
//! [`DEFAULT_MAX_CONNECTIONS`]) for the keys you expect to hold at once per instance;
//! the in-process tier already makes every key cost at most one connection per
//! instance. Releases also use one control connection per backend, opened on the
//! first release, beside the pool. When the pool is exhausted, a request waits for a connection within its
//! wait and then gets the timeout response (409). Mind the server's `max_connections`.
//!
//! # What it does not guarantee
//!
//! - **The signal is not a guard.** When the session ends on the server's side
//!   (`KILL`, a server restart, a connection reset), the holder is told as its
//!   connection closes and a waiting instance is granted as the lock is freed: the
//!   holder hears first in practice (by 1 to 5 ms on a quiet machine, measured on
//!   MariaDB; on a loaded one it can hear a scheduling delay after the grant), but work
//!   already under way does not stop by itself. For work that must never overlap,
//!   write the [fencing token](self#fencing-tokens) with it and let the store reject
//!   older tokens.
//! - **Replication and failover.** `GET_LOCK` lives on one server and is not
//!   replicated: instances pointed at two servers (a primary and a replica, two nodes)
//!   do not exclude each other, and after a failover to a replica that lagged, the
//!   fencing counter can go backwards. Point every instance at the same primary.
//! - **Fencing without durability.** With `innodb_flush_log_at_trx_commit = 2`, an
//!   operating-system crash (not a server crash) can lose the last second of counter
//!   increments. Dropping or truncating the counter table starts the tokens again
//!   from 1: don't, or set the row past the highest token written (`UPDATE <table>
//!   SET token = <n> WHERE id = 1`).
//! - **Fairness.** The server wakes waiters of a name in no promised order.

// The client is `mysql_async`: maintained, tokio-native, light with `minimal-rust`
// (no TLS, no proc macros), and its `Conn` can be owned outside any pool, which the
// cancel safety needs (see `session`). sqlx's MySQL driver would do too (its pool can
// `detach` a connection), but its current release needs Rust 1.94 and brings sqlx-core's
// machinery for one statement shape.
//
// One concern per file: `lock_name` is the stable name of a key, `session` the pool of
// connections that closes those in an unknown state, `acquire` runs `GET_LOCK` and the
// round trip after the grant, `server` the first-use checks and the fencing table,
// `lease` is this engine's side of a held lock (the pending statement that checks it, its
// interrupt and `RELEASE_LOCK`; the holding task, the lease's deadline and the release
// are the session-lock core's, in `backend/session`), `holder` tells whether a key is
// held, and `error` is the backend's error. This file has the public type and its
// configuration.
// `session` also keeps the control connection that interrupts a holder's pending
// statement on release.
mod acquire;
mod deployment;
mod error;
mod holder;
mod lease;
mod lock_name;
mod server;
mod session;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use mysql_async::Opts;
use tokio::sync::OnceCell;
use tokio::time::Instant;

pub use self::lock_name::{lock_name, MAX_LOCK_NAME_LEN};

use self::error::MyError;
use self::lock_name::MAX_PREFIX_LEN;
use self::session::Pool;
use super::session::{self as session_core, Builder as _, Draft, Settings};
use super::SetupError;
use super::{Acquisition, BoxFuture, Holder, LockBackend};
use crate::error::LockError;
use crate::key::Key;

/// The default [`MySqlBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "tkl";
/// The default [`MySqlBackendBuilder::liveness_interval`].
pub const DEFAULT_LIVENESS_INTERVAL: Duration = session_core::DEFAULT_LIVENESS_INTERVAL;
/// The default [`MySqlBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = session_core::DEFAULT_COMMAND_TIMEOUT;
/// The default [`MySqlBackendBuilder::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// The default [`MySqlBackendBuilder::fencing_table`].
pub const DEFAULT_FENCING_TABLE: &str = "tower_keyed_lock_fencing";

/// A [`LockBackend`] on MySQL / MariaDB named locks. See the [module docs](self).
///
/// Cheap to clone; clones share the pool.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::mysql::MySqlBackend;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = MySqlBackend::builder_from_url("mysql://app:secret@db.internal:3306/app")?
///     .max_connections(32)                            // default 16
///     .prefix("billing")                              // default "tkl"
///     .liveness_interval(Duration::from_millis(500))  // default 1 s
///     .command_timeout(Duration::from_secs(1))        // default 2 s
///     .fencing(true)                                  // default off
///     .build()
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MySqlBackend {
    inner: Arc<Inner>,
}

/// Configures a [`MySqlBackend`]; made by [`MySqlBackend::builder`].
#[derive(Clone)]
#[must_use]
pub struct MySqlBackendBuilder {
    /// The backend's state, and the first setting refused, which [`build`](Self::build)
    /// returns.
    draft: Draft<Inner>,
}

#[derive(Clone)]
struct Inner {
    pool: Arc<Pool>,
    /// The prefix and the timing (see `backend/session`).
    settings: Settings,
    /// Kept while fencing is off, so turning it back on keeps the name.
    table: Arc<str>,
    fencing: Option<Fencing>,
    /// Set once the first-use checks passed; shared by clones with the same settings.
    checked: Arc<OnceCell<server::Server>>,
    /// The locks held, each with its holding task from the grant (the statement it
    /// keeps pending shows the session's end).
    holds: session_core::Holds<Inner>,
}

#[derive(Clone)]
struct Fencing {
    table: Arc<str>,
}

impl Fencing {
    /// Increments the counter; `LAST_INSERT_ID()` is then the token, in this session.
    fn increment_sql(&self) -> String {
        format!(
            "INSERT INTO {} (id, token) VALUES (1, LAST_INSERT_ID(1)) \
             ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)",
            self.table
        )
    }
}

impl MySqlBackend {
    /// Starts configuring a backend with a pool of its own
    /// ([`DEFAULT_MAX_CONNECTIONS`] connections) to the server `opts` describe. The
    /// pool settings of `opts` are not used: the backend pools its connections itself
    /// (see [How a key is locked](self#how-a-key-is-locked)).
    ///
    /// ```
    /// use mysql_async::OptsBuilder;
    /// use tower_keyed_lock::backend::mysql::MySqlBackend;
    ///
    /// let opts = OptsBuilder::default()
    ///     .ip_or_hostname("db.internal")
    ///     .user(Some("app"))
    ///     .db_name(Some("app"));
    /// let builder = MySqlBackend::builder(opts);
    /// ```
    pub fn builder(opts: impl Into<Opts>) -> MySqlBackendBuilder {
        MySqlBackendBuilder {
            draft: Draft::new(Inner {
                pool: Arc::new(Pool::new(opts.into(), DEFAULT_MAX_CONNECTIONS)),
                settings: Settings::new(DEFAULT_PREFIX),
                table: DEFAULT_FENCING_TABLE.into(),
                fencing: None,
                checked: Arc::default(),
                holds: session_core::Holds::new(None),
            }),
        }
    }

    /// [`builder`](Self::builder) with a `mysql://user:password@host:port/database`
    /// URL. Fails only if the URL does not parse ([`SetupError::Invalid`]).
    pub fn builder_from_url(url: &str) -> Result<MySqlBackendBuilder, SetupError> {
        let opts = Opts::from_url(url)
            .map_err(|error| SetupError::Invalid(format!("the MySQL URL: {error}")))?;
        Ok(Self::builder(opts))
    }

    /// A backend with the default settings on the server at `url`; see
    /// [`MySqlBackendBuilder::build`].
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder_from_url(url)?.build().await
    }

    /// The lock name of `key` under the layer `name` with this backend's prefix.
    ///
    /// ```
    /// use tower_keyed_lock::backend::mysql::{lock_name, MySqlBackend};
    ///
    /// let backend = MySqlBackend::builder_from_url("mysql://localhost/app")
    ///     .unwrap()
    ///     .prefix("billing")
    ///     .build_lazy();
    /// assert_eq!(backend.lock_name("orders", "42"), "billing:orders:42");
    /// assert_eq!(backend.lock_name("orders", "42"), lock_name("billing", "orders", "42"));
    /// ```
    pub fn lock_name(&self, name: &str, key: &str) -> String {
        lock_name(&self.inner.settings.prefix, name, key)
    }
}

impl MySqlBackendBuilder {
    /// Connects and checks the server: that `GET_LOCK` is shared by every client of it
    /// (see [Proxies](self#proxies)), and, with fencing, the counter table; within one
    /// command timeout per step.
    pub async fn build(self) -> Result<MySqlBackend, SetupError> {
        let backend = MySqlBackend {
            inner: self.draft.finish()?,
        };
        let inner = &backend.inner;
        let deadline = Instant::now() + 4 * inner.settings.timing.command_timeout;
        inner.prepare(deadline).await.map_err(|error| {
            let server = inner.pool.address();
            match error {
                LockError::Backend(cause) => SetupError::failed("MySQL", server, cause),
                other => SetupError::failed("MySQL", server, other),
            }
        })?;
        Ok(backend)
    }

    /// The backend, connecting on first use: for a service that must start while the
    /// server is down. The checks of [`build`](Self::build) then run at its first
    /// acquisitions, and fail them with the same error until they pass.
    ///
    /// # Panics
    /// If a setting was refused (what [`build`](Self::build) returns as
    /// [`SetupError::Invalid`]): a configuration mistake, not a server's state.
    pub fn build_lazy(self) -> MySqlBackend {
        MySqlBackend {
            inner: self.draft.finish_lazy("MySqlBackendBuilder"),
        }
    }

    /// The most connections this backend opens (default [`DEFAULT_MAX_CONNECTIONS`]):
    /// the most keys this instance can hold, or wait for in the server, at once (see
    /// [Pool size](self#pool-size)). Call it before the backend is used.
    /// Zero is refused by [`build`](Self::build).
    pub fn max_connections(self, max: usize) -> Self {
        if let Some(problem) = session_core::refused_pool_size(max) {
            return self.refuse(problem);
        }
        self.configure(|inner| {
            inner.pool = Arc::new(Pool::new(inner.pool.opts().clone(), max));
        })
    }

    /// The first part of every lock name (default [`DEFAULT_PREFIX`]): applications
    /// that share a server but must not share locks use different prefixes.
    /// A prefix that is empty, longer than 24 bytes, not ASCII, or holds `:` or `#` is
    /// refused by [`build`](Self::build): names would no longer be told apart.
    pub fn prefix(self, prefix: impl Into<String>) -> Self {
        let prefix: String = prefix.into();
        let valid = !prefix.is_empty()
            && prefix.is_ascii()
            && prefix.len() <= MAX_PREFIX_LEN
            && !prefix.contains([':', '#']);
        if !valid {
            return self.refuse(format!(
                "prefix: {prefix:?} must be 1 to {MAX_PREFIX_LEN} ASCII bytes without ':' or '#'"
            ));
        }
        self.with_prefix(prefix)
    }

    /// How often a held lock's session is checked (default 1 s): the statement kept
    /// pending on it answers this often. A server gone silent is noticed at most this
    /// long plus the command timeout after its last answer, and a holder process that
    /// crashed keeps its lock at most this long. Part of the server-side idle limit
    /// (see [Timing](self#timing)).
    /// Zero is refused by [`build`](Self::build).
    pub fn liveness_interval(self, interval: Duration) -> Self {
        self.with_liveness_interval(interval)
    }

    /// The longest wait for one answer from the server — connecting, a statement, a
    /// check, the release — beyond the request's own wait (default 2 s). A statement
    /// past it leaves its connection in an unknown state, so the connection is closed
    /// rather than reused.
    /// Zero is refused by [`build`](Self::build).
    pub fn command_timeout(self, timeout: Duration) -> Self {
        self.with_command_timeout(timeout)
    }

    /// Issues a fencing token with every grant (off by default), from the counter in
    /// the [`fencing_table`](Self::fencing_table), which the backend creates on first
    /// use if it is missing.
    pub fn fencing(self, enabled: bool) -> Self {
        self.configure(|inner| {
            inner.fencing = enabled.then(|| Fencing {
                table: inner.table.clone(),
            });
        })
    }

    /// The table of the fencing counter (default [`DEFAULT_FENCING_TABLE`]): a plain or
    /// database-qualified name of unquoted identifiers (`tokens`, `locks.tokens`); a
    /// plain name lives in the connection's database. Enables fencing. Any other name is
    /// refused by [`build`](Self::build).
    pub fn fencing_table(self, name: &str) -> Self {
        // MySQL's identifiers are at most 64 bytes.
        if !session_core::is_plain_or_qualified(name, 64) {
            return self.refuse(format!(
                "fencing_table: {name:?} is not a plain or database-qualified identifier"
            ));
        }
        self.configure(|inner| {
            inner.table = name.into();
            inner.fencing = Some(Fencing {
                table: inner.table.clone(),
            });
        })
    }
}

impl session_core::Builder<Inner> for MySqlBackendBuilder {
    fn draft(&mut self) -> &mut Draft<Inner> {
        &mut self.draft
    }
}

impl session_core::Configurable for Inner {
    fn settings_mut(&mut self) -> &mut Settings {
        &mut self.settings
    }

    fn settings_changed(&mut self) {
        // New settings are checked anew.
        self.checked = Arc::default();
    }
}

impl Inner {
    /// How long the server lets a session sit idle (`wait_timeout`, and the read and
    /// write timeouts) before it ends it and frees its locks: `Timing::server_idle_limit`
    /// rounded up to whole seconds (the settings' unit), so a holder cut off still
    /// declares the lease lost a network timeout or more before the server frees the
    /// lock.
    fn server_idle_limit(&self) -> Duration {
        let limit = self.settings.timing.server_idle_limit();
        Duration::from_secs(limit.as_nanos().div_ceil(1_000_000_000) as u64)
    }

    /// How long a pooled connection may sit idle before it is closed instead of reused:
    /// the server's idle limit less a command timeout.
    fn max_pooled_idle(&self) -> Duration {
        self.server_idle_limit()
            .saturating_sub(self.settings.timing.command_timeout)
    }
}

impl fmt::Debug for MySqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.debug("MySqlBackend", f)
    }
}

impl fmt::Debug for MySqlBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.draft.inner.debug("MySqlBackendBuilder", f)
    }
}

impl Inner {
    fn debug(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self;
        let mut f = f.debug_struct(name);
        inner.settings.debug_fields(&mut f);
        f.field("fencing_table", &inner.fencing.as_ref().map(|f| &*f.table))
            .field("max_connections", &inner.pool.max())
            .field("idle_connections", &inner.pool.idle())
            .finish()
    }
}

impl LockBackend for MySqlBackend {
    super::engine_head::engine_head!("mysql", findings = deployment::findings);

    /// Only with [`fencing(true)`](MySqlBackendBuilder::fencing).
    fn issues_fencing_tokens(&self) -> bool {
        self.inner.fencing.is_some()
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let name = self.lock_name(name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move { inner.holder(name).await })
    }

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let name = self.lock_name(name, key.as_str());
        let inner = self.inner.clone();
        let unanswered = || {
            MyError::message("MySQL did not answer within the wait plus the command timeout")
                .into_lock_error()
        };
        Box::pin(async move {
            let timing = inner.settings.timing;
            session_core::within_wait(timing, wait, inner.acquire(name, wait), unanswered).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::session::testing::{assert_invalid, assert_refused};

    fn backend() -> MySqlBackendBuilder {
        MySqlBackend::builder_from_url("mysql://localhost/app").unwrap()
    }

    #[test]
    fn table_names_are_checked() {
        let _ = backend().fencing_table("locks.tokens");
        for bad in ["", "a b", "x;drop", "a.b.c", "1abc", "a'b", "a`b"] {
            assert_refused(backend().fencing_table(bad), "fencing_table", bad);
        }
    }

    #[tokio::test]
    async fn a_refused_setting_is_the_error_of_build() {
        let builder = backend().max_connections(0).prefix("a:b");
        // The first refused setting, before any connection is tried.
        assert_invalid(builder.build().await, "max_connections");
    }

    #[test]
    fn prefixes_are_checked() {
        for bad in ["", "a:b", "a#b", "é", &"n".repeat(25)] {
            assert_refused(backend().prefix(bad), "prefix", bad);
        }
    }

    #[test]
    fn the_idle_limit_is_whole_seconds_past_the_deadline() {
        let backend = backend()
            .liveness_interval(Duration::from_millis(100))
            .command_timeout(Duration::from_millis(500));
        assert_eq!(
            backend.draft.inner.server_idle_limit(),
            Duration::from_secs(2)
        );
        assert_eq!(
            backend.draft.inner.max_pooled_idle(),
            Duration::from_millis(1500)
        );
        assert_eq!(
            MySqlBackend::builder_from_url("mysql://x/y")
                .unwrap()
                .draft
                .inner
                .server_idle_limit(),
            Duration::from_secs(5)
        );
    }
}
