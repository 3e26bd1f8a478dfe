//! Two instances sharing Redis, and two sharing PostgreSQL (lock and replay store),
//! take many deliveries of many webhook ids: retries, concurrent duplicates, and
//! clients that disconnect at random moments. Every id's side effect must happen at
//! most once (exactly once when a handler completed), and every duplicate answered
//! with a 2xx must carry the first response's bytes.
//!
//! Short by default; the issue's size:
//!
//! ```text
//! REPLAY_SOAK_DELIVERIES=10000 REPLAY_SOAK_IDS=1000 \
//!     cargo test --release --all-features --test soak replay:: -- --nocapture
//! ```
#![cfg(all(feature = "replay", feature = "redis", feature = "postgres"))]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use deadpool_postgres::{Manager, Pool};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;
use tower_keyed_lock::backend::postgres::PostgresBackend;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::replay::{PostgresReplayStore, RedisReplayStore, ReplayLayer};
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

use crate::support::occupancy::Occupancy;
use crate::support::pg_server::PgServer;
use crate::support::redis_server::RedisServer;

fn size(var: &str, default: usize) -> usize {
    std::env::var(var).map_or(default, |v| v.parse().expect("a number"))
}

/// What the handlers did, shared by both instances of one run.
#[derive(Default)]
struct Effects {
    /// Side effects per id, and the body the handler answered.
    done: Mutex<HashMap<String, (usize, String)>>,
    /// Handlers running per id, to catch an overlap no lease loss explains.
    running: Occupancy<String>,
}

async fn deliver(
    Extension(effects): Extension<Arc<Effects>>,
    Extension(lock): Extension<LockInfo>,
    payload: String,
) -> String {
    let id = lock.key().to_owned();
    let leaving = effects.running.enter(id.clone(), lock.lease());
    // Work that a disconnect can interrupt.
    tokio::time::sleep(Duration::from_millis(u64::from(payload.len() as u8 % 4))).await;
    drop(leaving);
    // The side effect is the handler's last step: it happened iff the handler completed.
    let mut done = effects.done.lock().unwrap();
    let entry = done.entry(id.clone()).or_default();
    entry.0 += 1;
    let body = format!("{id} processed, effect {} of {payload}", entry.0);
    entry.1.clone_from(&body);
    body
}

fn app(
    lock: KeyedLockLayer<tower_keyed_lock::key::HeaderKey>,
    replay: ReplayLayer,
    effects: Arc<Effects>,
) -> Router {
    // The store on the lock's engine: records are looked up by the lock's acquisition.
    Router::new()
        .route("/webhooks", post(deliver))
        .layer(lock.replay(replay))
        .layer(Extension(effects))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A small deterministic generator (xorshift), so a failing run can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[derive(Default, Debug)]
struct Tally {
    answered_2xx: u64,
    replayed: u64,
    other_status: u64,
    disconnected: u64,
}

/// Sends the deliveries to the two instances, at most 64 in flight, and checks the
/// outcome.
async fn soak(instances: [SocketAddr; 2], effects: Arc<Effects>) {
    // Not beside another soak of this binary (the Redis, PostgreSQL and DynamoDB ones).
    let _turn = crate::support::soak_turn().await;
    // Store and backend warnings explain a failure.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let deliveries = size("REPLAY_SOAK_DELIVERIES", 1_000);
    let ids = size("REPLAY_SOAK_IDS", 100);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let in_flight = Arc::new(Semaphore::new(64));
    let answers = Arc::new(Mutex::new(Vec::new()));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..deliveries {
        let id = format!("evt-{}", rng.below(ids as u64));
        let addr = instances[rng.below(2) as usize];
        // One delivery in five hangs up after 0–9 ms.
        let disconnect_after = (rng.below(5) == 0).then(|| Duration::from_millis(rng.below(10)));
        let permit = Arc::clone(&in_flight).acquire_owned().await.unwrap();
        let (client, answers, tally) = (client.clone(), Arc::clone(&answers), Arc::clone(&tally));
        tasks.spawn(async move {
            let _permit = permit;
            let request = Request::post(format!("http://{addr}/webhooks"))
                .header("webhook-id", &id)
                .body(Full::new(Bytes::from(format!("payload of {id}"))))
                .unwrap();
            let exchange = async {
                let response = client.request(request).await.expect("answered");
                let status = response.status();
                let replayed = response.headers().contains_key("idempotent-replayed");
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, replayed, body)
            };
            let outcome = match disconnect_after {
                Some(after) => tokio::time::timeout(after, exchange).await.ok(),
                None => Some(exchange.await),
            };
            let mut tally = tally.lock().unwrap();
            match outcome {
                None => tally.disconnected += 1,
                Some((status, replayed, body)) if status.is_success() => {
                    tally.answered_2xx += 1;
                    tally.replayed += u64::from(replayed);
                    answers.lock().unwrap().push((id, body));
                }
                Some((status, _, body)) => {
                    if tally.other_status == 0 {
                        println!("first non-2xx: {status} {}", String::from_utf8_lossy(&body));
                    }
                    tally.other_status += 1;
                }
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }

    let tally = tally.lock().unwrap();
    let done = effects.done.lock().unwrap();
    let more_than_once: Vec<_> = done.iter().filter(|(_, (n, _))| *n > 1).collect();
    println!(
        "{deliveries} deliveries of {ids} ids: {tally:?}; ids processed: {}; processed more than once: {}",
        done.len(),
        more_than_once.len()
    );
    assert!(more_than_once.is_empty(), "{more_than_once:?}");
    assert_eq!(
        effects.running.unsignalled_overlaps(),
        0,
        "unsignalled overlap"
    );
    for (id, body) in answers.lock().unwrap().iter() {
        let first = &done.get(id).expect("a 2xx for an id never processed").1;
        assert_eq!(body, first.as_bytes(), "{id}: a 2xx with other bytes");
    }
    // The run means something: most ids completed, and duplicates were replayed.
    assert!(
        done.len() * 10 >= ids * 9,
        "only {} of {ids} ids completed",
        done.len()
    );
    assert!(tally.replayed > 0 && tally.disconnected > 0, "{tally:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_redis() {
    let redis = RedisServer::start();
    let effects = Arc::new(Effects::default());
    let mut instances = Vec::new();
    for _ in 0..2 {
        let backend = RedisBackend::builder(redis.client())
            // A server started for this run: no instance can hold a key it lost.
            .restart_guard(false)
            .build()
            .await
            .unwrap();
        let store = RedisReplayStore::new(&backend);
        let lock = KeyedLockLayer::by_header("webhook-id")
            .name("soak")
            .wait_timeout(Duration::from_secs(10))
            .backend(backend);
        instances.push(serve(app(lock, ReplayLayer::new(store), Arc::clone(&effects))).await);
    }
    soak([instances[0], instances[1]], effects).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_postgres() {
    let pg = PgServer::start();
    let effects = Arc::new(Effects::default());
    let mut instances = Vec::new();
    for _ in 0..2 {
        let backend = PostgresBackend::builder_from_str(&pg.conn_str())
            .unwrap()
            .max_connections(16)
            .fencing(true)
            .build_lazy();
        let config: tokio_postgres::Config = pg.conn_str().parse().unwrap();
        let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
            .max_size(8)
            .build()
            .unwrap();
        let replay = ReplayLayer::new(PostgresReplayStore::new(pool).looked_up_by(&backend));
        let lock = KeyedLockLayer::by_header("webhook-id")
            .name("soak")
            .wait_timeout(Duration::from_secs(10))
            .backend(backend);
        instances.push(serve(app(lock, replay, Arc::clone(&effects))).await);
    }
    soak([instances[0], instances[1]], effects).await;
}
