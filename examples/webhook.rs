//! A Stripe-style webhook receiver that processes each event exactly once, keyed by the
//! event id in the JSON body (`{"id": "evt_…", ...}`: Stripe sends it nowhere else).
//!
//! Senders redeliver an event for hours when they think a delivery failed: sometimes
//! while the first delivery still runs, mostly after it finished, and each attempt
//! carries a new `delivered_at` stamp. The stack is
//!
//! - `BufferRequestBodyLayer`: the body is read before the key is taken, so a slow
//!   sender cannot hold the key, and the key can come from the body;
//! - `KeyedLockLayer::by_json_body("/id")`: copies that arrive while the event is being
//!   processed wait for it;
//! - `ReplayLayer` with a `MemoryStore` and a fingerprint that leaves out
//!   `delivered_at`: every copy after the first gets the first response back, marked
//!   `Idempotent-Replayed: true`, without running the handler, whatever its stamp; a
//!   copy with a different payload under the same id gets 422.
//!
//! Run it with `cargo run --example webhook --features replay,json`. It serves and drives
//! itself on 127.0.0.1 (no servers needed) and exits non-zero if the side effect does
//! not happen exactly once per event or the answers are not the ones described.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tower_keyed_lock::replay::{MemoryStore, ReplayLayer};
use tower_keyed_lock::{BufferRequestBodyLayer, KeyedLockLayer, LockInfo};

/// How long processing one event takes: concurrent copies arrive meanwhile.
const PROCESSING: Duration = Duration::from_millis(200);

/// The side effects: how many times each event was processed.
type Processed = Arc<Mutex<HashMap<String, usize>>>;

async fn receive_event(
    Extension(processed): Extension<Processed>,
    Extension(lock): Extension<LockInfo>,
    payload: String,
) -> String {
    // Stands in for the real work: charging a card, sending an email, ...
    tokio::time::sleep(PROCESSING).await;
    *processed
        .lock()
        .unwrap()
        .entry(lock.key().to_owned())
        .or_default() += 1;
    format!("processed {} ({payload})", lock.key())
}

/// The event as the fingerprint sees it: everything but the `delivered_at` stamp, which
/// the sender changes on every attempt of one event.
fn without_stamp(_: &http::request::Parts, body: &Bytes) -> Vec<u8> {
    let mut event: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    if let Some(fields) = event.as_object_mut() {
        fields.remove("delivered_at");
    }
    serde_json::to_vec(&event).unwrap_or_default()
}

/// What came back for one delivery.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: String,
}

#[tokio::main]
async fn main() {
    let processed = Processed::default();
    let app = Router::new()
        .route("/webhooks", post(receive_event))
        // The lock on the delivery id, and the stored response replayed inside it.
        .layer(
            KeyedLockLayer::by_json_body("/id")
                .wait_timeout(Duration::from_secs(5))
                .replay(ReplayLayer::new(MemoryStore::default()).fingerprint_with(without_stamp)),
        )
        // Outermost: the body is read before the key is taken.
        .layer(BufferRequestBodyLayer::new())
        .layer(Extension(processed.clone()));
    let sender = Sender::new(serve(app).await);

    // 1. The first delivery of evt_1 runs.
    let first = sender.deliver("evt_1", 10, 1).await;
    show("evt_1, first delivery", &first);
    assert_eq!((first.status, first.replayed), (StatusCode::OK, false));

    // 2. Three retries after it completed, at once, each with a new `delivered_at`:
    //    replayed, not run (the fingerprint leaves the stamp out).
    let retries = sender.deliver_many("evt_1", 10, 3).await;
    for retry in &retries {
        show("evt_1, retry (new stamp)", retry);
        assert_eq!((retry.status, retry.replayed), (StatusCode::OK, true));
        assert_eq!(retry.body, first.body);
    }

    // 3. Three copies of evt_2 at once: one runs, the others wait and get its answer.
    let copies = sender.deliver_many("evt_2", 20, 3).await;
    for copy in &copies {
        show("evt_2, concurrent copy", copy);
        assert_eq!(copy.status, StatusCode::OK);
        assert_eq!(copy.body, copies[0].body);
    }
    assert_eq!(copies.iter().filter(|copy| !copy.replayed).count(), 1);

    // 4. evt_1 again with a changed amount: not the same event, refused.
    let changed = sender.deliver("evt_1", 9999, 9).await;
    show("evt_1, changed amount", &changed);
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(changed.body.contains("fingerprint_mismatch"));

    // 5. A body without an event id: 400, nothing run.
    let anonymous = sender.post(r#"{"amount":5}"#).await;
    show("no id in the body", &anonymous);
    assert_eq!(anonymous.status, StatusCode::BAD_REQUEST);
    assert!(anonymous.body.contains("missing_key"));

    let processed = processed.lock().unwrap().clone();
    println!("\nside effects: {processed:?}");
    assert_eq!(
        processed,
        HashMap::from([("evt_1".into(), 1), ("evt_2".into(), 1)])
    );
    println!("every event processed exactly once");
}

fn show(label: &str, answer: &Answer) {
    let replayed = match (answer.replayed, answer.status.is_success()) {
        (true, _) => "replayed",
        (false, true) => "ran",
        (false, false) => "refused",
    };
    println!(
        "{label:<32} {} {replayed:<8} {}",
        answer.status.as_u16(),
        answer.body
    );
}

/// A webhook sender: POSTs JSON events, stamped with the attempt's `delivered_at`.
#[derive(Clone)]
struct Sender {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: String,
    attempts: Arc<AtomicU64>,
}

impl Sender {
    fn new(addr: SocketAddr) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            uri: format!("http://{addr}/webhooks"),
            attempts: Arc::new(AtomicU64::new(100)),
        }
    }

    /// Delivers event `id` with `amount`, stamped `delivered_at`.
    async fn deliver(&self, id: &str, amount: u64, delivered_at: u64) -> Answer {
        self.post(&format!(
            r#"{{"id":"{id}","amount":{amount},"delivered_at":{delivered_at}}}"#
        ))
        .await
    }

    async fn post(&self, event: &str) -> Answer {
        let request = Request::post(&self.uri)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(event.to_owned())))
            .unwrap();
        let response = self.client.request(request).await.expect("delivered");
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            replayed,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    /// `copies` deliveries of one event, all in flight at once, each with a stamp of
    /// its own.
    async fn deliver_many(&self, id: &str, amount: u64, copies: usize) -> Vec<Answer> {
        let mut in_flight = tokio::task::JoinSet::new();
        for _ in 0..copies {
            let stamp = self.attempts.fetch_add(1, Ordering::Relaxed);
            let (sender, id) = (self.clone(), id.to_owned());
            in_flight.spawn(async move { sender.deliver(&id, amount, stamp).await });
        }
        in_flight.join_all().await
    }
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
