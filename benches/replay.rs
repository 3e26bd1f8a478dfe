//! What a replay costs per request, against running a trivial handler, with the memory,
//! Redis and PostgreSQL stores (a real `redis-server` and PostgreSQL the bench starts),
//! and how many round trips each request makes (issue 33).
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench replay
//! cargo bench -p tower-keyed-lock-benches --bench replay -- --test     # CI: each once
//! REPLAY_MEMORY_ONLY=1 cargo bench -p tower-keyed-lock-benches --bench replay  # memory: 3 ratios
//! ```
//!
//! Each stack is driven with `ServiceExt::oneshot` (no sockets), a request with a
//! 64-byte body and an `idempotency-key`:
//!
//! - `run`: the lock layer and the handler, no replay layer — the cost to beat;
//! - `replay`: `lock.replay(replay)` and a key already stored — every request is a
//!   replay (read the body, fingerprint, look up, build the response);
//! - `first`: a new key each time — the replay layer's cost on a request that runs
//!   and is stored;
//! - `replay-by-hand` and `first-by-hand`: the two layers stacked by hand
//!   (`.layer(replay).layer(lock)`), where the replay layer asks its store itself (the
//!   same as `lock.replay(..)` for the memory store).
//!
//! After criterion's own report the bench times `run` against each other stack in
//! alternating batches (the same load hits both) and prints the median ratios; then
//! counts round trips per request on the wire, for each engine and stacking
//! (`support::round_trips`: the connections go through a counting proxy). A full run
//! writes the ratios and counts to `<criterion>/tkl-custom/replay.jsonl` for
//! `scripts/bench-charts`.

mod support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use criterion::Criterion;
use deadpool_postgres::{Manager, Pool};
use http::{Request, Response};
use support::pg_server::PgServer;
use support::redis_server::RedisServer;
use support::tcp_proxy::TcpProxy;
use tower::util::BoxCloneSyncService;
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
use tower_keyed_lock::backend::postgres::PostgresBackend;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::key::HeaderKey;
use tower_keyed_lock::replay::{
    MemoryStore, PostgresReplayStore, RedisReplayStore, ReplayLayer, ReplayStore,
};
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
    let mut lines = Vec::new();

    let memory = Stacks::new(
        KeyedLockLayer::by_header("idempotency-key"),
        MemoryStore::default(),
    );
    bench(&mut c, &rt, "replay-memory", &memory);
    // The memory store alone, no servers: its ratio three times over.
    if std::env::var_os("REPLAY_MEMORY_ONLY").is_some() {
        for _ in 0..3 {
            let ratio = median_ratio(&rt, &memory.run, &memory.replay, "stored");
            println!("replay/run per request, memory store: {ratio:.2}x (median of 15 alternating batches)");
        }
        return;
    }

    let redis_server = RedisServer::start();
    let redis = rt.block_on(async {
        let (lock, store) = redis_layers(redis_server.client()).await;
        Stacks::new(lock, store)
    });
    bench(&mut c, &rt, "replay-redis", &redis);

    let pg_server = PgServer::start();
    let postgres = rt.block_on(async {
        let (lock, store) = postgres_layers(&pg_server.conn_str());
        Stacks::new(lock, store)
    });
    bench(&mut c, &rt, "replay-postgres", &postgres);
    c.final_summary();

    if !quick {
        let ratios = [
            ("memory", "replay", &memory, &memory.replay, "stored"),
            ("redis", "replay", &redis, &redis.replay, "stored"),
            (
                "redis",
                "replay-by-hand",
                &redis,
                &redis.replay_by_hand,
                "stored-by-hand",
            ),
            ("postgres", "replay", &postgres, &postgres.replay, "stored"),
            (
                "postgres",
                "replay-by-hand",
                &postgres,
                &postgres.replay_by_hand,
                "stored-by-hand",
            ),
        ];
        for (store, name, stacks, stack, key) in ratios {
            let ratio = median_ratio(&rt, &stacks.run, stack, key);
            println!("{name}/run per request, {store} store: {ratio:.2}x (median of 15 alternating batches)");
            lines.push(format!(
                r#"{{"workload":"replay-ratio","store":"{store}","stack":"{name}","ratio":{ratio:.4}}}"#
            ));
        }
    }

    // Round trips, on layers of their own whose connections go through a proxy.
    let counts = rt.block_on(async {
        let redis_addr = format!("127.0.0.1:{}", redis_server.port())
            .parse()
            .unwrap();
        let proxy = Arc::new(TcpProxy::start(redis_addr).await);
        let client = redis::Client::open(format!("redis://{}/", proxy.addr)).unwrap();
        let (lock, store) = redis_layers(client).await;
        let mut lines = support::round_trips::count("redis", proxy, lock, store).await;
        let pg_addr = format!("127.0.0.1:{}", pg_server.port()).parse().unwrap();
        let proxy = Arc::new(TcpProxy::start(pg_addr).await);
        let via_proxy = format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            proxy.addr.port()
        );
        let (lock, store) = postgres_layers(&via_proxy);
        lines.extend(support::round_trips::count("postgres", proxy, lock, store).await);
        lines
    });
    lines.extend(counts);
    support::write_results("replay", quick, &lines);
}

/// A lock on a Redis backend and the Redis store on it.
async fn redis_layers(client: redis::Client) -> (KeyedLockLayer<HeaderKey>, RedisReplayStore) {
    let backend = RedisBackend::builder(client)
        // A server started for this run: no instance can hold a key it lost.
        .restart_guard(false)
        .build()
        .await
        .unwrap();
    let store = RedisReplayStore::new(&backend);
    let lock = KeyedLockLayer::by_header("idempotency-key").backend(backend);
    (lock, store)
}

/// A lock on a PostgreSQL backend (fencing on, as the store needs) and the store on a
/// pool of its own, looked up by the lock.
fn postgres_layers(config: &str) -> (KeyedLockLayer<HeaderKey>, PostgresReplayStore) {
    let config: tokio_postgres::Config = config.parse().unwrap();
    let backend = PostgresBackend::builder_from_config(config.clone())
        .fencing(true)
        .build_lazy();
    let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
        .max_size(8)
        .build()
        .unwrap();
    let store = PostgresReplayStore::new(pool).looked_up_by(&backend);
    let lock = KeyedLockLayer::by_header("idempotency-key").backend(backend);
    (lock, store)
}

/// The stacks of one store.
struct Stacks {
    run: Stack,
    replay: Stack,
    replay_by_hand: Stack,
    next_key: AtomicU64,
}

impl Stacks {
    fn new(lock: KeyedLockLayer<HeaderKey>, store: impl ReplayStore + Clone) -> Self {
        let handler = service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::from("done: a trivial handler")))
        });
        let run = ServiceBuilder::new()
            .layer(lock.clone())
            .service(handler)
            .map_response(|response| response.map(Body::new));
        let replay = lock
            .clone()
            .replay(ReplayLayer::new(store.clone()))
            .layer(handler)
            .map_response(|response| response.map(Body::new));
        let replay_by_hand = ServiceBuilder::new()
            .layer(lock)
            .layer(ReplayLayer::new(store))
            .service(handler)
            .map_response(|response| response.map(Body::new));
        Self {
            run: BoxCloneSyncService::new(run),
            replay: BoxCloneSyncService::new(replay),
            replay_by_hand: BoxCloneSyncService::new(replay_by_hand),
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
    // The keys every `replay` request finds stored.
    rt.block_on(call(&stacks.replay, "stored"));
    rt.block_on(call(&stacks.replay_by_hand, "stored-by-hand"));
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
    group.bench_function("replay-by-hand", |b| {
        b.to_async(rt)
            .iter(|| async { call(&stacks.replay_by_hand, "stored-by-hand").await })
    });
    group.bench_function("first-by-hand", |b| {
        b.to_async(rt)
            .iter(|| async { call(&stacks.replay_by_hand, &stacks.fresh_key()).await })
    });
    group.finish();
}

/// Times `run` and `other` (on `key`, which it replays) in alternating batches; the
/// median of `other / run`.
fn median_ratio(rt: &tokio::runtime::Runtime, run: &Stack, other: &Stack, key: &str) -> f64 {
    const BATCH: u32 = 2_000;
    let time = |stack: &Stack| {
        rt.block_on(async {
            let start = Instant::now();
            for _ in 0..BATCH {
                call(stack, key).await;
            }
            start.elapsed()
        })
    };
    let mut ratios: Vec<f64> = (0..15)
        .map(|round| {
            let (run, other) = if round % 2 == 0 {
                let run = time(run);
                (run, time(other))
            } else {
                let other = time(other);
                (time(run), other)
            };
            other.as_secs_f64() / run.as_secs_f64()
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}
