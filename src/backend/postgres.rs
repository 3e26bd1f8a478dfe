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

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use deadpool_postgres::{
    Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime, TimeoutType,
    Timeouts,
};
use sha2::{Digest, Sha256};
use tokio::sync::{oneshot, OnceCell};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant, MissedTickBehavior};
use tokio_postgres::error::SqlState;
use tokio_postgres::{NoTls, SimpleQueryMessage};

use super::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LockBackend, ReleaseLease};
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

/// The SQL that computes a lock id, as [`lock_id`] does: `$1` the namespace, `$2` the
/// layer name, `$3` the key (all `text`); returns a `bigint`.
///
/// ```no_run
/// # async fn f(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
/// use tower_keyed_lock::backend::postgres::{lock_id, LOCK_ID_SQL};
///
/// let row = client.query_one(LOCK_ID_SQL, &[&"tower-keyed-lock", &"orders", &"42"]).await?;
/// assert_eq!(row.get::<_, i64>(0), lock_id("tower-keyed-lock", "orders", "42"));
/// # Ok(())
/// # }
/// ```
pub const LOCK_ID_SQL: &str = "SELECT ('x' || substr(encode(sha256(\
    int4send(octet_length(convert_to($1, 'UTF8'))) || convert_to($1, 'UTF8') || \
    int4send(octet_length(convert_to($2, 'UTF8'))) || convert_to($2, 'UTF8') || \
    int4send(octet_length(convert_to($3, 'UTF8'))) || convert_to($3, 'UTF8')\
    ), 'hex'), 1, 16))::bit(64)::bigint";

const UNLOCK_SQL: &str = "SELECT pg_advisory_unlock($1)";
/// Whether this session holds the lock (`$1` the high, `$2` the low 32 bits of the id).
const HOLDS_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks \
    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
    AND objsubid = 1 AND classid::bigint = $1 AND objid::bigint = $2)";

/// The advisory lock id of `key` under the layer `name` and `namespace`: the first 8
/// bytes, big-endian, of SHA-256 over the three strings, each prefixed by its length in
/// bytes as a big-endian `u32`. Stable across builds and machines; see the
/// [module docs](self#lock-ids) for SQL and Python versions.
///
/// ```
/// use tower_keyed_lock::backend::postgres::lock_id;
///
/// assert_eq!(lock_id("tower-keyed-lock", "orders", "42"), -2_357_060_318_159_420_717);
/// ```
pub fn lock_id(namespace: &str, name: &str, key: &str) -> i64 {
    let mut hasher = Sha256::new();
    for part in [namespace, name, key] {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ. Keys are at most
        // `max_key_len` bytes, far below u32::MAX.
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        hasher.update(len.to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

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

impl Inner {
    async fn acquire(self: Arc<Self>, id: i64, wait: Duration) -> Result<Lease, LockError> {
        let deadline = Instant::now() + wait;
        let mut session = self.session(deadline).await?;
        if let Some(fencing) = &self.fencing {
            self.create_sequence(fencing, &session).await?;
        }
        let tried = match self.try_lock(&session, id).await {
            // A pooled connection that died while idle (a server restart) and was not
            // noticed yet: the session is gone, and its locks with it, so one more try
            // on a fresh connection is safe.
            Err(error) if error.closed && session.reused() => {
                drop(session);
                session = self.session(deadline).await?;
                self.try_lock(&session, id).await
            }
            tried => tried,
        };
        // On every early return below, `session` is dropped: closed, not pooled.
        let token = match tried.map_err(PgError::into_lock_error)? {
            Some(token) => token,
            None => match self.wait_lock(&session, id, deadline).await? {
                Some(token) => token,
                None => {
                    session.give_back();
                    return Err(LockError::Timeout);
                }
            },
        };
        Ok(self.hold(session, id, token))
    }

    /// A pooled connection, waiting for one at most until `deadline` (then
    /// [`LockError::Timeout`]: the pool is exhausted) plus the network timeout to open
    /// a new one.
    async fn session(&self, deadline: Instant) -> Result<Session, LockError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let timeouts = Timeouts {
            // Zero means "try once" to deadpool, as to the layer.
            wait: Some(wait),
            create: Some(self.network_timeout),
            recycle: Some(self.network_timeout),
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
                false => wait + self.network_timeout,
            };
            got = match timeout(limit, self.pool.timeout_get(&untimed)).await {
                Ok(got) => got,
                Err(_) => return Err(LockError::Timeout),
            };
        }
        match got {
            Ok(object) => Ok(Session(Some(object))),
            Err(PoolError::Timeout(TimeoutType::Wait)) => Err(LockError::Timeout),
            Err(error) => {
                Err(PgError::new("cannot connect to PostgreSQL", error).into_lock_error())
            }
        }
    }

    /// Creates the fencing sequence once per backend (and again after a failure).
    async fn create_sequence(&self, fencing: &Fencing, session: &Session) -> Result<(), LockError> {
        let create = async {
            let sql = format!("CREATE SEQUENCE IF NOT EXISTS {}", fencing.sequence);
            match self.round_trip(session.batch_execute(&sql)).await {
                Ok(()) => Ok(()),
                // Another instance created it at the same moment, or we may not create
                // it but it may exist (`nextval` will tell).
                Err(PgError {
                    code: Some(code), ..
                }) if code == SqlState::UNIQUE_VIOLATION
                    || code == SqlState::DUPLICATE_TABLE
                    || code == SqlState::INSUFFICIENT_PRIVILEGE =>
                {
                    Ok(())
                }
                Err(error) => Err(error),
            }
        };
        fencing
            .created
            .get_or_try_init(|| create)
            .await
            .map(|_| ())
            .map_err(PgError::into_lock_error)
    }

    /// `pg_try_advisory_lock`: `Some(token)` when granted.
    async fn try_lock(&self, session: &Session, id: i64) -> Result<Option<Option<u64>>, PgError> {
        let sql = match &self.fencing {
            Some(fencing) => &*fencing.try_sql,
            None => "SELECT pg_try_advisory_lock($1)",
        };
        let row = self
            .round_trip(async {
                let statement = session.prepare_cached(sql).await?;
                session.query_one(&statement, &[&id]).await
            })
            .await?;
        Ok(match &self.fencing {
            Some(_) => row.get::<_, Option<i64>>(0).map(|token| Some(token as u64)),
            None => row.get::<_, bool>(0).then_some(None),
        })
    }

    /// Waits in PostgreSQL's own queue until granted (`Some(token)`) or `deadline`
    /// (`None`). Returns `None` with the session unlocked and clean.
    async fn wait_lock(
        &self,
        session: &Session,
        id: i64,
        deadline: Instant,
    ) -> Result<Option<Option<u64>>, LockError> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        // `lock_timeout = 0` would mean "wait forever".
        let millis = remaining.as_millis();
        if millis == 0 {
            return Ok(None);
        }
        let nextval = match &self.fencing {
            Some(fencing) => format!("; SELECT nextval('{}')", fencing.sequence),
            None => String::new(),
        };
        // One simple-protocol message is one implicit transaction: the setting is
        // transaction-local, so it cannot leak to the next user of the connection,
        // while the session lock outlives the transaction. `id` and `millis` are
        // numbers we made, so formatting them in is safe.
        let sql = format!(
            "SELECT set_config('lock_timeout', '{millis}ms', true); \
             SELECT pg_advisory_lock({id}){nextval}"
        );
        let answer = timeout(remaining + self.network_timeout, session.simple_query(&sql)).await;
        match answer {
            Ok(Ok(messages)) => Ok(Some(self.fencing.as_ref().and(last_value(&messages)))),
            Ok(Err(error)) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                // The lock may have been granted as the timeout fired: PostgreSQL then
                // keeps the session lock although the statement failed.
                match self.holds(session, id).await {
                    Ok(false) => Ok(None),
                    Ok(true) => match &self.fencing {
                        Some(fencing) => {
                            let sql = format!("SELECT nextval('{}')", fencing.sequence);
                            let token = self
                                .round_trip(session.query_one(&sql, &[]))
                                .await
                                .map_err(PgError::into_lock_error)?;
                            Ok(Some(Some(token.get::<_, i64>(0) as u64)))
                        }
                        None => Ok(Some(None)),
                    },
                    // Unknown: the caller's drop closes the session, which frees the
                    // lock if it was granted. The wait is over either way.
                    Err(_) => Err(LockError::Timeout),
                }
            }
            Ok(Err(error)) => Err(PgError::new("pg_advisory_lock failed", error).into_lock_error()),
            Err(_) => Err(
                PgError::message("PostgreSQL did not answer the lock wait in time")
                    .into_lock_error(),
            ),
        }
    }

    /// Whether this session holds the advisory lock `id` (per `pg_locks`).
    async fn holds(&self, session: &Session, id: i64) -> Result<bool, PgError> {
        let bits = id as u64;
        let (high, low) = ((bits >> 32) as i64, (bits & 0xffff_ffff) as i64);
        let row = self
            .round_trip(session.query_one(HOLDS_SQL, &[&high, &low]))
            .await?;
        Ok(row.get(0))
    }

    /// Runs one round trip within the network timeout.
    async fn round_trip<T>(
        &self,
        query: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, PgError> {
        match timeout(self.network_timeout, query).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(PgError::new("PostgreSQL statement failed", error)),
            Err(_) => Err(PgError::message("PostgreSQL did not answer in time")),
        }
    }

    /// Hands the locked session to a task that watches it until the lease is released.
    fn hold(self: Arc<Self>, session: Session, id: i64, token: Option<u64>) -> Lease {
        let (lost, signal) = LeaseSignal::new();
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(self.watch(session, id, lost, stopped));
        Lease::new(token, signal, PgRelease { stop, task })
    }

    /// Checks the held connection every liveness interval until the lease is released
    /// (or dropped), then unlocks. If the runtime drops this task instead, `session`'s
    /// drop closes the connection, which frees the lock.
    async fn watch(
        self: Arc<Self>,
        session: Session,
        id: i64,
        lost: LeaseLostSender,
        mut stop: oneshot::Receiver<()>,
    ) {
        let interval = self.liveness_interval;
        let mut ticks = tokio::time::interval_at(Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            // `stop` fires on release, and on its sender's drop.
            if let Either::Left(_) = race(&mut stop, ticks.tick()).await {
                break;
            }
            let alive = !session.is_closed()
                && match race(&mut stop, self.round_trip(session.simple_query("SELECT 1"))).await {
                    Either::Left(_) => break,
                    Either::Right(ping) => ping.is_ok(),
                };
            if !alive {
                // The session ended (so PostgreSQL freed the lock) or went silent: another
                // instance may hold the key now, or soon. Close our end too.
                if lost.lose() {
                    tracing::warn!(lock_id = id, "PostgreSQL lock lost: its connection died");
                }
                return;
            }
        }
        let unlocked = self
            .round_trip(async {
                let statement = session.prepare_cached(UNLOCK_SQL).await?;
                session.query_one(&statement, &[&id]).await
            })
            .await;
        // Only a connection known to hold nothing goes back; otherwise `session` is
        // dropped here: closed, so PostgreSQL ends the session and frees its locks.
        match unlocked {
            Ok(row) if row.get::<_, bool>(0) => session.give_back(),
            Ok(_) => tracing::warn!(lock_id = id, "PostgreSQL lock was not held at release"),
            Err(error) => {
                tracing::debug!(lock_id = id, %error, "unlock failed; closing the connection")
            }
        }
    }
}

/// The most recent value in a simple-query answer: the fencing token.
fn last_value(messages: &[SimpleQueryMessage]) -> Option<u64> {
    messages.iter().rev().find_map(|message| match message {
        SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
        _ => None,
    })
}

/// A pooled connection whose session may hold a lock. Dropped, it is taken out of the
/// pool and closed — PostgreSQL then ends the session and frees its locks; only
/// [`give_back`](Self::give_back), for a session known to hold nothing, pools it again.
struct Session(Option<Object>);

impl Session {
    fn give_back(mut self) {
        drop(self.0.take());
    }

    /// Whether the connection served an earlier request.
    fn reused(&self) -> bool {
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

/// Ends a lease: stops its watch task, which then unlocks.
struct PgRelease {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ReleaseLease for PgRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let PgRelease { stop, task } = *self;
        let _ = stop.send(());
        Box::pin(async move {
            let _ = task.await;
        })
    }
}

enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Polls both futures; the first ready wins (`left` first). The other is dropped.
async fn race<A: Future + Unpin, B: Future>(mut left: A, right: B) -> Either<A::Output, B::Output> {
    let mut right = pin!(right);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(value) = std::pin::Pin::new(&mut left).poll(cx) {
            return Poll::Ready(Either::Left(value));
        }
        right.as_mut().poll(cx).map(Either::Right)
    })
    .await
}

/// A backend failure: what failed, and the PostgreSQL or pool error behind it.
#[derive(Debug)]
struct PgError {
    what: &'static str,
    code: Option<SqlState>,
    /// Whether the connection was found closed.
    closed: bool,
    source: Option<Box<dyn Error + Send + Sync>>,
}

impl PgError {
    fn new(what: &'static str, source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        let source = source.into();
        let (code, closed) = match source.downcast_ref::<tokio_postgres::Error>() {
            Some(error) => (error.code().cloned(), error.is_closed()),
            None => (None, false),
        };
        Self {
            what,
            code,
            closed,
            source: Some(source),
        }
    }

    fn message(what: &'static str) -> Self {
        Self {
            what,
            code: None,
            closed: false,
            source: None,
        }
    }

    fn into_lock_error(self) -> LockError {
        LockError::Backend(Box::new(self))
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{}: {source}", self.what),
            None => f.write_str(self.what),
        }
    }
}

impl Error for PgError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_are_length_prefixed() {
        assert_ne!(lock_id("ns", "ab", "c"), lock_id("ns", "a", "bc"));
        assert_ne!(lock_id("ns", "a", "b"), lock_id("ns", "b", "a"));
    }

    #[test]
    fn lock_id_is_sha256_prefix() {
        // sha256(00000002 "ns" 00000001 "n" 00000001 "k"), computed independently.
        let mut message = Vec::new();
        for part in ["ns", "n", "k"] {
            message.extend_from_slice(&(part.len() as u32).to_be_bytes());
            message.extend_from_slice(part.as_bytes());
        }
        let digest = Sha256::digest(&message);
        let expected = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(lock_id("ns", "n", "k"), expected);
    }

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
