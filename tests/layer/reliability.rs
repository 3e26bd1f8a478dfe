//! Faults and bad input through the layer: handlers that never finish, bodies dropped
//! half-way, fuzzed keys, key flooding and hot-key floods.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use tower::ServiceExt;
use tower_keyed_lock::KeyedLockLayer;

use crate::support::{eventually, serve};

#[tokio::test]
async fn a_handler_that_never_finishes_is_released_by_an_outer_timeout() {
    let layer = KeyedLockLayer::by_path("id").wait_timeout(Duration::ZERO);
    let timeout = tower_http::timeout::TimeoutLayer::with_status_code(
        StatusCode::REQUEST_TIMEOUT,
        Duration::from_millis(100),
    );
    let app = Router::new()
        .route("/jobs/{id}", post(std::future::pending::<()>))
        .layer(layer.clone())
        .layer(timeout);
    let server = serve(app).await;

    assert_eq!(
        server.post("/jobs/1").await.status,
        StatusCode::REQUEST_TIMEOUT
    );
    assert_eq!(layer.active_keys(), 0);
    // Free again: a second attempt times out too instead of getting 409.
    assert_eq!(
        server.post("/jobs/1").await.status,
        StatusCode::REQUEST_TIMEOUT
    );
}

#[tokio::test]
async fn a_response_body_dropped_half_way_releases_the_key() {
    let layer = KeyedLockLayer::by_path("id")
        .hold_until_body_end(true)
        .wait_timeout(Duration::ZERO);
    // A body that sends one chunk and then never ends.
    let app = Router::new()
        .route(
            "/exports/{id}",
            post(|| async {
                let first = once_then_open(Bytes::from_static(b"first chunk\n"));
                Body::new(first)
            }),
        )
        .layer(layer.clone());
    let server = serve(app).await;

    let mut connection = server.send_raw("/exports/1").await;
    let mut buffer = [0u8; 1024];
    let read = tokio::io::AsyncReadExt::read(&mut connection, &mut buffer)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&buffer[..read]).contains("first chunk"));
    assert_eq!(
        layer.active_keys(),
        1,
        "the key is held while the body streams"
    );
    drop(connection);

    eventually("the dropped body releases its key", || {
        layer.active_keys() == 0
    })
    .await;
}

/// A body that yields one data frame, then stays open forever.
fn once_then_open(
    chunk: Bytes,
) -> impl http_body::Body<Data = Bytes, Error = std::convert::Infallible> {
    struct OnceThenPending(Option<Bytes>);
    impl http_body::Body for OnceThenPending {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            match self.0.take() {
                Some(chunk) => std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk)))),
                None => std::task::Poll::Pending,
            }
        }
    }
    OnceThenPending(Some(chunk))
}

/// Collects every log line the layer writes, at every level.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Sends one request with `header` as the key and checks the answer.
async fn check_header_key(app: Router, raw: &[u8]) {
    let Ok(value) = http::HeaderValue::from_bytes(raw) else {
        return; // hyper would refuse it before any layer runs
    };
    let request = Request::post("/webhook")
        .header("idempotency-key", value)
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.expect("the layer never errs");
    let status = response.status();
    let content_type = response.headers().get("content-type").cloned();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).expect("bodies are UTF-8");

    let valid = std::str::from_utf8(raw).ok().filter(|s| {
        !s.is_empty() && s.len() <= 32 && !s.chars().any(char::is_control) && s.is_ascii()
    });
    match valid {
        Some(key) => {
            assert_eq!(status, StatusCode::OK, "{raw:?}");
            assert_eq!(text, key);
        }
        None => {
            assert_eq!(status, StatusCode::BAD_REQUEST, "{raw:?}");
            assert_eq!(content_type.unwrap(), "application/problem+json");
            assert!(
                text.contains(r#""reason":"invalid_key""#)
                    || text.contains(r#""reason":"missing_key""#)
            );
            // Nothing of the key comes back.
            let lossy = String::from_utf8_lossy(raw);
            if lossy.trim().len() >= 6 {
                assert!(!text.contains(lossy.trim()), "key echoed: {text}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Arbitrary header bytes and lengths: never a panic; a usable key is served, any
    /// other gets 400 problem+json that echoes none of it; no log line carries it.
    #[test]
    fn fuzzed_header_keys_are_served_or_refused_cleanly(raw in prop::collection::vec(any::<u8>(), 0..64)) {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let app = Router::new()
            .route("/webhook", post(|headers: http::HeaderMap| async move {
                headers["idempotency-key"].to_str().unwrap().to_owned()
            }))
            .layer(KeyedLockLayer::by_header("idempotency-key").max_key_len(32));
        runtime().block_on(check_header_key(app, &raw));
        let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        prop_assert!(!logs.chars().any(|c| c.is_control() && c != '\n'), "control character logged: {logs:?}");
        let lossy = String::from_utf8_lossy(&raw);
        if lossy.trim().len() >= 6 {
            prop_assert!(!logs.contains(lossy.trim()), "key logged: {logs}");
        }
    }

    /// Arbitrary bytes as a percent-encoded path parameter: never a panic; 200 for a
    /// usable key, 400 problem+json otherwise.
    #[test]
    fn fuzzed_path_keys_are_served_or_refused_cleanly(raw in prop::collection::vec(any::<u8>(), 1..300)) {
        let encoded: String = raw.iter().map(|b| format!("%{b:02X}")).collect();
        let app = Router::new()
            .route("/orders/{id}", post(|| async {}))
            .layer(KeyedLockLayer::by_path("id"));
        let request = Request::post(format!("/orders/{encoded}")).body(Body::empty()).unwrap();
        let response = runtime().block_on(app.oneshot(request)).expect("the layer never errs");
        let usable = std::str::from_utf8(&raw)
            .is_ok_and(|s| s.len() <= 256 && !s.chars().any(char::is_control));
        let expected = if usable { StatusCode::OK } else { StatusCode::BAD_REQUEST };
        prop_assert_eq!(response.status(), expected, "{:?}", raw);
        if !usable {
            prop_assert_eq!(response.headers()["content-type"].to_str().unwrap(), "application/problem+json");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_flooding_is_bounded_and_real_keys_are_still_served() {
    const MAX_KEYS: usize = 200;
    let layer = KeyedLockLayer::by_path("id")
        .max_keys(MAX_KEYS)
        .wait_timeout(Duration::from_millis(50));
    let peak = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/orders/{id}",
            post(|| async { tokio::time::sleep(Duration::from_millis(5)).await }),
        )
        .layer(layer.clone());
    let server = Arc::new(serve(app).await);

    // An attacker invents a new key for every request, 64 at a time.
    let flood = (0..64).map(|client| {
        let (server, layer, peak) = (server.clone(), layer.clone(), peak.clone());
        tokio::spawn(async move {
            let mut unavailable = 0;
            for n in 0..100 {
                let status = server
                    .post(&format!("/orders/flood-{client}-{n}"))
                    .await
                    .status;
                peak.fetch_max(layer.active_keys(), Ordering::SeqCst);
                match status {
                    StatusCode::OK => {}
                    StatusCode::SERVICE_UNAVAILABLE => unavailable += 1,
                    other => panic!("flood request got {other}"),
                }
            }
            unavailable
        })
    });
    let flood: Vec<_> = flood.collect();

    // Meanwhile a legitimate client keeps paying its own orders.
    let mut served = 0;
    for n in 0..50 {
        if server.post(&format!("/orders/real-{}", n % 5)).await.status == StatusCode::OK {
            served += 1;
        }
    }
    let mut unavailable = 0;
    for client in flood {
        unavailable += client.await.unwrap();
    }

    assert!(
        peak.load(Ordering::SeqCst) <= MAX_KEYS,
        "table grew past max_keys"
    );
    assert!(
        served > 0,
        "no legitimate request was served during the flood"
    );
    eventually("the table empties", || layer.active_keys() == 0).await;
    println!("flood: {unavailable} of 6400 got 503; legitimate: {served}/50 served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_flood_beyond_max_waiters_is_refused_at_once() {
    const WAITERS: usize = 8;
    let layer = KeyedLockLayer::by_path("id")
        .max_waiters(WAITERS)
        .wait_timeout(Duration::from_secs(10));
    let running = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/orders/{id}",
            post({
                let running = running.clone();
                move || {
                    let running = running.clone();
                    async move {
                        running.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }),
        )
        .layer(layer.clone());

    let requests = (0..500).map(|_| {
        let app = app.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let response = app
                .oneshot(Request::post("/orders/hot").body(Body::empty()).unwrap())
                .await
                .unwrap();
            (response.status(), started.elapsed())
        })
    });
    let requests: Vec<_> = requests.collect();
    let mut refused = Vec::new();
    let mut served = 0;
    for request in requests {
        match request.await.unwrap() {
            (StatusCode::OK, _) => served += 1,
            (StatusCode::TOO_MANY_REQUESTS, took) => refused.push(took),
            (other, _) => panic!("{other}"),
        }
    }
    // One holder plus at most WAITERS in the queue at any time; everyone else is
    // refused without waiting for the holder.
    assert!(served > WAITERS, "served {served}");
    assert_eq!(served + refused.len(), 500);
    assert_eq!(running.load(Ordering::SeqCst), served);
    refused.sort();
    assert!(
        refused[refused.len() / 2] < Duration::from_millis(20),
        "median refusal took {:?}",
        refused[refused.len() / 2]
    );
    assert_eq!(layer.active_keys(), 0);
}
