//! PostgreSQL backend: serializes a key across every instance that shares one database,
//! with session-level advisory locks.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::backend::postgres::PostgresBackend;
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
//! let backend = PostgresBackend::builder_from_str("host=db.internal user=app dbname=app")?
//!     .max_connections(32) // keys held (or waited for) at once by this instance
//!     .fencing(true)
//!     .build() // connects, and checks the setup
//!     .await?;
//!
//! let app: Router = Router::new()
//!     .route("/orders/{order_id}/pay", post(|| async { "paid" }))
//!     .layer(
//!         KeyedLockLayer::by_path("order_id")
//!             .name("orders") // part of the lock id: give every layer its own name
//!             .wait_timeout(Duration::from_secs(2))
//!             .backend(backend),
//!     );
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # How a key is locked
//!
//! Requests first queue on the layer's in-process table; only the local winner comes
//! here. It takes a connection from the backend's pool and runs
//! `pg_try_advisory_lock(id)`. If another instance holds the key and the request may
//! still wait, it waits *inside PostgreSQL*: one round trip runs
//! `set_config('lock_timeout', <remaining wait>, true)` and `pg_advisory_lock(id)` in
//! one implicit transaction, so PostgreSQL queues the waiters in arrival order and
//! wakes the next one on release — nobody polls — and the `lock_timeout` setting ends
//! with that transaction instead of leaking to the next user of the connection (the
//! session lock itself outlives the transaction, as session advisory locks do). When
//! PostgreSQL answers with `lock_timeout`'s error (SQLSTATE `55P03`), the backend checks
//! `pg_locks` for a grant that raced the timeout before it reports
//! [`LockError::Timeout`].
//!
//! The statement that tries the lock also records the server process
//! (`pg_backend_pid()`), sets the [server-side limits](self#lost-locks)
//! `idle_session_timeout` and `tcp_user_timeout` on a session not set up yet (once
//! per session: the confirmation of its first grant marks it set up), and, when
//! granted, takes the fencing token and sets the marker `tower_keyed_lock.lease` (the
//! lock id and a random number of this acquisition) until the unlock.
//!
//! A grant counts only from a round trip that answered within the
//! [`command_timeout`](PostgresBackendBuilder::command_timeout): PostgreSQL's idle limit runs
//! from the moment it grants, which a late answer does not date. A statement that
//! waited in PostgreSQL's queue usually answers later than that, so one more round trip
//! confirms the grant; if the confirmation does not answer in time, the grant is given
//! back (the connection is closed) and the acquisition fails with
//! [`LockError::Backend`] (503) — the server may already have freed the lock. The first
//! grant on each server session is confirmed too, from a later transaction: see
//! [poolers](self#lock-scopes-and-poolers).
//! The try, the wait and the unlock of an exclusive or shared session lock are
//! prepared statements, prepared once per connection: a session-scope backend
//! uses them only once its pooler check found every server session to be its client's
//! own (a statement prepared on a session is there as long as the session). Every
//! other statement, and every statement of [`LockScope::Transaction`] (made for
//! transaction poolers), is a simple query (the id, the pid and the limits are numbers
//! the backend made; the sequence name is checked), which a pooler in between cannot
//! mishandle. An uncontended lock costs two round trips, as the bare
//! `pg_advisory_lock` / `pg_advisory_unlock` pair does (and a third, the confirmation,
//! on a connection's first grant).
//!
//! Release runs `pg_advisory_unlock(id)` on the same connection, clears the marker,
//! and returns the connection to the pool. A replay record of a
//! `PostgresReplayStore` looked up by this backend is written in the release's round
//! trip: its upsert and the unlock are sent together, as two messages, so the write
//! commits before the unlock runs. The holding session is
//! the lock's owner token: no other session can unlock it, and a lock has no expiry to
//! renew — it lasts as long as the session (or, for [`LockScope::Transaction`], the
//! transaction). A connection whose state is unknown — an error or timeout while
//! acquiring or unlocking, a task dropped mid-statement — is never returned to the
//! pool: it is taken out of the pool and closed, and PostgreSQL frees every lock of a
//! session that ends. A closed connection's wait leaves PostgreSQL's queue within
//! 50 ms: the backend sets `client_connection_check_interval` (PostgreSQL 14 and later)
//! on its sessions where the server allows it (probed once, by `build` or the first
//! acquisition), as PostgreSQL does not otherwise notice a closed connection during a
//! lock wait (the wait would be granted first, and keep a server process until then).
//!
//! # Lock scopes and poolers
//!
//! A session lock needs **a direct connection or session pooling** (PgBouncer
//! `pool_mode=session`): it lives in a server session, and a transaction pooler
//! (PgBouncer `pool_mode=transaction` or `statement`, and the like) hands that session
//! to another client after every transaction. That client would find the lock already
//! held by "its" session, and `pg_try_advisory_lock` is re-entrant: a second grant,
//! silently.
//!
//! So with [`LockScope::Session`] the backend checks, once, that each server session
//! belongs to its client connection alone: when it is built
//! ([`build`](PostgresBackendBuilder::build), which then fails with
//! [`SetupError::Unsafe`] naming the pooler mode and the fix), or else on its first
//! acquisition (every acquisition then fails with a [`LockError::Backend`] carrying that
//! error). The check ends a session of its own from the server's side while the client
//! is idle (`idle_session_timeout`): a session of its own takes the client connection
//! with it, a pooled one does not, and the client's next statement then lands on a
//! session without the check's marker. It refuses a transaction or statement pooler
//! every time, whatever the pool size and `server_reset_query_always`; a direct
//! connection or session pooling is never refused (it may take a few round trips on a
//! loaded server, at most four command timeouts). The reasoning, and why a slow round
//! trip restarts the check instead of deciding it, is in `pooler.rs`. PostgreSQL before
//! 14 has no `idle_session_timeout`: the check is skipped with a warning.
//!
//! The checks made while acquiring and holding stay, for a pooler put in between
//! later (a changed address, a pooler switched to transaction pooling): a session found
//! with another client's marker set, or a statement answered by another server process
//! than the one that granted the lock (the pid is compared at the wait, at every
//! liveness check and at the unlock), fails the acquisition with a
//! [`LockError::Backend`] that names the cause, or raises the lost-lease signal of a
//! holder. A lock left behind on a pooler's server session that way stays until that
//! session has been idle for the server-side limit.
//!
//! A pooler may also reset every server session after each transaction (PgBouncer's
//! `server_reset_query = DISCARD ALL` with `server_reset_query_always = 1`): the reset
//! drops the lock and the marker as soon as the granting statement ends, so nothing is
//! left to find. So the first grant on each server session is confirmed by a round trip
//! of its own, after the granting transaction ended: the session must still hold the
//! lock with this acquisition's marker, or the acquisition fails with the same error.
//! A confirmed session is marked (`tower_keyed_lock.checked`, which such a reset
//! clears too), so later grants on it need no extra round trip.
//!
//! Behind a transaction pooler use [`LockScope::Transaction`]
//! ([`lock_scope`](PostgresBackendBuilder::lock_scope)): the lock is
//! `pg_advisory_xact_lock(id)`, taken in one round trip with
//! `BEGIN; SET LOCAL idle_in_transaction_session_timeout …; SET LOCAL lock_timeout …`
//! (or `pg_try_advisory_xact_lock` alone for a zero wait; before a wait, the same try,
//! its answer kept with `set_config(.., true)` for the last row, says whether the lock
//! was [contended](crate::backend::Lease::contended)), inside a transaction held open
//! until release, which ends it with `ROLLBACK`. The open transaction pins the server
//! session to the connection, so the pooler cannot hand it to anyone else. Its cost:
//! a pooled connection, and a pooler server connection, per held key (size the
//! pooler's `default_pool_size` for the keys held at once by every instance), and an
//! open transaction as long as the key is held. With fencing, `nextval` gives that
//! transaction an id, which holds back vacuum's horizon while the key is held: keep
//! holds short. Both scopes use the same lock ids, and a session lock and a
//! transaction lock of one id exclude each other, so instances may be moved from one
//! scope to the other one at a time.
//!
//! # Pool size
//!
//! A session-level lock lives on its connection, so **each key held, or waited for
//! in PostgreSQL, by this instance pins one pooled connection** until it is released.
//! Size the pool ([`max_connections`](PostgresBackendBuilder::max_connections), default
//! [`DEFAULT_MAX_CONNECTIONS`], or the size of the pool you pass to
//! [`PostgresBackend::builder`]) for the keys you expect to hold at once per instance;
//! the in-process tier already makes every key cost at most one connection per
//! instance. When the pool is exhausted, a request waits for a connection within its
//! [`wait_timeout`](crate::KeyedLockLayer::wait_timeout) and then gets the timeout
//! response (409). Give the backend a pool of its own: its connections sit idle while
//! they hold locks.
//!
//! # Lock ids
//!
//! A key becomes a 64-bit advisory lock id — the same on every build and machine:
//! SHA-256 over the prefix ([`prefix`](PostgresBackendBuilder::prefix), default
//! [`DEFAULT_PREFIX`]), the layer [`name`](crate::KeyedLockLayer::name) and the key,
//! each as its UTF-8 bytes prefixed by their length as a big-endian `u32`; the first 8
//! bytes of the digest, read as a big-endian `i64`, are the id ([`lock_id`]). In SQL
//! ([`LOCK_ID_SQL`], PostgreSQL 11 or later):
//!
//! ```sql
//! SELECT ('x' || substr(encode(sha256(
//!            int4send(octet_length(convert_to($1, 'UTF8'))) || convert_to($1, 'UTF8') ||
//!            int4send(octet_length(convert_to($2, 'UTF8'))) || convert_to($2, 'UTF8') ||
//!            int4send(octet_length(convert_to($3, 'UTF8'))) || convert_to($3, 'UTF8')
//!        ), 'hex'), 1, 16))::bit(64)::bigint
//! -- $1 prefix, $2 layer name, $3 key
//! ```
//!
//! In Python:
//!
//! ```python
//! import hashlib, struct
//! def lock_id(prefix, name, key):
//!     parts = [s.encode() for s in (prefix, name, key)]
//!     message = b"".join(struct.pack(">I", len(p)) + p for p in parts)
//!     return struct.unpack(">q", hashlib.sha256(message).digest()[:8])[0]
//! ```
//!
//! So another program can take the same lock with `pg_advisory_lock(<id>)`. In
//! `pg_locks` the lock shows as `locktype = 'advisory'`, `objsubid = 1`, with the high
//! 32 bits of the id in `classid` and the low 32 bits in `objid`. Two keys share an id
//! only by a 64-bit hash collision, which would serialize them needlessly, nothing worse.
//!
//! # Lost locks
//!
//! PostgreSQL holds the lock as long as the holding session lives. When the session
//! ends — a server restart, `pg_terminate_backend`, a connection reset, the idle limit
//! below — the lock is gone and another instance may take the key.
//!
//! The backend watches each holding connection: every 5 ms it looks whether the
//! connection has closed (no round trip: whether its connection task ended), and every
//! [`liveness_interval`](PostgresBackendBuilder::liveness_interval) (default
//! [`DEFAULT_LIVENESS_INTERVAL`], 1 s) it asks `SELECT pg_backend_pid()`. Until its
//! first check, a lock costs no task: one task looks at every such connection, and
//! the release unlocks on the caller's task; from then on, a task of its own runs the
//! checks. A closed
//! connection, a check that fails, takes longer than the
//! [`command_timeout`](PostgresBackendBuilder::command_timeout) or is answered by another
//! server process raises the lease-lost signal of [`LockInfo`](crate::LockInfo), the
//! layer counts it in `keyed_lock_lease_lost_total`, and
//! [`abort_on_lease_lost`](crate::KeyedLockLayer::abort_on_lease_lost) turns it into
//! 503.
//!
//! A network that goes silent frees nothing by itself: PostgreSQL does not know the
//! holder is gone, and without help an idle session would keep its lock until TCP
//! keepalive gives up (hours by default). So every session the backend uses carries a
//! server-side limit of one liveness interval plus two command timeouts (5 s with the
//! defaults): `idle_session_timeout` (PostgreSQL 14 or later; for
//! [`LockScope::Transaction`], `idle_in_transaction_session_timeout` while the lock is
//! held) ends a session that heard nothing for that long, and `tcp_user_timeout`
//! (PostgreSQL 12 or later) one whose answers go unacknowledged as long. A live holder
//! is never idle that long: its liveness checks keep the session busy. The limit stays
//! on pooled connections too, so a partition strands no server session, holding a lock
//! or not; its cost is that a pooled connection idle for that long is closed by the
//! server and opened again when next needed. A holder cut off is told at most
//! one interval plus one command timeout after its last answered check, one network
//! timeout *before* the server frees the lock; the checks count from the sending of
//! the round trip that [counted the grant](self#how-a-key-is-locked), so that holds
//! from the first check on (measured: 300 ms ahead with a 300 ms
//! command timeout; see `RELIABILITY.md`).
//!
//! The signal is not a guard everywhere: when the session ends on the server's side
//! first (`pg_terminate_backend`, a server restart), a waiting instance is granted
//! within a millisecond or two, and the holder hears of it only when its connection
//! closes a few milliseconds later. For work that must never overlap, write the
//! [fencing token](self#fencing-tokens) with it and let the store reject older tokens:
//! the token, not the signal, is what orders the two holders.
//!
//! # Fencing tokens
//!
//! With [`fencing(true)`](PostgresBackendBuilder::fencing) every grant also takes `nextval` of
//! a sequence (default [`DEFAULT_FENCING_SEQUENCE`]) in the statement that grants the
//! lock, so the tokens of one key strictly increase from holder to holder; the handler
//! reads it with [`LockInfo::fencing_token`](crate::LockInfo::fencing_token). The
//! backend creates the sequence on first use if it is missing: it looks first (nothing
//! runs, and no NOTICE is sent, when it exists), and creates it under a
//! transaction-scoped advisory lock, so instances that start together take turns
//! instead of colliding (`CREATE SEQUENCE IF NOT EXISTS` is not safe under
//! concurrency). The tokens increase only
//! for a sequence with `CACHE 1` (each session caches its own range otherwise, and two
//! instances' tokens interleave: 1, 21, 2, …), `NO CYCLE`, a positive increment and a
//! minimum of at least 0: the backend checks the sequence on first use and refuses
//! another one — every acquisition fails with a [`LockError::Backend`] saying what to
//! change, until the sequence is altered (no restart needed).
//!
//! What a token costs the server: PostgreSQL logs a sequence 32 values ahead, so one
//! grant in 32 (and the first after a checkpoint) writes WAL, and its transaction, like
//! any that writes, waits for the WAL flush under `synchronous_commit = on` (and for a
//! synchronous standby, if there is one): 3 200 `nextval` calls made 97 WAL flushes
//! (`pg_stat_wal`). That flush keeps the tokens increasing across a crash of the server.
//!
//! # Shared locks and permits
//!
//! With [`LockScope::Session`] (the default) the backend gives every
//! [`LockMode`]:
//!
//! - **Shared**: `pg_try_advisory_lock_shared` / `pg_advisory_lock_shared` on the key's
//!   lock id, released by `pg_advisory_unlock_shared`, with every rule above (the
//!   marker, the confirmation, the liveness checks). PostgreSQL's own lock queue keeps
//!   writers from starving: a shared request that conflicts with a *waiting* exclusive
//!   one waits behind it, whichever instance sent either.
//! - **Permits**: `n` lock ids per key (the prefix followed by a NUL and the
//!   permit's place, see [`lock_id`]), each an exclusive session lock; an acquisition
//!   tries them in turn from a random place, and when all are taken sleeps between half
//!   of [`PERMIT_POLL`] and all of it before the next round, until its wait is over.
//!   PostgreSQL queues a waiter on one lock, not on "any of n", so permit waiters are
//!   served in no particular order. A crashed holder's permit comes back when its
//!   session ends (the [lost locks](self#lost-locks) bound). A permit holder also
//!   holds the key's own lock id in shared mode, taken first in the try's statement
//!   and given back there if no permit was free (both or neither; the release unlocks
//!   both in its one statement): so an instance configured with permits and one
//!   configured exclusive under the same name — in two processes, where the mismatch
//!   cannot be refused when built — exclude each other on a key, and a writer waiting
//!   in PostgreSQL's queue keeps new permit holders out, as it keeps readers out.
//!   Readers and permit holders do not exclude each other. Each acquirer counts
//!   against its own `n` (its own `n` lock ids): instances configured with different
//!   `n` under one name do not share their permits.
//! - **Fencing** (with [`fencing`](PostgresBackendBuilder::fencing)): writers and permit
//!   holders take `nextval` of the sequence, so writers' tokens keep increasing across
//!   shared and exclusive grants. A reader takes none: its token is the sequence's last
//!   value when it was granted — at least the token of the last writer of its key
//!   before it, below the next one's (other keys' grants share the sequence) — or
//!   `None` before the sequence's first value.
//!
//! With [`LockScope::Transaction`] only exclusive locks are given: the other modes are
//! refused when the locks or the layer are built.
//! # Who holds a key
//!
//! [`holder`](LockBackend::holder) (and [`DistributedLocks::holder`](crate::DistributedLocks::holder))
//! reads `pg_locks` for the lock's id and the holding session's `application_name` in
//! `pg_stat_activity`: one round trip, nothing taken. The statement that grants a lock
//! writes `tkl <grant time in ms, the server's clock> <fencing token or -> <instance
//! id>` there ([`instance_id`](PostgresBackendBuilder::instance_id)), in the same statement as
//! the grant; the unlock of a session-scope lock resets it to the name the session
//! connected with, transaction scope sets it with `set_config(.., true)`, so the
//! transaction's end restores it. `application_name` was chosen over a table: no write
//! of its own per grant, nothing to clean up after a crash (the name goes with the
//! session, as the lock does), and readable by every role. So the holding sessions show
//! as `tkl …` in `pg_stat_activity` while they hold a key. No lease is left to tell: a
//! session lock lasts as long as its session, so `lease_left` is `None`; a lock taken by
//! another program (with the same id) shows as held by an unknown instance.
//!
//! # Failures
//!
//! An unreachable database or a failing statement is [`LockError::Backend`]: 503, or
//! the request runs under the in-process lock alone with
//! [`fail_open`](crate::KeyedLockLayer::fail_open). A connection that fails says
//! `cannot connect to PostgreSQL at <host:port>: ` and the whole cause (the address of
//! a backend made with [`builder_from_config`](PostgresBackend::builder_from_config);
//! never a user or password); [`build`](PostgresBackendBuilder::build) fails with it as
//! [`SetupError::Failed`]. Only the wait bounds the waiting: once the server answered
//! the backend (its build, or any acquisition's try), a connection that breaks, a
//! connect or a statement left unanswered, or a server restarting during a wait (before
//! a grant is confirmed) is not the end of it — the broken session is closed, never
//! pooled (the server frees any lock it was granted, and that grant is never counted),
//! and the acquisition queues again on a fresh connection after a jittered pause (10
//! ms, doubling to 500 ms), behind whoever queued meanwhile, until its wait ends; then
//! it fails with the last such error (503). A server out of reach before it ever
//! answered is told at once (503). An acquisition takes at most the
//! request's remaining wait plus one [`command_timeout`](PostgresBackendBuilder::command_timeout)
//! in all, however many round trips were slow (the first ones of a session-scope
//! backend not [built](PostgresBackendBuilder::build), up to four command timeouts more, for
//! the [session check](self#lock-scopes-and-poolers)); an unlock or a liveness check at
//! most one command timeout. After an outage the pool reconnects by itself: connections that
//! died are dropped when next taken from the pool.

// One concern per file: `lock_id` is the stable hash of a key and its SQL form,
// `session` takes pooled connections and closes those in an unknown state, `acquire`
// runs the session lock's try and wait statements, `xact` the transaction lock's,
// `fencing` checks the sequence, `schema` creates it (and the replay store's table)
// safely under concurrency, `lease` is this engine's side of a held lock (its liveness
// check and unlock; the holding tasks, the lease's deadline and the release are the
// session-lock core's, in `backend/session`), and `error` is the backend's error,
// `holder` records and reads who holds a lock, `pooler` checks that sessions are the
// client's own, `setup` builds the backend (and `SetupError`), `replay` is what the
// PostgreSQL replay store needs of it. This file has the public type and its
// configuration.
mod acquire;
mod client_check;
mod deployment;
mod error;
mod fencing;
mod holder;
mod lease;
mod lock_id;
mod permits;
mod pooler;
mod prepared;
#[cfg(feature = "replay")]
mod replay;
mod request;
pub(crate) mod schema;
mod session;
mod setup;
mod xact;

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, QueueMode, RecyclingMethod, Runtime};
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tokio_postgres::NoTls;

pub use self::lock_id::{lock_id, LOCK_ID_SQL};
pub use self::permits::PERMIT_POLL;

use self::error::PgError;
use self::request::Request;
use super::session::{self as session_core, Builder as _, Draft, Settings};
use super::{default_instance_id, Acquired, Acquisition, BoxFuture, Holder, LockBackend, LockMode};
use crate::backend::SetupError;
use crate::error::LockError;
use crate::key::Key;

/// The default [`PostgresBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "tower-keyed-lock";
/// The default [`PostgresBackendBuilder::liveness_interval`].
pub const DEFAULT_LIVENESS_INTERVAL: Duration = session_core::DEFAULT_LIVENESS_INTERVAL;
/// The default [`PostgresBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = session_core::DEFAULT_COMMAND_TIMEOUT;
/// The pool size of [`PostgresBackend::builder_from_config`] (change it with
/// [`PostgresBackendBuilder::max_connections`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// The default [`PostgresBackendBuilder::fencing_sequence`].
pub const DEFAULT_FENCING_SEQUENCE: &str = "tower_keyed_lock_fencing";

/// A [`LockBackend`] on PostgreSQL advisory locks. See the [module docs](self).
///
/// Cheap to clone; clones share the pool.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::postgres::PostgresBackend;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = PostgresBackend::builder_from_str("postgresql://app@db.internal/app")?
///     .max_connections(32)                            // default 16
///     .prefix("billing")                              // default "tower-keyed-lock"
///     .liveness_interval(Duration::from_millis(500))  // default 1 s
///     .command_timeout(Duration::from_secs(1))        // default 2 s
///     .fencing(true)                                  // default off
///     .build()
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

/// Configures a [`PostgresBackend`]; made by [`PostgresBackend::builder`] (on a pool of
/// yours) or [`PostgresBackend::builder_from_config`] (a pool of its own).
#[derive(Clone)]
#[must_use]
pub struct PostgresBackendBuilder {
    /// The backend's state, and the first setting refused, which [`build`](Self::build)
    /// returns.
    draft: Draft<Inner>,
}

#[derive(Clone)]
struct Inner {
    pool: Pool,
    /// What the pool was built from, when the backend built it (so it can rebuild it
    /// with another size).
    pool_config: Option<tokio_postgres::Config>,
    /// Set once the pool turned out to have no runtime for its timeouts.
    pool_without_runtime: Arc<AtomicBool>,
    /// The prefix and the timing (see `backend/session`).
    settings: Settings,
    /// Kept while fencing is off, so turning it back on keeps the name.
    sequence: Arc<str>,
    fencing: Option<Fencing>,
    scope: LockScope,
    /// The instance id as a SQL literal's content (see `holder::instance_literal`).
    instance_literal: Arc<str>,
    /// Where the pool connects (`host:port`), when the backend built it: for errors.
    address: Option<Arc<str>>,
    /// Whether this pool's sessions are the client's own (see `pooler.rs`): probed once,
    /// by `build` or the first session-scope acquisition; shared by clones.
    sessions: Arc<OnceCell<pooler::Sessions>>,
    /// Whether the server lets sessions set the client check (see `client_check.rs`):
    /// probed once, by `build` or the first acquisition; shared by clones.
    client_check: Arc<OnceCell<bool>>,
    /// Whether the server ever answered (see `session::retry`); shared by clones.
    reached: Arc<session_core::Reached>,
    /// The SQL of the prepared statements, made from the settings above on first use.
    statements: std::sync::OnceLock<Arc<prepared::Statements>>,
    /// The locks held; young sessions looked at every `CLOSED_CHECK_PERIOD`.
    holds: session_core::Holds<Inner>,
}

#[derive(Clone)]
struct Fencing {
    sequence: Arc<str>,
    /// Set once the sequence is known to exist and to issue increasing values; shared
    /// by clones with this sequence.
    checked: Arc<OnceCell<()>>,
}

/// How long a lock lasts in PostgreSQL: see [Lock scopes](self#lock-scopes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockScope {
    /// `pg_advisory_lock`: the lock lasts as long as the session, which sits idle
    /// between liveness checks. Needs a direct connection or session pooling (the
    /// default).
    #[default]
    Session,
    /// `pg_advisory_xact_lock` inside a transaction held open until release: works
    /// behind a transaction pooler (PgBouncer `pool_mode=transaction`), at the cost of
    /// an open transaction per held key.
    Transaction,
}

impl PostgresBackend {
    /// Starts configuring a backend on `pool`, which it should own: every key held pins
    /// one of its connections (see [Pool size](self#pool-size)). Build the pool with a
    /// runtime (`Runtime::Tokio1`), so that the backend can tell a pool exhausted (the
    /// timeout response when the wait is over) from a database slow to connect (503);
    /// without one it guesses from the pool's status. Hand out the connection given back
    /// last (`QueueMode::Lifo`), as the backend's own pool does: its server process is
    /// still awake, where first in, first out wakes a sleeping one for each lock (a
    /// bare lock and unlock through such a pool took 1.7× as long, one task at a time).
    ///
    /// ```no_run
    /// use deadpool_postgres::{Config, PoolConfig, QueueMode, Runtime};
    /// use tokio_postgres::NoTls;
    /// use tower_keyed_lock::backend::postgres::PostgresBackend;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut config = Config::new();
    /// config.host = Some("db.internal".into());
    /// config.dbname = Some("app".into());
    /// let mut pool = PoolConfig::new(32);
    /// pool.queue_mode = QueueMode::Lifo;
    /// config.pool = Some(pool);
    /// let pool = config.create_pool(Some(Runtime::Tokio1), NoTls)?;
    /// let backend = PostgresBackend::builder(pool).prefix("billing").build().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(pool: Pool) -> PostgresBackendBuilder {
        PostgresBackendBuilder {
            draft: Draft::new(Inner {
                pool,
                pool_config: None,
                pool_without_runtime: Arc::default(),
                settings: Settings::new(DEFAULT_PREFIX),
                sequence: DEFAULT_FENCING_SEQUENCE.into(),
                fencing: None,
                scope: LockScope::Session,
                instance_literal: holder::instance_literal(&default_instance_id()).into(),
                address: None,
                sessions: Arc::default(),
                client_check: Arc::default(),
                reached: Arc::default(),
                statements: Default::default(),
                holds: session_core::Holds::new(Some(lease::CLOSED_CHECK_PERIOD)),
            }),
        }
    }

    /// Starts configuring a backend with a pool of its own
    /// ([`DEFAULT_MAX_CONNECTIONS`] connections, without TLS) to the database `config`
    /// describes. Sets the application name `tower-keyed-lock` unless `config` has one,
    /// so the lock connections are easy to find in `pg_stat_activity`.
    pub fn builder_from_config(mut config: tokio_postgres::Config) -> PostgresBackendBuilder {
        if config.get_application_name().is_none() {
            config.application_name("tower-keyed-lock");
        }
        let mut builder = Self::builder(own_pool(config.clone(), DEFAULT_MAX_CONNECTIONS));
        builder.draft.inner.address = Some(setup::address(&config).into());
        builder.draft.inner.pool_config = Some(config);
        builder
    }

    /// [`builder_from_config`](Self::builder_from_config) with a connection string:
    /// `key=value` pairs (`host=db user=app dbname=app`) or a `postgresql://` URL. Fails
    /// only if the string does not parse ([`SetupError::Invalid`]).
    pub fn builder_from_str(config: &str) -> Result<PostgresBackendBuilder, SetupError> {
        let config = config.parse().map_err(|error| {
            SetupError::Invalid(format!("the PostgreSQL connection string: {error}"))
        })?;
        Ok(Self::builder_from_config(config))
    }

    /// A backend with the default settings and a pool of its own, on the database the
    /// connection string `config` names; see [`PostgresBackendBuilder::build`].
    pub async fn connect(config: &str) -> Result<Self, SetupError> {
        Self::builder_from_str(config)?.build().await
    }

    /// The pool the locks are taken on.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The lock id of `key` under the layer `name` with this backend's prefix.
    ///
    /// ```
    /// use tower_keyed_lock::backend::postgres::{lock_id, PostgresBackend};
    ///
    /// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
    /// let backend = PostgresBackend::connect("host=localhost").await?;
    /// assert_eq!(backend.lock_id("orders", "42"), lock_id("tower-keyed-lock", "orders", "42"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock_id(&self, name: &str, key: &str) -> i64 {
        lock_id(&self.inner.settings.prefix, name, key)
    }
}

impl PostgresBackendBuilder {
    /// The size of the pool made by
    /// [`builder_from_config`](PostgresBackend::builder_from_config) (default
    /// [`DEFAULT_MAX_CONNECTIONS`]): the most keys this instance can hold, or wait for
    /// in PostgreSQL, at once (see [Pool size](self#pool-size)).
    ///
    /// Zero, or a pool passed to [`builder`](PostgresBackend::builder) (size that
    /// pool when you build it), is refused by [`build`](Self::build).
    pub fn max_connections(self, max: usize) -> Self {
        if let Some(problem) = session_core::refused_pool_size(max) {
            return self.refuse(problem);
        }
        let Some(config) = self.draft.inner.pool_config.clone() else {
            return self.refuse(
                "max_connections: the pool was passed to PostgresBackend::builder; size it there"
                    .into(),
            );
        };
        self.configure(|inner| {
            inner.pool = own_pool(config, max);
            inner.pool_without_runtime = Arc::default();
            inner.sessions = Arc::default();
        })
    }

    /// Who this instance is (default [`default_instance_id`], `<hostname>:<pid>`):
    /// recorded by every grant, in the granting statement, as the holding session's
    /// `application_name` (see [Who holds a key](self#who-holds-a-key)). Printable
    /// ASCII is kept, other characters become `_`; the record is cut at 63 bytes,
    /// PostgreSQL's limit, so keep it short.
    ///
    /// ```
    /// # use tower_keyed_lock::backend::postgres::PostgresBackend;
    /// let builder = PostgresBackend::builder_from_str("host=db user=app")
    ///     .unwrap()
    ///     .instance_id("billing-7");
    /// ```
    pub fn instance_id(self, instance_id: impl Into<String>) -> Self {
        let literal = holder::instance_literal(&instance_id.into());
        self.configure(|inner| inner.instance_literal = literal.into())
    }

    /// The first part of every lock id (default [`DEFAULT_PREFIX`]): applications
    /// that share a database but must not share locks use different prefixes.
    pub fn prefix(self, prefix: impl Into<String>) -> Self {
        self.with_prefix(prefix.into())
    }

    /// How often held connections are checked with a round trip (default 1 s): a
    /// server gone silent is noticed at most this long plus the command timeout after
    /// its last answer (a closed connection is noticed within 5 ms, without a round
    /// trip). Each check is one `SELECT pg_backend_pid()`. Also part of the server-side
    /// limit of a holding session (see [Lost locks](self#lost-locks)).
    /// Zero is refused by [`build`](Self::build).
    pub fn liveness_interval(self, interval: Duration) -> Self {
        self.with_liveness_interval(interval)
    }

    /// The longest wait for one answer from PostgreSQL — connecting, a statement, a
    /// liveness check, the unlock — beyond the request's own wait (default 2 s). A
    /// statement past it leaves its connection in an unknown state, so the connection
    /// is closed rather than reused. The server-side limit of a holding session is one
    /// liveness interval plus two command timeouts (see [Lost locks](self#lost-locks)).
    /// Zero is refused by [`build`](Self::build).
    pub fn command_timeout(self, timeout: Duration) -> Self {
        self.with_command_timeout(timeout)
    }

    /// Issues a fencing token with every grant (off by default): `nextval` of the
    /// [`fencing_sequence`](Self::fencing_sequence), taken in the same round trip as
    /// the lock. The backend creates the sequence on first use if it is missing.
    pub fn fencing(self, enabled: bool) -> Self {
        self.configure(|inner| {
            inner.fencing = enabled.then(|| Fencing::new(inner.sequence.clone()));
        })
    }

    /// The sequence of the fencing tokens (default [`DEFAULT_FENCING_SEQUENCE`]): a
    /// plain or schema-qualified name of unquoted identifiers (`tokens`,
    /// `locks.tokens`). Enables fencing. Any other name is refused by
    /// [`build`](Self::build).
    pub fn fencing_sequence(self, name: &str) -> Self {
        // PostgreSQL's identifiers are at most 63 bytes.
        if !session_core::is_plain_or_qualified(name, 63) {
            return self.refuse(format!(
                "fencing_sequence: {name:?} is not a plain or schema-qualified identifier"
            ));
        }
        self.configure(|inner| {
            inner.sequence = name.into();
            inner.fencing = Some(Fencing::new(inner.sequence.clone()));
        })
    }

    /// How long a lock lasts in PostgreSQL (default [`LockScope::Session`]); see
    /// [Lock scopes and poolers](self#lock-scopes-and-poolers). Behind PgBouncer in
    /// `pool_mode=transaction` or `statement`, use [`LockScope::Transaction`]: session
    /// scope is refused there.
    pub fn lock_scope(self, scope: LockScope) -> Self {
        self.configure(|inner| inner.scope = scope)
    }
}

impl session_core::Builder<Inner> for PostgresBackendBuilder {
    fn draft(&mut self) -> &mut Draft<Inner> {
        &mut self.draft
    }
}

impl session_core::Configurable for Inner {
    fn settings_mut(&mut self) -> &mut Settings {
        &mut self.settings
    }

    fn settings_changed(&mut self) {
        // Made again from the new settings.
        self.statements = Default::default();
    }
}

/// A pool of `size` connections without TLS, with a runtime so waits are bounded.
fn own_pool(config: tokio_postgres::Config, size: usize) -> Pool {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            // The backend returns connections unlocked and with no session setting
            // changed; a closed one is still caught here.
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        // The connection given back last, whose server process is still awake: first
        // in, first out cycles through every connection, each a cold process to wake
        // (a bare pair through such a pool took 1.7x as long at one task).
        .queue_mode(QueueMode::Lifo)
        .runtime(Runtime::Tokio1)
        .build()
        .expect("a pool with a runtime always builds")
}

impl Fencing {
    fn new(sequence: Arc<str>) -> Self {
        Self {
            sequence,
            checked: Arc::default(),
        }
    }
}

impl Inner {
    /// How long PostgreSQL lets a holding session sit idle (`idle_session_timeout`,
    /// `tcp_user_timeout`; `idle_in_transaction_session_timeout` for transaction-scoped
    /// locks) before it ends it and frees the lock: see `Timing::server_idle_limit`.
    fn server_idle_limit(&self) -> Duration {
        self.settings.timing.server_idle_limit()
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.debug("PostgresBackend", f)
    }
}

impl fmt::Debug for PostgresBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.draft.inner.debug("PostgresBackendBuilder", f)
    }
}

impl Inner {
    fn debug(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (inner, status) = (self, self.pool.status());
        let mut f = f.debug_struct(name);
        inner.settings.debug_fields(&mut f);
        f.field(
            "fencing_sequence",
            &inner.fencing.as_ref().map(|f| &*f.sequence),
        )
        .field("lock_scope", &inner.scope)
        .field("max_connections", &status.max_size)
        .field("connections", &status.size)
        .finish()
    }
}

impl LockBackend for PostgresBackend {
    super::engine_head::engine_head!("postgres", findings = deployment::findings);

    /// Only with [`fencing(true)`](PostgresBackendBuilder::fencing).
    fn issues_fencing_tokens(&self) -> bool {
        self.inner.fencing.is_some()
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let id = self.lock_id(name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move { inner.holder(id).await })
    }

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        self.acquire_mode(name, key, LockMode::Exclusive, wait)
    }

    /// Every mode with [`LockScope::Session`] (shared: `pg_advisory_lock_shared`;
    /// permits: a lock id per permit); only exclusive locks with
    /// [`LockScope::Transaction`]. See [Shared locks and permits](self#shared-locks-and-permits).
    fn supports(&self, mode: LockMode) -> bool {
        mode == LockMode::Exclusive || self.inner.scope == LockScope::Session
    }

    fn acquire_mode(&self, name: &str, key: &Key, mode: LockMode, wait: Duration) -> Acquisition {
        if !self.supports(mode) {
            let what = match mode {
                LockMode::Shared => super::SHARED_LOCKS,
                _ => super::PERMITS,
            };
            return Box::pin(async move { Err(LockError::Unsupported(what)) });
        }
        let acquire = self.acquire_looking_up(name, key, mode, wait, None);
        Box::pin(async move { acquire.await?.into_lease() })
    }

    /// Looks for a record of the PostgreSQL replay store made to be looked up by this
    /// backend (`PostgresReplayStore::looked_up_by`), in the try's own round trip;
    /// session locks only.
    #[cfg(feature = "replay")]
    fn acquire_unless_recorded(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
        record: &super::RecordLookup,
    ) -> Option<BoxFuture<Result<Acquired, LockError>>> {
        #[allow(irrefutable_let_patterns)]
        let super::Place::Postgres { engine, sql } = &record.place
        else {
            return None;
        };
        if *engine != self.engine_id() || self.inner.scope != LockScope::Session {
            return None;
        }
        let sql = Some(sql.clone());
        Some(self.acquire_looking_up(name, key, LockMode::Exclusive, wait, sql))
    }
}

impl PostgresBackend {
    /// An acquisition in `mode`; an exclusive session lock looks for `record` too.
    fn acquire_looking_up(
        &self,
        name: &str,
        key: &Key,
        mode: LockMode,
        wait: Duration,
        record: Option<String>,
    ) -> BoxFuture<Result<Acquired, LockError>> {
        let id = self.lock_id(name, key.as_str());
        let permits = match mode {
            LockMode::Permit { of } => {
                permits::permit_ids(&self.inner.settings.prefix, name, key.as_str(), of)
            }
            _ => Vec::new(),
        };
        let shared = mode == LockMode::Shared;
        let inner = self.inner.clone();
        // PostgreSQL's `lock_timeout` is an `int` of milliseconds (24.8 days): a longer
        // wait (`Duration::MAX` for "no limit" included) ends there, with a timeout.
        let wait = wait.min(Duration::from_millis(i32::MAX as u64));
        Box::pin(async move {
            // Once per backend, outside the wait (up to four command timeouts).
            if inner.scope == LockScope::Session {
                inner
                    .check_own_sessions()
                    .await
                    .map_err(setup::into_lock_error)?;
            }
            let timing = inner.settings.timing;
            let acquire = async {
                let deadline = Instant::now() + wait;
                inner.prepare_fencing(deadline).await?;
                inner.probe_client_check(deadline).await?;
                // The rarer paths boxed: the common one's future does not carry them.
                match inner.scope {
                    LockScope::Session if !permits.is_empty() => {
                        Box::pin(inner.clone().acquire_permit(id, permits, deadline))
                            .await
                            .map(Acquired::Granted)
                    }
                    LockScope::Session => {
                        let request = Request {
                            id,
                            shared,
                            key: None,
                            deadline,
                            record: record.as_deref(),
                        };
                        inner.clone().acquire_unless_recorded(request).await
                    }
                    LockScope::Transaction => Box::pin(inner.acquire_in_transaction(id, deadline))
                        .await
                        .map(Acquired::Granted),
                }
            };
            let unanswered = || {
                PgError::message(
                    "PostgreSQL did not answer within the wait plus the command timeout",
                )
                .into_lock_error()
            };
            session_core::within_wait(timing, wait, acquire, unanswered).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::session::testing::{assert_invalid, assert_refused};

    #[test]
    fn sequence_names_are_checked() {
        let backend = || PostgresBackend::builder_from_str("host=localhost").unwrap();
        let _ = backend().fencing_sequence("locks.tokens");
        for bad in ["", "a b", "x;drop", "a.b.c", "1abc", "a'b"] {
            assert_refused(backend().fencing_sequence(bad), "fencing_sequence", bad);
        }
    }

    #[tokio::test]
    async fn a_refused_setting_is_the_error_of_build() {
        let builder = PostgresBackend::builder_from_str("host=localhost")
            .unwrap()
            .command_timeout(Duration::ZERO)
            .liveness_interval(Duration::ZERO);
        // The first refused setting, before any connection is tried.
        assert_invalid(builder.build().await, "command_timeout");
        let pool = PostgresBackend::builder_from_str("host=localhost")
            .unwrap()
            .build_lazy()
            .inner
            .pool
            .clone();
        // A pool of the caller's is sized by the caller.
        let sized = PostgresBackend::builder(pool).max_connections(4);
        assert_refused(sized, "size it there", "4");
    }

    /// Every move of an acquisition's future copies all of it (into its box, into each
    /// wrapper): what runs once per backend or off the common path is boxed, and the
    /// round trips are bounded without a second copy (see `session/bounded.rs`). It
    /// was 15 kB, copied a few times per lock.
    #[tokio::test]
    async fn an_acquisitions_future_stays_small() {
        let backend = PostgresBackend::builder_from_str("host=localhost")
            .unwrap()
            .fencing(true)
            .build_lazy();
        let key = Key::new("order-1", 64).unwrap();
        let wait = Duration::from_secs(1);
        for record in [None, Some("NULL".to_owned())] {
            let acquire = backend.acquire_looking_up("n", &key, LockMode::Exclusive, wait, record);
            let size = std::mem::size_of_val(&*acquire);
            assert!(
                size <= 6 * 1024,
                "an acquisition's future takes {size} bytes"
            );
        }
    }

    #[test]
    fn fencing_keeps_the_sequence() {
        let backend = PostgresBackend::builder_from_str("host=localhost")
            .unwrap()
            .fencing_sequence("tokens")
            .fencing(false)
            .fencing(true);
        assert_eq!(
            backend.draft.inner.fencing.as_ref().map(|f| &*f.sequence),
            Some("tokens")
        );
    }
}
