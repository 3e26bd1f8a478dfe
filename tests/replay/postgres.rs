//! The replay layer with the PostgreSQL store, under the PostgreSQL lock backend with
//! fencing, against a real PostgreSQL (one per test) through real hyper servers: every
//! row of the table, the table DDL, the fenced upsert after a lost session, and a
//! silent store.
#![cfg(all(feature = "replay", feature = "postgres"))]

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use deadpool_postgres::{Manager, Pool};
use http::StatusCode;
use tokio_postgres::NoTls;
use tower_keyed_lock::backend::postgres::PostgresBackend;
use tower_keyed_lock::replay::{PostgresReplayStore, ReplayLayer};
use tower_keyed_lock::{Key, KeyedLockLayer, LockBackend, LockInfo};

use crate::support::pg_server::PgServer;
use crate::support::replay::{serve, Kit, Probe};
use crate::support::tcp_proxy::TcpProxy;

const NAME: &str = "replay-postgres";

fn backend(config: &str, instance: &str) -> PostgresBackend {
    let mut config: tokio_postgres::Config = config.parse().unwrap();
    config.application_name(instance);
    // A holding session's application name is its holder record, ending with the
    // instance id: `tkl % <instance>` finds it.
    PostgresBackend::from_config(config)
        .instance_id(instance)
        .liveness_interval(Duration::from_millis(100))
        .fencing(true)
}

/// The store's own pool, as the store docs advise.
fn pool(config: &str) -> Pool {
    let mut config: tokio_postgres::Config = config.parse().unwrap();
    config.application_name("replay-store");
    config.connect_timeout(Duration::from_secs(1));
    Pool::builder(Manager::new(config, NoTls))
        .max_size(8)
        .build()
        .unwrap()
}

fn kit(pg: &PgServer) -> Kit {
    let backend = backend(&pg.conn_str(), "instance");
    let store = PostgresReplayStore::new(pool(&pg.conn_str()));
    Kit {
        lock: Box::new(move || {
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(backend.clone())
        }),
        replay: Box::new(move || ReplayLayer::new(store.clone())),
    }
}

macro_rules! rows {
    ($($row:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $row() {
            let pg = PgServer::start();
            crate::support::replay::$row(&kit(&pg)).await;
        }
    )*};
}

rows!(
    duplicate_after_completion_is_replayed,
    duplicate_in_flight_waits_then_replays,
    duplicate_in_flight_without_waiting_gets_409,
    different_fingerprint_is_rejected,
    custom_fingerprint_ignores_what_changes_between_retries,
    transient_answers_are_not_stored,
    panic_stores_nothing,
    cancelled_request_stores_nothing,
    body_over_the_limit_passes_through,
    expired_record_is_a_new_request,
    key_is_scoped_by_route,
);

#[tokio::test]
async fn table_is_created_with_the_documented_columns_and_a_configurable_name() {
    let pg = PgServer::start();
    let backend = backend(&pg.conn_str(), "instance");
    let store = PostgresReplayStore::with_table(pool(&pg.conn_str()), "public.my_replays").unwrap();
    let app = Router::new()
        .route("/orders", post(|| async { "made" }))
        .layer(ReplayLayer::new(store.clone()).ttl(Duration::from_millis(200)))
        .layer(
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(backend),
        );
    let app = serve(app, Arc::new(Probe::default())).await;
    app.post("/orders", "k", "").await;
    assert!(app.post("/orders", "k", "").await.is_replay());

    let (admin, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let columns: Vec<(String, String)> = admin
        .query(
            "SELECT column_name::text, data_type::text FROM information_schema.columns \
             WHERE table_name = 'my_replays' ORDER BY ordinal_position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let expected = [
        ("layer", "text"),
        ("key", "text"),
        ("scope", "text"),
        ("fence", "bigint"),
        ("record", "bytea"),
        ("expires_at", "timestamp with time zone"),
    ];
    let expected: Vec<_> = expected
        .iter()
        .map(|(c, t)| (c.to_string(), t.to_string()))
        .collect();
    assert_eq!(columns, expected);

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.purge_expired().await.unwrap(), 1);

    for bad in ["x; DROP TABLE y", "a.b.c", "", "1abc", "quoted\"name"] {
        assert!(
            PostgresReplayStore::with_table(pool(&pg.conn_str()), bad).is_err(),
            "{bad}"
        );
    }
}

/// Instance A's lock session is killed while its handler runs; instance B takes the
/// key (a higher fencing token), runs and stores. A's late upsert carries the lower
/// token and is refused: the record stays B's.
#[tokio::test]
async fn write_after_a_lost_session_is_fenced() {
    let pg = PgServer::start();
    let store = PostgresReplayStore::new(pool(&pg.conn_str()));
    let calls = Arc::new(AtomicUsize::new(0));
    let (a_entered, mut entered) = tokio::sync::mpsc::unbounded_channel();
    let b_entered = Arc::new(tokio::sync::Notify::new());
    let app = |instance: &str| {
        let calls = Arc::clone(&calls);
        let a_entered = a_entered.clone();
        let b_entered = Arc::clone(&b_entered);
        let handler = move |Extension(info): Extension<LockInfo>| async move {
            let call = calls.fetch_add(1, SeqCst) + 1;
            if call == 1 {
                a_entered.send(()).unwrap();
                info.lease().unwrap().lost().await;
                // Finish only once the successor runs: a late writer, not an early one.
                b_entered.notified().await;
            } else {
                b_entered.notify_one();
            }
            format!("call {call}")
        };
        Router::new()
            .route("/orders", post(handler))
            .layer(ReplayLayer::new(store.clone()))
            .layer(
                KeyedLockLayer::by_header("idempotency-key")
                    .name(NAME)
                    .backend(backend(&pg.conn_str(), instance)),
            )
    };
    let probe = Arc::new(Probe::default());
    let a = Arc::new(serve(app("instance-a"), Arc::clone(&probe)).await);
    let b = serve(app("instance-b"), probe).await;

    let slow = tokio::spawn({
        let a = Arc::clone(&a);
        async move { a.post("/orders", "k", "").await }
    });
    entered.recv().await.unwrap();
    let (admin, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let killed = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'instance-a' \
             OR application_name LIKE 'tkl % instance-a'",
            &[],
        )
        .await
        .unwrap();
    assert!(!killed.is_empty());
    // B runs while A, told its lease is lost, finishes late (the lost-lease signal
    // wakes it; nothing aborts it).
    let taken_over = b.post("/orders", "k", "").await;
    let late = slow.await.unwrap();
    assert_eq!(
        (late.body.as_str(), taken_over.body.as_str()),
        ("call 1", "call 2")
    );

    let replayed = a.post("/orders", "k", "").await;
    assert!(replayed.is_replay(), "{replayed:?}");
    assert_eq!(
        replayed.body, "call 2",
        "the lower fencing token overwrote the record"
    );
}

#[tokio::test]
async fn silent_store_fails_closed_with_503() {
    let pg = PgServer::start();
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", pg.port()).parse().unwrap()).await;
    let store_config = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.addr.port()
    );
    let store = PostgresReplayStore::new(pool(&store_config));
    let backend = backend(&pg.conn_str(), "instance");
    let kit = Kit {
        lock: Box::new(move || {
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(backend.clone())
        }),
        replay: Box::new(move || {
            ReplayLayer::new(store.clone()).store_timeout(Duration::from_millis(300))
        }),
    };
    let app = kit.serve().await;
    app.post("/orders", "before", "").await;
    proxy.blackhole();
    let refused = app.post("/orders", "k", "").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.headers["retry-after"], "1");
    assert_eq!(app.probe.completed(), 1);
}

/// A store that needs fencing tokens under a backend that issues none would never
/// store (before: every retry ran the handler again, and one log line said why). The
/// request is refused as misconfigured instead, before the handler runs.
#[tokio::test]
async fn store_without_fencing_tokens_is_refused() {
    let pg = PgServer::start();
    let backend = backend(&pg.conn_str(), "instance").fencing(false);
    let store = PostgresReplayStore::new(pool(&pg.conn_str()));
    let kit = Kit {
        lock: Box::new(move || {
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(backend.clone())
        }),
        replay: Box::new(move || ReplayLayer::new(store.clone())),
    };
    let app = kit.serve().await;
    for _ in 0..2 {
        let refused = app.post("/orders", "k", "").await;
        assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(refused.reason(), "misconfigured");
    }
    assert_eq!(app.probe.started(), 0);
}

/// The convenience that stacks the two layers refuses it when the layers are built,
/// with an error that names the fix; with fencing on, the same stack is accepted.
#[tokio::test]
async fn store_without_fencing_tokens_is_refused_at_build_time() {
    let pg = PgServer::start();
    let unfenced = backend(&pg.conn_str(), "instance").fencing(false);
    let store = PostgresReplayStore::new(pool(&pg.conn_str()));
    let lock = || KeyedLockLayer::by_header("idempotency-key").name(NAME);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lock()
            .backend(unfenced.clone())
            .replay(ReplayLayer::new(store.clone()))
    }));
    let message = refused.expect_err("a store that can never write was accepted");
    let message = (message.downcast_ref::<&str>().copied())
        .or(message.downcast_ref::<String>().map(String::as_str))
        .expect("a panic message");
    assert!(message.contains("fencing(true)"), "{message}");

    let _ = lock()
        .backend(unfenced.fencing(true))
        .replay(ReplayLayer::new(store));
}

/// Instances that start together on a database where neither the fencing sequence
/// nor the replay table exists yet: 6 backends (fencing on) and 6 stores set up at
/// once, each by its first use (an acquisition, a store call). Before, concurrent
/// `CREATE TABLE IF NOT EXISTS` / `CREATE SEQUENCE IF NOT EXISTS` collided
/// (`duplicate key value violates unique constraint "pg_type_typname_nsp_index"`), so
/// some first requests got 503; every start also logged a NOTICE ("already exists,
/// skipping"). Each round uses a fresh schema, and starts twice: the second start finds
/// everything there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_use_by_many_instances_at_once_sets_up_the_schema_safely_and_quietly() {
    const ROUNDS: usize = 8;
    const INSTANCES: usize = 6;
    let pg = PgServer::start();
    let (admin, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    // NOTICEs reach the server log too, so the test can count them.
    for statement in [
        "ALTER SYSTEM SET log_min_messages = 'notice'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(statement).await.unwrap();
    }
    let mut failed = Vec::new();
    for round in 0..ROUNDS {
        let schema = format!("fresh_{round}");
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .unwrap();
        for start in ["first", "second"] {
            let barrier = Arc::new(tokio::sync::Barrier::new(2 * INSTANCES));
            let mut tasks = Vec::new();
            for instance in 0..INSTANCES {
                let backend = backend(&pg.conn_str(), &format!("instance-{instance}"))
                    .fencing_sequence(&format!("{schema}.tokens"));
                let key = Key::new(&format!("{start}-{instance}"), 64).unwrap();
                let barrier_ = barrier.clone();
                tasks.push(tokio::spawn(async move {
                    barrier_.wait().await;
                    match backend.acquire(NAME, &key, Duration::from_secs(2)).await {
                        Ok(lease) => {
                            lease.release().await;
                            Ok(())
                        }
                        Err(error) => Err(format!("backend: {error}")),
                    }
                }));
                let table = format!("{schema}.replays");
                let store = PostgresReplayStore::with_table(pool(&pg.conn_str()), &table).unwrap();
                let barrier = barrier.clone();
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .purge_expired()
                        .await
                        .map(drop)
                        .map_err(|error| format!("store: {error}"))
                }));
            }
            for task in tasks {
                if let Err(error) = task.await.unwrap() {
                    failed.push(format!("round {round}, {start} start: {error}"));
                }
            }
        }
    }
    let log = pg.log();
    let noisy: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("already exists") || line.contains("duplicate key"))
        .collect();
    assert!(
        failed.is_empty() && noisy.is_empty(),
        "{} of {} first uses failed: {failed:#?}\nserver log: {noisy:#?}",
        failed.len(),
        ROUNDS * 2 * 2 * INSTANCES
    );
}

/// Expired records are deleted as the store is used (issue 28): no task to schedule.
/// 600 records that expire at once: after the 256th and 512th writes, batches of
/// expired rows are gone without a call to `purge_expired`.
#[tokio::test]
async fn expired_records_are_purged_as_the_store_is_used() {
    let pg = PgServer::start();
    let backend = backend(&pg.conn_str(), "instance");
    let store = PostgresReplayStore::new(pool(&pg.conn_str()));
    let app = Router::new()
        .route("/orders", post(|| async { "made" }))
        .layer(ReplayLayer::new(store).ttl(Duration::from_millis(1)))
        .layer(
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(backend),
        );
    let app = serve(app, Arc::new(Probe::default())).await;
    for n in 0..600 {
        app.post("/orders", &format!("order-{n}"), "").await;
    }
    let (admin, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let rows = || async {
        let row = admin
            .query_one("SELECT count(*) FROM keyed_lock_replay", &[])
            .await
            .unwrap();
        row.get::<_, i64>(0)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rows().await > 600 - 2 * 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} rows left of 600 expired writes: nothing was purged",
            rows().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
