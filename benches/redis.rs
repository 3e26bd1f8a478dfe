//! The Redis backend against a real `redis-server` the bench starts on a free port.
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-redis cargo bench -p tower-keyed-lock-benches --bench redis
//! cargo bench -p tower-keyed-lock-benches --bench redis -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `RedisBackend` (`acquire` then
//!    `Lease::release`: two scripts, a token, a renewal task, the release message) vs a
//!    bare `SET key token NX PX` + `DEL key` through a `ConnectionManager` of the same
//!    `redis::Client`. Criterion times each; then both run in alternating batches
//!    (A B, B A, …: the same load hits both) and the median ratio is printed. Target:
//!    ≤ 1.3×.
//! 2. Commands sent to Redis per request when 32 requests for one key arrive at once
//!    at one instance (a layer with the backend, driven with `ServiceExt::oneshot`):
//!    `INFO commandstats` deltas, printed per command. Script calls are the round trips;
//!    the commands they run inside Redis are listed too.

#[path = "../tests/support/ports.rs"]
mod ports;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use criterion::Criterion;
use http::{Request, StatusCode};
use redis::aio::ConnectionManager;
use redis_server::{command_calls, command_stat, RedisServer};
use tower::ServiceExt;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::{Key, KeyedLockLayer, LockBackend};

const WAITERS: usize = 32;

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
    let server = RedisServer::start();
    let client = server.client();
    let backend = rt.block_on(guarded_backend(&client));
    let bare = rt.block_on(ConnectionManager::new(client.clone())).unwrap();
    let key = Key::new("order-1", 256).unwrap();

    // Loads the scripts (the first call of each is NOSCRIPT + SCRIPT LOAD).
    rt.block_on(backend_round(&backend, &key));

    let mut group = c.benchmark_group("redis-uncontended");
    group.bench_function("backend-acquire-release", |b| {
        b.to_async(&rt).iter(|| backend_round(&backend, &key));
    });
    group.bench_function("bare-set-nx-px-del", |b| {
        b.to_async(&rt).iter(|| bare_round(&bare));
    });
    group.finish();

    let (rounds, batch) = if quick { (2, 10) } else { (21, 500) };
    let ratio = rt.block_on(alternating(&backend, &bare, &key, rounds, batch));
    println!(
        "redis uncontended acquire+release: backend {:.1} µs, bare SET NX PX + DEL {:.1} µs, \
         ratio {:.2}x (median of {rounds} alternating rounds of {batch})",
        ratio.backend_us, ratio.bare_us, ratio.ratio
    );

    let usec = rt.block_on(async {
        let mut connection = server.connection().await;
        command_stat(&mut connection, "usec_per_call").await
    });
    let stat = |name: &str| usec.get(name).copied().unwrap_or(0.0);
    println!(
        "  time inside Redis per call: scripts (EVALSHA, mean of acquire and release) \
         {:.2} µs, SET {:.2} µs, DEL {:.2} µs",
        stat("evalsha"),
        stat("set"),
        stat("del"),
    );

    let rounds = if quick { 1 } else { 10 };
    rt.block_on(commands_per_request(&server, &client, rounds));
    c.final_summary();
}

async fn backend_round(backend: &RedisBackend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

async fn bare_round(connection: &ConnectionManager) {
    let mut connection = connection.clone();
    let set: Option<String> = redis::cmd("SET")
        .arg("bare:order-1")
        .arg("token")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(set.is_some(), "the bare key was held");
    redis::cmd("DEL")
        .arg("bare:order-1")
        .query_async::<()>(&mut connection)
        .await
        .unwrap();
}

struct Ratio {
    backend_us: f64,
    bare_us: f64,
    ratio: f64,
}

/// Median over rounds of (backend batch time / bare batch time), the order of the two
/// batches alternating between rounds.
async fn alternating(
    backend: &RedisBackend,
    bare: &ConnectionManager,
    key: &Key,
    rounds: usize,
    batch: usize,
) -> Ratio {
    let mut samples = Vec::new();
    for round in 0..rounds {
        let mut backend_time = Duration::ZERO;
        let mut bare_time = Duration::ZERO;
        for first in [round % 2 == 0, round % 2 != 0] {
            let started = Instant::now();
            for _ in 0..batch {
                match first {
                    true => backend_round(backend, key).await,
                    false => bare_round(bare).await,
                }
            }
            match first {
                true => backend_time = started.elapsed(),
                false => bare_time = started.elapsed(),
            }
        }
        samples.push((backend_time, bare_time));
    }
    let per_op = |d: Duration| d.as_secs_f64() * 1e6 / batch as f64;
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    Ratio {
        backend_us: median(samples.iter().map(|s| per_op(s.0)).collect()),
        bare_us: median(samples.iter().map(|s| per_op(s.1)).collect()),
        ratio: median(
            samples
                .iter()
                .map(|s| s.0.as_secs_f64() / s.1.as_secs_f64())
                .collect(),
        ),
    }
}

/// A backend as deployed (restart guard on), on a server past the guard: a short
/// lease, and a wait of one lease and a second after the server started.
async fn guarded_backend(client: &redis::Client) -> RedisBackend {
    let lease = Duration::from_secs(1);
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    RedisBackend::builder(client.clone())
        .lease(lease)
        .build()
        .await
        .unwrap()
}

/// 32 requests for one key at once, `rounds` times, through a layer with the backend.
async fn commands_per_request(server: &RedisServer, client: &redis::Client, rounds: usize) {
    let backend = guarded_backend(client).await;
    let app = Router::new()
        .route(
            "/orders/{order_id}",
            post(|| async {
                // Long enough for all 32 to queue behind the first.
                tokio::time::sleep(Duration::from_micros(200)).await;
            }),
        )
        .layer(
            KeyedLockLayer::by_path("order_id")
                .name("bench")
                .backend(backend),
        );
    let mut stats = server.connection().await;
    // Warm-up: loads the scripts.
    send(&app).await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    let before = command_calls(&mut stats).await;
    for _ in 0..rounds {
        let requests: Vec<_> = (0..WAITERS)
            .map(|_| tokio::spawn(send_owned(app.clone())))
            .collect();
        for request in requests {
            request.await.unwrap();
        }
    }
    // Releases finish in the background after the responses.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let after = command_calls(&mut stats).await;

    let requests = (rounds * WAITERS) as f64;
    let mut delta: BTreeMap<String, u64> = after
        .iter()
        .map(|(name, calls)| (name.clone(), calls - before.get(name).copied().unwrap_or(0)))
        .filter(|(name, calls)| *calls > 0 && name != "info")
        .collect();
    let scripts = delta.remove("evalsha").unwrap_or(0) + delta.remove("eval").unwrap_or(0);
    let inside: u64 = delta.values().sum();
    println!(
        "redis commands per request, {WAITERS} local waiters on one key, {} requests:",
        rounds * WAITERS
    );
    println!(
        "  sent to Redis (script calls = round trips): {:.2}",
        scripts as f64 / requests
    );
    println!(
        "  run inside those scripts: {:.2} ({})",
        inside as f64 / requests,
        delta
            .iter()
            .map(|(name, calls)| format!("{name} {:.2}", *calls as f64 / requests))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

async fn send(app: &Router) {
    send_owned(app.clone()).await;
}

async fn send_owned(app: Router) {
    let request = Request::post("/orders/1").body(Body::empty()).unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}
