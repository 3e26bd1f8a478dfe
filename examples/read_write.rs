//! Readers together, a writer alone: `KeyedLockLayer::shared_methods([GET])` on
//! `GET` and `PUT /orders/{order_id}`.
//!
//! Three GETs of order 1 run at the same time; a PUT of order 1, sent while they run,
//! waits for them and then runs alone; three more GETs, sent while the PUT waits, queue
//! behind it (a waiting writer stops new readers, so a stream of GETs cannot starve a
//! PUT) and run together after it. The example prints a timeline of who ran when.
//!
//! Run it with `cargo run --example read_write`. It serves and drives itself on
//! 127.0.0.1 and exits non-zero if the requests did not run as described.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

/// How long each handler takes: long enough to see who waits for whom.
const WORK: Duration = Duration::from_millis(200);

#[derive(Clone)]
struct Timeline {
    started: Instant,
    runs: Arc<Mutex<Vec<Run>>>,
}

#[derive(Clone, Debug)]
struct Run {
    name: String,
    shared: bool,
    start: Duration,
    end: Duration,
}

async fn handle(timeline: &Timeline, lock: &LockInfo, name: String) -> String {
    let start = timeline.started.elapsed();
    tokio::time::sleep(WORK).await;
    let end = timeline.started.elapsed();
    let shared = lock.is_shared();
    timeline.runs.lock().unwrap().push(Run {
        name: name.clone(),
        shared,
        start,
        end,
    });
    format!("{name} ran {}", if shared { "shared" } else { "alone" })
}

#[tokio::main]
async fn main() {
    let timeline = Timeline {
        started: Instant::now(),
        runs: Arc::default(),
    };
    let order_lock = KeyedLockLayer::by_path("order_id")
        .shared_methods([Method::GET, Method::HEAD])
        .wait_timeout(Duration::from_secs(10));
    let app = Router::new()
        .route(
            "/orders/{order_id}",
            get(|State(t): State<Timeline>, lock: LockInfo, req: Request<axum::body::Body>| async move {
                let name = req.headers()["x-name"].to_str().unwrap().to_owned();
                handle(&t, &lock, name).await
            })
            .put(|State(t): State<Timeline>, lock: LockInfo, req: Request<axum::body::Body>| async move {
                let name = req.headers()["x-name"].to_str().unwrap().to_owned();
                handle(&t, &lock, name).await
            }),
        )
        .with_state(timeline.clone())
        .route_layer(order_lock.clone());
    let addr = serve(app).await;

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    // (name, method, sent this long after the start)
    let plan = [
        ("GET 1", Method::GET, 0),
        ("GET 2", Method::GET, 0),
        ("GET 3", Method::GET, 0),
        ("PUT", Method::PUT, 50),
        ("GET 4", Method::GET, 100),
        ("GET 5", Method::GET, 100),
        ("GET 6", Method::GET, 100),
    ];
    let mut requests = JoinSet::new();
    let planned = plan.len();
    for (name, method, after) in plan {
        let client = client.clone();
        let request = Request::builder()
            .method(method.clone())
            .uri(format!("http://{addr}/orders/1"))
            .header("x-name", name)
            .body(Empty::new())
            .unwrap();
        requests.spawn(async move {
            tokio::time::sleep(Duration::from_millis(after)).await;
            let response = client.request(request).await.expect("request failed");
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            println!(
                "{method:<4} /orders/1 ({name}) -> {status}  {}",
                String::from_utf8_lossy(&body)
            );
            assert!(status.is_success(), "{name} should succeed");
        });
    }
    requests.join_all().await;

    let mut runs = timeline.runs.lock().unwrap().clone();
    runs.sort_by_key(|run| run.start);
    println!("\ntimeline:");
    for run in &runs {
        println!(
            "  {:<6} {:>4}-{:>4} ms  {}",
            run.name,
            run.start.as_millis(),
            run.end.as_millis(),
            if run.shared { "shared" } else { "alone" }
        );
    }

    assert_eq!(
        runs.len(),
        planned,
        "every request should have run its handler"
    );
    let overlap = |a: &Run, b: &Run| a.start < b.end && b.start < a.end;
    let put = runs.iter().find(|run| run.name == "PUT").unwrap();
    assert!(!put.shared, "the PUT holds its key alone");
    for get in runs.iter().filter(|run| run.shared) {
        assert!(!overlap(put, get), "the PUT ran beside {}", get.name);
    }
    let first: Vec<&Run> = runs
        .iter()
        .filter(|run| ["GET 1", "GET 2", "GET 3"].contains(&run.name.as_str()))
        .collect();
    assert!(
        first.iter().all(|a| first.iter().all(|b| overlap(a, b))),
        "the first three GETs should run together"
    );
    assert_eq!(order_lock.active_keys(), 0, "no key should stay locked");
    println!("\nthe GETs ran together, the PUT alone; active_keys() now: 0");
}

/// Serves `app` on a free port of 127.0.0.1 in the background.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
