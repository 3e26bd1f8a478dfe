//! Soak test: many concurrent clients over a real hyper server, random handler delays
//! and random client disconnects; every handler checks it is alone in its key.
//!
//! ```sh
//! cargo run --release --example soak                      # 100 000 requests
//! cargo run --release --example soak -- --requests 20000  # the test script's short run
//! ```
//!
//! Exits non-zero if two handlers of one key ever overlapped, if a request was neither
//! answered nor cancelled, or if the lock table is not empty at the end.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower_keyed_lock::KeyedLockLayer;

struct Settings {
    requests: u64,
    keys: usize,
    clients: u64,
}

impl Settings {
    fn from_args() -> Self {
        let mut settings = Settings {
            requests: 100_000,
            keys: 1_000,
            clients: 512,
        };
        let args: Vec<String> = std::env::args().skip(1).collect();
        for pair in args.chunks(2) {
            let value = || {
                pair.get(1)
                    .and_then(|v| v.parse().ok())
                    .expect("a number after the flag")
            };
            match pair[0].as_str() {
                "--requests" => settings.requests = value(),
                "--keys" => settings.keys = value() as usize,
                "--clients" => settings.clients = value(),
                other => panic!("unknown flag {other}; use --requests, --keys, --clients"),
            }
        }
        settings
    }
}

/// What the handlers saw: one "inside" counter per key, and the overlaps found.
struct Handlers {
    inside: Vec<AtomicUsize>,
    overlaps: AtomicU64,
    ran: AtomicU64,
}

async fn handle(State(handlers): State<Arc<Handlers>>, Path(id): Path<usize>) -> &'static str {
    let _inside = Inside::enter(&handlers, id);
    // A random delay of 0–2 ms, sometimes none at all.
    let delay = Duration::from_micros(
        fastrand(id as u64 ^ handlers.ran.fetch_add(1, Ordering::Relaxed)) % 2_000,
    );
    if delay > Duration::from_micros(200) {
        tokio::time::sleep(delay).await;
    }
    "ok"
}

/// A handler inside its key; leaving happens on drop, because a client that
/// disconnects cancels the handler at its await.
struct Inside<'a>(&'a AtomicUsize);

impl<'a> Inside<'a> {
    fn enter(handlers: &'a Handlers, id: usize) -> Self {
        let inside = &handlers.inside[id];
        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
            handlers.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        Inside(inside)
    }
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A small stateless mixer: good enough for delays and key choice.
fn fastrand(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[derive(Default)]
struct Outcomes {
    ok: AtomicU64,
    conflict: AtomicU64,
    other: AtomicU64,
    cancelled: AtomicU64,
}

#[tokio::main]
async fn main() {
    let settings = Settings::from_args();
    let handlers = Arc::new(Handlers {
        inside: (0..settings.keys).map(|_| AtomicUsize::new(0)).collect(),
        overlaps: AtomicU64::new(0),
        ran: AtomicU64::new(0),
    });
    let layer = KeyedLockLayer::by_path("id")
        .name("soak")
        .wait_timeout(Duration::from_secs(10));
    let app = Router::new()
        .route("/orders/{id}", post(handle))
        .with_state(handlers.clone())
        .route_layer(layer.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let outcomes = Arc::new(Outcomes::default());
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..settings.clients)
        .map(|_| {
            let (client, outcomes, next) = (client.clone(), outcomes.clone(), next.clone());
            let keys = settings.keys as u64;
            let total = settings.requests;
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        break;
                    }
                    let r = fastrand(n);
                    let uri = format!("http://{addr}/orders/{}", r % keys);
                    let request = Request::post(uri).body(Empty::new()).unwrap();
                    let exchange = async {
                        let response = client.request(request).await.expect("request failed");
                        let status = response.status();
                        response.into_body().collect().await.expect("body failed");
                        status
                    };
                    // One request in 20 disconnects after 0–3 ms, wherever it is then.
                    let status = if r % 20 == 0 {
                        let patience = Duration::from_micros((r >> 8) % 3_000);
                        tokio::time::timeout(patience, exchange).await.ok()
                    } else {
                        Some(exchange.await)
                    };
                    let counter = match status {
                        Some(StatusCode::OK) => &outcomes.ok,
                        Some(StatusCode::CONFLICT) => &outcomes.conflict,
                        Some(_) => &outcomes.other,
                        None => &outcomes.cancelled,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    let elapsed = started.elapsed();

    // Cancelled requests are dropped by the server as their connections close.
    let deadline = Instant::now() + Duration::from_secs(10);
    while layer.active_keys() != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let load = |counter: &AtomicU64| counter.load(Ordering::SeqCst);
    let answered = load(&outcomes.ok) + load(&outcomes.conflict) + load(&outcomes.other);
    let overlaps = load(&handlers.overlaps);
    println!(
        "soak: {} requests over {} keys from {} clients in {:.1?} ({:.0} req/s)",
        settings.requests,
        settings.keys,
        settings.clients,
        elapsed,
        settings.requests as f64 / elapsed.as_secs_f64()
    );
    println!(
        "      answered {answered} (200: {}, 409: {}, other: {}), cancelled {}, handlers ran {}",
        load(&outcomes.ok),
        load(&outcomes.conflict),
        load(&outcomes.other),
        load(&outcomes.cancelled),
        load(&handlers.ran)
    );
    println!(
        "      overlaps {overlaps}, active_keys() {}",
        layer.active_keys()
    );

    assert_eq!(overlaps, 0, "two handlers of one key overlapped");
    assert_eq!(
        answered + load(&outcomes.cancelled),
        settings.requests,
        "a request was lost"
    );
    assert_eq!(load(&outcomes.other), 0, "unexpected statuses");
    assert_eq!(layer.active_keys(), 0, "the lock table is not empty");
}
