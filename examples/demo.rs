//! The main job of `tower-keyed-lock`: no lost updates when concurrent requests change
//! the same record.
//!
//! `POST /orders/{order_id}/pay` reads an order's balance, awaits a simulated database
//! call, then writes the new balance back. The demo fires a few hundred concurrent
//! payments over a handful of orders twice: without the layer, payments to one order
//! read the same balance and overwrite each other; with
//! `KeyedLockLayer::by_path("order_id")` they take turns, while different orders still
//! run in parallel. Two last runs show the rejections: a busy key under
//! `wait_timeout(Duration::ZERO)` (409) and a full queue under `max_waiters(1)` (429).
//!
//! Run it with `cargo run --example demo`. It serves and drives itself on 127.0.0.1 and
//! exits non-zero if a behaviour it shows did not happen.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tower_keyed_lock::{KeyedLockLayer, LockInfo, PathParam};

const ORDERS: u32 = 8;
const PAYMENTS_PER_ORDER: u32 = 50;
const PAYMENT_CENTS: u64 = 500;
/// The await between read and write: the window in which another payment can sneak in.
const FAST_DB: Duration = Duration::from_millis(5);
/// Long enough that every request of a rejection run arrives while the first one runs.
const SLOW_DB: Duration = Duration::from_millis(300);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// The "database": balances in cents per order, plus how long each served request
/// waited for its order's lock, as the handler saw it.
#[derive(Clone, Default)]
struct Store {
    balances: Arc<Mutex<HashMap<u32, u64>>>,
    lock_waits: Arc<Mutex<Vec<Duration>>>,
    db_latency: Duration,
}

async fn pay(
    State(store): State<Store>,
    Path(order_id): Path<u32>,
    lock: Option<Extension<LockInfo>>,
) -> StatusCode {
    // Read, await, write: a lost update whenever two payments interleave. The std mutex
    // is held only for the read and for the write, never across the await.
    let balance = store.balances.lock().unwrap().get(&order_id).copied();
    tokio::time::sleep(store.db_latency).await;
    let new_balance = balance.unwrap_or(0) + PAYMENT_CENTS;
    store.balances.lock().unwrap().insert(order_id, new_balance);

    if let Some(Extension(lock)) = lock {
        store.lock_waits.lock().unwrap().push(lock.waited());
    }
    StatusCode::OK
}

/// What one run did, as seen by the client and by the store.
struct Report {
    label: &'static str,
    sent: usize,
    served: usize,
    lost_updates: u64,
    conflicts: usize,
    too_many: usize,
    latencies: Vec<Duration>,
    lock_waits: Vec<Duration>,
    wall: Duration,
}

/// Serves `pay` (behind `lock`, if any) and sends one payment per entry of `order_ids`,
/// all at once.
async fn run(
    label: &'static str,
    lock: Option<&KeyedLockLayer<PathParam>>,
    db_latency: Duration,
    order_ids: &[u32],
) -> Report {
    let store = Store {
        db_latency,
        ..Store::default()
    };
    let mut app = Router::new()
        .route("/orders/{order_id}/pay", post(pay))
        .with_state(store.clone());
    if let Some(lock) = lock {
        app = app.route_layer(lock.clone());
    }
    let addr = serve(app).await;
    let client = Client::builder(TokioExecutor::new()).build_http();

    let started = Instant::now();
    let mut requests = JoinSet::new();
    for &order_id in order_ids {
        let uri = format!("http://{addr}/orders/{order_id}/pay");
        requests.spawn(timed_post(client.clone(), uri));
    }
    let responses = requests.join_all().await;
    let wall = started.elapsed();

    let count = |status| responses.iter().filter(|(s, _)| *s == status).count();
    let served = responses.iter().filter(|(s, _)| s.is_success()).count();
    // Every 2xx promised a payment; whatever the balances lack was overwritten.
    let expected = served as u64 * PAYMENT_CENTS;
    let recorded: u64 = store.balances.lock().unwrap().values().sum();
    let lock_waits = store.lock_waits.lock().unwrap().clone();
    Report {
        label,
        sent: responses.len(),
        served,
        lost_updates: (expected - recorded) / PAYMENT_CENTS,
        conflicts: count(StatusCode::CONFLICT),
        too_many: count(StatusCode::TOO_MANY_REQUESTS),
        latencies: responses.into_iter().map(|(_, latency)| latency).collect(),
        lock_waits,
        wall,
    }
}

/// Sends an empty POST and returns its status and how long the full response took.
async fn timed_post(client: HttpClient, uri: String) -> (StatusCode, Duration) {
    let started = Instant::now();
    let request = Request::post(uri).body(Empty::new()).unwrap();
    let response = client.request(request).await.expect("request failed");
    let status = response.status();
    response.into_body().collect().await.expect("body failed");
    (status, started.elapsed())
}

/// Serves `app` on a free port of 127.0.0.1 in the background.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::main]
async fn main() {
    // Every order gets PAYMENTS_PER_ORDER payments, interleaved.
    let busy_orders: Vec<u32> = (0..ORDERS * PAYMENTS_PER_ORDER)
        .map(|i| i % ORDERS)
        .collect();
    let one_order = [1; 5];

    let by_order = KeyedLockLayer::by_path("order_id")
        .wait_timeout(Duration::from_secs(10))
        .max_waiters(1_000);
    let try_once = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::ZERO);
    let short_queue = KeyedLockLayer::by_path("order_id").max_waiters(1);

    let without = run("without layer", None, FAST_DB, &busy_orders).await;
    let with = run("by_path(order_id)", Some(&by_order), FAST_DB, &busy_orders).await;
    let busy = run("wait_timeout(0)", Some(&try_once), SLOW_DB, &one_order).await;
    let full = run("max_waiters(1)", Some(&short_queue), SLOW_DB, &one_order).await;

    println!(
        "{} concurrent payments over {ORDERS} orders; the handler reads a balance, \
         awaits {FAST_DB:?}, writes it back.\n",
        busy_orders.len()
    );
    print_table(&[&without, &with, &busy, &full]);
    println!(
        "\nlost: answered 2xx but missing from the balances. client: latency seen by \
         the client.\nlock wait: LockInfo::waited() seen by the handler. \
         The last two runs send 5 payments to one order, {SLOW_DB:?} each."
    );
    let active_keys = by_order.active_keys() + try_once.active_keys() + short_queue.active_keys();
    println!("\nactive_keys() after all runs: {active_keys}");

    assert!(
        without.lost_updates > 0,
        "without the layer the read-await-write race should lose updates"
    );
    assert_eq!(
        with.served, with.sent,
        "with the layer every payment should be served"
    );
    assert_eq!(with.lost_updates, 0, "with the layer no update may be lost");
    assert_eq!(
        (busy.served, busy.conflicts),
        (1, 4),
        "wait_timeout(0): one request holds the key, the others get 409 at once"
    );
    assert_eq!(
        (full.served, full.too_many),
        (2, 3),
        "max_waiters(1): one holder and one waiter are served, the others get 429"
    );
    assert_eq!(active_keys, 0, "the lock tables should be empty once idle");
}

fn print_table(reports: &[&Report]) {
    println!(
        "{:<18} {:>5} {:>5} {:>5} {:>4} {:>4}  {:>21}  {:>21}  {:>8}",
        "run",
        "sent",
        "2xx",
        "lost",
        "409",
        "429",
        "client p50 / p99",
        "lock wait p50 / p99",
        "wall"
    );
    for r in reports {
        println!(
            "{:<18} {:>5} {:>5} {:>5} {:>4} {:>4}  {:>21}  {:>21}  {:>8}",
            r.label,
            r.sent,
            r.served,
            r.lost_updates,
            r.conflicts,
            r.too_many,
            p50_p99(&r.latencies),
            p50_p99(&r.lock_waits),
            ms(r.wall),
        );
    }
}

/// "p50 / p99" of `samples`, or "-" when there are none (no layer, no lock waits).
fn p50_p99(samples: &[Duration]) -> String {
    if samples.is_empty() {
        return "-".into();
    }
    let mut sorted = samples.to_vec();
    sorted.sort();
    // Nearest rank: the smallest sample with at least q of all samples at or below it.
    let at = |q: f64| sorted[((sorted.len() as f64 * q).ceil() as usize).max(1) - 1];
    format!("{} / {}", ms(at(0.50)), ms(at(0.99)))
}

fn ms(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}
