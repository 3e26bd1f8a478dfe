//! Where the layer meets axum's router and the application's own setup: unrouted
//! requests, server misconfiguration, repeated key headers and a layer applied twice.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Extension;
use axum::routing::{get, post};
use axum::Router;
use http::{Request, StatusCode};
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

use crate::support::logs::Captured;
use crate::support::recorder::{self, counter};
use crate::support::serve;

#[tokio::test]
async fn an_unrouted_request_reaches_the_fallback_untouched() {
    recorder::install();
    for (label, route_layer) in [("layer", false), ("route_layer", true)] {
        let name = if route_layer {
            "fallback-rl"
        } else {
            "fallback-l"
        };
        let layer = KeyedLockLayer::by_path("order_id").name(name);
        let routes = Router::new().route("/orders/{order_id}", post(|| async {}));
        let app = match route_layer {
            true => routes.route_layer(layer),
            false => routes.layer(layer),
        };
        let server = serve(app).await;
        assert_eq!(
            server.post("/no/such/path").await.status,
            StatusCode::NOT_FOUND,
            "{label}"
        );
        let rejected = counter(
            "keyed_lock_rejected_total",
            name,
            &[("reason", "missing_key")],
        );
        assert_eq!(rejected, 0, "{label}: a 404 counted as a rejection");
    }

    // A custom fallback answers, not the layer.
    let app = Router::new()
        .route("/orders/{order_id}", post(|| async {}))
        .fallback(|| async { (StatusCode::IM_A_TEAPOT, "custom fallback") })
        .layer(KeyedLockLayer::by_header("idempotency-key"));
    let answer = serve(app).await.post("/elsewhere").await;
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (StatusCode::IM_A_TEAPOT, "custom fallback")
    );
}

#[tokio::test]
async fn a_route_without_the_path_parameter_is_a_server_error_logged_once() {
    recorder::install();
    let captured = Captured::default();
    let _logs = captured.install();
    let app = Router::new()
        .route("/orders/{order_id}", post(|| async {}))
        .route("/health", get(|| async { "ok" }))
        .layer(KeyedLockLayer::by_path("order_id").name("misrouted"));
    let server = serve(app).await;

    for _ in 0..3 {
        let answer = server.send(Request::get("/health").body(()).unwrap()).await;
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(answer.headers["content-type"], "application/problem+json");
        assert!(
            answer.body.contains(r#""reason":"misconfigured""#),
            "{}",
            answer.body
        );
        assert!(!answer.body.contains("order_id"), "{}", answer.body);
    }
    let logs = captured.text();
    let errors: Vec<_> = logs.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "{logs}");
    assert!(
        errors[0].contains("order_id") && errors[0].contains("misrouted"),
        "{logs}"
    );
    assert_eq!(
        counter(
            "keyed_lock_rejected_total",
            "misrouted",
            &[("reason", "misconfigured")]
        ),
        3
    );
}

#[derive(Clone)]
struct UserId(u64);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "user-{}", self.0)
    }
}

#[tokio::test]
async fn a_missing_auth_extension_is_a_server_error_naming_the_type() {
    let captured = Captured::default();
    let _logs = captured.install();
    let app = Router::new()
        .route("/me", post(|| async {}))
        .layer(KeyedLockLayer::by_extension::<UserId>().name("no-auth"));
    let answer = serve(app).await.post("/me").await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    let logs = captured.text();
    assert!(logs.contains("ERROR") && logs.contains("UserId"), "{logs}");
}

#[tokio::test]
async fn a_missing_client_header_is_still_a_client_error() {
    let app = Router::new()
        .route("/webhook", post(|| async {}))
        .layer(KeyedLockLayer::by_header("idempotency-key"));
    let answer = serve(app).await.post("/webhook").await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(answer.body.contains(r#""reason":"missing_key""#));
}

#[tokio::test]
async fn a_repeated_key_header_is_refused() {
    let app = Router::new()
        .route(
            "/webhook",
            post(|Extension(info): Extension<LockInfo>| async move { info.key().to_owned() }),
        )
        .layer(KeyedLockLayer::by_header("idempotency-key"));
    let server = serve(app).await;
    let twice = Request::post("/webhook")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(())
        .unwrap();
    let answer = server.send(twice).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(
        answer.body.contains(r#""reason":"invalid_key""#),
        "{}",
        answer.body
    );
    let once = Request::post("/webhook")
        .header("idempotency-key", "a")
        .body(())
        .unwrap();
    assert_eq!(server.send(once).await.body, "a");
}

#[tokio::test]
async fn the_same_layer_twice_on_one_path_does_not_wait_for_itself() {
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::from_millis(500));
    let inner = Router::new()
        .route(
            "/{order_id}/pay",
            post(|Extension(info): Extension<LockInfo>| async move { info.key().to_owned() }),
        )
        .layer(layer.clone());
    let app = Router::new().nest("/orders", inner).layer(layer.clone());
    let server = serve(app).await;
    let started = std::time::Instant::now();
    let answer = server.post("/orders/7/pay").await;
    assert_eq!((answer.status, answer.body.as_str()), (StatusCode::OK, "7"));
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "waited for itself"
    );
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn two_layers_nested_keep_both_locks() {
    // A different layer in between: the innermost still sees the outer key as held.
    let orders = KeyedLockLayer::by_path("order_id").name("outer-orders");
    let users = KeyedLockLayer::by_header("x-user").name("users");
    let (started, finish) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let gate = {
        let (started, finish) = (started.clone(), finish.clone());
        move || {
            let (started, finish) = (started.clone(), finish.clone());
            async move {
                started.notify_one();
                finish.notified().await;
            }
        }
    };
    let app = Router::new()
        .route("/orders/{order_id}", post(gate))
        .layer(orders.clone())
        .layer(users.clone())
        .layer(orders.clone());
    let server = Arc::new(serve(app).await);
    let request = || {
        Request::post("/orders/1")
            .header("x-user", "u1")
            .body(())
            .unwrap()
    };
    let holder = tokio::spawn({
        let server = server.clone();
        async move { server.send(request()).await }
    });
    tokio::time::timeout(Duration::from_secs(2), started.notified())
        .await
        .expect("the request waited for itself through another layer");
    assert_eq!((orders.active_keys(), users.active_keys()), (1, 1));
    finish.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
}
