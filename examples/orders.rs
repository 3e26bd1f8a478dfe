//! One `KeyedLockLayer::by_path("order_id")` on a router with two routes,
//! `POST /orders/{order_id}/pay` and `POST /orders/{order_id}/refund`.
//!
//! Both routes share the layer's lock table, so a payment and a refund of the same
//! order take turns, while another order runs at the same time. The handlers read the
//! `LockInfo` the layer puts in the request extensions (the key and how long the request
//! waited for it), and the example prints a timeline of who ran when.
//!
//! Run it with `cargo run --example orders`. It serves and drives itself on 127.0.0.1
//! and exits non-zero if the requests did not run as described.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

/// How long each pay or refund takes: long enough to see who waits for whom.
const WORK: Duration = Duration::from_millis(200);

/// When each handler ran, relative to the start of the example.
#[derive(Clone)]
struct Timeline {
    started: Instant,
    runs: Arc<Mutex<Vec<Run>>>,
}

#[derive(Clone)]
struct Run {
    order: String,
    action: &'static str,
    waited: Duration,
    start: Duration,
    end: Duration,
}

async fn pay(State(timeline): State<Timeline>, Extension(lock): Extension<LockInfo>) -> String {
    work(&timeline, &lock, "pay").await
}

async fn refund(State(timeline): State<Timeline>, Extension(lock): Extension<LockInfo>) -> String {
    work(&timeline, &lock, "refund").await
}

/// Stands in for the real work, recording when it ran.
async fn work(timeline: &Timeline, lock: &LockInfo, action: &'static str) -> String {
    let start = timeline.started.elapsed();
    tokio::time::sleep(WORK).await;
    let end = timeline.started.elapsed();
    timeline.runs.lock().unwrap().push(Run {
        order: lock.key().to_owned(),
        action,
        waited: lock.waited(),
        start,
        end,
    });
    format!(
        "{action} of order {} done, waited {} ms for the lock",
        lock.key(),
        lock.waited().as_millis()
    )
}

#[tokio::main]
async fn main() {
    let timeline = Timeline {
        started: Instant::now(),
        runs: Arc::default(),
    };
    // One layer value for the whole router: every route shares one lock table, so the
    // key "order 1" means the same lock on /pay and on /refund.
    let order_lock = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::from_secs(2));
    let app = Router::new()
        .route("/orders/{order_id}/pay", post(pay))
        .route("/orders/{order_id}/refund", post(refund))
        .with_state(timeline.clone())
        .route_layer(order_lock.clone());
    let addr = serve(app).await;

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let paths = [
        "/orders/1/pay",
        "/orders/1/refund",
        "/orders/2/pay",
        "/orders/2/refund",
    ];
    let mut requests = JoinSet::new();
    for path in paths {
        let client = client.clone();
        let request = Request::post(format!("http://{addr}{path}"))
            .body(Empty::new())
            .unwrap();
        requests.spawn(async move {
            let response = client.request(request).await.expect("request failed");
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            println!(
                "POST {path:<17} -> {status}  {}",
                String::from_utf8_lossy(&body)
            );
            assert!(status.is_success(), "{path} should succeed");
        });
    }
    requests.join_all().await;
    let wall = timeline.started.elapsed();

    let mut runs = timeline.runs.lock().unwrap().clone();
    runs.sort_by_key(|run| (run.order.clone(), run.start));
    print_timeline(&runs, wall);
    println!("\nactive_keys() now: {}", order_lock.active_keys());

    assert_eq!(runs.len(), 4, "every request should have run its handler");
    let overlap = |a: &Run, b: &Run| a.start < b.end && b.start < a.end;
    let (order_1, order_2) = runs.split_at(2);
    assert!(
        !overlap(&order_1[0], &order_1[1]) && !overlap(&order_2[0], &order_2[1]),
        "pay and refund of the same order must not overlap"
    );
    assert!(
        overlap(&order_1[0], &order_2[0]),
        "different orders should run in parallel"
    );
    assert!(
        wall < WORK * 3,
        "four requests of {WORK:?} over two orders should take about {:?}, took {wall:?}",
        WORK * 2
    );
    assert_eq!(order_lock.active_keys(), 0, "no key should stay locked");
}

/// One line per handler run: a bar of when it ran (one character per 25 ms).
fn print_timeline(runs: &[Run], wall: Duration) {
    const TICK: Duration = Duration::from_millis(25);
    let ticks = |d: Duration| (d.as_millis() / TICK.as_millis()) as usize;
    println!(
        "\ntimeline ({} ms in all, one character = 25 ms):",
        wall.as_millis()
    );
    for run in runs {
        let bar = format!(
            "{}{}",
            " ".repeat(ticks(run.start)),
            "#".repeat(ticks(run.end) - ticks(run.start))
        );
        println!(
            "  order {} {:<6} |{bar:<w$}| {:>3}-{:>3} ms, waited {:>3} ms",
            run.order,
            run.action,
            run.start.as_millis(),
            run.end.as_millis(),
            run.waited.as_millis(),
            w = ticks(wall),
        );
    }
}

/// Serves `app` on a free port of 127.0.0.1 in the background.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
