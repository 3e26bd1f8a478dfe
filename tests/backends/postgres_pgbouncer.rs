//! The PostgreSQL backend behind a real PgBouncer each test starts (a generated ini, a
//! free port) in front of a real PostgreSQL: session locks work through session
//! pooling and are refused through transaction pooling, never granted twice;
//! transaction-scoped locks work through both.
#![cfg(feature = "postgres")]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};
use tower_keyed_lock::backend::postgres::{LockScope, PostgresBackend, PostgresBackendBuilder};
use tower_keyed_lock::backend::SetupError;
use tower_keyed_lock::{Key, LockBackend, LockError};

use crate::support::pg_server::PgServer;
use crate::support::pgbouncer::{PgBouncer, PoolMode};
use crate::support::Overlap;

/// Long enough for anything that should happen; a test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(10);

/// A backend as an instance would build it, connecting to `conn` (PgBouncer or the
/// server itself), with fast liveness checks.
fn builder(conn: &str, instance: &str, scope: LockScope) -> PostgresBackendBuilder {
    let mut config: tokio_postgres::Config = conn.parse().unwrap();
    config.application_name(instance);
    PostgresBackend::builder_from_config(config)
        .liveness_interval(Duration::from_millis(100))
        .command_timeout(Duration::from_millis(500))
        .lock_scope(scope)
}

/// [`builder`] as it is, connecting on first use.
fn backend(conn: &str, instance: &str, scope: LockScope) -> PostgresBackend {
    builder(conn, instance, scope).build_lazy()
}

fn key(key: &str) -> Key {
    Key::new(key, 64).unwrap()
}

/// A connection of the test's own (to the server, or through PgBouncer).
async fn connect(conn: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(conn, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

async fn advisory_locks(admin: &Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

async fn eventually<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let deadline = Instant::now() + PATIENCE;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two instances, 8 tasks each, take one key 10 times each: never two holders at once,
/// and fencing tokens strictly increase in the order the holders came in.
async fn assert_serialized(a: PostgresBackend, b: PostgresBackend) {
    let overlap = Arc::new(Overlap::default());
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for task in 0..16 {
        let backend = if task % 2 == 0 { a.clone() } else { b.clone() };
        let (overlap, tokens) = (overlap.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let lease = backend
                    .acquire("orders", &key("1"), PATIENCE)
                    .await
                    .expect("granted within the wait");
                {
                    let _inside = overlap.enter();
                    tokens.lock().unwrap().push(lease.fencing_token().unwrap());
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                assert!(!lease.signal().is_lost(), "a lease was lost");
                lease.release().await;
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(PATIENCE * 3, task)
            .await
            .expect("the workload hung")
            .unwrap();
    }
    assert_eq!(overlap.max(), 1, "two holders of one key at once");
    let tokens = tokens.lock().unwrap();
    assert_eq!(tokens.len(), 160);
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "fencing tokens out of order: {tokens:?}"
    );
}

// ---------------------------------------------------------------- session locks

/// PgBouncer in transaction pooling hands one server session to every client in turn:
/// a session lock taken by one instance then looks held by the next client that lands
/// on that session, and `pg_try_advisory_lock` (re-entrant) grants it again. Before the
/// backend checked for this, instance B was granted the key A held. Now neither
/// instance is granted anything: the first acquisition of each checks the sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_locks_through_transaction_pooling_are_refused() {
    let pg = PgServer::start();
    let bouncer = PgBouncer::start(&pg, PoolMode::Transaction, 1);
    let a = backend(&bouncer.conn_str(), "a", LockScope::Session);
    let b = backend(&bouncer.conn_str(), "b", LockScope::Session);
    for (instance, backend, key_name) in [("A", &a, "1"), ("B", &b, "1"), ("B", &b, "2")] {
        match backend
            .acquire("orders", &key(key_name), Duration::ZERO)
            .await
        {
            Ok(lease) => panic!("key {key_name} granted to {instance}: {lease:?}"),
            Err(LockError::Backend(error)) => {
                let message = error.to_string();
                assert!(
                    names_the_pooler_and_the_fix(&message),
                    "unclear error: {message}"
                );
            }
            Err(other) => panic!("expected a clear backend error, got {other:?}"),
        }
    }
}

/// A holder whose liveness check lands on another server process (the pooler was
/// switched to transaction pooling after the backend was checked, and gave the
/// holder's server session to someone else) is told its lease is lost; the lock it
/// left on the old session is freed when that session sits idle past its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holder_moved_to_another_server_process_is_told_lost() {
    let pg = PgServer::start();
    let admin = connect(&pg.conn_str()).await;
    let bouncer = PgBouncer::start(&pg, PoolMode::Session, 2);
    let a = builder(&bouncer.conn_str(), "a", LockScope::Session)
        .build()
        .await
        .expect("session pooling is accepted");
    let lease = a
        .acquire("orders", &key("1"), Duration::ZERO)
        .await
        .unwrap();
    bouncer.set_pool_mode(PoolMode::Transaction);
    // The holder's connection is released at the end of its next check.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let holder: i32 = admin
        .query_one(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    // Another client pins the holder's server session in a transaction, so the
    // holder's next check runs on the other one.
    let other = connect(&bouncer.conn_str()).await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let pinned: i32 = other
            .simple_query("BEGIN; SELECT pg_backend_pid()")
            .await
            .unwrap()
            .iter()
            .find_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
                _ => None,
            })
            .unwrap();
        if pinned == holder {
            break;
        }
        other.batch_execute("COMMIT").await.unwrap();
        assert!(
            Instant::now() < deadline,
            "never landed on the holder's session"
        );
    }
    tokio::time::timeout(Duration::from_secs(2), lease.signal().lost())
        .await
        .expect("the holder was not told its lease is lost");
    other.batch_execute("COMMIT").await.unwrap();
    lease.release().await;
    // The lock stayed on the pooler's server session; PostgreSQL ends that session
    // once it is idle past the limit (100 ms + 2 × 500 ms) set at the grant.
    eventually("the stranded lock is freed", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_locks_through_session_pooling_serialize() {
    let pg = PgServer::start();
    let bouncer = PgBouncer::start(&pg, PoolMode::Session, 20);
    let instance = |name| {
        builder(&bouncer.conn_str(), name, LockScope::Session)
            .fencing(true)
            .build_lazy()
    };
    assert_serialized(instance("a"), instance("b")).await;
    let admin = connect(&pg.conn_str()).await;
    eventually("every lock is released", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
}

/// PgBouncer's settings that reset a server session after every transaction, in
/// transaction pooling: `DISCARD ALL` drops the advisory locks and the session marker.
const RESET_ALWAYS: &[(&str, &str)] = &[
    ("server_reset_query", "DISCARD ALL"),
    ("server_reset_query_always", "1"),
];

/// What the workload of [`hammer`] saw.
#[derive(Debug, Default)]
struct Tally {
    grants: u64,
    /// Backend errors that name the transaction pooler and the fix.
    refused: u64,
    timeouts: u64,
    /// Backend errors of any other kind, and the first one's message.
    other_errors: u64,
    first_other_error: Option<String>,
    /// A grant while another holder of the key had not been told it lost its lease.
    unsignalled_overlaps: u64,
    /// A fencing token not above the key's last one.
    token_regressions: u64,
}

/// The shape of a [`hammer`] run.
#[derive(Clone, Copy, Debug)]
struct Workload {
    /// Tasks in all, every other one on the second instance.
    tasks: u64,
    keys: u64,
    wait: Duration,
    /// Holds run from 0 to this, in five steps.
    longest_hold: Duration,
    run: Duration,
}

/// Two instances, 16 tasks, 4 keys, waits of 300 ms, holds of 0-40 ms.
fn two_instances_on_four_keys(run: Duration) -> Workload {
    Workload {
        tasks: 16,
        keys: 4,
        wait: Duration::from_millis(300),
        longest_hold: Duration::from_millis(40),
        run,
    }
}

/// Whether a backend error names the transaction pooler and the fix.
fn names_the_pooler_and_the_fix(message: &str) -> bool {
    message.contains("pool_mode=transaction") && message.contains("LockScope::Transaction")
}

/// Two instances run `workload`: every acquisition's outcome, and every grant checked
/// against the key's other holders.
async fn hammer(a: PostgresBackend, b: PostgresBackend, workload: Workload) -> Tally {
    type Holders = Vec<(u64, tower_keyed_lock::LeaseSignal)>;
    let keys: Arc<Vec<Mutex<(Holders, u64)>>> =
        Arc::new((0..workload.keys).map(|_| Mutex::default()).collect());
    let tally = Arc::new(Mutex::new(Tally::default()));
    let until = Instant::now() + workload.run;
    let mut tasks = Vec::new();
    for task in 0..workload.tasks {
        let backend = if task % 2 == 0 { a.clone() } else { b.clone() };
        let (keys, tally) = (keys.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            let mut round = task;
            while Instant::now() < until {
                round += 1;
                let index = (round % workload.keys) as usize;
                let name = format!("reset-{index}");
                let acquired = backend.acquire("orders", &key(&name), workload.wait).await;
                let lease = match acquired {
                    Ok(lease) => lease,
                    Err(LockError::Backend(error)) => {
                        let message = error.to_string();
                        {
                            let mut tally = tally.lock().unwrap();
                            if names_the_pooler_and_the_fix(&message) {
                                tally.refused += 1;
                            } else {
                                tally.other_errors += 1;
                                tally.first_other_error.get_or_insert(message);
                            }
                        }
                        // Refused at once: do not spin.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    Err(_) => {
                        tally.lock().unwrap().timeouts += 1;
                        continue;
                    }
                };
                let token = lease.fencing_token().unwrap();
                {
                    let (holders, last) = &mut *keys[index].lock().unwrap();
                    let mut tally = tally.lock().unwrap();
                    tally.grants += 1;
                    if holders.iter().any(|(_, signal)| !signal.is_lost()) {
                        tally.unsignalled_overlaps += 1;
                    }
                    if token <= *last {
                        tally.token_regressions += 1;
                    }
                    *last = token;
                    holders.push((token, lease.signal().clone()));
                }
                tokio::time::sleep(workload.longest_hold * (round % 5) as u32 / 4).await;
                keys[index]
                    .lock()
                    .unwrap()
                    .0
                    .retain(|(held, _)| *held != token);
                lease.release().await;
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(PATIENCE * 3, task)
            .await
            .expect("the workload hung")
            .unwrap();
    }
    std::mem::take(&mut *tally.lock().unwrap())
}

/// PgBouncer in transaction pooling with `server_reset_query_always = 1` and
/// `DISCARD ALL`: the reset after each transaction drops both the lock and the marker
/// that shows a shared session, so before the fix session locks were *granted* and
/// overlapped silently (most grants of this workload), tokens going backwards. Session
/// scope must be refused whatever the pooler's reset settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_locks_through_a_resetting_transaction_pooler_are_refused() {
    let pg = PgServer::start();
    for pool_size in [1, 4] {
        let bouncer = PgBouncer::start_with(&pg, PoolMode::Transaction, pool_size, RESET_ALWAYS);
        let instance = |name| {
            builder(&bouncer.conn_str(), name, LockScope::Session)
                .fencing(true)
                .build_lazy()
        };
        let tally = hammer(
            instance("a"),
            instance("b"),
            two_instances_on_four_keys(Duration::from_secs(2)),
        )
        .await;
        println!("reset always, pool of {pool_size}, session scope: {tally:?}");
        assert_eq!(tally.unsignalled_overlaps, 0, "{tally:?}");
        assert_eq!(tally.token_regressions, 0, "{tally:?}");
        assert_eq!(tally.grants, 0, "a session lock was granted: {tally:?}");
        assert!(tally.refused > 0, "{tally:?}");
    }
}

/// PgBouncer's default reset behaviour in transaction pooling: `DISCARD ALL` is set
/// but runs only when a session-pooled client leaves (`server_reset_query_always = 0`),
/// so a server session keeps its settings, and its session locks, from one client's
/// transaction to the next client's.
const RESET_ON_SESSION_END: &[(&str, &str)] = &[
    ("server_reset_query", "DISCARD ALL"),
    ("server_reset_query_always", "0"),
];

/// An instance as the pooler checks below configure it: session scope, fencing on,
/// liveness checks every 100 ms, a network timeout of 300 ms.
fn checked_instance(conn: &str, name: &str) -> PostgresBackendBuilder {
    builder(conn, name, LockScope::Session)
        .command_timeout(Duration::from_millis(300))
        .fencing(true)
}

/// How long each pool size of [`session_scope_behind_a_transaction_pooler_never_grants`]
/// runs its workload (`PG_POOLER_SECONDS`, default 2).
fn pooler_run() -> Duration {
    let seconds = std::env::var("PG_POOLER_SECONDS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(2);
    Duration::from_secs(seconds)
}

/// Transaction pooling with PgBouncer's default reset behaviour, pools of 1, 2 and 4
/// server connections: two session-scope instances, 8 tasks on 4 keys (waits of 1 s,
/// holds of 0-20 ms). The runtime checks caught the pooler only when an acquisition
/// happened to land on a server session that another client's lock had marked, so
/// some acquisitions were granted, some waits ran out behind a lock stranded on a
/// server session, and locks were still held on the server after every client had
/// ended. Session scope must be refused there every time: no grant, no lock left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_scope_behind_a_transaction_pooler_never_grants() {
    let pg = PgServer::start();
    let admin = connect(&pg.conn_str()).await;
    let mut runs = Vec::new();
    for pool_size in [1, 2, 4] {
        let bouncer =
            PgBouncer::start_with(&pg, PoolMode::Transaction, pool_size, RESET_ON_SESSION_END);
        let workload = Workload {
            tasks: 8,
            keys: 4,
            wait: Duration::from_secs(1),
            longest_hold: Duration::from_millis(20),
            run: pooler_run(),
        };
        let (a, b) = (
            checked_instance(&bouncer.conn_str(), "a").build_lazy(),
            checked_instance(&bouncer.conn_str(), "b").build_lazy(),
        );
        let tally = hammer(a, b, workload).await;
        // Every client has ended: what do the server sessions still hold?
        let left = advisory_locks(&admin).await;
        println!(
            "transaction pooling, pool of {pool_size}, session scope: {tally:?}, \
             {left} locks left"
        );
        runs.push((pool_size, tally, left));
    }
    for (pool_size, tally, left) in runs {
        let run = format!("pool of {pool_size}: {tally:?}, {left} locks left");
        assert_eq!(tally.unsignalled_overlaps, 0, "{run}");
        assert_eq!(tally.token_regressions, 0, "{run}");
        assert_eq!(tally.grants, 0, "a session lock was granted: {run}");
        assert_eq!(tally.timeouts, 0, "{run}");
        assert_eq!(tally.other_errors, 0, "{run}");
        assert!(tally.refused > 0, "{run}");
        assert_eq!(
            left, 0,
            "locks left on the server after every client ended: {run}"
        );
    }
}

/// More `[pgbouncer]` settings, as `PgBouncer::start_with` takes them.
type PoolerSettings = &'static [(&'static str, &'static str)];

/// How many times each pooler setup of the build checks below is built.
const BUILDS: usize = 10;

/// A client of the pooler that runs one short statement after another until dropped:
/// other traffic on the pooler's server sessions while a backend is built.
struct Traffic(tokio::task::JoinHandle<()>);

impl Traffic {
    async fn start(conn: &str) -> Traffic {
        let client = connect(conn).await;
        Traffic(tokio::spawn(async move {
            while client.simple_query("SELECT 1").await.is_ok() {}
        }))
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Session scope is refused when the backend is built behind a transaction or
/// statement pooler, every time: pools of 1, 2 and 4 server connections, PgBouncer's
/// default reset behaviour and a reset after every transaction, with and without other
/// clients using the pooler's server sessions meanwhile. The error names the pooler
/// mode and the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_scope_behind_a_transaction_pooler_is_refused_at_build_every_time() {
    let pg = PgServer::start();
    let setups: [(PoolMode, usize, PoolerSettings); 7] = [
        (PoolMode::Transaction, 1, RESET_ON_SESSION_END),
        (PoolMode::Transaction, 2, RESET_ON_SESSION_END),
        (PoolMode::Transaction, 4, RESET_ON_SESSION_END),
        (PoolMode::Transaction, 1, RESET_ALWAYS),
        (PoolMode::Transaction, 4, RESET_ALWAYS),
        (PoolMode::Statement, 1, RESET_ON_SESSION_END),
        (PoolMode::Statement, 4, RESET_ON_SESSION_END),
    ];
    for (mode, pool_size, settings) in setups {
        let bouncer = PgBouncer::start_with(&pg, mode, pool_size, settings);
        let mut slowest = Duration::ZERO;
        for build in 0..BUILDS {
            // Half of the builds while two other clients keep the sessions busy.
            let _traffic = match build % 2 {
                0 => vec![],
                _ => vec![
                    Traffic::start(&bouncer.conn_str()).await,
                    Traffic::start(&bouncer.conn_str()).await,
                ],
            };
            let started = Instant::now();
            // The default network timeout: the test is about the pooler, not the
            // speed of this machine's round trips.
            let built = checked_instance(&bouncer.conn_str(), "a")
                .command_timeout(Duration::from_secs(2))
                .build()
                .await;
            slowest = slowest.max(started.elapsed());
            match built {
                Ok(_) => panic!("{mode:?} pooling, pool of {pool_size}: build {build} accepted"),
                Err(error @ SetupError::Unsafe(_)) => {
                    let message = error.to_string();
                    assert!(
                        names_the_pooler_and_the_fix(&message)
                            && message.contains("pool_mode=statement"),
                        "unclear error: {message}"
                    );
                }
                Err(other) => panic!("{mode:?}, pool of {pool_size}: {other}"),
            }
        }
        println!(
            "{mode:?} pooling, pool of {pool_size}, {settings:?}: {BUILDS} of {BUILDS} \
             builds refused, the slowest in {slowest:?}"
        );
    }
}

/// The check refuses nothing that gives each client its own session: a direct
/// connection, and PgBouncer in session pooling (pools of 1 and 4), each built many
/// times, and the backends then serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_scope_direct_and_through_session_pooling_is_accepted_at_build() {
    let pg = PgServer::start();
    let session_pool_1 = PgBouncer::start_with(&pg, PoolMode::Session, 1, RESET_ON_SESSION_END);
    let session_pool_4 = PgBouncer::start_with(&pg, PoolMode::Session, 4, RESET_ON_SESSION_END);
    for (setup, conn) in [
        ("direct", pg.conn_str()),
        ("session pooling, pool of 1", session_pool_1.conn_str()),
        ("session pooling, pool of 4", session_pool_4.conn_str()),
    ] {
        let mut slowest = Duration::ZERO;
        for build in 0..BUILDS {
            let started = Instant::now();
            let backend = checked_instance(&conn, "a")
                .command_timeout(Duration::from_secs(2))
                .max_connections(1)
                .build()
                .await
                .unwrap_or_else(|error| panic!("{setup}: build {build} refused: {error}"));
            slowest = slowest.max(started.elapsed());
            let lease = backend
                .acquire("orders", &key("1"), PATIENCE)
                .await
                .unwrap_or_else(|error| panic!("{setup}: not granted after the build: {error}"));
            lease.release().await;
        }
        println!("{setup}: {BUILDS} of {BUILDS} builds accepted, the slowest in {slowest:?}");
    }
}

/// The same pooler and workload with `LockScope::Transaction`: every lock is granted in
/// turn, never two holders, tokens in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_locks_through_a_resetting_transaction_pooler_serialize() {
    let pg = PgServer::start();
    let bouncer = PgBouncer::start_with(&pg, PoolMode::Transaction, 20, RESET_ALWAYS);
    let instance = |name| {
        builder(&bouncer.conn_str(), name, LockScope::Transaction)
            .fencing(true)
            .build_lazy()
    };
    let tally = hammer(
        instance("a"),
        instance("b"),
        two_instances_on_four_keys(Duration::from_secs(2)),
    )
    .await;
    println!("reset always, transaction scope: {tally:?}");
    assert_eq!(tally.unsignalled_overlaps, 0, "{tally:?}");
    assert_eq!(tally.token_regressions, 0, "{tally:?}");
    assert_eq!(tally.refused, 0, "{tally:?}");
    assert!(tally.grants > 0, "{tally:?}");
    assert_serialized(instance("c"), instance("d")).await;
}

// ---------------------------------------------------------------- transaction locks

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_locks_through_transaction_pooling_serialize() {
    let pg = PgServer::start();
    let bouncer = PgBouncer::start(&pg, PoolMode::Transaction, 20);
    let instance = |name| {
        builder(&bouncer.conn_str(), name, LockScope::Transaction)
            .fencing(true)
            .build_lazy()
    };
    assert_serialized(instance("a"), instance("b")).await;
    let admin = connect(&pg.conn_str()).await;
    eventually("every lock is released", || async {
        advisory_locks(&admin).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_locks_serialize_on_direct_connections() {
    let pg = PgServer::start();
    let instance = |name| {
        builder(&pg.conn_str(), name, LockScope::Transaction)
            .fencing(true)
            .build_lazy()
    };
    assert_serialized(instance("a"), instance("b")).await;
}

/// A busy key times out within the wait, and the connection goes back to the pool
/// outside any transaction; a released key is free at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_lock_times_out_and_pools_a_clean_connection() {
    let pg = PgServer::start();
    let bouncer = PgBouncer::start(&pg, PoolMode::Transaction, 4);
    let a = backend(&bouncer.conn_str(), "a", LockScope::Transaction);
    let b = backend(&bouncer.conn_str(), "b", LockScope::Transaction);
    let lease = a
        .acquire("orders", &key("1"), Duration::ZERO)
        .await
        .unwrap();
    for wait in [Duration::ZERO, Duration::from_millis(300)] {
        let started = Instant::now();
        let busy = b.acquire("orders", &key("1"), wait).await;
        let took = started.elapsed();
        assert!(matches!(busy, Err(LockError::Timeout)), "{busy:?}");
        assert!(took >= wait, "gave up early, after {took:?}");
        assert!(
            took < wait + Duration::from_secs(1),
            "gave up late, after {took:?}"
        );
        let status = b.pool().status();
        assert_eq!((status.size, status.available), (1, 1), "not pooled again");
    }
    // The pooled connection is outside a transaction: each statement is its own.
    let pooled = b.pool().get().await.unwrap();
    let answer = pooled
        .simple_query("SELECT now() = statement_timestamp()")
        .await
        .unwrap();
    let outside = answer.iter().any(|message| {
        matches!(message, tokio_postgres::SimpleQueryMessage::Row(row) if row.get(0) == Some("t"))
    });
    assert!(outside, "the connection was left in a transaction");
    drop(pooled);

    lease.release().await;
    let next = b
        .acquire("orders", &key("1"), Duration::ZERO)
        .await
        .expect("free once released");
    next.release().await;
}

/// An acquisition dropped at any point — before the pool answered, while creating and
/// checking the fencing sequence, while waiting in PostgreSQL, right after the grant —
/// leaves no lock: the key is free for others.
async fn assert_dropped_acquisitions_leave_no_lock(pg: &PgServer, conn: &str, scope: LockScope) {
    let admin = connect(&pg.conn_str()).await;
    let holder = backend(conn, "holder", scope);
    for delay_ms in [0, 1, 2, 3, 5, 10, 30, 100] {
        // A fresh instance each time: its first acquisition also prepares the sequence.
        let waiter = builder(conn, "waiter", scope).fencing(true).build_lazy();
        // Not `ZERO`: the last round's dropped attempt may have been read by the server
        // after its client closed the connection, and hold the key until the server
        // notices (a moment, never for good: a leaked lock would fail this wait too).
        let lease = holder
            .acquire("orders", &key("1"), Duration::from_secs(2))
            .await
            .expect("the key is free within 2 s of the last round");
        let waiting = tokio::spawn(waiter.acquire("orders", &key("1"), PATIENCE));
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        // Half of the time the holder leaves first, so the drop may hit a grant.
        if delay_ms % 2 == 1 {
            lease.release().await;
            waiting.abort();
        } else {
            waiting.abort();
            lease.release().await;
        }
        let _ = waiting.await;
        eventually("no lock is left", || async {
            advisory_locks(&admin).await == 0
        })
        .await;
        let again = holder
            .acquire("orders", &key("1"), Duration::from_secs(2))
            .await
            .expect("the key is free");
        again.release().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_acquisitions_leave_no_lock_through_transaction_pooling() {
    let pg = PgServer::start();
    let bouncer = PgBouncer::start(&pg, PoolMode::Transaction, 8);
    assert_dropped_acquisitions_leave_no_lock(&pg, &bouncer.conn_str(), LockScope::Transaction)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_acquisitions_leave_no_lock_on_direct_connections() {
    let pg = PgServer::start();
    for scope in [LockScope::Session, LockScope::Transaction] {
        assert_dropped_acquisitions_leave_no_lock(&pg, &pg.conn_str(), scope).await;
    }
}
