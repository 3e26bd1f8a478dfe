//! `shared_methods`: requests with those methods hold their key together, the rest
//! alone, through a real server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, MethodRouter};
use axum::Router;
use http::{Method, Request, StatusCode};
use tokio::sync::Barrier;
use tower_keyed_lock::backend::{Acquisition, LockBackend};
use tower_keyed_lock::{Key, KeyedLockLayer, LockInfo};

use crate::support::{join_all, serve};

/// Readers and writers of one key inside the handlers now; a writer beside anyone is
/// counted as a violation.
#[derive(Default)]
struct ReadWrite {
    readers: AtomicUsize,
    writers: AtomicUsize,
    violations: AtomicUsize,
}

impl ReadWrite {
    async fn read(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
        if self.writers.load(Ordering::SeqCst) != 0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }

    async fn write(&self) {
        let writers = self.writers.fetch_add(1, Ordering::SeqCst);
        if writers != 0 || self.readers.load(Ordering::SeqCst) != 0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.writers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// GET reads and PUT writes `state`; both answer whether the key was held shared.
fn reads_and_writes(state: Arc<ReadWrite>) -> MethodRouter {
    let writes = state.clone();
    get(move |lock: LockInfo| async move {
        state.read().await;
        format!("shared={}", lock.is_shared())
    })
    .put(move |lock: LockInfo| async move {
        writes.write().await;
        format!("shared={}", lock.is_shared())
    })
}

/// A backend that holds keys exclusively only (the default modes), and never answers.
struct Unreachable;

impl LockBackend for Unreachable {
    fn acquire(&self, _: &str, _: &Key, _: Duration) -> Acquisition {
        Box::pin(async { Err(tower_keyed_lock::LockError::Backend("unreachable".into())) })
    }
}

fn request(method: Method, path: &str) -> Request<()> {
    Request::builder()
        .method(method)
        .uri(path)
        .body(())
        .unwrap()
}

/// Two GETs of one order must be inside the handler at once to finish (a barrier of
/// two): with the key taken exclusively they would wait for each other for ever.
#[tokio::test]
async fn gets_of_one_key_run_together() {
    let barrier = Arc::new(Barrier::new(2));
    let app = Router::new()
        .route(
            "/orders/{order_id}",
            get(move |lock: LockInfo| {
                let barrier = barrier.clone();
                async move {
                    barrier.wait().await;
                    format!("shared={}", lock.is_shared())
                }
            }),
        )
        .layer(KeyedLockLayer::by_path("order_id").shared_methods([Method::GET, Method::HEAD]));
    let server = serve(app).await;
    let both = join_all((0..2).map(|_| server.send(request(Method::GET, "/orders/7"))));
    let answers = tokio::time::timeout(Duration::from_secs(30), both)
        .await
        .expect("the GETs waited for each other: the key was not shared");
    for answer in answers {
        assert_eq!(
            (answer.status, answer.body.as_str()),
            (StatusCode::OK, "shared=true")
        );
    }
}

/// GETs and PUTs of one order in a burst: every request runs, and a PUT never runs
/// beside another request of its order.
#[tokio::test]
async fn a_put_runs_alone_among_gets() {
    let state = Arc::new(ReadWrite::default());
    let layer = KeyedLockLayer::by_path("order_id")
        .shared_methods([Method::GET])
        .wait_timeout(Duration::from_secs(60));
    let app = Router::new()
        .route("/orders/{order_id}", reads_and_writes(state.clone()))
        .layer(layer.clone());
    let server = serve(app).await;
    let methods: Vec<Method> = (0..40)
        .map(|i| if i % 4 == 0 { Method::PUT } else { Method::GET })
        .collect();
    let answers = join_all(
        methods
            .iter()
            .map(|method| server.send(request(method.clone(), "/orders/7"))),
    )
    .await;
    for (method, answer) in methods.iter().zip(&answers) {
        let shared = *method == Method::GET;
        assert_eq!(answer.status, StatusCode::OK, "{method}");
        assert_eq!(answer.body, format!("shared={shared}"), "{method}");
    }
    assert_eq!(
        state.violations.load(Ordering::SeqCst),
        0,
        "a PUT ran beside another request"
    );
    assert_eq!(layer.active_keys(), 0);
}

#[test]
#[should_panic(expected = "does not support shared locks across instances")]
fn shared_methods_with_an_exclusive_only_backend_are_refused_when_applied() {
    let layer = KeyedLockLayer::by_path("order_id")
        .shared_methods([Method::GET])
        .backend(Unreachable);
    let _ = Router::<()>::new()
        .route("/orders/{order_id}", get(|| async {}))
        .layer(layer);
}

/// Across instances on Redis: two layers, each with its own Redis client (two
/// instances). A GET to each must be inside its handler at once to finish (a barrier of
/// two), and in a burst of GETs and PUTs spread over both, a PUT never runs beside
/// another request of its order.
#[cfg(feature = "redis")]
mod across_instances {
    use super::*;
    use crate::support::redis_server::RedisServer;
    use tower_keyed_lock::backend::redis::RedisBackend;

    async fn instance(redis: &RedisServer, state: Arc<ReadWrite>, barrier: Arc<Barrier>) -> Router {
        let backend = RedisBackend::builder(redis.client())
            .restart_guard(false)
            .build()
            .await
            .expect("backend connects");
        let layer = KeyedLockLayer::by_path("order_id")
            .name("shared-across")
            .shared_methods([Method::GET])
            .wait_timeout(Duration::from_secs(60))
            .backend(backend);
        Router::new()
            .route("/orders/{order_id}", reads_and_writes(state))
            .route(
                "/together/{order_id}",
                get(move || {
                    let barrier = barrier.clone();
                    async move {
                        barrier.wait().await;
                    }
                }),
            )
            .layer(layer)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn gets_hold_together_and_puts_alone_across_instances() {
        let redis = RedisServer::start();
        let state = Arc::new(ReadWrite::default());
        let barrier = Arc::new(Barrier::new(2));
        let a = serve(instance(&redis, state.clone(), barrier.clone()).await).await;
        let b = serve(instance(&redis, state.clone(), barrier).await).await;

        let together = tokio::time::timeout(
            Duration::from_secs(30),
            futures_join(
                a.send(request(Method::GET, "/together/7")),
                b.send(request(Method::GET, "/together/7")),
            ),
        )
        .await
        .expect("two GETs on two instances were not let in together");
        assert_eq!(
            (together.0.status, together.1.status),
            (StatusCode::OK, StatusCode::OK)
        );

        let methods: Vec<Method> = (0..40)
            .map(|i| if i % 4 == 0 { Method::PUT } else { Method::GET })
            .collect();
        let answers = join_all(methods.iter().enumerate().map(|(i, method)| {
            let server = if i % 2 == 0 { &a } else { &b };
            server.send(request(method.clone(), "/orders/7"))
        }))
        .await;
        for (method, answer) in methods.iter().zip(&answers) {
            let shared = *method == Method::GET;
            assert_eq!(answer.status, StatusCode::OK, "{method}");
            assert_eq!(answer.body, format!("shared={shared}"), "{method}");
        }
        assert_eq!(
            state.violations.load(Ordering::SeqCst),
            0,
            "a PUT ran beside another request across instances"
        );
    }

    async fn futures_join<A, B>(
        a: impl std::future::Future<Output = A>,
        b: impl std::future::Future<Output = B>,
    ) -> (A, B) {
        tokio::join!(a, b)
    }
}

#[test]
#[should_panic(
    expected = "KeyedLockLayer::permits(3): the custom lock backend does not support 3 permits per key across instances"
)]
fn permits_an_exclusive_only_backend_cannot_count_are_refused_when_applied() {
    let layer = KeyedLockLayer::by_path("order_id")
        .permits(3)
        .backend(Unreachable);
    let _ = Router::<()>::new()
        .route("/orders/{order_id}", get(|| async {}))
        .layer(layer);
}

/// `permits(2)` across two instances on Redis over HTTP: two requests of one key, one
/// on each instance, are inside their handler at once; a third, on either instance,
/// gets the timeout status while they are (the permits are cluster-wide, not per
/// instance), and gets in once one leaves.
#[cfg(feature = "redis")]
mod permits_across_instances {
    use super::*;
    use crate::support::redis_server::RedisServer;
    use tokio::sync::Semaphore;
    use tower_keyed_lock::backend::redis::RedisBackend;

    async fn instance(
        redis: &RedisServer,
        entered: Arc<Semaphore>,
        gate: Arc<Semaphore>,
    ) -> Router {
        let backend = RedisBackend::builder(redis.client())
            .restart_guard(false)
            .build()
            .await
            .expect("backend connects");
        let layer = KeyedLockLayer::by_path("tenant")
            .name("exports-over-http")
            .permits(2)
            .wait_timeout(Duration::ZERO)
            .backend(backend);
        Router::new()
            .route(
                "/exports/{tenant}",
                get(move || {
                    let (entered, gate) = (entered.clone(), gate.clone());
                    async move {
                        entered.add_permits(1);
                        gate.acquire().await.unwrap().forget();
                    }
                }),
            )
            .layer(layer)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_permits_hold_across_two_instances() {
        let redis = RedisServer::start();
        let (entered, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let a = Arc::new(serve(instance(&redis, entered.clone(), gate.clone()).await).await);
        let b = Arc::new(serve(instance(&redis, entered.clone(), gate.clone()).await).await);
        let first = tokio::spawn({
            let a = a.clone();
            async move { a.send(request(Method::GET, "/exports/acme")).await }
        });
        let second = tokio::spawn({
            let b = b.clone();
            async move { b.send(request(Method::GET, "/exports/acme")).await }
        });
        // Both inside at once: one permit each, on two instances.
        tokio::time::timeout(Duration::from_secs(30), entered.acquire_many(2))
            .await
            .expect("two holders of two permits were not let in together")
            .unwrap()
            .forget();
        for server in [&a, &b] {
            let third = server.send(request(Method::GET, "/exports/acme")).await;
            assert_eq!(
                third.status,
                StatusCode::CONFLICT,
                "a third holder of 2 permits"
            );
        }
        gate.add_permits(1);
        let one = tokio::select! {
            answer = first => answer,
            answer = second => answer,
        };
        assert_eq!(one.unwrap().status, StatusCode::OK);
        gate.add_permits(16);
        let mut third = None;
        // Up to 10 s: a patience bound, not a speed figure.
        for _ in 0..1_000 {
            let answer = a.send(request(Method::GET, "/exports/acme")).await;
            if answer.status == StatusCode::OK {
                third = Some(answer);
                break;
            }
            // The release of the first holder may still be on its way to Redis.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(third.is_some(), "no third holder got in after one left");
    }
}
