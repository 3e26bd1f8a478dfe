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
use tower_keyed_lock::replay::{MemoryStore, RedisReplayStore, ReplayLayer};
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

use crate::support::redis_server::RedisServer;
use crate::support::replay::{serve, Kit, Probe};
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
async fn kit(redis: &RedisServer) -> Kit {
    let backend = backend(redis).await;
    let store = RedisReplayStore::new(&backend);
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
            let redis = RedisServer::start();
            crate::support::replay::$row(&kit(&redis).await).await;
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
                .backend(backend.clone())
        }),
        replay: Box::new(move || {
            ReplayLayer::new(store.clone()).store_timeout(Duration::from_millis(300))
        }),
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
    let store = RedisReplayStore::new(&backend_a);
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
        Router::new()
            .route("/orders", post(handler))
            .layer(ReplayLayer::new(store.clone()))
            .layer(
                KeyedLockLayer::by_header("idempotency-key")
                    .name(NAME)
                    .backend(backend),
            )
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
