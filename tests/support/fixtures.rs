//! The servers the `distributed` tests and the conformance suite run against, so every
//! test body is written once and runs on each engine (and, where it makes sense, in
//! process). A remote fixture is a testkit `Deployment` (and `Proxied` where the fault
//! proxy can stand in front of it), which the conformance suite runs on as it is;
//! `Fixture` and `Remote` add what only the tests do: start, kill, an instance by name.
//! The servers themselves are the sibling modules (`redis_server`, `pg_server`, …).
// A binary uses part of it: the fixtures it re-exports too.
#![allow(dead_code, unused_imports)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tower_keyed_lock::backend::Acquisition;

// The testkit's traits, which every remote fixture implements: the tests use them as
// their own.
pub use tower_keyed_lock::testkit::{Deployment, Proxied};
// Declared here rather than in every binary that includes this file.
use tower_keyed_lock::{DistributedAcquire, DistributedLocks, Key, Lease, LockBackend, LockError};

/// The name every instance gives its locks, so they share keys at the backend.
pub const NAME: &str = "jobs";

/// Long enough for anything that should happen; a test fails instead of hanging.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// The fault tests' bound on one call through the proxy: what they are about.
pub const FAULT_TIMEOUT: Duration = Duration::from_millis(500);

/// Every other test's bound on one call: on a loaded machine moto, a three-server
/// ensemble or PostgreSQL behind PgBouncer answers past 500 ms now and then, and a test
/// not about timeouts must not fail on one.
pub const GENEROUS_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a key may stay held after its guard or acquisition was dropped: the remote
/// release is a round trip in a task of its own. Shorter than the Redis lease, so that
/// a key left to expire instead is caught.
pub const FREED_WITHIN: Duration = Duration::from_millis(500);

/// Where instances meet: a server they share, or one process's table.
pub trait Fixture: Sized {
    /// Whether the backend can name a key's holder (`DistributedLocks::holder`): its
    /// instance id and fencing token. MySQL can only tell held from free.
    const NAMES_HOLDERS: bool = true;

    /// Whether tests running at once may share one server ([`shared`]).
    const SHAREABLE: bool = true;

    /// Starts the server (panics with a clear message when it is not installed).
    fn start() -> Self;

    /// The locks of one instance: its own backend connections, the shared server.
    fn instance(&self, name: &str) -> impl Future<Output = DistributedLocks>;

    /// How long a key may stay held after its guard or acquisition was dropped
    /// ([`FREED_WITHIN`] unless the engine needs longer and a leak would still show).
    fn freed_within(&self) -> Duration {
        FREED_WITHIN
    }
}

/// A fixture with a real server that instances reach over the network: a testkit
/// [`Deployment`] (its backends, loss bound, records and record window), and
/// [`Proxied`] where the fault proxy can stand in an instance's path. This adds what
/// only the tests do with it.
pub trait Remote: Fixture + Deployment {
    /// A fresh backend for the instance `name`: [`Deployment::backend`], labelled with
    /// the name where the engine shows one (PostgreSQL's `application_name`).
    fn backend_named(&self, name: &str) -> impl Future<Output = Arc<dyn LockBackend>> + Send {
        let _ = name;
        self.backend()
    }

    /// Kills the server (SIGKILL for Redis, a fast shutdown for PostgreSQL): every
    /// session and every lock on it is gone.
    fn kill(&mut self);
}

/// The server of fixture type `F` that the tests running now share: started by the
/// first, stopped when the last one using it ends (the next then starts another).
/// Starting a server costs more than most checks (three JVMs for ZooKeeper, `initdb`
/// for PostgreSQL); tests that share one use names of their own, and never kill it.
pub fn shared<F: Fixture + Send + Sync + 'static>() -> Arc<F> {
    use std::any::{Any, TypeId};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock, PoisonError, Weak};

    if !F::SHAREABLE {
        return Arc::new(F::start());
    }
    type Slot = Arc<Mutex<Weak<dyn Any + Send + Sync>>>;
    static SLOTS: OnceLock<Mutex<HashMap<TypeId, Slot>>> = OnceLock::new();
    // One slot per fixture type: a ZooKeeper ensemble starting does not hold up a
    // PostgreSQL test.
    let slot = SLOTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(TypeId::of::<F>())
        .or_insert_with(|| Arc::new(Mutex::new(Weak::<F>::new())))
        .clone();
    let mut running = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(fixture) = running.upgrade() {
        return fixture.downcast().expect("one fixture type per slot");
    }
    let fixture = Arc::new(F::start());
    let weak: Weak<F> = Arc::downgrade(&fixture);
    *running = weak;
    fixture
}

/// One test's part of a server that the tests running at once share ([`shared`]):
/// every lock name its backends send the server starts with a scope of its own, so
/// tests that use the same names and keys do not meet. Never killed: a test that kills
/// its server runs on one of its own (`alone` in [`for_each_fixture!`]).
pub struct Scoped<F> {
    fixture: Arc<F>,
    scope: String,
}

impl<F: Remote + Send + Sync + 'static> Scoped<F> {
    /// `inner`, sending every lock name in this test's scope.
    fn in_scope(&self, inner: Arc<dyn LockBackend>) -> Arc<dyn LockBackend> {
        Arc::new(InScope {
            inner,
            scope: self.scope.clone(),
        })
    }
}

impl<F: Remote + Send + Sync + 'static> Fixture for Scoped<F> {
    const NAMES_HOLDERS: bool = F::NAMES_HOLDERS;

    fn start() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        Scoped {
            fixture: shared::<F>(),
            scope: format!("t{}-", NEXT.fetch_add(1, SeqCst)),
        }
    }

    async fn instance(&self, name: &str) -> DistributedLocks {
        locks_on(self.backend_named(name).await)
    }

    fn freed_within(&self) -> Duration {
        self.fixture.freed_within()
    }
}

impl<F: Remote + Send + Sync + 'static> Deployment for Scoped<F> {
    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.in_scope(self.fixture.backend().await)
    }

    fn loss_bound(&self) -> Duration {
        self.fixture.loss_bound()
    }

    fn instance_id(&self) -> String {
        self.fixture.instance_id()
    }

    async fn records(&self, name: &str) -> usize {
        self.fixture.records(&format!("{}{name}", self.scope)).await
    }

    fn record_window(&self) -> Duration {
        self.fixture.record_window()
    }
}

impl<F: Remote + Send + Sync + 'static> Remote for Scoped<F> {
    async fn backend_named(&self, name: &str) -> Arc<dyn LockBackend> {
        self.in_scope(self.fixture.backend_named(name).await)
    }

    fn kill(&mut self) {
        panic!("a shared server is never killed: list the test as `alone`")
    }
}

impl<F: Remote + Proxied + Send + Sync + 'static> Proxied for Scoped<F> {
    fn upstream(&self) -> std::net::SocketAddr {
        self.fixture.upstream()
    }

    async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
        self.in_scope(self.fixture.backend_via(host_port).await)
    }

    fn command_timeout(&self) -> Duration {
        self.fixture.command_timeout()
    }

    fn reset_notice(&self) -> Duration {
        self.fixture.reset_notice()
    }
}

/// `inner` with every lock name prefixed by `scope`; everything else forwarded as is.
struct InScope {
    inner: Arc<dyn LockBackend>,
    scope: String,
}

impl InScope {
    fn name(&self, name: &str) -> String {
        format!("{}{name}", self.scope)
    }
}

impl LockBackend for InScope {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        self.inner.acquire(&self.name(name), key, wait)
    }

    fn acquire_mode(
        &self,
        name: &str,
        key: &Key,
        mode: tower_keyed_lock::backend::LockMode,
        wait: Duration,
    ) -> Acquisition {
        self.inner.acquire_mode(&self.name(name), key, mode, wait)
    }

    fn supports(&self, mode: tower_keyed_lock::backend::LockMode) -> bool {
        self.inner.supports(mode)
    }

    fn health(&self) -> tower_keyed_lock::backend::BoxFuture<tower_keyed_lock::backend::Health> {
        self.inner.health()
    }

    fn issues_fencing_tokens(&self) -> bool {
        self.inner.issues_fencing_tokens()
    }

    fn engine(&self) -> &'static str {
        self.inner.engine()
    }

    fn no_fencing_tokens_reason(&self) -> Option<&'static str> {
        self.inner.no_fencing_tokens_reason()
    }

    fn holder(
        &self,
        name: &str,
        key: &Key,
    ) -> tower_keyed_lock::backend::BoxFuture<
        Result<Option<tower_keyed_lock::backend::Holder>, LockError>,
    > {
        self.inner.holder(&self.name(name), key)
    }

    fn acquire_unless_recorded(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
        record: &tower_keyed_lock::backend::RecordLookup,
    ) -> Option<
        tower_keyed_lock::backend::BoxFuture<
            Result<tower_keyed_lock::backend::Acquired, LockError>,
        >,
    > {
        self.inner
            .acquire_unless_recorded(&self.name(name), key, wait, record)
    }

    fn identity(&self) -> Option<tower_keyed_lock::backend::BackendIdentity> {
        self.inner.identity()
    }
}

/// The locks of an instance on `backend`.
pub fn locks_on(backend: Arc<dyn LockBackend>) -> DistributedLocks {
    DistributedLocks::builder(NAME)
        .shared_backend(backend)
        .build()
}

/// `backend` as another instance of the application holds it: every call forwarded,
/// but an identity of its own ([`LockBackend::identity`]), so that a test playing
/// several instances in one process can give each a layer under one name on one
/// backend value. Within one real instance the layer refuses that (two layers never
/// exclude each other in process; see `tests/distributed/names.rs`).
pub struct AnotherInstance<B>(pub B);

impl<B: LockBackend> LockBackend for AnotherInstance<B> {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        self.0.acquire(name, key, wait)
    }

    fn acquire_mode(
        &self,
        name: &str,
        key: &Key,
        mode: tower_keyed_lock::backend::LockMode,
        wait: Duration,
    ) -> Acquisition {
        self.0.acquire_mode(name, key, mode, wait)
    }

    fn supports(&self, mode: tower_keyed_lock::backend::LockMode) -> bool {
        self.0.supports(mode)
    }

    fn health(&self) -> tower_keyed_lock::backend::BoxFuture<tower_keyed_lock::backend::Health> {
        self.0.health()
    }

    fn issues_fencing_tokens(&self) -> bool {
        self.0.issues_fencing_tokens()
    }

    fn engine(&self) -> &'static str {
        self.0.engine()
    }

    fn no_fencing_tokens_reason(&self) -> Option<&'static str> {
        self.0.no_fencing_tokens_reason()
    }

    fn holder(
        &self,
        name: &str,
        key: &Key,
    ) -> tower_keyed_lock::backend::BoxFuture<
        Result<Option<tower_keyed_lock::backend::Holder>, LockError>,
    > {
        self.0.holder(name, key)
    }

    fn acquire_unless_recorded(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
        record: &tower_keyed_lock::backend::RecordLookup,
    ) -> Option<
        tower_keyed_lock::backend::BoxFuture<
            Result<tower_keyed_lock::backend::Acquired, LockError>,
        >,
    > {
        self.0.acquire_unless_recorded(name, key, wait, record)
    }
}

/// Every instance is a clone of one in-process table: the locks without a backend.
pub struct InProcess(DistributedLocks);

impl Fixture for InProcess {
    fn start() -> Self {
        InProcess(DistributedLocks::in_process(NAME))
    }

    async fn instance(&self, _name: &str) -> DistributedLocks {
        self.0.clone()
    }
}

#[cfg(feature = "redis")]
pub use self::redis::Redis;

/// The Redis keys of the lock name `name` (under the default prefix) on the server at
/// `url`: `SCAN MATCH`, which a server with many keys answers in pages.
#[cfg(feature = "redis")]
pub async fn redis_records(url: &str, name: &str) -> usize {
    use ::redis::AsyncCommands;
    let client = ::redis::Client::open(url).expect("a Redis URL");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("connecting to Redis to count its keys");
    let pattern = format!(
        "*{}{name}:*",
        tower_keyed_lock::backend::redis::DEFAULT_PREFIX
    );
    let mut keys = connection
        .scan_match::<_, String>(pattern)
        .await
        .expect("SCAN");
    let mut count = 0;
    while let Some(key) = keys.next_item().await {
        key.expect("SCAN answers");
        count += 1;
    }
    count
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use crate::support::redis_server::RedisServer;
    use tower_keyed_lock::RedisBackend;

    pub use super::ttl_lease::LEASE;

    pub struct Redis(pub RedisServer);

    impl Fixture for Redis {
        fn start() -> Self {
            Redis(RedisServer::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);

    impl Proxied for Redis {
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.port()))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            let client = ::redis::Client::open(format!("redis://{host_port}/")).unwrap();
            Arc::new(backend_on(client).await)
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }
    }

    async fn backend_on(client: ::redis::Client) -> RedisBackend {
        RedisBackend::builder(client)
            // A server started for this run: no instance can hold a key it lost.
            .restart_guard(false)
            .lease(LEASE)
            .command_timeout(COMMAND_TIMEOUT)
            .build()
            .await
            .expect("the backend connects to Redis")
    }

    impl Deployment for Redis {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            Arc::new(backend_on(self.0.client()).await)
        }

        fn loss_bound(&self) -> Duration {
            LEASE
        }

        async fn records(&self, name: &str) -> usize {
            redis_records(&self.0.url(), name).await
        }

        fn record_window(&self) -> Duration {
            // The records expire a window (default: one lease) after the lock's own TTL,
            // itself at most a lease after the release.
            2 * LEASE
        }
    }

    impl Remote for Redis {
        fn kill(&mut self) {
            self.0.stop();
        }
    }
}

/// The lease of the TTL-lease fixtures (Redis, DynamoDB).
mod ttl_lease {
    use std::time::Duration;

    /// Short enough that a crashed holder's key frees soon, long enough to renew
    /// (every lease/3) on a loaded machine.
    pub const LEASE: Duration = Duration::from_secs(1);
}

#[cfg(feature = "redis")]
pub use self::cluster::RedisCluster;

#[cfg(feature = "redis")]
mod cluster {
    use super::redis::LEASE;
    use super::*;
    use tower_keyed_lock::RedisBackend;

    /// Three primaries, no replicas: the same tests on sharded pub/sub and a cluster
    /// connection.
    pub struct RedisCluster(pub crate::support::redis_cluster::RedisCluster);

    impl Fixture for RedisCluster {
        fn start() -> Self {
            RedisCluster(crate::support::redis_cluster::RedisCluster::start_primaries())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    impl Deployment for RedisCluster {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            let backend = RedisBackend::cluster_builder(self.0.client())
                .restart_guard(false)
                .lease(LEASE)
                .command_timeout(Duration::from_millis(500))
                .build()
                .await
                .expect("the backend connects to the cluster");
            Arc::new(backend)
        }

        fn loss_bound(&self) -> Duration {
            LEASE
        }

        /// Every primary's keys: a key lives on the primary of its slot.
        async fn records(&self, name: &str) -> usize {
            let mut count = 0;
            for url in self.0.urls() {
                count += super::redis_records(&url, name).await;
            }
            count
        }

        fn record_window(&self) -> Duration {
            // The records expire a window (default: one lease) after the lock's own TTL,
            // itself at most a lease after the release.
            2 * LEASE
        }
    }

    impl Remote for RedisCluster {
        fn kill(&mut self) {
            self.0.stop_all();
        }
    }
}

#[cfg(feature = "postgres")]
pub use self::postgres::Postgres;

/// What a PostgreSQL server started for one test keeps: the rows of every table outside
/// the system schemas (the crate's, on a server of its own) and the advisory locks
/// held.
#[cfg(feature = "postgres")]
pub async fn postgres_records(conn_str: &str) -> usize {
    let (client, connection) = tokio_postgres::connect(conn_str, tokio_postgres::NoTls)
        .await
        .expect("connecting to PostgreSQL to count its records");
    tokio::spawn(connection);
    let tables = client
        .query(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables \
             WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
            &[],
        )
        .await
        .expect("listing the tables");
    let mut count = 0;
    for table in tables {
        let table: String = table.get(0);
        let rows: i64 = client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .expect("counting a table's rows")
            .get(0);
        count += rows as usize;
    }
    let locks: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .expect("counting the advisory locks")
        .get(0);
    count + locks as usize
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use crate::support::pg_server::PgServer;
    use tower_keyed_lock::PostgresBackend;

    const LIVENESS: Duration = Duration::from_millis(100);
    const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);

    pub struct Postgres(pub PgServer);

    impl Fixture for Postgres {
        fn start() -> Self {
            Postgres(PgServer::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    fn backend_on(mut config: tokio_postgres::Config, name: &str) -> Arc<dyn LockBackend> {
        // Tells the instances apart in `pg_stat_activity` and the server log.
        config.application_name(name);
        let backend = PostgresBackend::builder_from_config(config)
            .liveness_interval(LIVENESS)
            .command_timeout(COMMAND_TIMEOUT)
            .fencing(true)
            .build_lazy();
        Arc::new(backend)
    }

    impl Proxied for Postgres {
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.port()))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            let (host, port) = host_port.split_once(':').unwrap();
            // A fresh config: `host` and `port` add to a parsed one's lists.
            let mut config = tokio_postgres::Config::new();
            config
                .host(host)
                .port(port.parse().unwrap())
                .user("postgres")
                .dbname("postgres");
            backend_on(config, "proxied")
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }

        fn reset_notice(&self) -> Duration {
            // The holder looks at its connection every 5 ms (`backend::postgres`
            // docs: "a few milliseconds later"); the rest is a loaded machine's slack.
            Duration::from_millis(100)
        }
    }

    impl Deployment for Postgres {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            self.backend_named("instance").await
        }

        fn loss_bound(&self) -> Duration {
            LIVENESS + COMMAND_TIMEOUT
        }

        /// The server is this test's alone: everything on it is the lock's.
        async fn records(&self, _name: &str) -> usize {
            super::postgres_records(&self.0.conn_str()).await
        }

        /// Session locks go with their release; what stays is PostgreSQL backend's own.
        fn record_window(&self) -> Duration {
            Duration::ZERO
        }
    }

    impl Remote for Postgres {
        async fn backend_named(&self, name: &str) -> Arc<dyn LockBackend> {
            backend_on(self.0.conn_str().parse().unwrap(), name)
        }

        fn kill(&mut self) {
            tokio::task::block_in_place(|| self.0.stop());
        }
    }
}

#[cfg(feature = "postgres")]
#[allow(unused_imports)] // the conformance suite's fixture only
pub use self::pgbouncer::PgBouncerTransaction;

#[cfg(feature = "postgres")]
mod pgbouncer {
    use super::*;
    use crate::support::pg_server::PgServer;
    use crate::support::pgbouncer::{PgBouncer, PoolMode};
    use tower_keyed_lock::backend::postgres::LockScope;
    use tower_keyed_lock::PostgresBackend;

    const LIVENESS: Duration = Duration::from_millis(100);
    // No fault test runs through this pooler: every call gets the generous bound.
    const COMMAND_TIMEOUT: Duration = GENEROUS_TIMEOUT;

    /// PostgreSQL behind PgBouncer in transaction pooling, locks in transaction scope:
    /// the set-up the backend accepts behind a transaction pooler.
    pub struct PgBouncerTransaction {
        // Dropped first: the pooler before its server.
        bouncer: PgBouncer,
        _server: PgServer,
    }

    impl Fixture for PgBouncerTransaction {
        /// Its pool of 8 server sessions is what the checks go through: checks side by
        /// side would queue in it.
        const SHAREABLE: bool = false;

        fn start() -> Self {
            let server = PgServer::start();
            let bouncer = PgBouncer::start(&server, PoolMode::Transaction, 8);
            PgBouncerTransaction {
                bouncer,
                _server: server,
            }
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    impl Deployment for PgBouncerTransaction {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            self.backend_named("instance").await
        }

        fn loss_bound(&self) -> Duration {
            LIVENESS + COMMAND_TIMEOUT
        }

        /// Counted on the server, not through the pooler.
        async fn records(&self, _name: &str) -> usize {
            super::postgres_records(&self._server.conn_str()).await
        }

        fn record_window(&self) -> Duration {
            Duration::ZERO
        }
    }

    impl Remote for PgBouncerTransaction {
        async fn backend_named(&self, name: &str) -> Arc<dyn LockBackend> {
            let mut config: tokio_postgres::Config = self.bouncer.conn_str().parse().unwrap();
            config.application_name(name);
            let backend = PostgresBackend::builder_from_config(config)
                .lock_scope(LockScope::Transaction)
                .liveness_interval(LIVENESS)
                .command_timeout(COMMAND_TIMEOUT)
                .fencing(true)
                .build_lazy();
            Arc::new(backend)
        }

        fn kill(&mut self) {
            tokio::task::block_in_place(|| self._server.stop());
        }
    }
}

// Not every binary that includes this file runs on MySQL.
#[cfg(feature = "mysql")]
#[allow(unused_imports)]
pub use self::mysql::MySql;

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use crate::support::mysql_server::MySqlServer;
    use tower_keyed_lock::MySqlBackend;

    pub const LIVENESS: Duration = Duration::from_millis(100);
    pub const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);

    /// MariaDB, `GET_LOCK`: a session lock like PostgreSQL's, on a server of its own.
    pub struct MySql(pub MySqlServer);

    impl Fixture for MySql {
        const NAMES_HOLDERS: bool = false;
        /// Seen: with the nine checks on one server, the server frees a cut
        /// acquisition's lock later than on a server of its own (540 ms against the
        /// check's 300 ms bound).
        const SHAREABLE: bool = false;

        fn start() -> Self {
            MySql(MySqlServer::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    pub fn backend_on(url: &str) -> MySqlBackend {
        MySqlBackend::builder_from_url(url)
            .expect("a valid URL")
            .liveness_interval(LIVENESS)
            .command_timeout(COMMAND_TIMEOUT)
            .fencing(true)
            .build_lazy()
    }

    impl Proxied for MySql {
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.port()))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            Arc::new(backend_on(&self.0.url_via(host_port)))
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }

        fn reset_notice(&self) -> Duration {
            // The holder keeps a statement pending, which the reset fails at once
            // (`backend::mysql` docs, Timing); the rest is a loaded machine's slack.
            Duration::from_millis(100)
        }
    }

    impl Deployment for MySql {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            Arc::new(backend_on(&self.0.url()))
        }

        fn loss_bound(&self) -> Duration {
            LIVENESS + COMMAND_TIMEOUT
        }

        /// The server is this test's alone: the rows of every table outside the system
        /// schemas (the fencing counter) and the user-level locks held (`GET_LOCK`),
        /// read from MariaDB's `metadata_lock_info` plugin, installed here if missing.
        async fn records(&self, _name: &str) -> usize {
            tokio::task::block_in_place(|| {
                let plugin = "SELECT COUNT(*) FROM information_schema.PLUGINS \
                              WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO'";
                if self.0.admin(plugin).trim() == "0" {
                    self.0.admin("INSTALL SONAME 'metadata_lock_info'");
                }
                let tables = self.0.admin(
                    "SELECT CONCAT('`', TABLE_SCHEMA, '`.`', TABLE_NAME, '`') \
                     FROM information_schema.TABLES WHERE TABLE_TYPE = 'BASE TABLE' \
                     AND TABLE_SCHEMA NOT IN \
                     ('mysql', 'information_schema', 'performance_schema', 'sys')",
                );
                let mut count: usize = 0;
                for table in tables.lines().filter(|line| !line.is_empty()) {
                    let rows = self.0.admin(&format!("SELECT COUNT(*) FROM {table}"));
                    count += rows.trim().parse::<usize>().expect("a row count");
                }
                let locks = self.0.admin(
                    "SELECT COUNT(*) FROM information_schema.METADATA_LOCK_INFO \
                     WHERE LOCK_TYPE = 'User lock'",
                );
                count + locks.trim().parse::<usize>().expect("a lock count")
            })
        }

        /// `GET_LOCK` names go with their release; the one counter row stays.
        fn record_window(&self) -> Duration {
            Duration::ZERO
        }
    }

    impl Remote for MySql {
        fn kill(&mut self) {
            tokio::task::block_in_place(|| self.0.stop());
        }
    }
}

#[cfg(feature = "dynamodb")]
pub use self::dynamodb::DynamoDb;

#[cfg(feature = "dynamodb")]
mod dynamodb {
    use super::ttl_lease::LEASE;
    use super::*;
    use crate::support::moto_server::{client_for, MotoServer};
    use tower_keyed_lock::backend::dynamodb::DynamoDbBackend;

    const TABLE: &str = "locks";

    /// moto, a DynamoDB-compatible server: waiting by polling, taking over a record
    /// that stopped changing.
    pub struct DynamoDb(pub MotoServer);

    impl Fixture for DynamoDb {
        /// moto serves one request at a time: checks side by side would queue there,
        /// past the bounds they measure.
        const SHAREABLE: bool = false;

        fn start() -> Self {
            DynamoDb(MotoServer::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }

        /// A give-back is a call to moto, which answers one request at a time (slow on
        /// a loaded machine); a key left to expire instead would take the whole lease.
        fn freed_within(&self) -> Duration {
            LEASE * 9 / 10
        }
    }

    const COMMAND_TIMEOUT: Duration = FAULT_TIMEOUT;

    async fn backend_on(url: &str, command_timeout: Duration) -> Arc<dyn LockBackend> {
        let builder = DynamoDbBackend::builder(client_for(url), TABLE)
            .lease(LEASE)
            .command_timeout(command_timeout)
            .poll_interval(Duration::from_millis(50));
        // moto answers its first requests slowly (it loads its backends).
        let patient = builder.clone().command_timeout(Duration::from_secs(10));
        patient.create_table().await.expect("create the table");
        let backend = builder.build().await.expect("the backend connects to moto");
        Arc::new(backend)
    }

    impl Proxied for DynamoDb {
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.port()))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            backend_on(&format!("http://{host_port}"), COMMAND_TIMEOUT).await
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }
    }

    impl Deployment for DynamoDb {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            backend_on(&self.0.url(), GENEROUS_TIMEOUT).await
        }

        fn loss_bound(&self) -> Duration {
            LEASE
        }

        /// The table's items of the lock name (`Scan`, in pages).
        async fn records(&self, name: &str) -> usize {
            use ::aws_sdk_dynamodb::types::{AttributeValue, Select};
            let client = client_for(&self.0.url());
            let prefix = format!(
                "{}{name}:",
                tower_keyed_lock::backend::dynamodb::DEFAULT_PREFIX
            );
            let mut count = 0;
            let mut start = None;
            loop {
                let page = client
                    .scan()
                    .table_name(TABLE)
                    .filter_expression("begins_with(pk, :prefix)")
                    .expression_attribute_values(":prefix", AttributeValue::S(prefix.clone()))
                    .select(Select::Count)
                    .set_exclusive_start_key(start)
                    .send()
                    .await
                    .expect("scanning the lock table");
                count += page.count() as usize;
                start = page.last_evaluated_key().cloned();
                if start.is_none() {
                    return count;
                }
            }
        }

        /// The backends of [`Deployment::backend`] wait a generous command timeout.
        fn record_window(&self) -> Duration {
            tower_keyed_lock::backend::dynamodb::record_window(GENEROUS_TIMEOUT)
        }
    }

    impl Remote for DynamoDb {
        fn kill(&mut self) {
            self.0.stop();
        }
    }
}

#[cfg(feature = "s3")]
#[allow(unused_imports)] // the conformance and s3 binaries use it
pub use self::s3::{BUCKET as S3_BUCKET, S3};

#[cfg(feature = "s3")]
mod s3 {
    use super::ttl_lease::LEASE;
    use super::*;
    use crate::support::moto_server::{s3_client_for, MotoServer};
    use tower_keyed_lock::backend::s3::S3Backend;

    /// Every instance's bucket.
    pub const BUCKET: &str = "locks";

    /// moto's S3: one object per key taken by conditional writes, polling waiters,
    /// taking over an object that stopped changing.
    pub struct S3(pub MotoServer);

    impl Fixture for S3 {
        /// moto serves one request at a time: checks side by side would queue there,
        /// past the bounds they measure.
        const SHAREABLE: bool = false;

        fn start() -> Self {
            S3(MotoServer::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }

        /// A give-back is a call to moto, which answers one request at a time (slow on
        /// a loaded machine); a key left to be taken over instead would take the whole
        /// lease.
        fn freed_within(&self) -> Duration {
            LEASE * 9 / 10
        }
    }

    const COMMAND_TIMEOUT: Duration = FAULT_TIMEOUT;

    impl S3 {
        /// A backend on moto at `url`, configured as every instance of the fixture; the
        /// bucket is made first if missing.
        pub async fn backend_on(url: &str, command_timeout: Duration) -> S3Backend {
            let client = s3_client_for(url);
            // moto answers its first requests slowly (it loads its backends).
            let made = within(
                "creating the bucket",
                PATIENCE,
                client.create_bucket().bucket(BUCKET).send(),
            )
            .await;
            if let Err(error) = made {
                let code = aws_sdk_s3::error::ProvideErrorMetadata::code(&error);
                assert!(
                    matches!(
                        code,
                        Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")
                    ),
                    "creating the bucket: {error:?}"
                );
            }
            S3Backend::builder(client, BUCKET)
                .lease(LEASE)
                .command_timeout(command_timeout)
                .poll_interval(Duration::from_millis(50))
                .build()
                .await
                .expect("the backend connects to moto's S3")
        }

        /// The objects under `prefix` in the bucket (`ListObjectsV2`, in pages).
        pub async fn objects(&self, prefix: &str) -> usize {
            let client = self.0.s3_client();
            let mut count = 0;
            let mut token = None;
            loop {
                let page = client
                    .list_objects_v2()
                    .bucket(BUCKET)
                    .prefix(prefix)
                    .set_continuation_token(token)
                    .send()
                    .await
                    .expect("listing the lock bucket");
                count += page.contents().len();
                token = page.next_continuation_token().map(str::to_owned);
                if token.is_none() {
                    return count;
                }
            }
        }
    }

    impl Proxied for S3 {
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.port()))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            Arc::new(Self::backend_on(&format!("http://{host_port}"), COMMAND_TIMEOUT).await)
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }
    }

    impl Deployment for S3 {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            Arc::new(Self::backend_on(&self.0.url(), GENEROUS_TIMEOUT).await)
        }

        fn loss_bound(&self) -> Duration {
            LEASE
        }

        /// The bucket's objects of the lock name.
        async fn records(&self, name: &str) -> usize {
            let prefix = format!("{}{name}/", tower_keyed_lock::backend::s3::DEFAULT_PREFIX);
            self.objects(&prefix).await
        }

        /// The backends of [`Deployment::backend`] wait a generous command timeout.
        fn record_window(&self) -> Duration {
            tower_keyed_lock::backend::s3::record_window(GENEROUS_TIMEOUT)
        }
    }

    impl Remote for S3 {
        fn kill(&mut self) {
            self.0.stop();
        }
    }
}

#[cfg(feature = "etcd")]
#[allow(unused_imports)] // the conformance and etcd binaries use it
pub use self::etcd::Etcd;

#[cfg(feature = "etcd")]
mod etcd {
    use super::ttl_lease::LEASE;
    use super::*;
    use crate::support::etcd_server::EtcdCluster;
    use tower_keyed_lock::EtcdBackend;

    /// A 3-member etcd cluster: a lease per holder, waiters queued by create revision
    /// and woken by a watch.
    pub struct Etcd(pub EtcdCluster);

    impl Fixture for Etcd {
        fn start() -> Self {
            Etcd(EtcdCluster::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);

    impl Etcd {
        /// A backend on `endpoints`, configured as every instance of the fixture.
        pub async fn backend_on_endpoints(endpoints: Vec<String>) -> EtcdBackend {
            backend_on(endpoints).await
        }
    }

    /// Built patiently (see `built_patiently`).
    async fn backend_on(endpoints: Vec<String>) -> EtcdBackend {
        super::built_patiently("etcd", || {
            EtcdBackend::builder(endpoints.clone())
                .lease(LEASE)
                .command_timeout(COMMAND_TIMEOUT)
                .build()
        })
        .await
    }

    impl Proxied for Etcd {
        /// The first member: the proxy stands in front of one member of three.
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.client_port(0)))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            Arc::new(backend_on(vec![format!("http://{host_port}")]).await)
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }
    }

    impl Deployment for Etcd {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            Arc::new(backend_on(self.0.endpoints()).await)
        }

        /// The lease: the test cluster's shortest is 900 ms, so 1 s is granted as
        /// asked.
        fn loss_bound(&self) -> Duration {
            LEASE
        }

        /// The keys under the lock name's prefix (a count-only range).
        async fn records(&self, name: &str) -> usize {
            let mut client = etcd_client::Client::connect(self.0.endpoints(), None)
                .await
                .expect("connecting to etcd to count its keys");
            let prefix = format!("{}{name}/", tower_keyed_lock::backend::etcd::DEFAULT_PREFIX);
            let options = etcd_client::GetOptions::new()
                .with_prefix()
                .with_count_only();
            let answer = client
                .get(prefix, Some(options))
                .await
                .expect("a count of etcd keys");
            answer.count() as usize
        }

        /// A contender's key goes with its lease, revoked at the release.
        fn record_window(&self) -> Duration {
            Duration::ZERO
        }
    }

    impl Remote for Etcd {
        fn kill(&mut self) {
            self.0.kill_all();
        }
    }
}

#[cfg(feature = "redis")]
#[allow(unused_imports)] // the conformance and redlock binaries use it
pub use self::redlock::{Redlock, COMMAND_TIMEOUT as REDLOCK_COMMAND_TIMEOUT};

#[cfg(feature = "redis")]
mod redlock {
    use super::ttl_lease::LEASE;
    use super::*;
    use crate::support::redis_server::RedisServer;
    use tower_keyed_lock::RedlockBackend;

    /// How many masters the fixture starts.
    pub const MASTERS: usize = 5;

    /// One attempt on one master: small against the lease (a third of it at most).
    pub const COMMAND_TIMEOUT: Duration = Duration::from_millis(250);

    /// Five independent `redis-server`s (Redlock's masters), each on a port of its own.
    pub struct Redlock(pub Vec<RedisServer>);

    impl Fixture for Redlock {
        fn start() -> Self {
            Redlock((0..MASTERS).map(|_| RedisServer::start()).collect())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    impl Redlock {
        /// The masters' URLs, in order.
        pub fn urls(&self) -> Vec<String> {
            self.0.iter().map(RedisServer::url).collect()
        }

        /// A backend on `urls` (the masters, or proxies in front of some), configured as
        /// every instance of the fixture, with the restart guard as asked.
        pub async fn backend_on(urls: Vec<String>, restart_guard: bool) -> RedlockBackend {
            RedlockBackend::builder(urls)
                .lease(LEASE)
                .command_timeout(COMMAND_TIMEOUT)
                .poll_interval(Duration::from_millis(50))
                .restart_guard(restart_guard)
                .build()
                .await
                .expect("the backend reaches a majority of the masters")
        }
    }

    impl Deployment for Redlock {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            // Servers started for this run: none can have lost a key an instance holds.
            Arc::new(Self::backend_on(self.urls(), false).await)
        }

        fn loss_bound(&self) -> Duration {
            LEASE
        }

        /// The most any one master keeps: each holds a copy of the lock's state.
        async fn records(&self, name: &str) -> usize {
            let mut most = 0;
            for url in self.urls() {
                most = most.max(super::redis_records(&url, name).await);
            }
            most
        }

        fn record_window(&self) -> Duration {
            // A release deletes the lock and its holder record (left alone, they expire
            // within two leases); a given-back mark lives ten command timeouts, at
            // least 5 s, within one lease and ten: 5 s here.
            let mark = (COMMAND_TIMEOUT * 10)
                .max(Duration::from_secs(5))
                .clamp(LEASE, LEASE * 10);
            mark.max(2 * LEASE)
        }
    }

    impl Remote for Redlock {
        fn kill(&mut self) {
            self.0.iter_mut().for_each(RedisServer::stop);
        }
    }
}

#[cfg(feature = "azure-blob")]
#[allow(unused_imports)] // the conformance and azure_blob binaries use it
pub use self::azure_blob::{AzureBlob, LEASE as AZURE_LEASE};

/// How many blobs whose names start with `prefix` the container at `url` (with its SAS
/// query) has: `List Blobs`, page after page.
#[cfg(feature = "azure-blob")]
pub async fn blob_count(url: &str, prefix: &str) -> usize {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let encode = |text: &str| -> String {
        text.bytes()
            .map(|byte| match byte {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (byte as char).to_string()
                }
                _ => format!("%{byte:02X}"),
            })
            .collect()
    };
    let mut count = 0;
    let mut marker = String::new();
    loop {
        let uri = format!(
            "{url}&restype=container&comp=list&prefix={}&marker={}",
            encode(prefix),
            encode(&marker)
        );
        let request = http::Request::get(uri)
            .header("x-ms-version", "2022-11-02")
            .body(Empty::new())
            .unwrap();
        let response = client.request(request).await.expect("List Blobs");
        assert!(
            response.status().is_success(),
            "List Blobs: {}",
            response.status()
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        count += body.matches("<Blob>").count();
        marker = body
            .split("<NextMarker>")
            .nth(1)
            .and_then(|rest| rest.split("</NextMarker>").next())
            .unwrap_or_default()
            .to_owned();
        if marker.is_empty() {
            return count;
        }
    }
}

#[cfg(feature = "azure-blob")]
mod azure_blob {
    use super::*;
    use crate::support::azurite_server::{container_url, AzuriteServer};
    use tower_keyed_lock::AzureBlobBackend;

    /// Azurite (Azure Blob Storage's emulator): a blob lease per holder, polling
    /// waiters, the fencing token in the blob's metadata.
    pub struct AzureBlob(pub AzuriteServer);

    /// Azure's shortest lease: the loss bound of every Azure test.
    pub const LEASE: Duration = Duration::from_secs(15);
    const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);
    /// Shorter than the default, for prompt hand-offs in the tests.
    const POLL_INTERVAL: Duration = Duration::from_millis(100);
    /// Every instance's container.
    pub const CONTAINER: &str = "locks";

    impl Fixture for AzureBlob {
        fn start() -> Self {
            AzureBlob(AzuriteServer::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }
    }

    impl AzureBlob {
        /// A backend on the container at `url`, configured as every instance of the
        /// fixture.
        pub async fn backend_on(url: String) -> AzureBlobBackend {
            Self::backend_with(url, COMMAND_TIMEOUT).await
        }

        async fn backend_with(url: String, command_timeout: Duration) -> AzureBlobBackend {
            AzureBlobBackend::builder(url)
                .lease(LEASE)
                .command_timeout(command_timeout)
                .poll_interval(POLL_INTERVAL)
                .build()
                .await
                .expect("the backend reaches Azurite")
        }

        /// A backend of this fixture's server.
        pub async fn azure_backend(&self) -> AzureBlobBackend {
            Self::backend_on(self.0.container_url(CONTAINER)).await
        }
    }

    impl Proxied for AzureBlob {
        fn upstream(&self) -> std::net::SocketAddr {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.0.port()))
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            Arc::new(Self::backend_on(container_url(host_port, CONTAINER)).await)
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }
    }

    impl Deployment for AzureBlob {
        /// Azurite on a loaded machine takes over 500 ms for a call now and then: an
        /// instance's backend, in a test not about timeouts, waits longer.
        async fn backend(&self) -> Arc<dyn LockBackend> {
            let url = self.0.container_url(CONTAINER);
            Arc::new(Self::backend_with(url, GENEROUS_TIMEOUT).await)
        }

        /// The lease: Azure's shortest, 15 s.
        fn loss_bound(&self) -> Duration {
            LEASE
        }

        /// The container's blobs of the lock name (`List Blobs` with the prefix, in
        /// pages).
        async fn records(&self, name: &str) -> usize {
            let prefix = format!(
                "{}{name}/",
                tower_keyed_lock::backend::azure_blob::DEFAULT_PREFIX
            );
            blob_count(&self.0.container_url(CONTAINER), &prefix).await
        }

        /// The backends of [`Deployment::backend`] wait a generous command timeout.
        fn record_window(&self) -> Duration {
            tower_keyed_lock::backend::azure_blob::record_window(GENEROUS_TIMEOUT)
        }
    }

    impl Remote for AzureBlob {
        fn kill(&mut self) {
            self.0.kill();
        }
    }
}

#[cfg(feature = "zookeeper")]
#[allow(unused_imports)] // the conformance and zookeeper binaries use it
pub use self::zookeeper::ZooKeeper;

#[cfg(feature = "zookeeper")]
pub mod zookeeper {
    use super::*;
    use crate::support::zookeeper_server::ZooKeeperEnsemble;
    use tower_keyed_lock::ZooKeeperBackend;

    /// A 3-server ZooKeeper ensemble: an ephemeral sequential node per contender, each
    /// waiter watching its predecessor.
    pub struct ZooKeeper(pub ZooKeeperEnsemble);

    impl Fixture for ZooKeeper {
        fn start() -> Self {
            ZooKeeper(ZooKeeperEnsemble::start())
        }

        async fn instance(&self, name: &str) -> DistributedLocks {
            locks_on(self.backend_named(name).await)
        }

        /// A dropped acquisition's give-back may first look its unanswered create up by
        /// its token (two round trips in a task of its own, slow on a loaded machine);
        /// a node left behind would stay for the backend's whole session, so a longer
        /// bound still catches a leak.
        fn freed_within(&self) -> Duration {
            Duration::from_secs(3)
        }
    }

    /// The session timeout asked (the test ensemble's tick is 200 ms: 10 ticks).
    pub const SESSION_TIMEOUT: Duration = Duration::from_secs(2);
    const COMMAND_TIMEOUT: Duration = FAULT_TIMEOUT;

    impl ZooKeeper {
        /// The command timeout of a backend behind the fault proxy.
        pub const PROXIED_COMMAND_TIMEOUT: Duration = COMMAND_TIMEOUT;

        /// A backend on `servers` (a connect string), configured as every instance of
        /// the fixture.
        pub async fn backend_on_servers(servers: &str) -> ZooKeeperBackend {
            Self::backend_with(servers, GENEROUS_TIMEOUT).await
        }

        /// A backend on `servers` with `command_timeout`: the fault tests' 500 ms through a
        /// proxy ([`Self::PROXIED_COMMAND_TIMEOUT`]), built patiently (see `built_patiently`).
        pub async fn backend_with(servers: &str, command_timeout: Duration) -> ZooKeeperBackend {
            super::built_patiently("ZooKeeper", || {
                ZooKeeperBackend::builder(servers)
                    .lease(SESSION_TIMEOUT)
                    .command_timeout(command_timeout)
                    .build()
            })
            .await
        }
    }

    impl Proxied for ZooKeeper {
        /// The first server: the proxy stands in front of one server of three.
        fn upstream(&self) -> std::net::SocketAddr {
            self.0.client_addr(0)
        }

        async fn backend_via(&self, host_port: &str) -> Arc<dyn LockBackend> {
            Arc::new(ZooKeeper::backend_with(host_port, COMMAND_TIMEOUT).await)
        }

        fn command_timeout(&self) -> Duration {
            COMMAND_TIMEOUT
        }
    }

    impl Deployment for ZooKeeper {
        async fn backend(&self) -> Arc<dyn LockBackend> {
            Arc::new(ZooKeeper::backend_on_servers(&self.0.connect_string()).await)
        }

        /// The session timeout, plus a tick: the leader expires sessions in buckets of
        /// a tick.
        fn loss_bound(&self) -> Duration {
            SESSION_TIMEOUT + crate::support::zookeeper_server::TICK
        }

        /// The lock name's node and every node under it.
        async fn records(&self, name: &str) -> usize {
            let client = ::zookeeper_client::Client::connect(&self.0.connect_string())
                .await
                .expect("connecting to ZooKeeper to count its nodes");
            let root = format!(
                "{}/{name}",
                tower_keyed_lock::backend::zookeeper::DEFAULT_PREFIX
            );
            let mut count = 0;
            let mut pending = vec![root];
            while let Some(path) = pending.pop() {
                match client.list_children(&path).await {
                    Ok(children) => {
                        count += 1;
                        pending.extend(children.into_iter().map(|child| format!("{path}/{child}")));
                    }
                    // Deleted meanwhile (a released contender, an emptied container).
                    Err(::zookeeper_client::Error::NoNode) => {}
                    Err(error) => panic!("listing {path}: {error}"),
                }
            }
            count
        }

        /// One sweep of the ensemble's container manager, which deletes the empty
        /// queues (the test ensemble sweeps every
        /// [`CONTAINER_SWEEP`](crate::support::zookeeper_server::CONTAINER_SWEEP)).
        fn record_window(&self) -> Duration {
            crate::support::zookeeper_server::CONTAINER_SWEEP
        }
    }

    impl Remote for ZooKeeper {
        fn kill(&mut self) {
            self.0.kill_all();
        }
    }
}

/// A real backend that counts the acquisitions this instance sends it: how many in
/// all, and the most in flight at once.
pub struct Counting {
    inner: Arc<dyn LockBackend>,
    in_flight: Arc<AtomicUsize>,
    most_in_flight: Arc<AtomicUsize>,
    calls: AtomicUsize,
}

impl Counting {
    pub fn new(inner: Arc<dyn LockBackend>) -> Arc<Self> {
        Arc::new(Counting {
            inner,
            in_flight: Arc::default(),
            most_in_flight: Arc::default(),
            calls: AtomicUsize::new(0),
        })
    }

    pub fn calls(&self) -> usize {
        self.calls.load(SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(SeqCst)
    }

    pub fn most_in_flight(&self) -> usize {
        self.most_in_flight.load(SeqCst)
    }
}

impl LockBackend for Counting {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        self.calls.fetch_add(1, SeqCst);
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.most_in_flight.fetch_max(now, SeqCst);
        let in_flight = self.in_flight.clone();
        let acquire = self.inner.acquire(name, key, wait);
        Box::pin(async move {
            let result = acquire.await;
            in_flight.fetch_sub(1, SeqCst);
            result
        })
    }
}

/// Waits until the async `condition` holds, failing the test after [`PATIENCE`]. The
/// looks back off (5 ms doubling to 100 ms): a server that serves one request at a
/// time (moto) drains what it queued instead of receiving a new look every 5 ms.
pub async fn until<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let deadline = Instant::now() + PATIENCE;
    let mut pause = Duration::from_millis(5);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// A backend from `build`, tried again for [`PATIENCE`]: setting up is not what a test
/// is about, and a loaded machine can slow a connect past a short command timeout.
async fn built_patiently<
    T,
    E: std::fmt::Debug + std::fmt::Display,
    F: Future<Output = Result<T, E>>,
>(
    engine: &str,
    mut build: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match build().await {
            Ok(backend) => return backend,
            Err(error) if Instant::now() < deadline => {
                eprintln!("connecting to {engine} again: {error}");
            }
            Err(error) => panic!("the backend connects to {engine}: {error:?}"),
        }
    }
}

/// Fails the test instead of hanging it.
pub async fn within<T>(what: &str, limit: Duration, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?}: {what}"))
}

/// Generates one `#[tokio::test]` per generic test body and fixture:
/// `for_each_fixture!(all: [a, b], remote: [c], alone: [d])` makes `in_process::a`
/// calling `a::<InProcess>()`, `redis::a` calling `a::<Scoped<Redis>>()` (a server the
/// tests running at once share, each in a scope of its own), `redis::c`, `redis::d`
/// calling `d::<Redis>()` (a server of its own: `d` kills it), `redis_cluster::a`, and so on.
#[allow(unused_macros)] // not every binary that includes this file uses it
macro_rules! for_each_fixture {
    (all: [$($all:ident),* $(,)?], remote: [$($remote:ident),* $(,)?] $(, alone: [$($alone:ident),* $(,)?])? $(,)?) => {
        for_each_fixture!(@mod in_process, $crate::support::fixtures::InProcess, $crate::support::fixtures::InProcess, []; [$($all),*]; []);
        for_each_fixture!(@remote redis, Redis, ["redis"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
        for_each_fixture!(@remote redis_cluster, RedisCluster, ["redis"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
        for_each_fixture!(@remote postgres, Postgres, ["postgres"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
        for_each_fixture!(@remote dynamodb, DynamoDb, ["dynamodb"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
        for_each_fixture!(@remote s3, S3, ["s3"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
        for_each_fixture!(@remote mysql, MySql, ["mysql"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
        for_each_fixture!(@remote zookeeper, ZooKeeper, ["zookeeper"]; [$($all,)* $($remote),*]; [$($($alone),*)?]);
    };
    (@remote $module:ident, $fixture:ident, [$feature:literal]; [$($test:ident),* $(,)?]; [$($alone:ident),* $(,)?]) => {
        for_each_fixture!(@mod $module,
            $crate::support::fixtures::Scoped<$crate::support::fixtures::$fixture>,
            $crate::support::fixtures::$fixture,
            [$feature]; [$($test),*]; [$($alone),*]);
    };
    (@mod $module:ident, $scoped:ty, $fixture:ty, [$($feature:literal)?]; [$($test:ident),* $(,)?]; [$($alone:ident),* $(,)?]) => {
        $(#[cfg(feature = $feature)])?
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test::<$scoped>().await
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $alone() {
                    super::$alone::<$fixture>().await
                }
            )*
        }
    };
}

/// Polls `future` once, with a waker that does nothing.
pub fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(Waker::noop()))
}

/// Which await the acquisition is at (`local`, `remote`, ...), from its `Debug` form.
pub fn state(acquire: &DistributedAcquire) -> String {
    let debug = format!("{acquire:?}");
    let start = debug.find("state: \"").expect("Debug shows the state") + 8;
    debug[start..].split('"').next().unwrap().to_owned()
}

/// Takes `key` on `locks` with `try_lock` until it is free, failing the test after
/// `limit`; returns how long that took.
/// `limit` is stretched by how late this runtime's timers fired meanwhile. A backend
/// error is looked past until then: `try_lock` waits one command timeout, which a
/// loaded machine can exceed now and then (a 503 to a user, not a key left held).
pub async fn wait_free(locks: &DistributedLocks, key: &str, limit: Duration) -> Duration {
    let lateness = crate::support::lateness::Lateness::watch();
    let started = Instant::now();
    let mut failed = None;
    loop {
        match locks.try_lock(key).await {
            Ok(guard) => {
                guard.release().await;
                return started.elapsed();
            }
            Err(LockError::Busy) => {}
            Err(LockError::Backend(error)) => {
                eprintln!("try_lock({key:?}) failed, trying again: {error}");
                failed = Some(error);
            }
            Err(error) => panic!("try_lock({key:?}) failed: {error}"),
        }
        let limit = lateness.allowing(limit);
        assert!(
            started.elapsed() < limit,
            "{key:?} still held after {limit:?} (the last backend error: {failed:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `condition` holds, failing the test after [`PATIENCE`].
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(
            started.elapsed() < PATIENCE,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
