//! The replay layer with the Redis store, under the Redis lock backend, against a real
//! `redis-server` (one per test) through real hyper servers: every row of the table,
//! a silent store, the fenced write after a lost lease, and the refused memory store.
#![cfg(all(feature = "replay", feature = "redis"))]

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use http::StatusCode;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::replay::{MemoryStore, RedisReplayStore, ReplayLayer, STORED_TOTAL};
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

use crate::support::fixtures::AnotherInstance;
use crate::support::redis_monitor::Monitor;
use crate::support::redis_server::RedisServer;
use crate::support::replay::{serve, Kit, Probe, Served, Stacking, PATIENCE};
use crate::support::tcp_proxy::TcpProxy;

const NAME: &str = "replay-redis";

async fn backend(redis: &RedisServer) -> RedisBackend {
    RedisBackend::builder(redis.client())
        // A server started for this run: no instance can hold a key it lost.
        .restart_guard(false)
        .build()
        .await
        .expect("backend connects")
}

/// Layers as two instances of an application would build them: each `serve` gets a
/// lock layer of its own on the shared backend, and the one store.
async fn kit_stacked(redis: &RedisServer, stacking: Stacking) -> Kit {
    let backend = backend(redis).await;
    let store = RedisReplayStore::new(&backend);
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

/// `KeyedLockLayer::replay`: the record looked up by the lock's acquisition.
async fn kit(redis: &RedisServer) -> Kit {
    kit_stacked(redis, Stacking::Replay).await
}

/// Every row, for the layers stacked both ways.
macro_rules! rows {
    ($($row:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $row() {
                let redis = RedisServer::start();
                crate::support::replay::$row(&kit(&redis).await).await;
            }
        )*
        mod by_hand {
            use super::*;
            $(
                #[tokio::test]
                async fn $row() {
                    let redis = RedisServer::start();
                    let kit = kit_stacked(&redis, Stacking::ByHand).await;
                    crate::support::replay::$row(&kit).await;
                }
            )*
        }
    };
}

crate::support::replay::every_row!(rows);

#[tokio::test]
async fn silent_store_fails_closed_with_503_or_open_if_configured() {
    let redis = RedisServer::start();
    let backend = backend(&redis).await;
    // The store talks to Redis through a proxy that can go silent (its own backend,
    // the same keys); the lock does not.
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", redis.port()).parse().unwrap()).await;
    let client = redis::Client::open(format!("redis://{}/", proxy.host_port())).unwrap();
    let store_backend = RedisBackend::builder(client)
        .restart_guard(false)
        .command_timeout(Duration::from_millis(300))
        .build()
        .await
        .expect("backend connects through the proxy");
    let store = RedisReplayStore::new(&store_backend);
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
    let closed = kit.serve().await;
    let open = kit
        .serve_with(|lock| lock, |replay| replay.fail_open(true))
        .await;
    assert!(!closed.post("/orders", "before", "").await.is_replay());

    proxy.blackhole();
    let started = tokio::time::Instant::now();
    let refused = closed.post("/orders", "k", "").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.headers["retry-after"], "1");
    assert_eq!(refused.reason(), "backend");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        closed.probe.completed(),
        1,
        "the handler ran without the store"
    );

    let ran = open.post("/orders", "k", "").await;
    assert_eq!(ran.status, StatusCode::CREATED);
    assert_eq!(open.probe.completed(), 1);

    // The silence ends the way partitions do for TCP: the stale connection is reset
    // (bytes the blackhole swallowed would desynchronize a pipelined connection).
    proxy.heal();
    proxy.reset();
    let mut healed = closed.post("/orders", "healed", "").await;
    for _ in 0..20 {
        if healed.status == StatusCode::CREATED {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        healed = closed.post("/orders", "healed", "").await;
    }
    assert_eq!(healed.status, StatusCode::CREATED, "{healed:?}");
    assert!(closed.post("/orders", "healed", "").await.is_replay());
}

#[tokio::test]
async fn memory_store_under_a_distributed_lock_is_refused() {
    let redis = RedisServer::start();
    let kit = Kit {
        lock: Box::new({
            let backend = backend(&redis).await;
            move || {
                KeyedLockLayer::by_header("idempotency-key")
                    .name(NAME)
                    .backend(backend.clone())
            }
        }),
        replay: Box::new(|| ReplayLayer::new(MemoryStore::default())),
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

/// The convenience that stacks the two layers refuses the same mistake when the layers
/// are built, before any request.
#[tokio::test]
async fn memory_store_under_a_distributed_lock_is_refused_at_build_time() {
    let redis = RedisServer::start();
    let lock = KeyedLockLayer::by_header("idempotency-key").backend(backend(&redis).await);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lock.clone()
            .replay(ReplayLayer::new(MemoryStore::default()))
    }));
    let message = refused.expect_err("the memory store was accepted");
    let message = (message.downcast_ref::<&str>().copied())
        .or(message.downcast_ref::<String>().map(String::as_str))
        .expect("a panic message");
    assert!(message.contains("MemoryStore"), "{message}");

    // A shared store is accepted, and without a backend the memory store is too.
    let store = RedisReplayStore::new(&backend(&redis).await);
    let _ = lock.replay(ReplayLayer::new(store));
    let _ = KeyedLockLayer::by_header("idempotency-key")
        .replay(ReplayLayer::new(MemoryStore::default()));
}

/// Instance A's lease runs out while its handler is slow; instance B takes the key,
/// runs and stores. A's late write is fenced: the record stays B's.
#[tokio::test]
async fn write_after_a_lost_lease_is_fenced() {
    write_after_a_lost_lease_is_fenced_when(Stacking::ByHand).await;
}

/// The same through `KeyedLockLayer::replay`: A's write-and-release script finds the
/// fence moved on and changes nothing (B's lock stays, and its record).
#[tokio::test]
async fn write_and_release_after_a_lost_lease_is_fenced() {
    write_after_a_lost_lease_is_fenced_when(Stacking::Replay).await;
}

async fn write_after_a_lost_lease_is_fenced_when(stacking: Stacking) {
    let redis = RedisServer::start();
    let short_lease = || async {
        RedisBackend::builder(redis.client())
            // A server started for this run: no instance can hold a key it lost.
            .restart_guard(false)
            .lease(Duration::from_millis(300))
            .renewal(false)
            .build()
            .await
            .unwrap()
    };
    let (backend_a, backend_b) = (short_lease().await, short_lease().await);
    let calls = Arc::new(AtomicUsize::new(0));
    let app = |backend: RedisBackend| {
        let calls = Arc::clone(&calls);
        let handler = move |Extension(info): Extension<LockInfo>| async move {
            let call = calls.fetch_add(1, SeqCst) + 1;
            if call == 1 {
                // Slow past the lease; it learns that it lost it.
                tokio::time::sleep(Duration::from_millis(900)).await;
                assert!(info.is_lease_lost());
            }
            format!("call {call}")
        };
        // Each instance's store on its own backend, as an application builds them.
        let replay = ReplayLayer::new(RedisReplayStore::new(&backend));
        let lock = KeyedLockLayer::by_header("idempotency-key")
            .name(NAME)
            .backend(backend);
        let routes = Router::new().route("/orders", post(handler));
        match stacking {
            Stacking::ByHand => routes.layer(replay).layer(lock),
            Stacking::Replay => routes.layer(lock.replay(replay)),
        }
    };
    let probe = Arc::new(Probe::default());
    let a = Arc::new(serve(app(backend_a), Arc::clone(&probe)).await);
    let b = serve(app(backend_b), probe).await;

    let slow = tokio::spawn({
        let a = Arc::clone(&a);
        async move { a.post("/orders", "k", "").await }
    });
    tokio::time::sleep(Duration::from_millis(450)).await;
    let taken_over = b.post("/orders", "k", "").await;
    assert_eq!(taken_over.body, "call 2");
    let late = slow.await.unwrap();
    assert_eq!(late.body, "call 1");

    let replayed = a.post("/orders", "k", "").await;
    assert!(replayed.is_replay());
    assert_eq!(replayed.body, "call 2", "the lost lease's write landed");
}

/// The app of the round-trip counts: `/orders` behind `lock.replay(replay)` (or the two
/// stacked by hand), `/plain` behind the lock alone; each handler marks the moment it
/// runs in Redis's MONITOR stream as `handler-<key>`.
fn counted_app(backend: &RedisBackend, monitor: &Arc<Monitor>, stacking: Stacking) -> Router {
    let handler = {
        let monitor = Arc::clone(monitor);
        move |headers: http::HeaderMap| async move {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            monitor.mark(&format!("handler-{key}")).await;
            format!("done {key}")
        }
    };
    let lock = || {
        KeyedLockLayer::by_header("idempotency-key")
            .name(NAME)
            .backend(AnotherInstance(backend.clone()))
    };
    let replay = ReplayLayer::new(RedisReplayStore::new(backend));
    let orders = Router::new().route("/orders", post(handler.clone()));
    let orders = match stacking {
        Stacking::Replay => orders.layer(lock().replay(replay)),
        Stacking::ByHand => orders.layer(replay).layer(lock()),
    };
    let plain = Router::new().route("/plain", post(handler)).layer(lock());
    orders.merge(plain)
}

/// What Redis ran for one request: the commands sent before the handler ran (all
/// until the answer, if it did not run), between the handler and the answer, and in
/// the 300 ms after the answer.
async fn count(monitor: &Monitor, app: &Served, path: &str, key: &str) -> [Vec<String>; 3] {
    let [start, answered, settled] =
        ["start", "answered", "settled"].map(|m| format!("{m}-{path}-{key}"));
    monitor.mark(&start).await;
    app.post(path, key, "{}").await;
    monitor.mark(&answered).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    monitor.mark(&settled).await;
    let handler = format!("handler-{key}");
    let until_answered = monitor.sent_between(&start, &answered).unwrap();
    let (before, after) = match monitor.sent_between(&start, &handler) {
        Some(before) if before.len() <= until_answered.len() => {
            (before, monitor.sent_between(&handler, &answered).unwrap())
        }
        // The handler did not run for this request (a replay).
        _ => (until_answered, Vec::new()),
    };
    let later = monitor.sent_between(&answered, &settled).unwrap();
    [before, after, later]
}

/// Issue 33, counted by Redis itself (MONITOR): through `KeyedLockLayer::replay` on the
/// Redis store a first request sends one command before its handler (the acquisition,
/// which looks for the record too) and one after it (the record written and the lock
/// released in one script), and nothing once answered; a replay of the completed key
/// sends one, and takes no lock. A lock without replay sends one before the handler and
/// releases after the response. The layers stacked by hand pay what they did before:
/// the record read after the acquisition, the release after the write.
#[tokio::test]
async fn round_trips_are_counted_by_redis() {
    let redis = RedisServer::start();
    let monitor = Arc::new(Monitor::start(redis.port()).await);
    let backend = backend(&redis).await;
    let probe = Arc::new(Probe::default());
    let app = serve(
        counted_app(&backend, &monitor, Stacking::Replay),
        Arc::clone(&probe),
    )
    .await;
    let by_hand = serve(counted_app(&backend, &monitor, Stacking::ByHand), probe).await;
    // Loads the scripts (a first EVALSHA finds none), on both paths.
    for (served, key) in [(&app, "warm-up"), (&by_hand, "warm-up-by-hand")] {
        served.post("/orders", key, "{}").await;
        served.post("/plain", key, "{}").await;
    }
    // Their releases are sent after the answers: let them land before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The release subscription's keep-alive PING runs on its own schedule.
    let names = |commands: &[String]| -> Vec<String> {
        let names = commands
            .iter()
            .map(|c| c.split(' ').next().unwrap().to_owned());
        names.filter(|name| name != "PING").collect()
    };

    let [before, after, later] = count(&monitor, &app, "/orders", "first").await;
    assert_eq!(
        names(&before),
        ["EVALSHA"],
        "before the handler: {before:?}"
    );
    assert_eq!(
        names(&after),
        ["EVAL"],
        "between handler and response: {after:?}"
    );
    assert!(names(&later).is_empty(), "after the response: {later:?}");

    let [before, after, later] = count(&monitor, &app, "/orders", "first").await;
    assert_eq!(names(&before), ["EVALSHA"], "a replay: {before:?}");
    assert!(
        names(&after).is_empty() && names(&later).is_empty(),
        "{after:?} {later:?}"
    );
    assert!(
        !redis_key_exists(&redis, &backend.lock_key(NAME, "first")).await,
        "the replay took the lock"
    );

    // The release runs beside the response, so it may reach Redis before or after the
    // client has the answer; it is sent after the handler either way.
    let [before, after, later] = count(&monitor, &app, "/plain", "plain").await;
    assert_eq!(names(&before), ["EVALSHA"], "{before:?}");
    assert_eq!(names(&[after, later].concat()), ["EVALSHA"], "the release");

    // Stacked by hand: acquire, then GET; after the handler the fenced write, and the
    // release. A replay: acquire and GET, then the release.
    let [before, after, later] = count(&monitor, &by_hand, "/orders", "by-hand").await;
    assert_eq!(names(&before), ["EVALSHA", "GET"], "{before:?}");
    assert_eq!(names(&[after, later].concat()), ["EVALSHA", "EVALSHA"]);
    let sent = count(&monitor, &by_hand, "/orders", "by-hand")
        .await
        .concat();
    assert_eq!(names(&sent), ["EVALSHA", "GET", "EVALSHA"], "{sent:?}");
}

async fn redis_key_exists(redis: &RedisServer, key: &str) -> bool {
    let mut connection = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<bool>(&mut connection)
        .await
        .unwrap()
}

/// Through `KeyedLockLayer::replay`, a request dropped after 0, 50 µs, 100 µs … 6.4 ms, 1 s
/// — at the acquisition that looks for the record, the handler, or the write that
/// releases the lock — leaves the lock free (not held until its lease runs out), and a
/// retry is replayed exactly when the handler ran to its end.
#[tokio::test]
async fn dropped_at_any_moment_leaves_the_lock_free_and_stores_only_completed() {
    use tower::{Layer, ServiceExt};
    let redis = RedisServer::start();
    let backend = backend(&redis).await;
    let completed = Arc::new(AtomicUsize::new(0));
    let handler = {
        let completed = Arc::clone(&completed);
        tower::service_fn(move |_: http::Request<axum::body::Body>| {
            let completed = Arc::clone(&completed);
            async move {
                tokio::time::sleep(Duration::from_micros(300)).await;
                let call = completed.fetch_add(1, SeqCst) + 1;
                Ok::<_, std::convert::Infallible>(http::Response::new(format!("call {call}")))
            }
        })
    };
    let service = KeyedLockLayer::by_header("idempotency-key")
        .name(NAME)
        .backend(backend.clone())
        .replay(ReplayLayer::new(RedisReplayStore::new(&backend)))
        .layer(handler);
    let request = |key: &str| {
        http::Request::post("/orders")
            .header("idempotency-key", key)
            .body(axum::body::Body::from("body"))
            .unwrap()
    };
    let mut finished = 0;
    // 0 µs never finishes (a round trip is needed); a second always does, however
    // loaded the machine.
    for (step, micros) in [0, 50, 100, 200, 400, 800, 1600, 3200, 6400, 1_000_000]
        .into_iter()
        .enumerate()
    {
        let key = format!("dropped-{step}");
        let before = completed.load(SeqCst);
        let call = service.clone().oneshot(request(&key));
        if tokio::time::timeout(Duration::from_micros(micros), call)
            .await
            .is_ok()
        {
            finished += 1;
        }
        // Freed by the write that releases it, or by the lease's own release: both
        // within moments, never a lease later (30 s).
        let lock = backend.lock_key(NAME, &key);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while redis_key_exists(&redis, &lock).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{lock} still held after a drop at {micros} µs"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ran_to_end = completed.load(SeqCst) > before;
        let retry = tokio::time::timeout(
            Duration::from_secs(10),
            service.clone().oneshot(request(&key)),
        )
        .await
        .expect("answered")
        .unwrap();
        let replayed = retry.headers().contains_key("idempotent-replayed");
        assert_eq!(replayed, ran_to_end, "dropped at {micros} µs");
    }
    assert!(
        finished > 0 && finished < 10,
        "{finished} of 10 finished: both paths taken"
    );
}

/// `lock.replay(..)` on a clone of a lock layer already applied elsewhere still looks
/// the record up in the acquisition (the lookup belongs to the service `replay`
/// builds, not to the layer's settings): a replay is one command. (The bench stacks
/// it so, and first measured the hand-stacked path.)
#[tokio::test]
async fn replay_on_a_clone_of_an_applied_lock_still_looks_up() {
    let redis = RedisServer::start();
    let monitor = Monitor::start(redis.port()).await;
    let backend = backend(&redis).await;
    let lock = KeyedLockLayer::by_header("idempotency-key")
        .name(NAME)
        .backend(backend.clone());
    let plain = Router::new()
        .route("/plain", post(|| async { "plain" }))
        .layer(lock.clone());
    let orders = Router::new()
        .route("/orders", post(|| async { "order" }))
        .layer(lock.replay(ReplayLayer::new(RedisReplayStore::new(&backend))));
    let app = serve(plain.merge(orders), Arc::new(Probe::default())).await;
    app.post("/plain", "k", "").await;
    app.post("/orders", "k", "").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    monitor.mark("replay-start").await;
    assert!(app.post("/orders", "k", "").await.is_replay());
    monitor.mark("replay-end").await;
    let sent = monitor.sent_between("replay-start", "replay-end").unwrap();
    let sent: Vec<_> = sent.iter().filter(|c| !c.starts_with("PING")).collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
}

/// Through `KeyedLockLayer::replay`, the lock's own Redis goes silent while the handler
/// runs: the write that would also release the lock times out within the store
/// timeout, the client gets its response (not stored), and once the path heals the key
/// is free again within the lease and a retry runs again (nothing was stored).
#[tokio::test]
async fn a_silent_engine_during_the_write_and_release_answers_and_frees_the_key() {
    let redis = RedisServer::start();
    let upstream = format!("127.0.0.1:{}", redis.port()).parse().unwrap();
    let proxy = TcpProxy::start(upstream).await;
    let client = redis::Client::open(format!("redis://{}/", proxy.addr)).unwrap();
    let backend = RedisBackend::builder(client)
        .restart_guard(false)
        .lease(Duration::from_secs(1))
        .command_timeout(Duration::from_millis(300))
        .build()
        .await
        .expect("backend connects through the proxy");
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (gate, calls) = (Arc::clone(&gate), Arc::clone(&calls));
        move || async move {
            let call = calls.fetch_add(1, SeqCst) + 1;
            if call == 1 {
                gate.acquire().await.unwrap().forget();
            }
            format!("call {call}")
        }
    };
    let lock = KeyedLockLayer::by_header("idempotency-key")
        .name(NAME)
        .backend(backend.clone());
    let replay =
        ReplayLayer::new(RedisReplayStore::new(&backend)).store_timeout(Duration::from_millis(300));
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(lock.replay(replay));
    let app = Arc::new(serve(app, Arc::new(Probe::default())).await);

    let first = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.post("/orders", "k", "").await }
    });
    while calls.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.blackhole();
    let silenced = tokio::time::Instant::now();
    gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.body, "call 1");
    assert!(
        silenced.elapsed() < Duration::from_secs(2),
        "answered {:?} after the silence began",
        silenced.elapsed()
    );

    proxy.heal();
    proxy.reset();
    // Freed by the lease's own release once the path is back, or by its expiry.
    let retry = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let retry = app.post("/orders", "k", "").await;
            if retry.status.is_success() {
                return retry;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the key is free again");
    assert!(!retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, "call 2");
}

/// The keys a layer leaves in Redis, by what follows the key's hash tag (`lock`,
/// `fence`, `holder`, `replay`, …), with the bytes Redis counts for one of each.
async fn footprint(
    redis: &RedisServer,
    layer: &str,
) -> std::collections::BTreeMap<String, (usize, i64)> {
    let mut connection = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{{keyed-lock:{layer}:*"))
        .query_async(&mut connection)
        .await
        .unwrap();
    let mut kinds = std::collections::BTreeMap::new();
    for key in keys {
        let kind = key.rsplit("}:").next().unwrap().split(':').next().unwrap();
        let entry = kinds.entry(kind.to_owned()).or_insert((0, 0));
        if entry.0 == 0 {
            let bytes: Option<i64> = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .query_async(&mut connection)
                .await
                .unwrap();
            entry.1 = bytes.unwrap_or(0);
        }
        entry.0 += 1;
    }
    kinds
}

/// What completed requests leave in Redis, each with a key of its own (idempotency
/// keys come from clients, one per request): their records expire with the replay
/// `ttl`. With `fence_ttl(None)` the lock's holder record (it carries the last fencing
/// token) stays, one per key ever locked; with a window, nothing is left.
#[tokio::test]
async fn records_expire_and_with_fence_ttl_nothing_is_left() {
    const REQUESTS: usize = 100;
    crate::support::recorder::install(); // before the layers register their handles
    let redis = RedisServer::start();
    let ttl = Duration::from_millis(300);
    let lease = Duration::from_secs(1);
    for (layer, fence_ttl) in [
        ("footprint-default", None),
        ("footprint-fence-ttl", Some(Duration::from_millis(10))),
    ] {
        let backend = RedisBackend::builder(redis.client())
            .restart_guard(false)
            .lease(lease)
            .fence_ttl(fence_ttl)
            .build()
            .await
            .expect("backend connects");
        let replay = ReplayLayer::new(RedisReplayStore::new(&backend)).ttl(ttl);
        let lock = KeyedLockLayer::by_header("idempotency-key")
            .name(layer)
            .backend(backend);
        let app = Router::new()
            .route("/orders", post(|| async { "made" }))
            .layer(lock.replay(replay));
        let app = serve(app, Arc::new(Probe::default())).await;
        for n in 0..REQUESTS {
            let answer = app.post("/orders", &format!("order-{n}"), "").await;
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        }
        // Every record written (counted, as some may have expired already).
        let stored = crate::support::recorder::counter(STORED_TOTAL, layer, &[]);
        assert_eq!(stored, REQUESTS as u64, "{layer}");
        eprintln!(
            "{layer}: after {REQUESTS} requests: {:?}",
            footprint(&redis, layer).await
        );
    }

    // Records go with the replay ttl; with `fence_ttl`, the holder record after the
    // lease (the longer of the two).
    let deadline = tokio::time::Instant::now() + PATIENCE + lease;
    loop {
        let default = footprint(&redis, "footprint-default").await;
        let with_fence_ttl = footprint(&redis, "footprint-fence-ttl").await;
        if !default.contains_key("replay") && with_fence_ttl.is_empty() {
            eprintln!("left without fence_ttl: {default:?}");
            let left: Vec<_> = default.iter().map(|(k, v)| (k.as_str(), v.0)).collect();
            assert_eq!(left, [("holder", REQUESTS)]);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still there after the record ttl and the lease: {default:?} {with_fence_ttl:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A request that holds its key longer than the backend's `fence_ttl` (renewed, its
/// lease never lost) must still store its response: the retry is replayed.
#[tokio::test]
async fn a_hold_longer_than_fence_ttl_still_stores() {
    let redis = RedisServer::start();
    let lease = Duration::from_secs(1);
    let backend = RedisBackend::builder(redis.client())
        .restart_guard(false)
        .lease(lease)
        .fence_ttl(Some(lease))
        .build()
        .await
        .expect("backend connects");
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = Arc::clone(&calls);
        move |Extension(lock): Extension<LockInfo>| async move {
            calls.fetch_add(1, SeqCst);
            // Longer than the fence's TTL, renewed all along.
            tokio::time::sleep(lease * 5 / 2).await;
            assert!(!lock.is_lease_lost(), "the lease itself was lost");
            "made"
        }
    };
    for stacking in [Stacking::Replay, Stacking::ByHand] {
        let replay = ReplayLayer::new(RedisReplayStore::new(&backend));
        let lock = KeyedLockLayer::by_header("idempotency-key")
            .name(format!("{NAME}-{stacking:?}"))
            .backend(backend.clone());
        let routes = Router::new().route("/orders", post(handler.clone()));
        let app = match stacking {
            Stacking::Replay => routes.layer(lock.replay(replay)),
            Stacking::ByHand => routes.layer(replay).layer(lock),
        };
        let app = serve(app, Arc::new(Probe::default())).await;
        let key = format!("long-{stacking:?}");
        assert_eq!(app.post("/orders", &key, "").await.status, StatusCode::OK);
        let retry = app.post("/orders", &key, "").await;
        assert!(
            retry.is_replay(),
            "{stacking:?}: the retry ran again: {retry:?}"
        );
    }
    assert_eq!(calls.load(SeqCst), 2);
}
