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
use tower_keyed_lock::backend::postgres::{PostgresBackend, PostgresBackendBuilder};
use tower_keyed_lock::replay::{PostgresReplayStore, ReplayLayer};
use tower_keyed_lock::{Key, KeyedLockLayer, LockBackend, LockInfo};

use crate::support::fixtures::{until, AnotherInstance};
use crate::support::pg_server::PgServer;
use crate::support::replay::{serve, Kit, Probe, Served, Stacking, PATIENCE};
use crate::support::tcp_proxy::TcpProxy;

const NAME: &str = "replay-postgres";

fn builder(config: &str, instance: &str) -> PostgresBackendBuilder {
    let mut config: tokio_postgres::Config = config.parse().unwrap();
    config.application_name(instance);
    // A holding session's application name is its holder record, ending with the
    // instance id: `tkl % <instance>` finds it.
    PostgresBackend::builder_from_config(config)
        .instance_id(instance)
        .liveness_interval(Duration::from_millis(100))
        .fencing(true)
}

/// [`builder`] as it is, connecting on first use.
fn backend(config: &str, instance: &str) -> PostgresBackend {
    builder(config, instance).build_lazy()
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

/// `KeyedLockLayer::replay` on a store the lock looks up: the record read in the lock's
/// try.
fn kit(pg: &PgServer) -> Kit {
    kit_stacked(pg, Stacking::Replay)
}

fn kit_stacked(pg: &PgServer, stacking: Stacking) -> Kit {
    let backend = backend(&pg.conn_str(), "instance");
    let store = PostgresReplayStore::new(pool(&pg.conn_str())).looked_up_by(&backend);
    Kit {
        lock: Box::new(move || {
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(AnotherInstance(backend.clone()))
        }),
        replay: Box::new(move || ReplayLayer::new(store.clone())),
        stacking,
    }
}

/// Every row, for the layers stacked both ways.
macro_rules! rows {
    ($($row:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $row() {
                let pg = PgServer::start();
                crate::support::replay::$row(&kit(&pg)).await;
            }
        )*
        mod by_hand {
            use super::*;
            $(
                #[tokio::test]
                async fn $row() {
                    let pg = PgServer::start();
                    crate::support::replay::$row(&kit_stacked(&pg, Stacking::ByHand)).await;
                }
            )*
        }
    };
}

crate::support::replay::every_row!(rows);

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
                .backend(AnotherInstance(backend.clone()))
        }),
        replay: Box::new(move || {
            ReplayLayer::new(store.clone()).store_timeout(Duration::from_millis(300))
        }),
        stacking: Stacking::ByHand,
    };
    let app = kit.serve().await;
    // A store reached: on a loaded machine the first calls (a connection, the table)
    // may outlast the 300 ms limit, and are refused as the silent store is below.
    let started = std::time::Instant::now();
    while !app.post("/orders", "before", "").await.status.is_success() {
        assert!(
            started.elapsed() < PATIENCE,
            "the store never answered in time"
        );
    }
    let completed = app.probe.completed();
    proxy.blackhole();
    let refused = app.post("/orders", "k", "").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.headers["retry-after"], "1");
    assert_eq!(
        app.probe.completed(),
        completed,
        "the handler ran for a request the silent store refused"
    );
}

/// A store that needs fencing tokens under a backend that issues none would never
/// store (before: every retry ran the handler again, and one log line said why). The
/// request is refused as misconfigured instead, before the handler runs.
#[tokio::test]
async fn store_without_fencing_tokens_is_refused() {
    let pg = PgServer::start();
    let backend = builder(&pg.conn_str(), "instance")
        .fencing(false)
        .build_lazy();
    let store = PostgresReplayStore::new(pool(&pg.conn_str()));
    let kit = Kit {
        lock: Box::new(move || {
            KeyedLockLayer::by_header("idempotency-key")
                .name(NAME)
                .backend(AnotherInstance(backend.clone()))
        }),
        replay: Box::new(move || ReplayLayer::new(store.clone())),
        stacking: Stacking::ByHand,
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
    let unfenced = builder(&pg.conn_str(), "instance")
        .fencing(false)
        .build_lazy();
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
        .backend(builder(&pg.conn_str(), "instance").build_lazy())
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
                let backend = builder(&pg.conn_str(), &format!("instance-{instance}"))
                    .fencing_sequence(&format!("{schema}.tokens"))
                    .build_lazy();
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

/// Issue 33, counted on the wire: the lock's and the store's connections go through a
/// proxy that counts each time a client speaks after PostgreSQL has (a round trip).
/// Through `KeyedLockLayer::replay` on a store looked up by the lock, a first request
/// makes one round trip before its handler (the try, which reads the record too) and
/// one after it before the answer (the fenced write and the unlock, pipelined on the
/// lock's session), none after the answer, and a replay of the completed key makes
/// one, taking no lock.
/// Stacked by hand, the record is read after the try: two before the handler, and two
/// for a replay (with the unlock after it).
#[tokio::test]
async fn round_trips_are_counted_on_the_wire() {
    let pg = PgServer::start();
    let proxy =
        Arc::new(TcpProxy::start(format!("127.0.0.1:{}", pg.port()).parse().unwrap()).await);
    let via_proxy = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.addr.port()
    );
    // No liveness check falls inside a request.
    let backend = builder(&via_proxy, "instance")
        .liveness_interval(Duration::from_secs(30))
        .build_lazy();
    let store = PostgresReplayStore::new(pool(&via_proxy)).looked_up_by(&backend);
    let counted = Counted::new(&proxy);
    let app = |stacking: Stacking| {
        let lock = KeyedLockLayer::by_header("idempotency-key")
            .name(NAME)
            .backend(AnotherInstance(backend.clone()));
        let replay = ReplayLayer::new(store.clone());
        let routes = Router::new().route("/orders", post(counted.handler()));
        let routes = match stacking {
            Stacking::Replay => routes.layer(lock.replay(replay)),
            Stacking::ByHand => routes.layer(replay).layer(lock),
        };
        // Counted as the layers answer: the unlock, spawned as the lock's guard drops,
        // has not run yet (a count at the client would race it).
        routes.layer(tower::util::MapResponseLayer::new(counted.at_answer()))
    };
    let probe = Arc::new(Probe::default());
    let looked_up = serve(app(Stacking::Replay), Arc::clone(&probe)).await;
    let by_hand = serve(app(Stacking::ByHand), probe).await;
    // The first requests create the table, prepare the store's statements and the
    // fencing sequence, and confirm a fresh session keeps its lock: once each.
    for served in [&looked_up, &by_hand] {
        for key in ["warm-1", "warm-2", "warm-3"] {
            served.post("/orders", key, "").await;
            served.post("/orders", key, "").await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(
        counted.request(&looked_up, "first").await,
        [1, 1, 0],
        "a first request: the write and the unlock in one round trip, nothing after"
    );
    assert_eq!(
        counted.request(&looked_up, "first").await,
        [1, 0, 0],
        "a replay"
    );
    let holder = backend
        .holder(NAME, &Key::new("first", 256).unwrap())
        .await
        .unwrap();
    assert!(holder.is_none(), "{holder:?}");
    assert_eq!(
        counted.request(&by_hand, "by-hand").await,
        [2, 1, 1],
        "a first request, by hand"
    );
    assert_eq!(
        counted.request(&by_hand, "by-hand").await,
        [2, 0, 1],
        "a replay, by hand"
    );
}

/// Round trips through a proxy at the moments of one request.
struct Counted {
    proxy: Arc<TcpProxy>,
    /// At the handler's start, `usize::MAX` until it runs.
    at_handler: Arc<AtomicUsize>,
    at_answer: Arc<AtomicUsize>,
}

impl Counted {
    fn new(proxy: &Arc<TcpProxy>) -> Self {
        Counted {
            proxy: Arc::clone(proxy),
            at_handler: Arc::new(AtomicUsize::new(usize::MAX)),
            at_answer: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn handler(
        &self,
    ) -> impl Fn() -> std::future::Ready<&'static str> + Clone + Send + Sync + 'static {
        let (proxy, at_handler) = (Arc::clone(&self.proxy), Arc::clone(&self.at_handler));
        move || {
            at_handler.store(proxy.round_trips() as usize, SeqCst);
            std::future::ready("done")
        }
    }

    fn at_answer(
        &self,
    ) -> impl FnMut(axum::response::Response) -> axum::response::Response + Clone + Send + Sync + 'static
    {
        let (proxy, at_answer) = (Arc::clone(&self.proxy), Arc::clone(&self.at_answer));
        move |response| {
            at_answer.store(proxy.round_trips() as usize, SeqCst);
            response
        }
    }

    /// Round trips before the handler (all until the answer if it did not run), between
    /// the handler and the answer, and in the 300 ms after the answer.
    async fn request(&self, app: &Served, key: &str) -> [usize; 3] {
        self.at_handler.store(usize::MAX, SeqCst);
        let start = self.proxy.round_trips() as usize;
        app.post("/orders", key, "").await;
        let answered = self.at_answer.load(SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let later = self.proxy.round_trips() as usize - answered;
        match self.at_handler.load(SeqCst) {
            usize::MAX => [answered - start, 0, later],
            ran => [ran - start, answered - ran, later],
        }
    }
}

/// Keys with quotes, backslashes and dollar-quote tags reach the lock's try as literals:
/// each is replayed under its own key, and no other's.
#[tokio::test]
async fn odd_keys_are_looked_up_as_they_are() {
    let pg = PgServer::start();
    let app = kit(&pg).serve().await;
    let keys = ["o'rder", r"back\slash", "$t0$dollar$t1$", "$$", "a;b--c"];
    for key in keys {
        let first = app.post("/orders", key, "").await;
        assert!(!first.is_replay(), "{key}: {first:?}");
    }
    for key in keys {
        let replayed = app.post("/orders", key, "").await;
        assert!(replayed.is_replay(), "{key}: {replayed:?}");
    }
    assert_eq!(app.probe.completed(), keys.len());
}

/// The lock's backend, and an app whose store is looked up by it (`KeyedLockLayer::
/// replay`), its table created by a first request; and an admin connection, which adds
/// a trigger that runs `action` (PL/pgSQL) when the record of key `key` is written.
async fn one_step_app(
    pg: &PgServer,
    replay: impl FnOnce(ReplayLayer) -> ReplayLayer,
    (key, action): (&str, &str),
) -> (PostgresBackend, Served, tokio_postgres::Client) {
    let backend = backend(&pg.conn_str(), "instance");
    let store = PostgresReplayStore::new(pool(&pg.conn_str())).looked_up_by(&backend);
    let lock = KeyedLockLayer::by_header("idempotency-key")
        .name(NAME)
        .backend(backend.clone());
    let probe = Arc::new(Probe::default());
    let app = crate::support::replay::app_stacked(
        Stacking::Replay,
        lock,
        replay(ReplayLayer::new(store)),
        Arc::clone(&probe),
    );
    let app = serve(app, probe).await;
    app.post("/orders", "warm", "").await;
    let (admin, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    // The first request's record (and with it the table) is written as its response
    // ends, which can be after the client has read it.
    until("the store has made its table", || async {
        admin
            .query_one("SELECT to_regclass('keyed_lock_replay') IS NOT NULL", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    admin
        .batch_execute(&format!(
            "CREATE FUNCTION on_write() RETURNS trigger LANGUAGE plpgsql AS $f$ \
             BEGIN {action}; RETURN NEW; END $f$; \
             CREATE TRIGGER on_write BEFORE INSERT OR UPDATE ON keyed_lock_replay \
             FOR EACH ROW WHEN (NEW.key = '{key}') EXECUTE FUNCTION on_write()"
        ))
        .await
        .unwrap();
    (backend, app, admin)
}

/// The rows stored for `key`.
async fn rows_of(admin: &tokio_postgres::Client, key: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM keyed_lock_replay WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

async fn is_held(backend: &PostgresBackend, key: &str) -> bool {
    let key = Key::new(key, 256).unwrap();
    backend.holder(NAME, &key).await.unwrap().is_some()
}

/// The write and the unlock go together, in two messages: a write that fails does not
/// keep the unlock from running. At the answer the key is free, nothing is stored, and
/// the retry runs the handler.
#[tokio::test]
async fn a_write_that_fails_still_unlocks_in_its_round_trip() {
    let pg = PgServer::start();
    let refuse = ("doomed", "RAISE EXCEPTION 'refused by a test trigger'");
    let (backend, app, admin) = one_step_app(&pg, |replay| replay, refuse).await;

    let first = app.post("/orders", "doomed", "").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.is_replay());
    assert!(!is_held(&backend, "doomed").await, "held after the answer");
    assert_eq!(rows_of(&admin, "doomed").await, 0);
    let retry = app.post("/orders", "doomed", "").await;
    assert!(!retry.is_replay(), "{retry:?}");
    assert_eq!(
        app.probe.completed(),
        3,
        "the warm-up, the first and its retry"
    );
}

/// The lock's session dies between the write and the unlock (the write's trigger ends
/// its own server process): the write does not commit and the unlock never runs, and
/// PostgreSQL frees the key with the session, so nothing is stored and nothing stays
/// held; the client still gets its answer, and the retry runs.
#[tokio::test]
async fn a_session_killed_at_the_write_stores_nothing_and_holds_nothing() {
    let pg = PgServer::start();
    let kill = ("killed", "PERFORM pg_terminate_backend(pg_backend_pid())");
    let (backend, app, admin) = one_step_app(&pg, |replay| replay, kill).await;

    let first = app.post("/orders", "killed", "").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.is_replay());
    assert_eq!(rows_of(&admin, "killed").await, 0);
    assert!(
        !is_held(&backend, "killed").await,
        "held after its session ended"
    );
    let retry = app.post("/orders", "killed", "").await;
    assert!(!retry.is_replay(), "{retry:?}");
    assert_eq!(app.probe.completed(), 3);
}

/// The request stops waiting for its write (the store timeout passes while the write
/// sleeps in its trigger): the lease's watch task finishes both halves all the same,
/// and the release the request then waits for is the one it started. The key is free
/// at the answer, the record is there, and the retry replays it.
#[tokio::test]
async fn a_write_given_up_on_is_finished_with_its_unlock() {
    let pg = PgServer::start();
    // The write goes out well within the store timeout, even on a loaded machine (a
    // timeout that passes before it is sent abandons it, honestly, and the table of
    // the warm-up's first write too), and sleeps well past it, but well within the
    // backend's command timeout (2 s): a write unanswered by then is given up and its
    // session closed, which cancels it.
    let slow = ("slow-write", "PERFORM pg_sleep(1)");
    let store_timeout = |replay: ReplayLayer| replay.store_timeout(Duration::from_millis(500));
    let (backend, app, admin) = one_step_app(&pg, store_timeout, slow).await;

    let first = app.post("/orders", "slow-write", "").await;
    assert!(!first.is_replay());
    assert!(
        !is_held(&backend, "slow-write").await,
        "held after the answer"
    );
    assert_eq!(rows_of(&admin, "slow-write").await, 1);
    let retry = app.post("/orders", "slow-write", "").await;
    assert!(retry.is_replay(), "{retry:?}");
}

/// The client goes away while the record is being written: the request's future is
/// dropped at that await, and the write and the unlock still finish together.
#[tokio::test]
async fn a_client_gone_during_the_write_leaves_it_done_and_the_key_free() {
    use tokio::io::AsyncWriteExt;

    let pg = PgServer::start();
    let slow = ("slow-write", "PERFORM pg_sleep(0.3)");
    let (backend, app, admin) = one_step_app(&pg, |replay| replay, slow).await;
    {
        let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        let head = "POST /orders HTTP/1.1\r\nhost: t\r\nidempotency-key: slow-write\r\n\
                    content-length: 0\r\n\r\n";
        stream.write_all(head.as_bytes()).await.unwrap();
        crate::support::replay::wait_until(|| app.probe.completed() == 2).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            is_held(&backend, "slow-write").await,
            "written before the sleep ended"
        );
    } // Dropped: the client went away mid-write.
    let mut polls = 0;
    while is_held(&backend, "slow-write").await {
        polls += 1;
        assert!(polls < 100, "the key stayed held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rows_of(&admin, "slow-write").await, 1);
    let retry = app.post("/orders", "slow-write", "").await;
    assert!(retry.is_replay(), "{retry:?}");
}

/// The lock's session is killed while the handler runs: the lease is lost, its watch
/// task has ended, and the write handed to it is not run (on no other connection
/// either). Nothing is stored, nothing stays held, and the retry runs.
#[tokio::test]
async fn a_lease_lost_before_the_write_stores_nothing() {
    let pg = PgServer::start();
    let (backend, app, admin) = one_step_app(&pg, |replay| replay, ("-", "NULL")).await;
    let app = Arc::new(app);
    let slow = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.post("/slow", "lost", "").await }
    });
    crate::support::replay::wait_until(|| app.probe.started() == 2).await;
    let killed = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name LIKE 'tkl % instance'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(killed.len(), 1);
    let mut polls = 0;
    while is_held(&backend, "lost").await {
        polls += 1;
        assert!(polls < 100, "the key stayed held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    app.probe.gate.add_permits(2);
    let late = slow.await.unwrap();
    assert!(!late.is_replay(), "{late:?}");
    assert_eq!(rows_of(&admin, "lost").await, 0);
    assert!(!is_held(&backend, "lost").await);
    let retry = app.post("/slow", "lost", "").await;
    assert!(!retry.is_replay(), "{retry:?}");
}
