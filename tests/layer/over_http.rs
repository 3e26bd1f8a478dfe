//! The layer through a real hyper server on 127.0.0.1.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, Path};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use tokio::sync::Notify;
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

use crate::support::{eventually, serve, Overlap};

/// A handler that checks how many handlers of its key run at once.
fn overlap_router(overlap: Arc<Overlap>, hold: Duration) -> Router {
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

async fn fire(server: &crate::support::Server, paths: Vec<String>) -> Vec<StatusCode> {
    let server = Arc::new(server);
    let requests = paths.iter().map(|path| server.post(path));
    crate::support::join_all(requests)
        .await
        .into_iter()
        .map(|a| a.status)
        .collect()
}

#[tokio::test]
async fn same_key_runs_one_at_a_time() {
    let overlap = Arc::new(Overlap::default());
    let layer = KeyedLockLayer::by_path("order_id");
    let server =
        serve(overlap_router(overlap.clone(), Duration::from_millis(10)).layer(layer.clone()))
            .await;

    let statuses = fire(&server, vec!["/orders/1".to_owned(); 20]).await;

    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert_eq!(overlap.max(), 1, "two handlers of one key overlapped");
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn different_keys_run_in_parallel() {
    let overlap = Arc::new(Overlap::default());
    let layer = KeyedLockLayer::by_path("order_id");
    let server =
        serve(overlap_router(overlap.clone(), Duration::from_millis(200)).layer(layer.clone()))
            .await;

    let paths = (0..8).map(|i| format!("/orders/{i}")).collect();
    let statuses = fire(&server, paths).await;

    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert!(overlap.max() > 1, "different keys never overlapped");
}

#[tokio::test]
async fn without_the_layer_the_same_handlers_overlap() {
    // The control for the test above: the overlap check can fail.
    let overlap = Arc::new(Overlap::default());
    let server = serve(overlap_router(overlap.clone(), Duration::from_millis(50))).await;
    fire(&server, vec!["/orders/1".to_owned(); 8]).await;
    assert!(overlap.max() > 1);
}

/// A handler that holds its key until told to finish.
fn gated_router(started: Arc<Notify>, finish: Arc<Notify>) -> Router {
    Router::new().route(
        "/orders/{order_id}",
        post(move || {
            let (started, finish) = (started.clone(), finish.clone());
            async move {
                started.notify_one();
                finish.notified().await;
            }
        }),
    )
}

/// Starts a request that holds `path` until `finish` is notified.
async fn hold_key(
    server: &Arc<crate::support::Server>,
    started: &Notify,
    path: &'static str,
) -> tokio::task::JoinHandle<crate::support::Answer> {
    let holder = tokio::spawn({
        let server = server.clone();
        async move { server.post(path).await }
    });
    started.notified().await;
    holder
}

#[tokio::test]
async fn wait_timeout_answers_409_with_problem_json() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::from_millis(50));
    let server =
        Arc::new(serve(gated_router(started.clone(), finish.clone()).layer(layer.clone())).await);
    let holder = hold_key(&server, &started, "/orders/7").await;

    let answer = server.post("/orders/7").await;
    assert_eq!(answer.status, StatusCode::CONFLICT);
    assert_eq!(answer.headers["content-type"], "application/problem+json");
    assert_eq!(answer.headers["retry-after"], "1");
    assert!(
        answer.body.contains(r#""reason":"timeout""#),
        "{}",
        answer.body
    );
    assert!(!answer.body.contains("/orders"), "{}", answer.body);

    finish.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn zero_wait_and_429_when_configured() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id")
        .wait_timeout(Duration::ZERO)
        .timeout_status(StatusCode::TOO_MANY_REQUESTS);
    let server = Arc::new(serve(gated_router(started.clone(), finish.clone()).layer(layer)).await);
    let holder = hold_key(&server, &started, "/orders/7").await;

    let answer = server.post("/orders/7").await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(answer.headers.contains_key("retry-after"));
    finish.notify_one();
    holder.await.unwrap();
}

#[tokio::test]
async fn queue_full_answers_429_at_once() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id")
        .max_waiters(1)
        .wait_timeout(Duration::from_secs(30));
    let server =
        Arc::new(serve(gated_router(started.clone(), finish.clone()).layer(layer.clone())).await);
    let holder = hold_key(&server, &started, "/orders/7").await;
    let waiter = tokio::spawn({
        let server = server.clone();
        async move { server.post("/orders/7").await }
    });
    eventually("the waiter queues", || layer.active_keys() == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let answer = server.post("/orders/7").await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        answer.body.contains(r#""reason":"queue_full""#),
        "{}",
        answer.body
    );

    finish.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    started.notified().await; // the waiter's handler started
    finish.notify_one();
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn max_keys_answers_503_for_new_keys_only() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id")
        .max_keys(1)
        .wait_timeout(Duration::ZERO);
    let server = Arc::new(serve(gated_router(started.clone(), finish.clone()).layer(layer)).await);
    let holder = hold_key(&server, &started, "/orders/1").await;

    let answer = server.post("/orders/2").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(answer.headers.contains_key("retry-after"));
    assert!(
        answer.body.contains(r#""reason":"too_many_keys""#),
        "{}",
        answer.body
    );
    // The known key still gets the ordinary busy answer.
    assert_eq!(server.post("/orders/1").await.status, StatusCode::CONFLICT);

    finish.notify_one();
    holder.await.unwrap();
}

fn echo_key_router() -> Router {
    Router::new().route(
        "/webhook",
        post(|info: Option<Extension<LockInfo>>| async move {
            info.map_or_else(
                || "unlocked".to_owned(),
                |Extension(info)| info.key().to_owned(),
            )
        }),
    )
}

#[tokio::test]
async fn missing_and_invalid_keys_answer_400() {
    let layer = KeyedLockLayer::by_header("idempotency-key").max_key_len(8);
    let server = serve(echo_key_router().layer(layer.clone())).await;
    let with_key = |value: &[u8]| {
        Request::post("/webhook")
            .header(
                "idempotency-key",
                http::HeaderValue::from_bytes(value).unwrap(),
            )
            .body(())
            .unwrap()
    };

    let missing = server.post("/webhook").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(
        missing.body.contains(r#""reason":"missing_key""#),
        "{}",
        missing.body
    );
    assert!(!missing.headers.contains_key("retry-after"));

    for bad in [&b""[..], b"123456789", b"caf\xc3\xa9", b"a\tb"] {
        let answer = server.send(with_key(bad)).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(answer.headers["content-type"], "application/problem+json");
        assert!(
            answer.body.contains(r#""reason":"invalid_key""#),
            "{}",
            answer.body
        );
    }
    let good = server.send(with_key(b"12345678")).await;
    assert_eq!(
        (good.status, good.body.as_str()),
        (StatusCode::OK, "12345678")
    );
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn control_characters_in_a_path_key_answer_400() {
    let server = serve(
        Router::new()
            .route("/orders/{order_id}", post(|| async {}))
            .layer(KeyedLockLayer::by_path("order_id")),
    )
    .await;
    assert_eq!(
        server.post("/orders/a%0Ab").await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        server.post("/orders/%FF").await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        server.post("/orders/caf%C3%A9").await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn allow_missing_key_passes_through_unlocked() {
    let layer = KeyedLockLayer::by_header("idempotency-key").allow_missing_key();
    let server = serve(echo_key_router().layer(layer)).await;
    let answer = server.post("/webhook").await;
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (StatusCode::OK, "unlocked")
    );
    // An unusable key is still refused.
    let empty = Request::post("/webhook")
        .header("idempotency-key", "")
        .body(())
        .unwrap();
    assert_eq!(server.send(empty).await.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn lock_info_reaches_the_handler() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let reached = Arc::new(AtomicUsize::new(0));
    let layer = KeyedLockLayer::by_path("order_id").name(format!("{}-orders", "acme"));
    let app = Router::new()
        .route(
            "/orders/{order_id}/info",
            post(
                |Path(id): Path<String>, Extension(info): Extension<LockInfo>| async move {
                    assert_eq!(info.key(), id);
                    assert_eq!(info.layer(), "acme-orders");
                    assert_eq!(info.fencing_token(), None);
                    assert!(info.lease().is_none() && !info.is_lease_lost());
                    info.waited().as_millis().to_string()
                },
            ),
        )
        .merge(gated_router(started.clone(), finish.clone()))
        .layer(layer)
        // Outside the lock: counts the requests that reached it (on a loaded machine a
        // request spawned can take tens of milliseconds to get there).
        .layer(axum::middleware::map_request({
            let reached = reached.clone();
            move |request: Request<axum::body::Body>| {
                if request.uri().path().ends_with("/info") {
                    reached.fetch_add(1, SeqCst);
                }
                async move { request }
            }
        }));
    let server = Arc::new(serve(app).await);

    assert_eq!(server.post("/orders/9/info").await.body, "0");
    let holder = hold_key(&server, &started, "/orders/9").await;
    let waiter = tokio::spawn({
        let server = server.clone();
        async move { server.post("/orders/9/info").await }
    });
    eventually("the waiter reaches the lock", || reached.load(SeqCst) == 2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    finish.notify_one();
    holder.await.unwrap();
    let waited: u64 = waiter.await.unwrap().body.parse().unwrap();
    assert!(waited >= 90, "waited {waited} ms");
}

#[tokio::test]
async fn one_table_is_shared_by_every_route_and_route_layer_works() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::ZERO);
    let app = Router::new()
        .route("/orders/{order_id}/refund", post(|| async {}))
        .merge(gated_router(started.clone(), finish.clone()))
        .route_layer(layer.clone());
    let server = Arc::new(serve(app).await);
    let holder = hold_key(&server, &started, "/orders/3").await;

    assert_eq!(layer.active_keys(), 1);
    assert_eq!(
        server.post("/orders/3/refund").await.status,
        StatusCode::CONFLICT
    );
    assert_eq!(server.post("/orders/4/refund").await.status, StatusCode::OK);
    finish.notify_one();
    holder.await.unwrap();
    assert_eq!(server.post("/orders/3/refund").await.status, StatusCode::OK);
}

#[tokio::test]
async fn client_disconnect_while_holding_releases_the_key() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::ZERO);
    let server = Arc::new(serve(gated_router(started.clone(), finish).layer(layer.clone())).await);

    let connection = server.send_raw("/orders/5").await;
    started.notified().await;
    assert_eq!(layer.active_keys(), 1);
    drop(connection);

    eventually("the dropped request releases its key", || {
        layer.active_keys() == 0
    })
    .await;
    // The gate is never opened, so the next handler starts but does not finish: what
    // matters is that it is admitted (not a 409) because the key is free.
    let admitted = tokio::spawn(async move { server.post("/orders/5").await });
    started.notified().await;
    admitted.abort();
}

#[tokio::test]
async fn client_disconnect_while_waiting_leaves_nothing_behind() {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id").max_waiters(1);
    let server =
        Arc::new(serve(gated_router(started.clone(), finish.clone()).layer(layer.clone())).await);
    let holder = hold_key(&server, &started, "/orders/5").await;

    let waiting = server.send_raw("/orders/5").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(waiting);
    tokio::time::sleep(Duration::from_millis(50)).await;
    finish.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    eventually("the table empties", || layer.active_keys() == 0).await;

    // The queue place of the dropped waiter is free again (max_waiters is 1).
    let holder = hold_key(&server, &started, "/orders/5").await;
    let waiter = tokio::spawn({
        let server = server.clone();
        async move { server.post("/orders/5").await }
    });
    finish.notify_one();
    holder.await.unwrap();
    started.notified().await;
    finish.notify_one();
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn a_panicking_handler_releases_its_key() {
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::ZERO);
    let app = Router::new()
        .route(
            "/orders/{order_id}",
            post(|Path(id): Path<String>| async move {
                if id == "boom" {
                    panic!("handler failed");
                }
            }),
        )
        .layer(layer.clone())
        .layer(tower_http::catch_panic::CatchPanicLayer::new());
    let server = serve(app).await;

    assert_eq!(
        server.post("/orders/boom").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(layer.active_keys(), 0);
    assert_eq!(
        server.post("/orders/boom").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
}

#[tokio::test]
async fn on_rejection_replaces_the_response() {
    use axum::response::IntoResponse;
    let layer = KeyedLockLayer::by_header("idempotency-key").on_rejection(|rejection| {
        let message = format!("custom {}", rejection.kind().as_str());
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            [("x-custom", "1")],
            message,
        )
            .into_response()
    });
    let server = serve(echo_key_router().layer(layer)).await;
    let answer = server.post("/webhook").await;
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, "custom missing_key")
    );
    assert_eq!(answer.headers["x-custom"], "1");
}

/// A body that is not ready at once, then yields `frames`, or fails after the first.
struct HandlerBody {
    frames: Vec<&'static str>,
    polled: bool,
    fail: bool,
}

impl http_body::Body for HandlerBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        use std::task::Poll;
        if !std::mem::replace(&mut self.polled, true) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if self.frames.is_empty() {
            return Poll::Ready(None);
        }
        let frame = self.frames.remove(0);
        if self.fail && frame != "first " {
            return Poll::Ready(Some(Err(std::io::Error::other("the body broke"))));
        }
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
            frame.as_bytes(),
        )))))
    }
}

#[tokio::test]
async fn on_rejection_bodies_that_stream_are_read_whole() {
    let layer = KeyedLockLayer::by_header("idempotency-key").on_rejection(|rejection| {
        let body = HandlerBody {
            frames: vec!["first ", "second"],
            polled: false,
            fail: false,
        };
        http::Response::builder()
            .status(rejection.status())
            .body(body)
            .unwrap()
    });
    let server = serve(echo_key_router().layer(layer)).await;
    let answer = server.post("/webhook").await;
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (StatusCode::BAD_REQUEST, "first second")
    );
}

#[tokio::test]
async fn an_on_rejection_body_that_fails_gets_the_default_rejection() {
    let layer = KeyedLockLayer::by_header("idempotency-key").on_rejection(|_| {
        let body = HandlerBody {
            frames: vec!["first ", "second"],
            polled: false,
            fail: true,
        };
        http::Response::builder()
            .status(StatusCode::IM_A_TEAPOT)
            .body(body)
            .unwrap()
    });
    let server = serve(echo_key_router().layer(layer)).await;
    let answer = server.post("/webhook").await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.headers["content-type"], "application/problem+json");
    assert!(
        answer.body.contains(r#""reason":"missing_key""#),
        "{}",
        answer.body
    );
}

#[tokio::test]
async fn by_extension_and_by_fn_key_requests() {
    #[derive(Clone)]
    struct UserId(u64);
    impl std::fmt::Display for UserId {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "user-{}", self.0)
        }
    }
    let by_user = echo_key_router()
        .layer(KeyedLockLayer::by_extension::<UserId>())
        .layer(axum::middleware::from_fn(
            |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
                request.extensions_mut().insert(UserId(42));
                next.run(request).await
            },
        ));
    assert_eq!(serve(by_user).await.post("/webhook").await.body, "user-42");

    let by_query = echo_key_router().layer(KeyedLockLayer::by_fn(|parts| {
        parts.uri.query().map(str::to_owned)
    }));
    let server = serve(by_query).await;
    assert_eq!(server.post("/webhook?tenant-7").await.body, "tenant-7");
    assert_eq!(
        server.post("/webhook").await.status,
        StatusCode::BAD_REQUEST
    );
}

/// A body that sends `chunks` chunks, one every `every`.
struct SlowBody {
    chunks: usize,
    every: Duration,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for SlowBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.chunks == 0 {
            return std::task::Poll::Ready(None);
        }
        let every = self.every;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(every)));
        std::task::ready!(sleep.as_mut().poll(cx));
        self.sleep = None;
        self.chunks -= 1;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
            b"chunk\n",
        )))))
    }
}

async fn streaming_status_of_second_request(
    layer: KeyedLockLayer<tower_keyed_lock::PathParam>,
) -> StatusCode {
    let app = Router::new()
        .route(
            "/orders/{order_id}",
            post(|| async {
                axum::body::Body::new(SlowBody {
                    chunks: 4,
                    every: Duration::from_millis(50),
                    sleep: None,
                })
            }),
        )
        .layer(layer.wait_timeout(Duration::ZERO));
    let server = Arc::new(serve(app).await);
    let streaming = tokio::spawn({
        let server = server.clone();
        async move { server.post("/orders/1").await }
    });
    // The handler has returned long before the 200 ms body is done.
    tokio::time::sleep(Duration::from_millis(60)).await;
    let second = server.post("/orders/1").await.status;
    assert_eq!(streaming.await.unwrap().body, "chunk\n".repeat(4));
    second
}

#[tokio::test]
async fn hold_until_body_end_holds_across_a_streaming_body() {
    let held = streaming_status_of_second_request(
        KeyedLockLayer::by_path("order_id").hold_until_body_end(true),
    )
    .await;
    assert_eq!(held, StatusCode::CONFLICT);
    let released = streaming_status_of_second_request(KeyedLockLayer::by_path("order_id")).await;
    assert_eq!(released, StatusCode::OK);
}
