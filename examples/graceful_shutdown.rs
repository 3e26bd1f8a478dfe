//! Graceful shutdown with the lock layer: on SIGTERM the instance stops taking keys
//! (503 with `Retry-After`, so the load balancer's retry lands on another instance),
//! lets the requests that hold a key finish up to a deadline, and only then lets axum
//! close its connections. With a distributed backend, a request still running at the
//! deadline is cut off: its lease is given back at once (the next instance takes the
//! key now, not when the lease expires) and its `LockInfo::lease()` signal says so.
//!
//! Run it with `cargo run --example graceful_shutdown`. It serves and drives itself on
//! 127.0.0.1, in process (no servers needed); a oneshot stands in for SIGTERM (in a
//! real server: `tokio::signal::unix::signal(SignalKind::terminate())`). It exits
//! non-zero if an answer is not the one described.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::Path;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, oneshot};
use tower_keyed_lock::{KeyedLockLayer, ShutdownReport};

/// How long holders may run on once the shutdown begins.
const DEADLINE: Duration = Duration::from_secs(5);
/// How long the slow payment takes: it is in flight when SIGTERM comes.
const SLOW: Duration = Duration::from_millis(300);

#[tokio::main]
async fn main() {
    let (entered_tx, mut entered) = mpsc::unbounded_channel::<String>();
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::from_secs(2));
    // Kept before `Router::layer` consumes the layer.
    let locks = layer.shutdown_handle();
    let app = Router::new()
        .route(
            "/orders/{order_id}/pay",
            post(move |Path(order_id): Path<String>| async move {
                let _ = entered_tx.send(order_id.clone());
                tokio::time::sleep(SLOW).await;
                format!("paid {order_id}")
            }),
        )
        .route_layer(layer);

    let (sigterm_tx, sigterm) = oneshot::channel::<()>();
    let (report_tx, report) = oneshot::channel::<ShutdownReport>();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // axum keeps accepting until this future ends: first the locks drain (new keys get
    // 503 meanwhile), then axum stops accepting and closes its connections.
    let on_sigterm = {
        let locks = locks.clone();
        async move {
            let _ = sigterm.await;
            let drained = locks.shutdown(DEADLINE).await;
            let _ = report_tx.send(drained);
        }
    };
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(on_sigterm)
            .into_future(),
    );

    // 1. A slow payment is in flight…
    let slow = tokio::spawn(pay(addr, "order-1"));
    assert_eq!(entered.recv().await.as_deref(), Some("order-1"));
    println!("order-1: payment in flight");

    // 2. …when SIGTERM comes.
    sigterm_tx.send(()).unwrap();
    while !locks.is_shutting_down() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!("SIGTERM: the locks take no new key");

    // 3. A new payment meanwhile: 503 with Retry-After, the handler not run.
    let (status, retry_after, body) = pay(addr, "order-2").await;
    println!(
        "order-2: {} (Retry-After: {retry_after}) {body}",
        status.as_u16()
    );
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!retry_after.is_empty());
    assert!(body.contains(r#""reason":"shutting_down""#));

    // 4. The payment in flight finishes within the deadline.
    let (status, _, body) = slow.await.unwrap();
    println!("order-1: {} {body}", status.as_u16());
    assert_eq!((status, body.as_str()), (StatusCode::OK, "paid order-1"));

    // 5. The drain is over: axum stops, and the report says what happened.
    let report = report.await.unwrap();
    server.await.unwrap().unwrap();
    println!("shutdown: {report}");
    assert_eq!((report.finished, report.cut_off), (1, 0));
    assert!(entered.try_recv().is_err(), "order-2's handler never ran");
    println!("server stopped gracefully");
}

/// POSTs a payment; returns the status, the `Retry-After` header and the body.
async fn pay(addr: SocketAddr, order: &str) -> (StatusCode, String, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let request = Request::post(format!("http://{addr}/orders/{order}/pay"))
        .body(Empty::new())
        .unwrap();
    let response = client.request(request).await.expect("answered");
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        retry_after,
        String::from_utf8_lossy(&body).into_owned(),
    )
}
