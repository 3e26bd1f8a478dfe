//! Checks through the layer: what the clients of two instances of an HTTP service see
//! (409 for a key held on another instance, 503 for a lease lost mid-request with
//! `abort_on_lease_lost`), and that a client that goes away, waiting or holding,
//! leaves no key held. The layer's service is called as a server calls it: a client
//! that disconnects is its response future dropped.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use super::faults::{FaultProxy, Proxied};
use super::mutual::eventually_free;
use super::{instance, taken_over, within, within_for, Deployment, Lateness, PATIENCE};
use crate::{HeaderKey, KeyedLock, KeyedLockLayer, LockError, LockInfo};

/// The request header the checks' layers take their key from.
const KEY_HEADER: &str = "x-conformance-key";
/// A request with this header holds its key until its instance's gate lets it finish.
const HOLD_HEADER: &str = "x-conformance-hold";

/// A handler that reports when a holding request is inside and finishes it when told.
struct Gate {
    entered: mpsc::UnboundedSender<()>,
    finish: Semaphore,
}

/// The inner service: a holding request waits for the gate and answers whether its
/// lease was lost (`lost=…`); any other request answers at once.
#[derive(Clone)]
struct Handler(Arc<Gate>);

impl Service<Request<()>> for Handler {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<()>) -> Self::Future {
        let gate = self.0.clone();
        let holds = request.headers().contains_key(HOLD_HEADER);
        let info = request.extensions().get::<LockInfo>().cloned();
        Box::pin(async move {
            if holds {
                let _ = gate.entered.send(());
                gate.finish.acquire().await.expect("never closed").forget();
            }
            let lost = info.is_some_and(|info| info.is_lease_lost());
            Ok(Response::new(Full::from(format!("lost={lost}"))))
        })
    }
}

/// What a client was answered.
struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: String,
}

/// One instance of the service: the layer over a backend of its own, around a
/// [`Handler`].
struct App {
    layer: KeyedLockLayer<HeaderKey>,
    service: KeyedLock<Handler, HeaderKey>,
    gate: Arc<Gate>,
    entered: mpsc::UnboundedReceiver<()>,
}

impl App {
    /// An instance on a backend of the deployment, its requests waiting `wait`.
    async fn new<D: Deployment>(deployment: &D, name: &'static str, wait: Duration) -> App {
        App::on(
            KeyedLockLayer::by_header(KEY_HEADER)
                .name(name)
                .wait_timeout(wait)
                .backend(deployment.backend().await),
        )
    }

    fn on(layer: KeyedLockLayer<HeaderKey>) -> App {
        let (entered, received) = mpsc::unbounded_channel();
        let gate = Arc::new(Gate {
            entered,
            finish: Semaphore::new(0),
        });
        App {
            service: layer.layer(Handler(gate.clone())),
            layer,
            gate,
            entered: received,
        }
    }

    /// A request for `key` sent now, answered in the task returned; aborting the task
    /// is the client disconnecting.
    fn send(&self, key: &str, holds: bool) -> JoinHandle<Answer> {
        let mut request = Request::builder().header(KEY_HEADER, key);
        if holds {
            request = request.header(HOLD_HEADER, "1");
        }
        let request = request.body(()).expect("a valid request");
        let answer = self.service.clone().call(request);
        tokio::spawn(async move {
            let response = answer.await.unwrap_or_else(|never| match never {});
            let (parts, body) = response.into_parts();
            let body = match body.collect().await {
                Ok(collected) => String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
                Err(never) => match never {},
            };
            Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            }
        })
    }

    /// A request for `key` that holds it: returned once its handler runs.
    async fn hold(&mut self, key: &str) -> JoinHandle<Answer> {
        let holding = self.send(key, true);
        within("a holding request enters its handler", self.entered.recv()).await;
        holding
    }

    /// Lets one holding request finish.
    fn finish_one(&self) {
        self.gate.finish.add_permits(1);
    }
}

/// The answer of `request`, or a panic naming `what` after [`PATIENCE`].
async fn answered(what: &str, request: JoinHandle<Answer>) -> Answer {
    within(what, request).await.expect("the request's task ran")
}

/// How soon a key given back must be free: half a loss bound (at least 100 ms, or three
/// round trips of the engine as the looks measure them), and always before the loss
/// bound, so that a key left to expire is caught.
fn given_back_within(loss_bound: Duration) -> (Duration, Duration) {
    (
        (loss_bound / 2).max(Duration::from_millis(100)),
        loss_bound * 9 / 10,
    )
}

/// While a request of one instance holds a key, another instance's request for it is
/// answered 409 (`application/problem+json`, `"reason":"timeout"`, a `Retry-After`)
/// once its wait is over: not before, and no later than the wait plus a few of the
/// engine's round trips as this check measures them. The waiter leaves nothing in its
/// instance's table; once the holder is answered (200, its lease never lost), the key
/// serves another request.
pub async fn a_key_held_on_another_instance_times_out_with_409<D: Deployment>(deployment: &D) {
    const NAME: &str = "conformance-layer-409";
    let wait = Duration::from_millis(300);
    let mut a = App::new(deployment, NAME, PATIENCE).await;
    let b = App::new(deployment, NAME, wait).await;
    let looks = instance(deployment, NAME).await;
    let holding = a.hold("7").await;

    // The engine's pace, measured: the slowest of a few looks at the held key.
    let lateness = Lateness::watch();
    let mut slowest_look = Duration::ZERO;
    for _ in 0..3 {
        let sent = Instant::now();
        let look = within("a look at a held key", looks.try_lock("7")).await;
        slowest_look = slowest_look.max(sent.elapsed());
        assert!(
            matches!(look, Err(LockError::Busy)),
            "conformance: a key held through the layer was not busy for another instance: {look:?}"
        );
    }
    let started = Instant::now();
    let answer = answered("the waiter's answer", b.send("7", false)).await;
    let waited = started.elapsed();
    assert_eq!(
        answer.status,
        StatusCode::CONFLICT,
        "conformance: a request for a key held on another instance was answered {} ({})",
        answer.status,
        answer.body
    );
    assert_eq!(
        answer
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..]),
        "conformance: the 409 is not problem+json"
    );
    assert!(
        answer.headers.contains_key(http::header::RETRY_AFTER),
        "conformance: the 409 has no Retry-After"
    );
    assert!(
        answer.body.contains(r#""reason":"timeout""#),
        "conformance: the 409 does not say timeout: {}",
        answer.body
    );
    assert!(
        waited >= wait,
        "conformance: answered 409 after {waited:?}, before the wait of {wait:?}"
    );
    // The wait, an attempt in flight at its end and a withdrawal: two round trips,
    // and two more of slack. Four wake-ups the load can each put off: the request
    // task's first poll (the wait starts there), the wait's timer, the answer's task
    // and its join.
    let bound = lateness.allowing_hops(wait + 4 * slowest_look, 4);
    assert!(
        waited <= bound,
        "conformance: answered 409 after {waited:?}, past the wait of {wait:?} and four \
         of the engine's round trips ({slowest_look:?} at the slowest) = {bound:?}"
    );
    assert_eq!(
        b.layer.active_keys(),
        0,
        "conformance: a waiter answered 409 left its key in its instance's table"
    );

    a.finish_one();
    let held = answered("the holder's answer", holding).await;
    assert_eq!(
        (held.status, held.body.as_str()),
        (StatusCode::OK, "lost=false"),
        "conformance: the holder was not answered as it ran"
    );
    let c = App::new(deployment, NAME, PATIENCE).await;
    let again = answered("a request after the release", c.send("7", false)).await;
    assert_eq!(
        again.status,
        StatusCode::OK,
        "conformance: the released key did not serve another instance: {}",
        again.body
    );
}

/// A client disconnects while its request holds a key (the handler still running):
/// the key is given back, free to another instance well before the loss bound (not
/// left to expire), and the instance's table is empty.
pub async fn a_client_that_disconnects_while_holding_leaves_no_key<D: Deployment>(deployment: &D) {
    const NAME: &str = "conformance-layer-gone-holding";
    let mut a = App::new(deployment, NAME, PATIENCE).await;
    let other = instance(deployment, NAME).await;
    let holding = a.hold("5").await;
    assert!(
        matches!(other.try_lock("5").await, Err(LockError::Busy)),
        "conformance: a key held through the layer was not busy for another instance"
    );
    let gone = Instant::now();
    holding.abort();
    let (limit, cap) = given_back_within(deployment.loss_bound());
    eventually_free(&other, "5", limit, cap).await;
    tracing::info!(free = ?gone.elapsed(), "conformance: a disconnected holder's key given back");
    within("the table empties", async {
        while a.layer.active_keys() != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// While one instance holds a key, two clients of another instance wait for it (the
/// first at the engine, the second behind it in its instance's queue) and disconnect.
/// Once the holder is answered, the key is free to a third instance well before the
/// loss bound, neither waiter's handler ever ran, both tables are empty, and the
/// waiters' instance serves the key again.
pub async fn clients_that_disconnect_while_waiting_leave_no_key<D: Deployment>(deployment: &D) {
    const NAME: &str = "conformance-layer-gone-waiting";
    let mut a = App::new(deployment, NAME, PATIENCE).await;
    let mut b = App::new(deployment, NAME, PATIENCE).await;
    let other = instance(deployment, NAME).await;
    let holding = a.hold("5").await;

    let remote_waiter = b.send("5", true);
    within("the first waiter is in its instance's table", async {
        while b.layer.active_keys() != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // Time for its acquisition to reach the engine; dropped earlier, it must leave
    // nothing all the same.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let local_waiter = b.send("5", true);
    tokio::time::sleep(Duration::from_millis(20)).await;
    remote_waiter.abort();
    local_waiter.abort();

    a.finish_one();
    let held = answered("the holder's answer", holding).await;
    assert_eq!(
        held.status,
        StatusCode::OK,
        "conformance: the holder was not answered: {}",
        held.body
    );
    let (limit, cap) = given_back_within(deployment.loss_bound());
    eventually_free(&other, "5", limit, cap).await;
    within("both tables empty", async {
        while a.layer.active_keys() + b.layer.active_keys() != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        b.entered.try_recv().is_err(),
        "conformance: a waiter whose client disconnected ran its handler"
    );
    let again = answered("the waiters' instance serves the key", b.send("5", false)).await;
    assert_eq!(
        again.status,
        StatusCode::OK,
        "conformance: the waiters' instance did not serve the key again: {}",
        again.body
    );
}

/// With `abort_on_lease_lost`, a request whose instance's path to the engine goes
/// silent while it holds its key (its handler never ends on its own) is answered 503,
/// `"reason":"lease_lost"`, its handler dropped; the instance's table empties, and
/// another instance is granted the key.
pub async fn abort_on_lease_lost_answers_503<P: Proxied>(deployment: &P) {
    const NAME: &str = "conformance-layer-abort";
    let proxy = FaultProxy::start(deployment.upstream()).await;
    let mut a = App::on(
        KeyedLockLayer::by_header(KEY_HEADER)
            .name(NAME)
            .wait_timeout(PATIENCE)
            .abort_on_lease_lost(true)
            .backend(deployment.backend_via(&proxy.host_port()).await),
    );
    let b = instance(deployment, NAME).await;
    let holding = a.hold("cut").await;
    proxy.blackhole();
    let cut = Instant::now();
    let answer = within_for(
        "the answer of a request whose lease is lost",
        deployment.loss_bound() + 3 * PATIENCE,
        holding,
    )
    .await
    .expect("the request's task ran");
    tracing::info!(after = ?cut.elapsed(), "conformance: a request cut off answered");
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "conformance: a request whose lease was lost was answered {} ({}), with abort_on_lease_lost",
        answer.status,
        answer.body
    );
    assert!(
        answer.body.contains(r#""reason":"lease_lost""#),
        "conformance: the 503 does not say lease_lost: {}",
        answer.body
    );
    within("the table empties", async {
        while a.layer.active_keys() != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let taken = taken_over(&b, "cut", "another instance takes the lost key").await;
    taken.release().await;
    proxy.heal();
}
