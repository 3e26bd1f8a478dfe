//! Two instances of an HTTP app on a backend, as the per-engine tests drive them: a
//! gated handler that reports when it holds its key and finishes when told, a handler
//! that counts overlaps, and requests alternating between the instances.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Extension;
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_keyed_lock::LockInfo;

pub use super::fixtures::within;
use super::{Answer, Overlap, Server};

/// Handlers that report when they hold their key and finish when told to.
pub struct Gate {
    pub entered: mpsc::UnboundedSender<(LockInfo, Instant)>,
    pub finish: Semaphore,
}

impl Gate {
    /// Lets one held handler finish.
    pub fn open_one(&self) {
        self.finish.add_permits(1);
    }
}

/// What the gated handlers report: their `LockInfo`, and when they entered.
pub type Entered = mpsc::UnboundedReceiver<(LockInfo, Instant)>;

pub fn gate() -> (Arc<Gate>, Entered) {
    let (entered, receiver) = mpsc::unbounded_channel();
    let gate = Gate {
        entered,
        finish: Semaphore::new(0),
    };
    (Arc::new(gate), receiver)
}

/// `/orders/{id}` holds the key until the gate lets it finish and answers whether the
/// lease was lost; `/quick/{id}` answers at once, under the same layer.
pub fn gated_router(gate: Arc<Gate>) -> Router {
    Router::new()
        .route(
            "/orders/{order_id}",
            post(move |Extension(info): Extension<LockInfo>| {
                let gate = gate.clone();
                async move {
                    let _ = gate.entered.send((info.clone(), Instant::now()));
                    gate.finish.acquire().await.unwrap().forget();
                    format!("lost={}", info.is_lease_lost())
                }
            }),
        )
        .route("/quick/{order_id}", post(|| async { "ok" }))
}

/// Starts a request on the gated route and waits until its handler holds the key.
pub async fn hold(
    server: &Arc<Server>,
    path: &str,
    entered: &mut Entered,
) -> (JoinHandle<Answer>, LockInfo, Instant) {
    let request = tokio::spawn({
        let (server, path) = (server.clone(), path.to_owned());
        async move { server.post(&path).await }
    });
    let (info, at) = within("the holder enters", Duration::from_secs(5), entered.recv())
        .await
        .unwrap();
    (request, info, at)
}

/// A handler that checks how many handlers run at once, across instances.
pub fn overlap_router(overlap: Arc<Overlap>, hold: Duration) -> Router {
    Router::new().route(
        "/orders/{order_id}",
        post(move || {
            let overlap = overlap.clone();
            async move {
                let _inside = overlap.enter();
                tokio::time::sleep(hold).await;
            }
        }),
    )
}

/// Sends `count` requests for `path`, alternating between the servers, all at once.
pub async fn alternate(servers: [&Arc<Server>; 2], path: &str, count: usize) -> Vec<StatusCode> {
    let requests: Vec<_> = (0..count)
        .map(|i| {
            let (server, path) = (servers[i % 2].clone(), path.to_owned());
            tokio::spawn(async move { server.post(&path).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for request in requests {
        statuses.push(
            within("a request", Duration::from_secs(10), request)
                .await
                .unwrap(),
        );
    }
    statuses
}

/// Percent-encodes every byte that is not an ASCII letter or digit.
pub fn path_escape(text: &str) -> String {
    text.bytes()
        .map(|b| match b.is_ascii_alphanumeric() {
            true => char::from(b).to_string(),
            false => format!("%{b:02X}"),
        })
        .collect()
}
