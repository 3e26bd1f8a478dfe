//! PostgreSQL backend: serializes a key across every instance that shares one database,
//! with session-level advisory locks.
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::backend::postgres::PostgresBackend;
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! # fn main() -> Result<(), tokio_postgres::Error> {
//! // Connects lazily: nothing is sent until the first request.
//! let backend = PostgresBackend::from_config_str("host=db.internal user=app dbname=app")?
//!     .max_connections(32) // keys held (or waited for) at once by this instance
//!     .fencing(true);
//!
//! let app: Router = Router::new()
//!     .route("/orders/{order_id}/pay", post(|| async { "paid" }))
//!     .layer(
//!         KeyedLockLayer::by_path("order_id")
//!             .name("orders") // part of the lock id: give every layer its own name
//!             .wait_timeout(Duration::from_secs(2))
//!             .backend(backend),
//!     );
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
//! Release runs `pg_advisory_unlock(id)` on the same connection and returns it to the
//! pool. The holding session is the lock's owner token: no other session can unlock
//! it, and a lock has no expiry to renew — it lasts exactly as long as the session. A connection whose state is unknown — an error or timeout while acquiring or
//! unlocking, a task dropped mid-statement — is never returned to the pool: it is taken
//! out of the pool and closed, and PostgreSQL frees every lock of a session that ends.
//!
//! # Pool size
//!
//! A session-level lock lives on its connection, so **each key held, or waited for
//! in PostgreSQL, by this instance pins one pooled connection** until it is released.
//! Size the pool ([`max_connections`](PostgresBackend::max_connections), default
//! [`DEFAULT_MAX_CONNECTIONS`], or the size of the pool you pass to
//! [`PostgresBackend::new`]) for the keys you expect to hold at once per instance;
//! the in-process tier already makes every key cost at most one connection per
//! instance. When the pool is exhausted, a request waits for a connection within its
//! [`wait_timeout`](crate::KeyedLockLayer::wait_timeout) and then gets the timeout
//! response (409). Give the backend a pool of its own: its connections sit idle while
//! they hold locks.
//!
//! # Lock ids
//!
//! A key becomes a 64-bit advisory lock id — the same on every build and machine:
//! SHA-256 over the namespace ([`namespace`](PostgresBackend::namespace), default
//! [`DEFAULT_NAMESPACE`]), the layer [`name`](crate::KeyedLockLayer::name) and the key,
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
//! -- $1 namespace, $2 layer name, $3 key
//! ```
//!
//! In Python:
//!
//! ```python
//! import hashlib, struct
//! def lock_id(namespace, name, key):
//!     parts = [s.encode() for s in (namespace, name, key)]
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
//! PostgreSQL holds the lock as long as the holding session lives. If the connection
//! dies — a server restart, `pg_terminate_backend`, a network failure — the lock is
//! gone and another instance may take the key. Every held connection is checked every
//! [`liveness_interval`](PostgresBackend::liveness_interval) (default
//! [`DEFAULT_LIVENESS_INTERVAL`], 1 s): a closed connection, or a `SELECT 1` that fails
//! or takes longer than the [`network_timeout`](PostgresBackend::network_timeout),
//! raises the lease-lost signal of [`LockInfo`](crate::LockInfo) within one interval
//! (plus the network timeout when the server went silent), the layer counts it in
//! `keyed_lock_lease_lost_total`, and
//! [`abort_on_lease_lost`](crate::KeyedLockLayer::abort_on_lease_lost) turns it into 503.
//!
//! # Fencing tokens
//!
//! With [`fencing(true)`](PostgresBackend::fencing) every grant also takes `nextval` of
//! a sequence (default [`DEFAULT_FENCING_SEQUENCE`], created by the backend with
//! `CREATE SEQUENCE IF NOT EXISTS` on first use) in the same round trip as the lock, so
//! the tokens of one key strictly increase from holder to holder; the handler reads it
//! with [`LockInfo::fencing_token`](crate::LockInfo::fencing_token).
//!
//! # Failures
//!
//! An unreachable database or a failing statement is [`LockError::Backend`]: 503, or
//! the request runs under the in-process lock alone with
//! [`fail_open`](crate::KeyedLockLayer::fail_open). An acquisition takes at most the
//! request's remaining wait plus one [`network_timeout`](PostgresBackend::network_timeout)
//! in all, however many round trips were slow; an unlock or a liveness check at most
//! one network timeout. After an outage the pool reconnects by itself: connections that
//! died are dropped when next taken from the pool.

// One concern per file: `lock_id` is the stable hash of a key and its SQL form,
// `session` takes pooled connections and closes those in an unknown state, `acquire`
// runs the try and wait statements, `lease` watches a held lock and unlocks it, and
// `error` is the backend's error. This file has the public type and its configuration.
mod acquire;
mod error;
mod lease;
mod lock_id;
mod session;

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::OnceCell;
use tokio::time::timeout;
use tokio_postgres::NoTls;

pub use self::lock_id::{lock_id, LOCK_ID_SQL};

use self::error::PgError;
use super::{BoxFuture, Lease, LockBackend};
use crate::key::Key;
use crate::locks::LockError;

/// The default [`PostgresBackend::namespace`].
pub const DEFAULT_NAMESPACE: &str = "tower-keyed-lock";
/// The default [`PostgresBackend::liveness_interval`].
pub const DEFAULT_LIVENESS_INTERVAL: Duration = Duration::from_secs(1);
/// The default [`PostgresBackend::network_timeout`].
pub const DEFAULT_NETWORK_TIMEOUT: Duration = Duration::from_secs(2);
/// The pool size of [`PostgresBackend::from_config`] (change it with
/// [`PostgresBackend::max_connections`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// The default [`PostgresBackend::fencing_sequence`].
pub const DEFAULT_FENCING_SEQUENCE: &str = "tower_keyed_lock_fencing";

/// A [`LockBackend`] on PostgreSQL advisory locks. See the [module docs](self).
///
/// Cheap to clone; clones share the pool. Builder methods take and return the backend,
/// before it is handed to [`KeyedLockLayer::backend`](crate::KeyedLockLayer::backend).
///
/// ```
/// use std::time::Duration;
/// use tower_keyed_lock::backend::postgres::PostgresBackend;
///
/// let backend = PostgresBackend::from_config_str("postgresql://app@db.internal/app")
///     .unwrap()
///     .max_connections(32)                            // default 16
///     .namespace("billing")                           // default "tower-keyed-lock"
///     .liveness_interval(Duration::from_millis(500))  // default 1 s
///     .network_timeout(Duration::from_secs(1))        // default 2 s
///     .fencing(true);                                 // default off
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    pool: Pool,
    /// What the pool was built from, when the backend built it (so it can rebuild it
    /// with another size).
    pool_config: Option<tokio_postgres::Config>,
    /// Set once the pool turned out to have no runtime for its timeouts.
    pool_without_runtime: Arc<AtomicBool>,
    namespace: Arc<str>,
    liveness_interval: Duration,
    network_timeout: Duration,
    /// Kept while fencing is off, so turning it back on keeps the name.
    sequence: Arc<str>,
    fencing: Option<Fencing>,
}

#[derive(Clone)]
struct Fencing {
    sequence: Arc<str>,
    /// Set once the sequence is known to exist; shared by clones with this sequence.
    created: Arc<OnceCell<()>>,
    try_sql: Arc<str>,
}

impl PostgresBackend {
    /// A backend on `pool`, which it should own: every key held pins one of its
    /// connections (see [Pool size](self#pool-size)). Build the pool with a runtime
    /// (`Runtime::Tokio1`), so that the backend can tell a pool exhausted (the timeout
    /// response when the wait is over) from a database slow to connect (503); without
    /// one it guesses from the pool's status.
    ///
    /// ```
    /// use deadpool_postgres::{Config, Runtime};
    /// use tokio_postgres::NoTls;
    /// use tower_keyed_lock::backend::postgres::PostgresBackend;
    ///
    /// let mut config = Config::new();
    /// config.host = Some("db.internal".into());
    /// config.dbname = Some("app".into());
    /// config.pool = Some(deadpool_postgres::PoolConfig::new(32));
    /// let pool = config.create_pool(Some(Runtime::Tokio1), NoTls).unwrap();
    /// let backend = PostgresBackend::new(pool).namespace("billing");
    /// ```
    pub fn new(pool: Pool) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                pool_config: None,
                pool_without_runtime: Arc::default(),
                namespace: DEFAULT_NAMESPACE.into(),
                liveness_interval: DEFAULT_LIVENESS_INTERVAL,
                network_timeout: DEFAULT_NETWORK_TIMEOUT,
                sequence: DEFAULT_FENCING_SEQUENCE.into(),
                fencing: None,
            }),
        }
    }

    /// A backend with a pool of its own ([`DEFAULT_MAX_CONNECTIONS`] connections) to
    /// the database `config` describes, without TLS. Connects lazily. Sets the
    /// application name `tower-keyed-lock` unless `config` has one, so the lock
    /// connections are easy to find in `pg_stat_activity`.
    pub fn from_config(mut config: tokio_postgres::Config) -> Self {
        if config.get_application_name().is_none() {
            config.application_name("tower-keyed-lock");
        }
        let mut backend = Self::new(own_pool(config.clone(), DEFAULT_MAX_CONNECTIONS));
        Arc::make_mut(&mut backend.inner).pool_config = Some(config);
        backend
    }

    /// [`from_config`](Self::from_config) with a connection string: `key=value` pairs
    /// (`host=db user=app dbname=app`) or a `postgresql://` URL. Fails only if the
    /// string does not parse; nothing is connected yet.
    pub fn from_config_str(config: &str) -> Result<Self, tokio_postgres::Error> {
        Ok(Self::from_config(config.parse()?))
    }

    /// The size of the pool made by [`from_config`](Self::from_config) (default
    /// [`DEFAULT_MAX_CONNECTIONS`]): the most keys this instance can hold, or wait for
    /// in PostgreSQL, at once (see [Pool size](self#pool-size)). Replaces the pool, so
    /// call it before the backend is used.
    ///
    /// # Panics
    /// If `max` is zero, or if the pool was passed to [`new`](Self::new): size that
    /// pool when you build it.
    pub fn max_connections(self, max: usize) -> Self {
        assert!(max > 0, "max_connections must be at least 1");
        self.configure(|inner| {
            let config = inner.pool_config.clone().expect(
                "max_connections: the pool was passed to PostgresBackend::new; size it there",
            );
            inner.pool = own_pool(config, max);
            inner.pool_without_runtime = Arc::default();
        })
    }

    /// The first part of every lock id (default [`DEFAULT_NAMESPACE`]): applications
    /// that share a database but must not share locks use different namespaces.
    pub fn namespace(self, namespace: impl Into<String>) -> Self {
        let namespace: String = namespace.into();
        self.configure(|inner| inner.namespace = namespace.into())
    }

    /// How often held connections are checked (default 1 s): a lost lock is signalled
    /// at most this long after its connection died (plus the network timeout if the
    /// server went silent). Each check of a live connection is one `SELECT 1`.
    ///
    /// # Panics
    /// If `interval` is zero.
    pub fn liveness_interval(self, interval: Duration) -> Self {
        assert!(!interval.is_zero(), "liveness_interval must not be zero");
        self.configure(|inner| inner.liveness_interval = interval)
    }

    /// The longest wait for one answer from PostgreSQL — connecting, a statement, a
    /// liveness check, the unlock — beyond the request's own wait (default 2 s). A
    /// statement past it leaves its connection in an unknown state, so the connection
    /// is closed rather than reused.
    ///
    /// # Panics
    /// If `timeout` is zero.
    pub fn network_timeout(self, timeout: Duration) -> Self {
        assert!(!timeout.is_zero(), "network_timeout must not be zero");
        self.configure(|inner| inner.network_timeout = timeout)
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
    /// `locks.tokens`). Enables fencing.
    ///
    /// # Panics
    /// If `name` is not such a name (a configuration mistake).
    pub fn fencing_sequence(self, name: &str) -> Self {
        let valid_part = |part: &str| {
            !part.is_empty()
                && part.len() <= 63
                && !part.starts_with(|c: char| c.is_ascii_digit())
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        let parts: Vec<&str> = name.split('.').collect();
        assert!(
            parts.len() <= 2 && parts.iter().all(|part| valid_part(part)),
            "fencing_sequence: {name:?} is not a plain or schema-qualified identifier"
        );
        self.configure(|inner| {
            inner.sequence = name.into();
            inner.fencing = Some(Fencing::new(inner.sequence.clone()));
        })
    }

    /// The pool the locks are taken on.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The lock id of `key` under the layer `name` with this backend's namespace.
    ///
    /// ```
    /// use tower_keyed_lock::backend::postgres::{lock_id, PostgresBackend};
    ///
    /// let backend = PostgresBackend::from_config_str("host=localhost")
    ///     .unwrap()
    ///     .namespace("billing");
    /// assert_eq!(backend.lock_id("orders", "42"), lock_id("billing", "orders", "42"));
    /// ```
    pub fn lock_id(&self, name: &str, key: &str) -> i64 {
        lock_id(&self.inner.namespace, name, key)
    }

    fn configure(mut self, change: impl FnOnce(&mut Inner)) -> Self {
        change(Arc::make_mut(&mut self.inner));
        self
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
        .runtime(Runtime::Tokio1)
        .build()
        .expect("a pool with a runtime always builds")
}

impl Fencing {
    fn new(sequence: Arc<str>) -> Self {
        Self {
            try_sql: format!(
                "SELECT CASE WHEN pg_try_advisory_lock($1) THEN nextval('{sequence}') END"
            )
            .into(),
            sequence,
            created: Arc::default(),
        }
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        let status = inner.pool.status();
        f.debug_struct("PostgresBackend")
            .field("namespace", &inner.namespace)
            .field("liveness_interval", &inner.liveness_interval)
            .field("network_timeout", &inner.network_timeout)
            .field(
                "fencing_sequence",
                &inner.fencing.as_ref().map(|f| &*f.sequence),
            )
            .field("max_connections", &status.max_size)
            .field("connections", &status.size)
            .finish()
    }
}

impl LockBackend for PostgresBackend {
    fn acquire(
        &self,
        name: &'static str,
        key: &Key,
        wait: Duration,
    ) -> BoxFuture<Result<Lease, LockError>> {
        let id = self.lock_id(name, key.as_str());
        let inner = self.inner.clone();
        // The whole acquisition stays within the wait plus one network timeout, however
        // many round trips were slow. Cut short, it drops its connection: closed, so
        // whatever PostgreSQL granted it is freed.
        let limit = wait + inner.network_timeout;
        Box::pin(async move {
            match timeout(limit, inner.acquire(id, wait)).await {
                Ok(result) => result,
                Err(_) => Err(PgError::message(
                    "PostgreSQL did not answer within the wait plus the network timeout",
                )
                .into_lock_error()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_names_are_checked() {
        let backend = || PostgresBackend::from_config_str("host=localhost").unwrap();
        let _ = backend().fencing_sequence("locks.tokens");
        for bad in ["", "a b", "x;drop", "a.b.c", "1abc", "a'b"] {
            let result = std::panic::catch_unwind(|| backend().fencing_sequence(bad));
            assert!(result.is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn fencing_keeps_the_sequence() {
        let backend = PostgresBackend::from_config_str("host=localhost")
            .unwrap()
            .fencing_sequence("tokens")
            .fencing(false)
            .fencing(true);
        assert_eq!(
            backend.inner.fencing.as_ref().map(|f| &*f.sequence),
            Some("tokens")
        );
    }
}
