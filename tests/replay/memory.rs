//! The replay layer with the memory store, through a real hyper server: every row of
//! the semantics table, scoping, reading the body first, metrics, and cancellation at
//! every await.
#![cfg(feature = "replay")]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use metrics_util::debugging::DebugValue;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
use tower_keyed_lock::replay::{MemoryStore, ReplayLayer, REPLAYED_TOTAL, STORED_TOTAL};
use tower_keyed_lock::{BufferRequestBodyLayer, KeyedLockLayer};

use crate::support::logs::Captured;
use crate::support::replay::{serve, Kit, Probe, Stacking, PATIENCE};

fn kit_stacked(stacking: Stacking) -> Kit {
    Kit {
        lock: Box::new(|| KeyedLockLayer::by_header("idempotency-key").name("replay-memory")),
        replay: Box::new(|| ReplayLayer::new(MemoryStore::default())),
        stacking,
    }
}

fn kit() -> Kit {
    kit_stacked(Stacking::Replay)
}

/// Every row, for the layers stacked both ways: through `KeyedLockLayer::replay` a
/// stored record is found before the key is taken.
macro_rules! rows {
    ($($row:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $row() {
                crate::support::replay::$row(&kit()).await;
            }
        )*
        mod by_hand {
            use super::*;
            $(
                #[tokio::test]
                async fn $row() {
                    crate::support::replay::$row(&kit_stacked(Stacking::ByHand)).await;
                }
            )*
        }
    };
}

crate::support::replay::every_row!(rows);

/// Through `KeyedLockLayer::replay`, a completed request's retry is answered from
/// memory while another request holds its key (on another path), and a retry with
/// another body is refused at once: neither takes the key. Stacked by hand, the
/// retry waits for the key like any request (and, with no wait, gets 409).
#[tokio::test]
async fn a_replay_from_memory_takes_no_key() {
    for stacking in [Stacking::Replay, Stacking::ByHand] {
        let lock = KeyedLockLayer::by_header("idempotency-key")
            .name("replay-memory")
            .wait_timeout(Duration::ZERO);
        let probe = Arc::new(Probe::default());
        let app = crate::support::replay::app_stacked(
            stacking,
            lock,
            ReplayLayer::new(MemoryStore::default()),
            Arc::clone(&probe),
        );
        let app = Arc::new(serve(app, Arc::clone(&probe)).await);
        let first = app.post("/orders", "k", "a").await;
        assert_eq!(first.status, StatusCode::CREATED);
        // The key held by a request on another path until the gate opens.
        let slow = tokio::spawn({
            let app = Arc::clone(&app);
            async move { app.post("/slow", "k", "").await }
        });
        let started = Instant::now();
        while probe.started() < 2 {
            assert!(
                started.elapsed() < PATIENCE,
                "the slow request never started"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let retry = app.post("/orders", "k", "a").await;
        let other_body = app.post("/orders", "k", "b").await;
        match stacking {
            Stacking::Replay => {
                assert!(retry.is_replay(), "{stacking:?}: {retry:?}");
                assert_eq!(retry.body, first.body);
                assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
            }
            Stacking::ByHand => {
                assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
                assert_eq!(other_body.status, StatusCode::CONFLICT);
            }
        }
        probe.gate.add_permits(1);
        assert_eq!(slow.await.unwrap().status, StatusCode::OK);
    }
}

/// Issue 25: with the fingerprint off, a key reused on another resource (another path,
/// or the same path with another query) must not get the first resource's response.
#[tokio::test]
async fn key_is_scoped_by_path_and_query_even_without_fingerprint() {
    let handler = |axum::extract::Path(order): axum::extract::Path<String>, uri: http::Uri| async move {
        format!("order {order} paid ({})", uri.query().unwrap_or("no query"))
    };
    let app = Router::new()
        .route("/orders/{order_id}/pay", post(handler))
        .layer(ReplayLayer::new(MemoryStore::default()).fingerprint(false))
        .layer(KeyedLockLayer::by_header("idempotency-key").name("replay-path-scope"));
    let server = serve(app, Arc::new(Probe::default())).await;

    let first = server.post("/orders/1/pay", "k", "").await;
    assert_eq!(first.body, "order 1 paid (no query)");
    let other_path = server.post("/orders/2/pay", "k", "").await;
    assert!(!other_path.is_replay(), "order 2 got order 1's response");
    assert_eq!(other_path.body, "order 2 paid (no query)");
    let other_query = server.post("/orders/1/pay?attempt=2", "k", "").await;
    assert!(
        !other_query.is_replay(),
        "another query got the first response"
    );
    assert_eq!(other_query.body, "order 1 paid (attempt=2)");
    // The same resource again is a replay, body or not.
    let again = server.post("/orders/1/pay", "k", "changed").await;
    assert!(again.is_replay());
    assert_eq!(again.body, "order 1 paid (no query)");
}

/// The user an authentication layer identified.
#[derive(Clone)]
struct User(&'static str);

impl std::fmt::Display for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

#[tokio::test]
async fn key_is_scoped_by_principal() {
    key_is_scoped_by_principal_when(Stacking::Replay).await;
    key_is_scoped_by_principal_when(Stacking::ByHand).await;
}

async fn key_is_scoped_by_principal_when(stacking: Stacking) {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = Arc::clone(&calls);
        move |Extension(user): Extension<User>| async move {
            format!("{} call {}", user.0, calls.fetch_add(1, SeqCst) + 1)
        }
    };
    let store = MemoryStore::default();
    let app_for = |user: Option<&'static str>| {
        let replay = ReplayLayer::new(store.clone()).principal::<User>();
        let lock = KeyedLockLayer::by_header("idempotency-key").name("replay-principal");
        let router = Router::new().route("/orders", post(handler.clone()));
        let router = match stacking {
            Stacking::Replay => router.layer(lock.replay(replay)),
            Stacking::ByHand => router.layer(replay).layer(lock),
        };
        match user {
            Some(user) => router.layer(Extension(User(user))),
            None => router,
        }
    };
    let probe = Arc::new(Probe::default());
    let alice = serve(app_for(Some("alice")), Arc::clone(&probe)).await;
    let bob = serve(app_for(Some("bob")), Arc::clone(&probe)).await;
    assert_eq!(alice.post("/orders", "k", "").await.body, "alice call 1");
    let bobs = bob.post("/orders", "k", "").await;
    assert!(!bobs.is_replay(), "bob got alice's response");
    assert_eq!(bobs.body, "bob call 2");
    assert!(alice.post("/orders", "k", "").await.is_replay());

    // A principal configured but missing is a misconfiguration, not a shared scope.
    let nobody = serve(app_for(None), probe).await;
    let missing = nobody.post("/orders", "k", "").await;
    assert_eq!(missing.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(missing.reason(), "misconfigured");
}

#[tokio::test]
async fn replays_and_rejections_are_counted_without_keys() {
    crate::support::recorder::install(); // installed before the layer registers handles
    let layer = "replay-metrics";
    let app = crate::support::replay::app(
        KeyedLockLayer::by_header("idempotency-key").name(layer),
        ReplayLayer::new(MemoryStore::default()),
        Arc::new(Probe::default()),
    );
    let app = serve(app, Arc::new(Probe::default())).await;
    app.post("/orders", "k", "a").await;
    assert!(app.post("/orders", "k", "a").await.is_replay());
    assert!(app.post("/orders", "k", "a").await.is_replay());
    app.post("/orders", "k", "b").await;
    // One snapshot: the debugging recorder's snapshots drain counters.
    let mut counters = std::collections::HashMap::new();
    for (key, value) in crate::support::recorder::snapshot() {
        let key = key.key();
        let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
        if let (true, DebugValue::Counter(n)) = (labels.contains(&("name", layer)), value) {
            let reason = labels.iter().find(|(k, _)| *k == "reason").map(|(_, v)| *v);
            counters.insert(format!("{} {reason:?}", key.name()), n);
        }
    }
    assert_eq!(counters[&format!("{STORED_TOTAL} None")], 1, "{counters:?}");
    assert_eq!(
        counters[&format!("{REPLAYED_TOTAL} None")],
        2,
        "{counters:?}"
    );
    let mismatch = "keyed_lock_rejected_total Some(\"fingerprint_mismatch\")";
    assert_eq!(counters[mismatch], 1, "{counters:?}");
}

/// The replay layer stacked outside the lock (`.layer(lock).layer(replay)`) reads a
/// request before any key is held: it cannot replay, and must not run the handler
/// twice as if it could. Every request for a route gets 500 problem+json without
/// running the handler, with one `error` log for the layer; a request no route
/// matched keeps the fallback's 404.
#[tokio::test]
async fn replay_stacked_outside_the_lock_is_a_server_error_logged_once() {
    let captured = Captured::default();
    let _logs = captured.install();
    let probe = Arc::new(Probe::default());
    let app = crate::support::replay::app_with_replay_outside(
        KeyedLockLayer::by_header("idempotency-key").name("replay-outside"),
        ReplayLayer::new(MemoryStore::default()),
        Arc::clone(&probe),
    );
    let app = serve(app, Arc::clone(&probe)).await;
    for _ in 0..3 {
        let answer = app.post("/orders", "k", "a").await;
        assert_eq!(
            answer.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{answer:?}"
        );
        assert_eq!(answer.reason(), "misconfigured");
        assert!(!answer.is_replay());
    }
    assert_eq!(app.probe.started(), 0, "the handler ran without replay");
    let unrouted = app.post("/nowhere", "k", "").await;
    assert_eq!(unrouted.status, StatusCode::NOT_FOUND, "{unrouted:?}");
    let logs = captured.text();
    let errors: Vec<_> = logs.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "{logs}");
    assert!(errors[0].contains("inside the lock"), "{logs}");
}

/// With no lock layer at all the replay layer has no key either: the same 500.
#[tokio::test]
async fn replay_without_a_lock_is_a_server_error() {
    let app = Router::new()
        .route("/orders", post(|| async { "ran" }))
        .layer(ReplayLayer::new(MemoryStore::default()));
    let app = serve(app, Arc::new(Probe::default())).await;
    let answer = app.post("/orders", "k", "").await;
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    assert_eq!(answer.reason(), "misconfigured");
}

/// A request the lock layer lets through without a key (`allow_missing_key`) runs,
/// unreplayed and unstored, under both supported stackings; no error is logged. A
/// request with a key is still replayed, and one no route matched gets the 404.
#[tokio::test]
async fn a_request_let_through_without_a_key_runs_unreplayed() {
    for stacking in [Stacking::Replay, Stacking::ByHand] {
        let captured = Captured::default();
        let _logs = captured.install();
        let probe = Arc::new(Probe::default());
        let app = crate::support::replay::app_stacked(
            stacking,
            KeyedLockLayer::by_header("idempotency-key")
                .name("replay-keyless")
                .allow_missing_key(),
            ReplayLayer::new(MemoryStore::default()),
            Arc::clone(&probe),
        );
        let app = serve(app, Arc::clone(&probe)).await;
        for call in 1..=2 {
            let answer = app.post_without_key("/orders", "a").await;
            assert_eq!(
                answer.status,
                StatusCode::CREATED,
                "{stacking:?}: {answer:?}"
            );
            assert_eq!(answer.body, format!("call {call} for a"), "{stacking:?}");
            assert!(!answer.is_replay(), "{stacking:?}");
        }
        app.post("/orders", "k", "a").await;
        assert!(
            app.post("/orders", "k", "a").await.is_replay(),
            "{stacking:?}"
        );
        let unrouted = app.post("/nowhere", "k", "").await;
        assert_eq!(unrouted.status, StatusCode::NOT_FOUND, "{stacking:?}");
        let logs = captured.text();
        assert!(!logs.contains("ERROR"), "{stacking:?}: {logs}");
    }
}

// ------------------------------------------------------------ reading the body first

/// An app keyed by `idempotency-key` whose handler reads the body; with
/// `buffer_first`, a `BufferRequestBodyLayer` reads it before the key is taken.
fn body_app(buffer_first: bool) -> Router {
    let app = Router::new()
        .route("/orders", post(|body: String| async move { body }))
        .layer(KeyedLockLayer::by_header("idempotency-key").wait_timeout(PATIENCE));
    if buffer_first {
        app.layer(
            BufferRequestBodyLayer::new()
                .limit(16)
                .read_timeout(Duration::from_secs(2)),
        )
    } else {
        app
    }
}

/// Sends the head of a POST whose body (of `len` bytes) the caller writes.
async fn open_post(addr: std::net::SocketAddr, len: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: t\r\nidempotency-key: k\r\ncontent-length: {len}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// The status of the response on `stream`.
async fn read_status(stream: &mut TcpStream) -> u16 {
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.unwrap();
    std::str::from_utf8(&head[9..12]).unwrap().parse().unwrap()
}

/// A client trickling its body (1 byte per 300 ms) and a second client with the same
/// key: whether the second one is answered before the trickler finished sending.
async fn prompt_client_answered_during_trickle(buffer_first: bool) -> bool {
    let app = serve(body_app(buffer_first), Arc::new(Probe::default())).await;
    let trickler = tokio::spawn(async move {
        let mut stream = open_post(app.addr, 4).await;
        for byte in b"slow" {
            tokio::time::sleep(Duration::from_millis(300)).await;
            stream.write_all(&[*byte]).await.unwrap();
        }
        let sent = Instant::now();
        assert_eq!(read_status(&mut stream).await, 200);
        sent
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut prompt = open_post(app.addr, 4).await;
    prompt.write_all(b"fast").await.unwrap();
    assert_eq!(read_status(&mut prompt).await, 200);
    let answered = Instant::now();
    answered < trickler.await.unwrap()
}

#[tokio::test]
async fn trickled_body_holds_the_key_without_buffering() {
    // Today's behaviour, which the buffer layer fixes: the handler reads the body
    // under the key, so the prompt client waits for the whole trickle.
    assert!(!prompt_client_answered_during_trickle(false).await);
}

#[tokio::test]
async fn trickled_body_is_read_before_the_key_is_taken() {
    assert!(prompt_client_answered_during_trickle(true).await);
}

#[tokio::test]
async fn body_over_the_limit_or_too_slow_is_refused() {
    let app = serve(body_app(true), Arc::new(Probe::default())).await;
    let long = app.post("/orders", "k", &"x".repeat(17)).await;
    assert_eq!(long.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(long.reason(), "body_too_large");
    assert_eq!(app.post("/orders", "k", "fits").await.body, "fits");

    // A body that stops coming gets 408 after the read timeout.
    let mut stalled = open_post(app.addr, 4).await;
    stalled.write_all(b"ab").await.unwrap();
    let status = tokio::time::timeout(PATIENCE, read_status(&mut stalled)).await;
    assert_eq!(status.unwrap(), 408);
}

/// A request body that comes in parts: each after its reader waited once.
struct InParts {
    parts: std::collections::VecDeque<Bytes>,
    waited: bool,
}

impl http_body::Body for InParts {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if !this.waited && !this.parts.is_empty() {
            this.waited = true;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        this.waited = false;
        std::task::Poll::Ready(
            this.parts
                .pop_front()
                .map(|part| Ok(http_body::Frame::data(part))),
        )
    }
}

/// Short bodies are kept beside their record and compared byte for byte, long ones
/// (over 4 KiB) compared by their digest: either way a retry with the same body is
/// replayed and one with another body of the same length refused, through both
/// stackings.
#[tokio::test]
async fn retries_with_short_and_long_bodies_are_told_apart() {
    for stacking in [Stacking::Replay, Stacking::ByHand] {
        let handler = service_fn(|_: Request<axum::body::Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from("done")))
        });
        let lock = KeyedLockLayer::by_header("idempotency-key");
        let replay = ReplayLayer::new(MemoryStore::default());
        let service = match stacking {
            Stacking::Replay => BoxCloneSyncService::new(lock.replay(replay).layer(handler)),
            Stacking::ByHand => BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(lock)
                    .layer(replay)
                    .service(handler),
            ),
        };
        for len in [64, 4 * 1024, 4 * 1024 + 1, 64 * 1024] {
            let send = |byte: u8| {
                let request = Request::post("/orders")
                    .header("idempotency-key", format!("{len}"))
                    .body(axum::body::Body::from(vec![byte; len]))
                    .unwrap();
                let service = service.clone();
                async move {
                    let response = service.oneshot(request).await.unwrap();
                    (
                        response.status(),
                        response.headers().contains_key("idempotent-replayed"),
                    )
                }
            };
            assert_eq!(
                send(b'a').await,
                (StatusCode::OK, false),
                "{stacking:?}, {len} bytes"
            );
            assert_eq!(
                send(b'a').await,
                (StatusCode::OK, true),
                "{stacking:?}, {len} bytes"
            );
            assert_eq!(
                send(b'b').await.0,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{stacking:?}, {len} bytes"
            );
        }
    }
}

/// A replay from memory reads what of the body is there at once and waits for the
/// rest: the first part, read when the service was called, is not lost (the retry in
/// parts replays the request sent whole, another second part is refused), and the
/// limit counts both.
#[tokio::test]
async fn a_replay_from_memory_reads_a_body_that_comes_in_parts() {
    let handler = service_fn(|request: Request<axum::body::Body>| async move {
        let body = http_body_util::BodyExt::collect(request.into_body()).await;
        let body = body.expect("the body is read").to_bytes();
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from(body)))
    });
    let replay = ReplayLayer::new(MemoryStore::default()).max_request_bytes(6);
    let service = KeyedLockLayer::by_header("idempotency-key")
        .replay(replay)
        .layer(handler);
    let send = |parts: &[&'static str]| {
        let body = InParts {
            parts: parts
                .iter()
                .map(|part| Bytes::from_static(part.as_bytes()))
                .collect(),
            // The first part is there when the service is called.
            waited: true,
        };
        let request = Request::post("/orders")
            .header("idempotency-key", "k")
            .body(axum::body::Body::new(body))
            .unwrap();
        let service = service.clone();
        async move {
            let response = service.oneshot(request).await.unwrap();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            let body = http_body_util::BodyExt::collect(response.into_body()).await;
            (status, replayed, body.unwrap().to_bytes())
        }
    };
    let first = send(&["abcd"]).await;
    assert_eq!(first, (StatusCode::OK, false, Bytes::from_static(b"abcd")));
    let retry = send(&["ab", "cd"]).await;
    assert_eq!(retry, (StatusCode::OK, true, Bytes::from_static(b"abcd")));
    let other = send(&["ab", "xy"]).await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
    let over = send(&["abcd", "efg"]).await;
    assert_eq!(over.0, StatusCode::PAYLOAD_TOO_LARGE, "{over:?}");
}

// ------------------------------------------------------------ cancellation

/// Drops a request after each number of polls in turn — so at every await of the
/// lock, the body read, the store and the handler — and checks after each: the key is
/// free again, and a retry is replayed exactly when the handler ran to its end.
#[tokio::test]
async fn cancelled_at_every_await_leaves_the_key_free_and_stores_only_completed() {
    cancelled_at_every_await_when(Stacking::Replay).await;
    cancelled_at_every_await_when(Stacking::ByHand).await;
}

async fn cancelled_at_every_await_when(stacking: Stacking) {
    let completed = Arc::new(AtomicUsize::new(0));
    let handler = {
        let completed = Arc::clone(&completed);
        service_fn(move |_: Request<axum::body::Body>| {
            let completed = Arc::clone(&completed);
            async move {
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                let call = completed.fetch_add(1, SeqCst) + 1;
                Ok::<_, std::convert::Infallible>(http::Response::new(format!("call {call}")))
            }
        })
    };
    let lock = KeyedLockLayer::by_header("idempotency-key").name("replay-cancel");
    let replay = ReplayLayer::new(MemoryStore::default());
    let service = match stacking {
        Stacking::Replay => BoxCloneSyncService::new(lock.clone().replay(replay).layer(handler)),
        Stacking::ByHand => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(lock.clone())
                .layer(replay)
                .service(handler),
        ),
    };
    let request = |key: &str| {
        Request::post("/orders")
            .header("idempotency-key", key)
            .body(axum::body::Body::from(Bytes::from_static(b"body")))
            .unwrap()
    };

    let mut finished_at = None;
    for polls in 0..50 {
        let key = format!("key-{polls}");
        let before = completed.load(SeqCst);
        let mut call = Box::pin(service.clone().oneshot(request(&key)));
        let mut cx = Context::from_waker(Waker::noop());
        let mut done = false;
        for _ in 0..=polls {
            if call.as_mut().poll(&mut cx).is_ready() {
                done = true;
                break;
            }
            // Lets spawned work (a store write) run between polls.
            tokio::task::yield_now().await;
        }
        drop(call);
        // Let a detached store write finish.
        tokio::task::yield_now().await;
        let ran_to_end = completed.load(SeqCst) > before;
        assert_eq!(
            lock.active_keys(),
            0,
            "key held after a drop at poll {polls}"
        );
        let retry = tokio::time::timeout(PATIENCE, service.clone().oneshot(request(&key)))
            .await
            .expect("the key is free")
            .unwrap();
        let replayed = retry.headers().contains_key("idempotent-replayed");
        assert_eq!(replayed, ran_to_end, "drop at poll {polls}");
        if done {
            finished_at = Some(polls);
            break;
        }
    }
    // The handler alone takes four polls (it yields three times); the memory store
    // writes without an await of its own.
    assert!(
        finished_at.is_some_and(|polls| polls >= 3),
        "{finished_at:?}"
    );
}

/// `lock.replay(..)` keeps `lock`'s table: a request through it and one through `lock`
/// on another route, with the same key, exclude each other.
#[tokio::test]
async fn replay_keeps_the_lock_layer_table() {
    let lock = KeyedLockLayer::by_header("idempotency-key").wait_timeout(Duration::ZERO);
    let probe = Arc::new(Probe::default());
    let plain = {
        let probe = Arc::clone(&probe);
        move || async move {
            probe.started.fetch_add(1, SeqCst);
            probe.gate.acquire().await.unwrap().forget();
            "plain"
        }
    };
    let app = Router::new()
        .route("/plain", post(plain))
        .layer(lock.clone())
        .merge(
            Router::new()
                .route("/orders", post(|| async { "ran" }))
                .layer(lock.replay(ReplayLayer::new(MemoryStore::default()))),
        );
    let app = Arc::new(serve(app, Arc::clone(&probe)).await);
    let held = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.post("/plain", "k", "").await }
    });
    let started = Instant::now();
    while probe.started() < 1 {
        assert!(
            started.elapsed() < PATIENCE,
            "the plain request never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy = app.post("/orders", "k", "").await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    probe.gate.add_permits(1);
    assert_eq!(held.await.unwrap().body, "plain");
    assert_eq!(app.post("/orders", "k", "").await.body, "ran");
}
