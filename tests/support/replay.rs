//! The replay tests' app, client, and the rows of the semantics table, run against each
//! store by `tests/replay/` (`memory.rs`, `redis.rs` and `postgres.rs`).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{header, HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_http::catch_panic::CatchPanicLayer;
use tower_keyed_lock::key::HeaderKey;
use tower_keyed_lock::replay::ReplayLayer;
use tower_keyed_lock::KeyedLockLayer;

/// Calls `$run!` with the name of every row of the semantics table (each a function
/// of this module), so each store's tests write only how they run a row, and a new
/// row runs against every store. (Other test binaries include this module too.)
#[allow(unused_macros)]
macro_rules! every_row {
    ($run:ident) => {
        $run!(
            duplicate_after_completion_is_replayed,
            duplicate_in_flight_waits_then_replays,
            duplicate_in_flight_without_waiting_gets_409,
            different_fingerprint_is_rejected,
            custom_fingerprint_ignores_what_changes_between_retries,
            transient_answers_are_not_stored,
            panic_stores_nothing,
            cancelled_request_stores_nothing,
            body_over_the_limit_passes_through,
            expired_record_is_a_new_request,
            key_is_scoped_by_route,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use every_row;

/// Long enough for anything that should happen; a test fails instead of hanging.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Makes the layers under test: the lock (with its backend) and the replay layer
/// (with its store). Each row tweaks them.
pub struct Kit {
    pub lock: Box<dyn Fn() -> KeyedLockLayer<HeaderKey> + Send + Sync>,
    pub replay: Box<dyn Fn() -> ReplayLayer + Send + Sync>,
    pub stacking: Stacking,
}

/// How the app puts the replay layer inside the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stacking {
    /// `.layer(replay).layer(lock)`: the replay layer asks its store itself.
    ByHand,
    /// `.layer(lock.replay(replay))`: a store on the lock's engine is looked up by the
    /// lock's own acquisition, and written with its release.
    Replay,
}

/// What the handlers did.
pub struct Probe {
    /// Handler calls that started.
    pub started: AtomicUsize,
    /// Handler calls that ran to the end.
    pub completed: AtomicUsize,
    /// Closed until a test lets `/slow` handlers finish.
    pub gate: Semaphore,
}

impl Default for Probe {
    fn default() -> Self {
        Self {
            started: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
            gate: Semaphore::new(0),
        }
    }
}

impl Probe {
    pub fn completed(&self) -> usize {
        self.completed.load(SeqCst)
    }

    pub fn started(&self) -> usize {
        self.started.load(SeqCst)
    }
}

/// The app: `/orders` answers 201 with a body naming the call, replayable and
/// private headers; `/status/{code}` answers `code`; `/slow` waits for the gate;
/// `/big` answers 100 000 bytes; `/panic` panics. The panic is caught outside the
/// lock, so the lock and replay layers see it unwind.
pub fn app(lock: KeyedLockLayer<HeaderKey>, replay: ReplayLayer, probe: Arc<Probe>) -> Router {
    app_stacked(Stacking::ByHand, lock, replay, probe)
}

/// The app, with the replay layer put inside the lock as `stacking` says.
pub fn app_stacked(
    stacking: Stacking,
    lock: KeyedLockLayer<HeaderKey>,
    replay: ReplayLayer,
    probe: Arc<Probe>,
) -> Router {
    let routes = routes(probe);
    let routes = match stacking {
        Stacking::ByHand => routes.layer(replay).layer(lock),
        Stacking::Replay => routes.layer(lock.replay(replay)),
    };
    routes.layer(CatchPanicLayer::new())
}

/// The routes of [`app`], without layers.
fn routes(probe: Arc<Probe>) -> Router {
    let orders = {
        let probe = Arc::clone(&probe);
        move |body: Bytes| async move {
            probe.started.fetch_add(1, SeqCst);
            let call = probe.completed.fetch_add(1, SeqCst) + 1;
            let mut headers = HeaderMap::new();
            headers.insert(header::LOCATION, "/orders/1".parse().unwrap());
            headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
            headers.append(header::VARY, "accept".parse().unwrap());
            headers.append(header::VARY, "origin".parse().unwrap());
            headers.insert(header::SET_COOKIE, "session=secret".parse().unwrap());
            headers.insert(header::WWW_AUTHENTICATE, "Basic".parse().unwrap());
            headers.insert("x-private", "1".parse().unwrap());
            let body = format!("call {call} for {}", String::from_utf8_lossy(&body));
            (StatusCode::CREATED, headers, body)
        }
    };
    let status = {
        let probe = Arc::clone(&probe);
        move |Path(code): Path<u16>| async move {
            probe.started.fetch_add(1, SeqCst);
            probe.completed.fetch_add(1, SeqCst);
            StatusCode::from_u16(code).unwrap()
        }
    };
    let slow = {
        let probe = Arc::clone(&probe);
        move || async move {
            let call = probe.started.fetch_add(1, SeqCst) + 1;
            probe.gate.acquire().await.unwrap().forget();
            probe.completed.fetch_add(1, SeqCst);
            format!("slow call {call}")
        }
    };
    let big = {
        let probe = Arc::clone(&probe);
        move || async move {
            probe.started.fetch_add(1, SeqCst);
            probe.completed.fetch_add(1, SeqCst);
            "x".repeat(100_000)
        }
    };
    let panics = {
        let probe = Arc::clone(&probe);
        move || async move {
            if probe.started.fetch_add(1, SeqCst) == 0 {
                panic!("the first call panics");
            }
            probe.completed.fetch_add(1, SeqCst);
            "fine"
        }
    };
    Router::new()
        .route("/orders", post(orders))
        .route("/other", post(|| async { "other" }))
        .route("/status/{code}", post(status))
        .route("/slow", post(slow))
        .route("/big", post(big))
        .route("/panic", post(panics))
}

/// The app with the layers stacked the wrong way round, `.layer(lock).layer(replay)`:
/// the replay layer outside the lock, where a request holds no key yet.
pub fn app_with_replay_outside(
    lock: KeyedLockLayer<HeaderKey>,
    replay: ReplayLayer,
    probe: Arc<Probe>,
) -> Router {
    routes(probe)
        .layer(lock)
        .layer(replay)
        .layer(CatchPanicLayer::new())
}

/// A served app and a client for it.
pub struct Served {
    pub addr: SocketAddr,
    pub probe: Arc<Probe>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// A response read to the end.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn is_replay(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn reason(&self) -> String {
        assert_eq!(
            self.headers[header::CONTENT_TYPE],
            "application/problem+json",
            "{self:?}"
        );
        let start = self.body.find(r#""reason":""#).expect("a reason") + 10;
        self.body[start..].trim_end_matches("\"}").to_owned()
    }
}

pub async fn serve(app: Router, probe: Arc<Probe>) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Served {
        addr,
        probe,
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

impl Served {
    /// POSTs `body` to `path` with `idempotency-key: key`.
    pub async fn post(&self, path: &str, key: &str, body: &str) -> Reply {
        let request = Request::post(format!("http://{}{path}", self.addr))
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        self.send(request).await
    }

    /// POSTs `body` to `path` without a key.
    pub async fn post_without_key(&self, path: &str, body: &str) -> Reply {
        let request = Request::post(format!("http://{}{path}", self.addr))
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        self.send(request).await
    }

    /// Sends `request` and reads the whole response.
    async fn send(&self, request: Request<Full<Bytes>>) -> Reply {
        let response = tokio::time::timeout(PATIENCE, self.client.request(request))
            .await
            .expect("answered in time")
            .expect("request failed");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body failed").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    }
}

impl Kit {
    /// Serves the app with the kit's layers, tweaked.
    pub async fn serve_with(
        &self,
        lock: impl FnOnce(KeyedLockLayer<HeaderKey>) -> KeyedLockLayer<HeaderKey>,
        replay: impl FnOnce(ReplayLayer) -> ReplayLayer,
    ) -> Served {
        let probe = Arc::new(Probe::default());
        let app = app_stacked(
            self.stacking,
            lock((self.lock)()),
            replay((self.replay)()),
            Arc::clone(&probe),
        );
        serve(app, probe).await
    }

    pub async fn serve(&self) -> Served {
        self.serve_with(|lock| lock, |replay| replay).await
    }
}

// ------------------------------------------------------------ the rows of the table

/// First request: runs, and its response is stored; a duplicate after completion gets
/// the status, the replayable headers (multi-valued ones whole) and the body, marked
/// as a replay, without a cookie or challenge; the handler is not called again.
pub async fn duplicate_after_completion_is_replayed(kit: &Kit) {
    let app = kit.serve().await;
    let first = app.post("/orders", "k1", "pay 10").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.is_replay());
    assert_eq!(first.body, "call 1 for pay 10");
    assert!(first.headers.get(header::SET_COOKIE).is_some());

    let again = app.post("/orders", "k1", "pay 10").await;
    assert_eq!(app.probe.completed(), 1, "the handler ran again");
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers[header::LOCATION], "/orders/1");
    assert_eq!(again.headers[header::CONTENT_TYPE], "text/plain");
    let vary: Vec<_> = again.headers.get_all(header::VARY).iter().collect();
    assert_eq!(vary, ["accept", "origin"]);
    assert!(again.headers.get(header::SET_COOKIE).is_none());
    assert!(again.headers.get(header::WWW_AUTHENTICATE).is_none());
    assert!(again.headers.get("x-private").is_none());

    // Another key runs on its own.
    let other = app.post("/orders", "k2", "pay 10").await;
    assert_eq!(other.body, "call 2 for pay 10");
}

/// A duplicate that arrives while the first runs waits for the key, then gets the
/// replay.
pub async fn duplicate_in_flight_waits_then_replays(kit: &Kit) {
    let app = Arc::new(
        kit.serve_with(|lock| lock.wait_timeout(PATIENCE), |replay| replay)
            .await,
    );
    let first = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.post("/slow", "k", "").await }
    });
    wait_until(|| app.probe.started() == 1).await;
    let duplicate = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.post("/slow", "k", "").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!duplicate.is_finished(), "the duplicate did not wait");
    app.probe.gate.add_permits(2);
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.is_replay());
    assert!(duplicate.is_replay(), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
    assert_eq!(app.probe.started(), 1);
}

/// With `wait_timeout(ZERO)` a duplicate in flight gets the lock layer's 409.
pub async fn duplicate_in_flight_without_waiting_gets_409(kit: &Kit) {
    let app = Arc::new(
        kit.serve_with(|lock| lock.wait_timeout(Duration::ZERO), |replay| replay)
            .await,
    );
    let first = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.post("/slow", "k", "").await }
    });
    wait_until(|| app.probe.started() == 1).await;
    let duplicate = app.post("/slow", "k", "").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    app.probe.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    // A distributed lease is released in a task after the response: until then a
    // retry still finds the key busy.
    let mut retry = app.post("/slow", "k", "").await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while retry.status == StatusCode::CONFLICT && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        retry = app.post("/slow", "k", "").await;
    }
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(app.probe.started(), 1);
}

/// Same key, different request: 422 problem+json, or the configured status; with
/// fingerprints off the first response is replayed whatever the body.
pub async fn different_fingerprint_is_rejected(kit: &Kit) {
    let app = kit.serve().await;
    app.post("/orders", "k", "pay 10").await;
    let changed = app.post("/orders", "k", "pay 99").await;
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{changed:?}"
    );
    assert_eq!(changed.reason(), "fingerprint_mismatch");
    assert_eq!(app.probe.completed(), 1);

    let configured = kit
        .serve_with(
            |lock| lock,
            |replay| replay.mismatch_status(StatusCode::BAD_REQUEST),
        )
        .await;
    configured.post("/orders", "k-configured", "pay 10").await;
    let changed = configured.post("/orders", "k-configured", "pay 99").await;
    assert_eq!(changed.status, StatusCode::BAD_REQUEST);

    let unchecked = kit
        .serve_with(|lock| lock, |replay| replay.fingerprint(false))
        .await;
    let first = unchecked.post("/orders", "k-unchecked", "pay 10").await;
    let changed = unchecked.post("/orders", "k-unchecked", "pay 99").await;
    assert!(changed.is_replay());
    assert_eq!(changed.body, first.body);
}

/// A custom fingerprint that ignores a delivery stamp (`@…` at the end of the body):
/// a retry whose stamp changed is replayed, one whose payload changed still gets 422;
/// without it the same stamped retry gets 422.
pub async fn custom_fingerprint_ignores_what_changes_between_retries(kit: &Kit) {
    let plain = kit.serve().await;
    plain.post("/orders", "k-stamped", "pay 10 @1").await;
    let restamped = plain.post("/orders", "k-stamped", "pay 10 @2").await;
    assert_eq!(
        restamped.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{restamped:?}"
    );
    assert_eq!(restamped.reason(), "fingerprint_mismatch");

    let custom = kit
        .serve_with(
            |lock| lock,
            |replay| {
                replay.fingerprint_with(|_parts, body: &Bytes| {
                    let stamp = body.iter().rposition(|&b| b == b'@').unwrap_or(body.len());
                    body.slice(..stamp)
                })
            },
        )
        .await;
    let first = custom.post("/orders", "k-custom", "pay 10 @1").await;
    assert_eq!(first.body, "call 1 for pay 10 @1");
    let restamped = custom.post("/orders", "k-custom", "pay 10 @2").await;
    assert!(restamped.is_replay(), "{restamped:?}");
    assert_eq!(restamped.body, first.body);
    let changed = custom.post("/orders", "k-custom", "pay 99 @3").await;
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{changed:?}"
    );
    assert_eq!(custom.probe.completed(), 1);
}

/// 5xx is not stored unless asked; 401, 403, 408, 409 and 429 never are.
pub async fn transient_answers_are_not_stored(kit: &Kit) {
    let app = kit.serve().await;
    for code in [500, 503, 401, 403, 408, 409, 429] {
        let key = format!("k{code}");
        let path = format!("/status/{code}");
        let before = app.probe.completed();
        assert_eq!(app.post(&path, &key, "").await.status.as_u16(), code);
        let retry = app.post(&path, &key, "").await;
        assert!(!retry.is_replay(), "{code} was replayed");
        assert_eq!(app.probe.completed(), before + 2, "{code}");
    }
    // A 404 is an answer about the request: stored.
    app.post("/status/404", "k404", "").await;
    assert!(app.post("/status/404", "k404", "").await.is_replay());

    let opted_in = kit
        .serve_with(|lock| lock, |replay| replay.store_server_errors(true))
        .await;
    opted_in.post("/status/500", "k-opted-in", "").await;
    let retry = opted_in.post("/status/500", "k-opted-in", "").await;
    assert!(retry.is_replay());
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    for code in [401, 429] {
        let path = format!("/status/{code}");
        opted_in.post(&path, "t", "").await;
        assert!(!opted_in.post(&path, "t", "").await.is_replay());
    }
}

/// A handler that panicked stored nothing: the retry runs.
pub async fn panic_stores_nothing(kit: &Kit) {
    let app = kit.serve().await;
    let first = app.post("/panic", "k", "").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retry = app.post("/panic", "k", "").await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(!retry.is_replay());
    assert!(app.post("/panic", "k", "").await.is_replay());
}

/// A client that disconnects while the handler runs cancels it: nothing stored, the
/// retry runs.
pub async fn cancelled_request_stores_nothing(kit: &Kit) {
    let app = kit.serve().await;
    {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        let head =
            "POST /slow HTTP/1.1\r\nhost: t\r\nidempotency-key: k\r\ncontent-length: 0\r\n\r\n";
        stream.write_all(head.as_bytes()).await.unwrap();
        wait_until(|| app.probe.started() == 1).await;
    } // Dropped: the client went away mid-handler.
    tokio::time::sleep(Duration::from_millis(100)).await;
    app.probe.gate.add_permits(1);
    let retry = app.post("/slow", "k", "").await;
    assert!(!retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, "slow call 2");
    assert_eq!(app.probe.completed(), 1);
}

/// A response body over the store limit reaches the client whole, and is not stored.
pub async fn body_over_the_limit_passes_through(kit: &Kit) {
    let app = kit
        .serve_with(|lock| lock, |replay| replay.max_response_bytes(10_000))
        .await;
    let first = app.post("/big", "k", "").await;
    assert_eq!(first.body.len(), 100_000);
    let retry = app.post("/big", "k", "").await;
    assert!(!retry.is_replay());
    assert_eq!(retry.body.len(), 100_000);
    assert_eq!(app.probe.completed(), 2);
    // Within the limit it is stored.
    let roomy = kit
        .serve_with(|lock| lock, |replay| replay.max_response_bytes(100_000))
        .await;
    roomy.post("/big", "k-roomy", "").await;
    assert!(roomy.post("/big", "k-roomy", "").await.is_replay());
}

/// A record older than its TTL is gone: the key makes a new request.
pub async fn expired_record_is_a_new_request(kit: &Kit) {
    let app = kit
        .serve_with(|lock| lock, |replay| replay.ttl(Duration::from_millis(300)))
        .await;
    app.post("/orders", "k", "a").await;
    assert!(app.post("/orders", "k", "a").await.is_replay());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let later = app.post("/orders", "k", "a").await;
    assert!(!later.is_replay());
    assert_eq!(later.body, "call 2 for a");
}

/// One key on another route runs there: records are scoped by method and route.
pub async fn key_is_scoped_by_route(kit: &Kit) {
    let app = kit.serve().await;
    app.post("/orders", "k", "").await;
    let other = app.post("/other", "k", "").await;
    assert!(!other.is_replay());
    assert_eq!(other.body, "other");
}

/// Polls `condition` until it holds, failing after [`PATIENCE`].
pub async fn wait_until(mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
