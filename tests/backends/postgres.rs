//! The PostgreSQL backend against a real PostgreSQL server each test starts (initdb in
//! a temp dir, a free port), through real hyper servers: two "instances" are two
//! layers with their own backends and pools on one database.
#![cfg(feature = "postgres")]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Extension;
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use tokio::sync::{mpsc, Semaphore};
use tokio_postgres::{Client, NoTls};
use tower_keyed_lock::backend::postgres::{
    lock_id, LockScope, PostgresBackend, PostgresBackendBuilder, DEFAULT_COMMAND_TIMEOUT,
    LOCK_ID_SQL,
};
use tower_keyed_lock::backend::SetupError;
use tower_keyed_lock::{Key, KeyedLockLayer, LockBackend, LockError, LockInfo};

use crate::support::pg_server::PgServer;
use crate::support::recorder::counter;
use crate::support::{serve, Overlap, Server};

/// Long enough for anything that should happen; a test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------- helpers

/// A backend as an application would build it, with a fast liveness check and an
/// application name that tells the instances apart in `pg_stat_activity` and the log.
fn builder(pg: &PgServer, instance: &str) -> PostgresBackendBuilder {
    let mut config: tokio_postgres::Config = pg.conn_str().parse().unwrap();
    config.application_name(instance);
    // Superuser-only setting, fine here: the log then shows every statement.
    config.options("-c log_statement=all");
    PostgresBackend::builder_from_config(config).liveness_interval(Duration::from_millis(100))
}

/// [`builder`] with its defaults, connecting on first use.
fn backend(pg: &PgServer, instance: &str) -> PostgresBackend {
    builder(pg, instance).build_lazy()
}

/// A connection of the test's own, to look at the server.
async fn admin(pg: &PgServer) -> Client {
    let (client, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

async fn advisory_locks(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The pid of the session holding an advisory lock (there must be exactly one).
async fn holder_pid(admin: &Client) -> i32 {
    let rows = admin
        .query(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "expected one advisory lock held");
    rows[0].get(0)
}

/// Sessions of `instance` blocked on an advisory lock: (pid, query_start as text).
async fn advisory_waiters(admin: &Client, instance: &str) -> Vec<(i32, String)> {
    admin
        .query(
            "SELECT pid, query_start::text FROM pg_stat_activity \
             WHERE application_name = $1 AND wait_event_type = 'Lock' \
             AND wait_event = 'advisory'",
            &[&instance],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Waits until `condition` holds, failing the test after [`PATIENCE`].
async fn eventually<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let deadline = Instant::now() + PATIENCE;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`assert_pool_clean`] once `idle` connections are back in the pool: a release
/// unlocks first and returns its connection after the answer, so the server can show
/// no lock while the pool is still one short.
async fn assert_pool_clean_with(backend: &PostgresBackend, idle: usize) {
    eventually("the connections are back in the pool", || async {
        backend.pool().status().available >= idle
    })
    .await;
    assert_eq!(assert_pool_clean(backend).await, idle);
}

/// Every connection idle in `backend`'s pool holds no advisory lock and has the
/// default `lock_timeout`: nothing leaked into the pool. Returns how many there were.
async fn assert_pool_clean(backend: &PostgresBackend) -> usize {
    let pool = backend.pool();
    let idle = pool.status().available;
    let mut taken = Vec::new();
    for _ in 0..idle {
        let client = tokio::time::timeout(PATIENCE, pool.get())
            .await
            .expect("pool wait")
            .expect("pooled connection");
        let locks: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_locks \
                 WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(locks, 0, "a pooled connection holds an advisory lock");
        let lock_timeout: String = client
            .query_one("SHOW lock_timeout", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(lock_timeout, "0", "lock_timeout leaked into the pool");
        taken.push(client);
    }
    idle
}

/// What the handlers report, and the gate that keeps them inside.
struct Probe {
    overlap: Overlap,
    entered: mpsc::UnboundedSender<LockInfo>,
    /// Each handler takes one permit before it returns.
    gate: Semaphore,
    hold: Duration,
}

impl Probe {
    /// A probe whose handlers wait at a closed gate.
    fn gated() -> (Arc<Probe>, mpsc::UnboundedReceiver<LockInfo>) {
        Self::new(Duration::ZERO, 0)
    }

    /// A probe whose handlers run for `hold` and leave.
    fn open(hold: Duration) -> (Arc<Probe>, mpsc::UnboundedReceiver<LockInfo>) {
        Self::new(hold, Semaphore::MAX_PERMITS)
    }

    fn new(hold: Duration, permits: usize) -> (Arc<Probe>, mpsc::UnboundedReceiver<LockInfo>) {
        let (entered, receiver) = mpsc::unbounded_channel();
        let probe = Probe {
            overlap: Overlap::default(),
            entered,
            gate: Semaphore::new(permits),
            hold,
        };
        (Arc::new(probe), receiver)
    }
}

/// `/orders/{order_id}`: enters, reports, holds, passes the gate; answers the fencing
/// token. `/lost/{order_id}`: enters, reports, answers "lost" once the lease is lost.
fn app(layer: KeyedLockLayer<tower_keyed_lock::PathParam>, probe: Arc<Probe>) -> Router {
    let lost_probe = probe.clone();
    Router::new()
        .route(
            "/orders/{order_id}",
            post(move |Extension(info): Extension<LockInfo>| {
                let probe = probe.clone();
                async move {
                    let _inside = probe.overlap.enter();
                    let token = info.fencing_token();
                    let _ = probe.entered.send(info);
                    tokio::time::sleep(probe.hold).await;
                    probe.gate.acquire().await.unwrap().forget();
                    token.map(|t| t.to_string()).unwrap_or_default()
                }
            }),
        )
        .route(
            "/lost/{order_id}",
            post(move |Extension(info): Extension<LockInfo>| {
                let probe = lost_probe.clone();
                async move {
                    let lease = info.lease().expect("a distributed lease").clone();
                    let _ = probe.entered.send(info);
                    match tokio::time::timeout(PATIENCE, lease.lost()).await {
                        Ok(()) => "lost",
                        Err(_) => "kept",
                    }
                }
            }),
        )
        .layer(layer)
}

/// A layer on `backend` named like every instance of the same application.
fn layer(backend: PostgresBackend, wait: Duration) -> KeyedLockLayer<tower_keyed_lock::PathParam> {
    KeyedLockLayer::by_path("order_id")
        .name("orders")
        .wait_timeout(wait)
        .backend(backend)
}

async fn next_entered(entered: &mut mpsc::UnboundedReceiver<LockInfo>) -> LockInfo {
    tokio::time::timeout(PATIENCE, entered.recv())
        .await
        .expect("no handler entered")
        .unwrap()
}

/// Sends `path` to `server`; fails the test instead of hanging if nothing answers.
async fn send(server: &Server, path: &str) -> crate::support::Answer {
    tokio::time::timeout(PATIENCE, server.post(path))
        .await
        .expect("request did not finish")
}

/// Sends `path` to `server` in a task of its own.
fn spawn_post(server: &Arc<Server>, path: &str) -> tokio::task::JoinHandle<crate::support::Answer> {
    let server = server.clone();
    let path = path.to_owned();
    tokio::spawn(async move { send(&server, &path).await })
}

async fn answer(task: tokio::task::JoinHandle<crate::support::Answer>) -> crate::support::Answer {
    tokio::time::timeout(PATIENCE, task)
        .await
        .expect("request did not finish")
        .unwrap()
}

// ---------------------------------------------------------------- lock ids

/// Lock ids are part of the wire format: other programs compute them too. These
/// values must never change.
const PINNED: [(&str, &str, &str, i64); 5] = [
    (
        "tower-keyed-lock",
        "default",
        "order-1",
        1_503_006_163_820_384_762,
    ),
    (
        "tower-keyed-lock",
        "orders",
        "42",
        -2_357_060_318_159_420_717,
    ),
    ("billing", "orders", "42", -2_255_981_584_657_395_281),
    (
        "tower-keyed-lock",
        "default",
        "Ünïcødé ключ 🔒",
        -3_185_340_814_722_296_477,
    ),
    ("", "", "x", -407_224_031_659_717_868),
];

#[test]
fn lock_ids_are_pinned() {
    for (namespace, name, key, id) in PINNED {
        assert_eq!(
            lock_id(namespace, name, key),
            id,
            "{namespace}/{name}/{key}"
        );
    }
    let backend = PostgresBackend::builder_from_str("host=localhost")
        .unwrap()
        .prefix("billing")
        .build_lazy();
    assert_eq!(backend.lock_id("orders", "42"), PINNED[2].3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sql_formula_gives_the_same_ids() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    for (namespace, name, key, id) in PINNED {
        let row = admin
            .query_one(LOCK_ID_SQL, &[&namespace, &name, &key])
            .await
            .unwrap();
        assert_eq!(row.get::<_, i64>(0), id, "{namespace}/{name}/{key}");
    }
    // The documented pg_locks mapping: classid = high 32 bits, objid = low 32 bits.
    let id = PINNED[1].3;
    admin
        .execute("SELECT pg_advisory_lock($1)", &[&id])
        .await
        .unwrap();
    let row = admin
        .query_one(
            "SELECT classid::bigint, objid::bigint, objsubid::int FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    let bits = id as u64;
    assert_eq!(row.get::<_, i64>(0), (bits >> 32) as i64);
    assert_eq!(row.get::<_, i64>(1), (bits & 0xffff_ffff) as i64);
    assert_eq!(row.get::<_, i32>(2), 1);
}

// ---------------------------------------------------------------- two instances

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn same_key_is_serialized_across_instances() {
    let pg = PgServer::start();
    let (probe, _entered) = Probe::open(Duration::from_millis(15));
    let (a, b) = (backend(&pg, "instance-a"), backend(&pg, "instance-b"));
    let (backend_a, backend_b) = (a.clone(), b.clone());
    let wait = Duration::from_secs(30);
    let server_a = serve(app(layer(a, wait), probe.clone())).await;
    let server_b = serve(app(layer(b, wait), probe.clone())).await;

    let mut requests = Vec::new();
    for _ in 0..12 {
        requests.push(send(&server_a, "/orders/1"));
        requests.push(send(&server_b, "/orders/1"));
    }
    let answers = crate::support::join_all(requests).await;
    for answer in &answers {
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    }
    assert_eq!(
        probe.overlap.max(),
        1,
        "two handlers of one key ran at once"
    );

    let admin = admin(&pg).await;
    eventually("every lock is released", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
    assert_pool_clean(&backend_a).await;
    assert_pool_clean(&backend_b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn different_keys_run_in_parallel() {
    let pg = PgServer::start();
    let (probe, mut entered) = Probe::gated();
    let wait = Duration::from_secs(30);
    let a = Arc::new(serve(app(layer(backend(&pg, "a"), wait), probe.clone())).await);
    let b = Arc::new(serve(app(layer(backend(&pg, "b"), wait), probe.clone())).await);

    let first = spawn_post(&a, "/orders/x");
    let second = spawn_post(&b, "/orders/y");
    let third = spawn_post(&a, "/orders/z");
    // All three are inside at once, behind the closed gate.
    let mut keys = Vec::new();
    for _ in 0..3 {
        keys.push(next_entered(&mut entered).await.key().to_owned());
    }
    keys.sort();
    assert_eq!(keys, ["x", "y", "z"]);
    assert_eq!(probe.overlap.max(), 3);

    probe.gate.add_permits(3);
    for task in [first, second, third] {
        assert_eq!(answer(task).await.status, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_key_times_out_with_409() {
    let pg = PgServer::start();
    let (probe, mut entered) = Probe::gated();
    let b = backend(&pg, "b");
    let backend_b = b.clone();
    let a = Arc::new(serve(app(layer(backend(&pg, "a"), PATIENCE), probe.clone())).await);
    let wait = Duration::from_millis(300);
    let server_b = serve(app(layer(b, wait), probe.clone())).await;
    let once = serve(app(
        layer(backend(&pg, "try-once"), Duration::ZERO),
        probe.clone(),
    ))
    .await;

    let holder = spawn_post(&a, "/orders/1");
    next_entered(&mut entered).await;

    let started = Instant::now();
    let busy = send(&server_b, "/orders/1").await;
    let waited = started.elapsed();
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert!(busy.headers.contains_key(http::header::RETRY_AFTER));
    assert!(waited >= wait, "gave up early, after {waited:?}");
    assert!(
        waited < wait + Duration::from_secs(1),
        "gave up late, after {waited:?}"
    );

    let started = Instant::now();
    assert_eq!(send(&once, "/orders/1").await.status, StatusCode::CONFLICT);
    assert!(started.elapsed() < Duration::from_secs(1));

    // The wait timed out in PostgreSQL (55P03), the grant check found nothing, and the
    // connection went back to the pool clean: no lock, lock_timeout reset.
    assert_pool_clean_with(&backend_b, 1).await;

    probe.gate.add_permits(1);
    assert_eq!(answer(holder).await.status, StatusCode::OK);
    probe.gate.add_permits(1);
    assert_eq!(send(&server_b, "/orders/1").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_happens_in_postgres_without_polling() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let b = backend(&pg, "waiter-b");
    let backend_b = b.clone();
    let a = Arc::new(
        serve(app(
            layer(backend(&pg, "holder-a"), PATIENCE),
            probe.clone(),
        ))
        .await,
    );
    let server_b = Arc::new(serve(app(layer(b, Duration::from_secs(30)), probe.clone())).await);

    let holder = spawn_post(&a, "/orders/1");
    next_entered(&mut entered).await;
    let waiter = spawn_post(&server_b, "/orders/1");

    // The waiter blocks inside PostgreSQL, on the advisory lock...
    eventually("the waiter blocks on the advisory lock", || async {
        advisory_waiters(&admin, "waiter-b").await.len() == 1
    })
    .await;
    let before = advisory_waiters(&admin, "waiter-b").await;
    // ...and stays in that one statement: a poller would have run many by now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(advisory_waiters(&admin, "waiter-b").await, before);
    let lock_statements = |log: &str| {
        log.lines()
            .filter(|line| line.contains("waiter-b:"))
            .filter(|line| {
                line.contains("pg_try_advisory_lock") || line.contains("pg_advisory_lock(")
            })
            .count()
    };
    assert_eq!(
        lock_statements(&pg.log()),
        2,
        "expected one try and one wait:\n{}",
        pg.log()
    );

    probe.gate.add_permits(2);
    assert_eq!(answer(holder).await.status, StatusCode::OK);
    let answer = answer(waiter).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(lock_statements(&pg.log()), 2);

    eventually("every lock is released", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
    // The granted wait left its connection clean too.
    assert_pool_clean_with(&backend_b, 1).await;
}

// ---------------------------------------------------------------- cancellation

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_while_waiting_leaves_no_lock() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let b = backend(&pg, "cancel-b");
    let backend_b = b.clone();
    let a = Arc::new(
        serve(app(
            layer(backend(&pg, "cancel-a"), PATIENCE),
            probe.clone(),
        ))
        .await,
    );
    let layer_b = layer(b, Duration::from_secs(30));
    let server_b = serve(app(layer_b.clone(), probe.clone())).await;

    let holder = spawn_post(&a, "/orders/1");
    next_entered(&mut entered).await;

    let client = server_b.send_raw("/orders/1").await;
    eventually("the waiter blocks in PostgreSQL", || async {
        advisory_waiters(&admin, "cancel-b").await.len() == 1
    })
    .await;
    drop(client);
    eventually("the cancelled request leaves the table", || async {
        layer_b.active_keys() == 0
    })
    .await;

    // The holder finishes; the abandoned wait has ended in PostgreSQL (its closed
    // connection seen within 50 ms), or is granted and given straight back.
    probe.gate.add_permits(1);
    assert_eq!(answer(holder).await.status, StatusCode::OK);
    eventually("no advisory lock is left", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
    assert_pool_clean(&backend_b).await;
    assert_eq!(probe.overlap.max(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_while_holding_leaves_no_lock() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let a = backend(&pg, "hold-a");
    let backend_a = a.clone();
    let layer_a = layer(a, PATIENCE);
    let server = serve(app(layer_a.clone(), probe.clone())).await;

    let client = server.send_raw("/orders/1").await;
    next_entered(&mut entered).await;
    assert_eq!(advisory_locks(&admin).await, 1);
    drop(client);

    eventually("the lock is released", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
    eventually("the key leaves the table", || async {
        layer_a.active_keys() == 0
    })
    .await;
    // Unlocked, and the connection went back to the pool rather than being closed.
    eventually("the connection is back in the pool", || async {
        let status = backend_a.pool().status();
        status.size == 1 && status.available == 1
    })
    .await;
    assert_pool_clean(&backend_a).await;
}

/// The backend alone, without the layer's detached task: a dropped acquire closes its
/// connection instead of pooling it, and PostgreSQL then frees what it got.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_acquire_closes_its_connection() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let holder = backend(&pg, "direct-holder");
    let waiter = backend(&pg, "direct-waiter");
    let key = Key::new("1", 64).unwrap();

    let lease = holder
        .acquire("orders", &key, Duration::ZERO)
        .await
        .unwrap();
    let waiting = waiter.acquire("orders", &key, Duration::from_millis(500));
    let waiting = tokio::spawn(waiting);
    eventually("the waiter blocks in PostgreSQL", || async {
        advisory_waiters(&admin, "direct-waiter").await.len() == 1
    })
    .await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    // Taken out of the pool, not returned to it.
    assert_eq!(waiter.pool().status().size, 0);

    lease.release().await;
    eventually("no advisory lock is left", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
    eventually("the abandoned session ends", || async {
        advisory_waiters(&admin, "direct-waiter").await.is_empty()
    })
    .await;
    assert_pool_clean(&holder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn release_unlocks_before_returning() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let backend = backend(&pg, "direct");
    let key = Key::new("1", 64).unwrap();
    for _ in 0..3 {
        let lease = backend
            .acquire("orders", &key, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(advisory_locks(&admin).await, 1);
        assert_eq!(lease.fencing_token(), None);
        assert!(!lease.signal().is_lost());
        // Busy for everyone else, this instance's other connections included.
        let busy = backend.acquire("orders", &key, Duration::ZERO).await;
        assert!(matches!(busy, Err(LockError::Timeout)), "{busy:?}");
        lease.release().await;
        assert_eq!(advisory_locks(&admin).await, 0);
    }
    assert_pool_clean(&backend).await;
}

// ---------------------------------------------------------------- lost locks

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminated_connection_raises_lease_lost() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let a = backend(&pg, "lost-a");
    let layer = KeyedLockLayer::by_path("order_id")
        .name("pg-lost")
        .backend(a.clone());
    let server = Arc::new(serve(app(layer, probe.clone())).await);
    let before = counter(
        tower_keyed_lock::metrics::LEASE_LOST_TOTAL,
        "pg-lost",
        &[("reason", "unreachable")],
    );

    let request = spawn_post(&server, "/lost/1");
    let info = next_entered(&mut entered).await;
    assert!(!info.is_lease_lost());
    let pid = holder_pid(&admin).await;
    let terminated: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(terminated);

    let started = Instant::now();
    let answer = answer(request).await;
    assert_eq!(answer.body, "lost");
    assert!(info.is_lease_lost());
    assert!(started.elapsed() < Duration::from_secs(2), "noticed late");
    eventually("the loss is counted", || async {
        counter(
            tower_keyed_lock::metrics::LEASE_LOST_TOTAL,
            "pg-lost",
            &[("reason", "unreachable")],
        ) == before + 1
    })
    .await;
    // The dead connection did not go back to the pool.
    assert_eq!(a.pool().status().size, 0);
}

/// A holding connection whose server process stops answering (SIGSTOP) is declared
/// lost by the liveness check's timeout, although the socket stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_holding_connection_raises_lease_lost() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let a = builder(&pg, "silent-a")
        .command_timeout(Duration::from_millis(300))
        .build_lazy();
    let server = Arc::new(serve(app(layer(a.clone(), PATIENCE), probe.clone())).await);

    let request = spawn_post(&server, "/lost/1");
    next_entered(&mut entered).await;
    let stopped = Stopped::new(holder_pid(&admin).await);
    let started = Instant::now();
    let answer = answer(request).await;
    drop(stopped);
    assert_eq!(answer.body, "lost");
    assert!(started.elapsed() < Duration::from_secs(2), "noticed late");

    // The handler is told at the lease's deadline, by the clock. The release that
    // follows either closed our end (the unlock got no answer in time; once the process
    // runs again it sees that and ends) or, if the process was resumed in time,
    // unlocked: either way the lock is freed, and a connection goes back to the pool
    // only if its unlock answered.
    eventually("the stopped session's lock is freed", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lost_lease_aborts_with_503() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let layer = layer(backend(&pg, "abort-a"), PATIENCE).abort_on_lease_lost(true);
    let server = Arc::new(serve(app(layer, probe.clone())).await);

    // The handler would wait at the gate forever.
    let request = spawn_post(&server, "/orders/1");
    next_entered(&mut entered).await;
    let pid = holder_pid(&admin).await;
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let answer = answer(request).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    // The session that held the lock ended: the engine is out of reach for it.
    assert!(answer.body.contains("could not be reached"), "{answer:?}");
    assert_eq!(probe.overlap.max(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outage_fails_closed_then_recovers() {
    let mut pg = PgServer::start();
    let (probe, mut entered) = Probe::open(Duration::ZERO);
    let wait = Duration::from_secs(2);
    let closed = Arc::new(serve(app(layer(backend(&pg, "closed"), wait), probe.clone())).await);
    let open_backend = backend(&pg, "open");
    let open = serve(app(
        layer(open_backend, wait).fail_open(true),
        probe.clone(),
    ))
    .await;

    assert_eq!(send(&closed, "/orders/1").await.status, StatusCode::OK);
    assert_eq!(send(&open, "/orders/1").await.status, StatusCode::OK);
    while entered.try_recv().is_ok() {}

    // A request holding a key when the server goes away learns that its lock is gone.
    let holding = spawn_post(&closed, "/lost/2");
    next_entered(&mut entered).await;
    tokio::task::block_in_place(|| pg.stop());
    assert_eq!(answer(holding).await.body, "lost");

    // The server answered before: each wait tries again until it ends, then fails
    // (503), never hanging past one command timeout after it.
    for _ in 0..3 {
        let started = Instant::now();
        let down = send(&closed, "/orders/1").await;
        assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{down:?}");
        assert!(down.headers.contains_key(http::header::RETRY_AFTER));
        let bound = wait + DEFAULT_COMMAND_TIMEOUT + Duration::from_secs(1);
        assert!(started.elapsed() < bound, "took {:?}", started.elapsed());
        // Fail open: the request runs under the in-process lock alone.
        assert_eq!(send(&open, "/orders/1").await.status, StatusCode::OK);
    }

    // Back up: the same application serves again, no restart needed.
    tokio::task::block_in_place(|| pg.start_again());
    assert_eq!(send(&closed, "/orders/1").await.status, StatusCode::OK);
    assert_eq!(send(&open, "/orders/1").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_database_answers_503_promptly() {
    let port = crate::support::ports::free_port();
    let conn = format!("host=127.0.0.1 port={port} user=postgres");
    let (probe, _entered) = Probe::open(Duration::ZERO);
    let backend = || {
        PostgresBackend::builder_from_str(&conn)
            .unwrap()
            .build_lazy()
    };
    let wait = Duration::from_secs(5);
    let closed = serve(app(layer(backend(), wait), probe.clone())).await;
    let open = serve(app(layer(backend(), wait).fail_open(true), probe.clone())).await;

    let started = Instant::now();
    let answer = send(&closed, "/orders/1").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert!(answer.body.contains("backend"), "{}", answer.body);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(send(&open, "/orders/1").await.status, StatusCode::OK);
}

/// What an error about an unreachable server at `port` must say: PostgreSQL and the
/// address, then the cause; never the password.
fn assert_names_postgres_and_the_address(message: &str, port: u16) {
    let named = format!("cannot connect to PostgreSQL at 127.0.0.1:{port}: ");
    assert!(message.contains(&named), "no engine or address: {message}");
    let cause = &message[message.find(&named).unwrap() + named.len()..];
    assert!(
        cause.contains("refused"),
        "no cause after the address: {message}"
    );
    assert!(
        !message.contains("hunter2"),
        "the password is shown: {message}"
    );
}

/// An acquisition against an unreachable server fails with an error that names
/// PostgreSQL and its address (never the password), then the cause; both scopes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_server_acquisition_error_names_postgres_and_the_address() {
    let port = crate::support::ports::free_port();
    let conn = format!("host=127.0.0.1 port={port} user=app password=hunter2 dbname=app");
    for scope in [LockScope::Session, LockScope::Transaction] {
        let backend = PostgresBackend::builder_from_str(&conn)
            .unwrap()
            .lock_scope(scope)
            .build_lazy();
        match backend
            .acquire("orders", &Key::new("1", 64).unwrap(), Duration::ZERO)
            .await
        {
            Err(error @ LockError::Backend(_)) => {
                assert_names_postgres_and_the_address(&error.to_string(), port)
            }
            other => panic!("{scope:?}: expected a backend error, got {other:?}"),
        }
    }
}

/// Building against an unreachable server fails with [`SetupError::Failed`], whose
/// message names PostgreSQL and the address (never the password), then the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_server_build_error_names_postgres_and_the_address() {
    let port = crate::support::ports::free_port();
    let conn = format!("postgresql://app:hunter2@127.0.0.1:{port}/app");
    for scope in [LockScope::Session, LockScope::Transaction] {
        let built = PostgresBackend::builder_from_str(&conn)
            .unwrap()
            .lock_scope(scope)
            .build()
            .await;
        match built {
            Err(error @ SetupError::Failed { .. }) => {
                println!("{scope:?}: {error}");
                assert_names_postgres_and_the_address(&error.to_string(), port);
                assert!(std::error::Error::source(&error).is_some(), "no cause");
            }
            Err(other) => panic!("{scope:?}: expected a connect error, got {other}"),
            Ok(_) => panic!("{scope:?}: built against nothing"),
        }
    }
}

/// A server process stopped with SIGSTOP until dropped, even if the test fails.
struct Stopped(i32);

impl Stopped {
    fn new(pid: i32) -> Stopped {
        Self::signal("-STOP", pid);
        Stopped(pid)
    }

    fn signal(signal: &str, pid: i32) {
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        Self::signal("-CONT", self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_database_answers_503_within_the_command_timeout() {
    // Accepts connections and never says a word.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut silent = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            silent.push(socket);
        }
    });
    let network = Duration::from_millis(300);
    let backend = PostgresBackend::builder_from_str(&format!("host=127.0.0.1 port={port}"))
        .unwrap()
        .command_timeout(network)
        .build_lazy();
    let (probe, _entered) = Probe::open(Duration::ZERO);
    let server = serve(app(layer(backend, Duration::from_secs(5)), probe)).await;

    let started = Instant::now();
    let answer = send(&server, "/orders/1").await;
    let took = started.elapsed();
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert!(took >= network, "gave up after {took:?}");
    assert!(
        took < network + Duration::from_secs(1),
        "gave up after {took:?}"
    );
}

// ---------------------------------------------------------------- pool, fencing

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exhausted_pool_times_out_with_409() {
    let pg = PgServer::start();
    let (probe, mut entered) = Probe::gated();
    let wait = Duration::from_millis(300);
    let layer = layer(builder(&pg, "small").max_connections(1).build_lazy(), wait);
    let server = Arc::new(serve(app(layer, probe.clone())).await);

    let holder = spawn_post(&server, "/orders/a");
    next_entered(&mut entered).await;
    // Another key, free in PostgreSQL, but the only connection is pinned by "a".
    let started = Instant::now();
    let starved = send(&server, "/orders/b").await;
    assert_eq!(starved.status, StatusCode::CONFLICT, "{starved:?}");
    assert!(started.elapsed() >= wait);

    probe.gate.add_permits(2);
    assert_eq!(answer(holder).await.status, StatusCode::OK);
    assert_eq!(send(&server, "/orders/b").await.status, StatusCode::OK);
}

/// A pool of the user's, built without a runtime: connections are still reused, and
/// an exhausted pool still times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_without_runtime_works() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let manager = deadpool_postgres::Manager::new(pg.conn_str().parse().unwrap(), NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .unwrap();
    let backend = PostgresBackend::builder(pool).build_lazy();
    let (one, two) = (Key::new("1", 64).unwrap(), Key::new("2", 64).unwrap());
    let wait = Duration::from_millis(200);
    let mut pids = Vec::new();
    for _ in 0..3 {
        let lease = backend
            .acquire("orders", &one, Duration::ZERO)
            .await
            .unwrap();
        pids.push(holder_pid(&admin).await);
        let started = Instant::now();
        let starved = backend.acquire("orders", &two, wait).await;
        let took = started.elapsed();
        assert!(matches!(starved, Err(LockError::Timeout)), "{starved:?}");
        assert!(took >= wait, "gave up after {took:?}");
        assert!(
            took < wait + Duration::from_secs(1),
            "gave up after {took:?}"
        );
        lease.release().await;
        let status = backend.pool().status();
        assert_eq!((status.size, status.available), (1, 1));
    }
    pids.dedup();
    assert_eq!(pids.len(), 1, "the connection was not reused");
    assert_pool_clean_with(&backend, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_tokens_strictly_increase() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (probe, mut entered) = Probe::gated();
    let a = Arc::new(
        serve(app(
            layer(builder(&pg, "fence-a").fencing(true).build_lazy(), PATIENCE),
            probe.clone(),
        ))
        .await,
    );
    let b = Arc::new(
        serve(app(
            layer(builder(&pg, "fence-b").fencing(true).build_lazy(), PATIENCE),
            probe.clone(),
        ))
        .await,
    );
    let token = |answer: crate::support::Answer| -> u64 {
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        answer.body.parse().unwrap()
    };

    // Uncontended grants, alternating instances.
    let mut last = 0;
    for i in 0..6 {
        let server = if i % 2 == 0 { &a } else { &b };
        probe.gate.add_permits(1);
        let next = token(send(server, "/orders/1").await);
        assert!(next > last, "token {next} after {last}");
        last = next;
        next_entered(&mut entered).await;
    }

    // A grant after a wait in PostgreSQL (the other statement) too.
    let holder = spawn_post(&a, "/orders/1");
    let held = next_entered(&mut entered).await.fencing_token().unwrap();
    assert!(held > last);
    let waiter = spawn_post(&b, "/orders/1");
    eventually("the waiter blocks in PostgreSQL", || async {
        advisory_waiters(&admin, "fence-b").await.len() == 1
    })
    .await;
    probe.gate.add_permits(2);
    assert_eq!(token(answer(holder).await), held);
    assert!(token(answer(waiter).await) > held);

    // Off by default.
    let plain = serve(app(layer(backend(&pg, "plain"), PATIENCE), probe.clone())).await;
    probe.gate.add_permits(1);
    assert_eq!(send(&plain, "/orders/1").await.body, "");
}

/// A sequence with `CACHE 20` hands each session its own range of 20 values, so two
/// instances' tokens interleave out of order (1, 21, 2, ...): refused with a clear
/// error instead, and taken up without a restart once fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_sequence_that_could_go_backwards_is_refused() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    admin
        .batch_execute(
            "CREATE SEQUENCE cached_tokens CACHE 20; CREATE SEQUENCE cycling_tokens CYCLE",
        )
        .await
        .unwrap();
    let key = Key::new("1", 64).unwrap();
    let mut refused = Vec::new();
    for sequence in ["cached_tokens", "cycling_tokens"] {
        let a = builder(&pg, "fence-a")
            .fencing_sequence(sequence)
            .build_lazy();
        refused.push(a.clone());
        let b = builder(&pg, "fence-b")
            .fencing_sequence(sequence)
            .build_lazy();
        let mut tokens = Vec::new();
        for i in 0..4 {
            let instance = if i % 2 == 0 { &a } else { &b };
            match instance.acquire("orders", &key, Duration::ZERO).await {
                Ok(lease) => {
                    tokens.push(lease.fencing_token().unwrap());
                    lease.release().await;
                }
                Err(LockError::Backend(error)) => {
                    let message = error.to_string();
                    assert!(
                        message.contains("CACHE 1") && message.contains("NO CYCLE"),
                        "unclear error: {message}"
                    );
                }
                Err(other) => panic!("{other:?}"),
            }
        }
        assert!(
            tokens.windows(2).all(|pair| pair[0] < pair[1]),
            "{sequence}: tokens went backwards: {tokens:?}"
        );
        assert!(tokens.is_empty(), "{sequence} was accepted: {tokens:?}");
    }

    // Fixed in the database: the same backends issue tokens again.
    admin
        .batch_execute("ALTER SEQUENCE cached_tokens CACHE 1")
        .await
        .unwrap();
    let lease = refused[0]
        .acquire("orders", &key, Duration::ZERO)
        .await
        .unwrap();
    assert!(lease.fencing_token().is_some());
}

/// The relations outside PostgreSQL's own schemas, by name.
async fn user_relations(admin: &Client) -> Vec<String> {
    admin
        .query(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') \
             AND n.nspname NOT LIKE 'pg_toast%' ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Sessions whose `application_name` still records a holder (`tkl …`).
async fn recorded_holders(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'tkl %'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// What keys locked and released leave on the server, with fencing and the holder
/// record on: 1 000 distinct keys (from 8 tasks at once) leave no advisory lock, no
/// session recording a holder, and no relation but the one fencing sequence of the
/// namespace (one row, whatever the keys) — nothing grows with the keys ever locked.
/// Tokens keep increasing across the keys, and across a server restart (a sequence
/// never hands out a value again, whatever a restart threw away).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn released_keys_leave_nothing_but_the_fencing_sequence() {
    const KEYS: usize = 1_000;
    const TASKS: usize = 8;
    let mut pg = PgServer::start();
    let backend = PostgresBackend::builder_from_str(&pg.conn_str())
        .unwrap()
        .max_connections(TASKS)
        .fencing(true)
        .build_lazy();
    let lock = |backend: PostgresBackend, key: String| async move {
        let lease = backend
            .acquire("footprint", &Key::new(&key, 64).unwrap(), PATIENCE)
            .await
            .expect("an uncontended key");
        let token = lease.fencing_token().expect("fencing is on");
        lease.release().await;
        token
    };
    let first = lock(backend.clone(), "first".into()).await;
    let admin_client = admin(&pg).await;
    let relations = user_relations(&admin_client).await;
    assert_eq!(relations, ["tower_keyed_lock_fencing"]);

    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let backend = backend.clone();
            tokio::spawn(async move {
                let mut tokens = Vec::new();
                for i in (task..KEYS).step_by(TASKS) {
                    tokens.push(lock(backend.clone(), format!("client-key-{i}")).await);
                }
                tokens
            })
        })
        .collect();
    let mut tokens = vec![first];
    for task in tasks {
        let mine = task.await.unwrap();
        assert!(mine.windows(2).all(|pair| pair[0] < pair[1]), "{mine:?}");
        tokens.extend(mine);
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), KEYS + 1, "a token was issued twice");
    assert!(tokens[0] == first, "a token below the first one's");

    assert_eq!(advisory_locks(&admin_client).await, 0, "locks left behind");
    assert_eq!(
        recorded_holders(&admin_client).await,
        0,
        "holder records left behind"
    );
    assert_eq!(
        user_relations(&admin_client).await,
        relations,
        "relations grew"
    );

    // A restart: the next token is still above every token issued before.
    let last = *tokens.last().unwrap();
    drop(admin_client);
    pg.stop();
    pg.start_again();
    let deadline = Instant::now() + PATIENCE;
    let after = loop {
        // The pool's connections died with the server: the first tries may fail.
        let key = Key::new("after-restart", 64).unwrap();
        match backend.acquire("footprint", &key, PATIENCE).await {
            Ok(lease) => {
                let token = lease.fencing_token().expect("fencing is on");
                lease.release().await;
                break token;
            }
            Err(error) => {
                assert!(
                    Instant::now() < deadline,
                    "no grant after the restart: {error}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(
        after > last,
        "token {after} after a restart, {last} before it"
    );
}

/// A pooled session idle longer than the server's idle limit (which every session that
/// tried a lock keeps) has been ended by PostgreSQL: the next lock on it, exclusive or
/// shared, takes a fresh session instead of failing. A quiet spell in production must
/// not turn the first request after it into a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_ended_while_idle_in_the_pool_is_replaced() {
    use tower_keyed_lock::backend::LockMode;
    let pg = PgServer::start();
    let network = Duration::from_millis(100);
    let b = builder(&pg, "idle-pool")
        .command_timeout(network)
        .build_lazy();
    // The server's idle limit: liveness interval + 2 × network timeout.
    let idle_limit = Duration::from_millis(100) + 2 * network;
    for mode in [LockMode::Exclusive, LockMode::Shared] {
        for round in 0..3 {
            let key = Key::new(&format!("idle-{mode:?}-{round}"), 64).unwrap();
            let lease = b
                .acquire_mode("orders", &key, mode, Duration::from_secs(2))
                .await
                .unwrap_or_else(|error| panic!("{mode:?}, round {round}: {error}"));
            lease.release().await;
            // Well past the limit: PostgreSQL ends the pooled session meanwhile.
            tokio::time::sleep(3 * idle_limit).await;
        }
    }
}
