//! A webhook receiver that processes each event once at a time:
//! `KeyedLockLayer::by_header("idempotency-key")` with `wait_timeout(Duration::ZERO)`.
//!
//! Webhook senders redeliver an event when they think a delivery failed, so two copies
//! can arrive at the same moment. With `Duration::ZERO` the second copy does not wait:
//! it gets `409 Conflict` with an `application/problem+json` body at once ("a request for
//! this key is already in progress") and the sender retries later. A different event is
//! processed in parallel, and a delivery without the header is refused with 400.
//!
//! (The lock stops *concurrent* processing. Remembering which events were already
//! processed, so that a later redelivery is skipped, is the application's job.)
//!
//! Run it with `cargo run --example webhook`. It serves and drives itself on 127.0.0.1
//! and exits non-zero if the responses are not the ones described.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

/// How long processing one event takes: the other deliveries arrive meanwhile.
const PROCESSING: Duration = Duration::from_millis(300);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn receive_event(Extension(lock): Extension<LockInfo>, payload: String) -> String {
    // Stands in for the real work: charging a card, sending an email, ...
    tokio::time::sleep(PROCESSING).await;
    format!("processed event {} ({} bytes)", lock.key(), payload.len())
}

/// What came back for one delivery.
struct Outcome {
    label: &'static str,
    status: StatusCode,
    took: Duration,
    content_type: String,
    retry_after: String,
    body: String,
}

#[tokio::main]
async fn main() {
    let one_at_a_time = KeyedLockLayer::by_header("idempotency-key").wait_timeout(Duration::ZERO);
    let app = Router::new()
        .route("/webhooks/payments", post(receive_event))
        .layer(one_at_a_time.clone());
    let addr = serve(app).await;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    let deliveries = [
        ("evt_1, delivery A", Some("evt_1")),
        ("evt_1, delivery B", Some("evt_1")),
        ("evt_2", Some("evt_2")),
        ("no idempotency-key", None),
    ];
    // All at once; the handles keep the printing in this order.
    let handles: Vec<_> = deliveries
        .into_iter()
        .map(|(label, key)| {
            let uri = format!("http://{addr}/webhooks/payments");
            tokio::spawn(deliver(client.clone(), uri, label, key))
        })
        .collect();
    let mut outcomes = Vec::new();
    for handle in handles {
        outcomes.push(handle.await.unwrap());
    }

    for o in &outcomes {
        // `StatusCode`'s Display ignores padding, hence `to_string()`.
        println!(
            "{:<19} -> {:<22} in {:>3} ms",
            o.label,
            o.status.to_string(),
            o.took.as_millis()
        );
        if o.status.is_success() {
            println!("    {}", o.body);
        } else {
            println!("    content-type: {}", o.content_type);
            println!("    retry-after:  {}", o.retry_after);
            println!("    {}", o.body);
        }
    }
    println!("\nactive_keys() now: {}", one_at_a_time.active_keys());

    let mut evt_1 = [outcomes[0].status, outcomes[1].status];
    evt_1.sort();
    assert_eq!(
        evt_1,
        [StatusCode::OK, StatusCode::CONFLICT],
        "one copy of evt_1 should be processed, the other refused with 409"
    );
    let refused = outcomes
        .iter()
        .find(|o| o.status == StatusCode::CONFLICT)
        .unwrap();
    assert_eq!(refused.content_type, "application/problem+json");
    assert!(
        refused.took < PROCESSING,
        "the 409 should come at once, not after waiting"
    );
    assert_eq!(outcomes[2].status, StatusCode::OK, "evt_2 runs in parallel");
    assert_eq!(
        outcomes[3].status,
        StatusCode::BAD_REQUEST,
        "a delivery without a key is refused"
    );
    assert_eq!(one_at_a_time.active_keys(), 0, "no key should stay locked");
}

/// POSTs a small event payload, with an `idempotency-key` header if `key` is set.
async fn deliver(
    client: HttpClient,
    uri: String,
    label: &'static str,
    key: Option<&str>,
) -> Outcome {
    let mut request = Request::post(uri).header(CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let payload = format!(
        r#"{{"id":"{}","type":"payment.succeeded"}}"#,
        key.unwrap_or("?")
    );
    let request = request.body(Full::from(payload)).unwrap();

    let started = Instant::now();
    let response = client.request(request).await.expect("request failed");
    let header = |name| {
        response
            .headers()
            .get(name)
            .map_or("-", |value| value.to_str().unwrap())
            .to_owned()
    };
    let (content_type, retry_after) = (header(CONTENT_TYPE), header(RETRY_AFTER));
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Outcome {
        label,
        status,
        took: started.elapsed(),
        content_type,
        retry_after,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Serves `app` on a free port of 127.0.0.1 in the background.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
