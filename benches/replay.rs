//! What a replay costs per request, against running a trivial handler, with the memory
//! store and with the Redis store (a real `redis-server` the bench starts).
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench replay
//! cargo bench -p tower-keyed-lock-benches --bench replay -- --test     # CI: each once
//! ```
//!
//! Each stack is driven with `ServiceExt::oneshot` (no sockets), a request with a
//! 64-byte body and an `idempotency-key`:
//!
//! - `run`: the lock layer and the handler, no replay layer — the cost to beat;
//! - `replay`: the lock layer, the replay layer, and a key already stored — every
//!   request is a replay (read the body, fingerprint, look up, build the response);
//! - `first`: a new key each time — the replay layer's cost on a request that runs
//!   and is stored.
//!
//! After criterion's own report the bench times `run` and `replay` in alternating
//! batches (the same load hits both) and prints the median ratio `replay / run`.

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use criterion::Criterion;
use http::{Request, Response};
use redis_server::RedisServer;
use tower::util::BoxCloneSyncService;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::replay::{MemoryStore, RedisReplayStore, ReplayLayer, ReplayStore};
use tower_keyed_lock::KeyedLockLayer;

type Stack = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

fn main() {
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .configure_from_args();
    let quick = std::env::args().any(|arg| arg == "--test");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");

    let memory = Stacks::new(
        KeyedLockLayer::by_header("idempotency-key"),
        MemoryStore::default(),
    );
    bench(&mut c, &rt, "replay-memory", &memory);

    let server = RedisServer::start();
    let (lock, store) = rt.block_on(async {
        let backend = RedisBackend::builder(server.client())
            // A server started for this run: no instance can hold a key it lost.
            .restart_guard(false)
            .build()
            .await
            .unwrap();
        let store = RedisReplayStore::new(&backend);
        (
            KeyedLockLayer::by_header("idempotency-key").backend(backend),
            store,
        )
    });
    let redis = rt.block_on(async { Stacks::new(lock, store) });
    bench(&mut c, &rt, "replay-redis", &redis);
    c.final_summary();

    if !quick {
        for (name, stacks) in [("memory", &memory), ("redis", &redis)] {
            let ratio = median_ratio(&rt, stacks);
            println!("replay/run per request, {name} store: {ratio:.2}x (median of 15 alternating batches)");
        }
    }
}

/// The three stacks of one store.
struct Stacks {
    run: Stack,
    replay: Stack,
    next_key: AtomicU64,
}

impl Stacks {
    fn new(
        lock: KeyedLockLayer<tower_keyed_lock::key::HeaderKey>,
        store: impl ReplayStore,
    ) -> Self {
        let handler = service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::from("done: a trivial handler")))
        });
        let run = ServiceBuilder::new()
            .layer(lock.clone())
            .service(handler)
            .map_response(|response| response.map(Body::new));
        let replay = ServiceBuilder::new()
            .layer(lock)
            .layer(ReplayLayer::new(store))
            .service(handler)
            .map_response(|response| response.map(Body::new));
        Self {
            run: BoxCloneSyncService::new(run),
            replay: BoxCloneSyncService::new(replay),
            next_key: AtomicU64::new(0),
        }
    }

    fn fresh_key(&self) -> String {
        format!("key-{}", self.next_key.fetch_add(1, Ordering::Relaxed))
    }
}

fn request(key: &str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::from(vec![b'x'; 64]))
        .unwrap()
}

async fn call(stack: &Stack, key: &str) {
    let response = stack.clone().oneshot(request(key)).await.unwrap();
    assert!(response.status().is_success());
}

fn bench(c: &mut Criterion, rt: &tokio::runtime::Runtime, group: &str, stacks: &Stacks) {
    // The key every `replay` request finds stored.
    rt.block_on(call(&stacks.replay, "stored"));
    let mut group = c.benchmark_group(group);
    group.bench_function("run", |b| {
        b.to_async(rt)
            .iter(|| async { call(&stacks.run, "stored").await })
    });
    group.bench_function("replay", |b| {
        b.to_async(rt)
            .iter(|| async { call(&stacks.replay, "stored").await })
    });
    group.bench_function("first", |b| {
        b.to_async(rt)
            .iter(|| async { call(&stacks.replay, &stacks.fresh_key()).await })
    });
    group.finish();
}

/// Times `run` and `replay` in alternating batches; the median of `replay / run`.
fn median_ratio(rt: &tokio::runtime::Runtime, stacks: &Stacks) -> f64 {
    const BATCH: u32 = 2_000;
    let time = |stack: &Stack| {
        rt.block_on(async {
            let start = Instant::now();
            for _ in 0..BATCH {
                call(stack, "stored").await;
            }
            start.elapsed()
        })
    };
    let mut ratios: Vec<f64> = (0..15)
        .map(|round| {
            let (run, replay) = if round % 2 == 0 {
                let run = time(&stacks.run);
                (run, time(&stacks.replay))
            } else {
                let replay = time(&stacks.replay);
                (time(&stacks.run), replay)
            };
            replay.as_secs_f64() / run.as_secs_f64()
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}
