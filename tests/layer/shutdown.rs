//! A layer's shutdown handle and health check, in process: readiness turns 503 as soon
//! as the shutdown begins (while holders still drain), and a handle can never be left
//! on a table no route uses — a setting changed after a handle was taken is refused.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_keyed_lock::{KeyedLockLayer, PathParam};

use crate::support::fixtures::{within, PATIENCE};

/// An app whose handler announces that it holds its key, then holds it until `gate`
/// gives it a permit.
fn gated(
    layer: KeyedLockLayer<PathParam>,
    gate: &Arc<Semaphore>,
    entered: &Arc<Semaphore>,
) -> Router {
    let (gate, entered) = (Arc::clone(gate), Arc::clone(entered));
    let handler = move || async move {
        entered.add_permits(1);
        gate.acquire().await.unwrap().forget();
        "paid"
    };
    Router::new()
        .route("/orders/{order_id}/pay", post(handler))
        .layer(layer)
}

/// Sends a POST to `path`: the status and the body.
async fn send(app: Router, path: &str) -> (StatusCode, String) {
    let request = Request::post(path).body(Body::empty()).unwrap();
    let response = app.oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// The status and body the health route would answer.
async fn readiness(health: &tower_keyed_lock::HealthCheck) -> (StatusCode, String) {
    let response = health.check().await.into_response();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// The panic's message.
fn message(panic: Box<dyn std::any::Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(message) => *message,
        Err(panic) => panic
            .downcast_ref::<&str>()
            .copied()
            .unwrap_or("?")
            .to_owned(),
    }
}

/// The health check and the shutdown handle taken before the layer is applied; a
/// request holds its key when the shutdown begins (a deadline longer than the test
/// waits): the layer answers 503 `shutting_down` to a new request, and so does the
/// readiness route, while the holder still runs. The drain then ends with the holder.
#[tokio::test]
async fn readiness_turns_503_as_the_shutdown_begins() {
    let layer = KeyedLockLayer::by_path("order_id");
    let health = layer.health_check();
    let shutdown = layer.shutdown_handle();
    let (gate, entered) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let app = gated(layer, &gate, &entered);
    assert_eq!(readiness(&health).await.0, StatusCode::OK);

    let holder = tokio::spawn(send(app.clone(), "/orders/1/pay"));
    within("the request holds its key", PATIENCE, entered.acquire())
        .await
        .unwrap()
        .forget();
    let draining = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { shutdown.shutdown(3 * PATIENCE).await }
    });
    within("the shutdown begins", PATIENCE, async {
        while !shutdown.is_shutting_down() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let (refused, body) = send(app.clone(), "/orders/2/pay").await;
    assert_eq!(refused, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains(r#""reason":"shutting_down""#), "{body}");

    let (ready, body) = readiness(&health).await;
    assert_eq!(
        ready,
        StatusCode::SERVICE_UNAVAILABLE,
        "readiness while the layer answers 503 shutting_down: {body}"
    );
    assert!(body.contains(r#""status":"shutting_down""#), "{body}");
    assert!(!draining.is_finished(), "the holder still runs");

    gate.add_permits(1);
    assert_eq!(holder.await.unwrap().0, StatusCode::OK);
    let report = within("the drain ends", PATIENCE, draining).await.unwrap();
    assert_eq!((report.finished, report.cut_off), (1, 0), "{report}");
}

/// A shutdown handle taken, then a setting changed: refused at that setting. Before,
/// the handle stayed on the table of the layer it was taken from, which no route used:
/// the app served 200 after "shutdown".
#[tokio::test]
async fn a_setting_after_a_shutdown_handle_is_refused() {
    let layer = KeyedLockLayer::by_path("order_id");
    let shutdown = layer.shutdown_handle();
    let changed = catch_unwind(AssertUnwindSafe(|| {
        layer.clone().wait_timeout(Duration::from_secs(1))
    }));
    let refusal = match changed {
        Err(panic) => message(panic),
        Ok(layer) => {
            let (gate, entered) = (Arc::new(Semaphore::new(1)), Arc::new(Semaphore::new(0)));
            let app = gated(layer, &gate, &entered);
            shutdown.shutdown(Duration::ZERO).await;
            let (status, body) = send(app, "/orders/1/pay").await;
            panic!(
                "the setting was not refused: after the shutdown the app answered {status} {body}"
            );
        }
    };
    assert!(
        refusal.contains("after `shutdown_handle()` or `health_check()`"),
        "{refusal}"
    );
    assert!(
        refusal.contains("Take handles after the last setting"),
        "{refusal}"
    );
    // The handle's own layer still works, and shuts down.
    let (gate, entered) = (Arc::new(Semaphore::new(1)), Arc::new(Semaphore::new(0)));
    let app = gated(layer, &gate, &entered);
    assert_eq!(send(app.clone(), "/orders/1/pay").await.0, StatusCode::OK);
    shutdown.shutdown(Duration::ZERO).await;
    assert_eq!(
        send(app, "/orders/1/pay").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

/// A health check taken, then a setting changed (the shutdown handle taken after it):
/// refused at that setting. Before, the health check stayed on a table no route used,
/// and answered 200 while the app answered 503 `shutting_down`.
#[tokio::test]
async fn a_setting_after_a_health_check_is_refused() {
    let layer = KeyedLockLayer::by_path("order_id");
    let health = layer.health_check();
    let changed = catch_unwind(AssertUnwindSafe(|| layer.clone().max_waiters(8)));
    let refusal = match changed {
        Err(panic) => message(panic),
        Ok(layer) => {
            let shutdown = layer.shutdown_handle();
            let (gate, entered) = (Arc::new(Semaphore::new(1)), Arc::new(Semaphore::new(0)));
            let app = gated(layer, &gate, &entered);
            shutdown.shutdown(Duration::ZERO).await;
            let (status, _) = send(app, "/orders/1/pay").await;
            let (ready, body) = readiness(&health).await;
            panic!(
                "the setting was not refused: the app answered {status}, readiness {ready} {body}"
            );
        }
    };
    assert!(
        refusal.contains("after `shutdown_handle()` or `health_check()`"),
        "{refusal}"
    );
    // Taken from one layer value, the handles see one table.
    let shutdown = layer.shutdown_handle();
    shutdown.shutdown(Duration::ZERO).await;
    assert_eq!(readiness(&health).await.0, StatusCode::SERVICE_UNAVAILABLE);
}

/// Settings changed before any handle is taken, and after the layer was applied (a new
/// layer value with a table of its own, as documented), are not refused.
#[tokio::test]
async fn settings_before_handles_and_after_applying_are_kept() {
    let layer = KeyedLockLayer::by_path("order_id").wait_timeout(Duration::from_secs(1));
    let (gate, entered) = (Arc::new(Semaphore::new(2)), Arc::new(Semaphore::new(0)));
    let first = gated(layer.clone(), &gate, &entered);
    assert_eq!(send(first, "/orders/1/pay").await.0, StatusCode::OK);
    let second = layer.max_waiters(8);
    let shutdown = second.shutdown_handle();
    let app = gated(second, &gate, &entered);
    assert_eq!(send(app.clone(), "/orders/1/pay").await.0, StatusCode::OK);
    shutdown.shutdown(Duration::ZERO).await;
    assert_eq!(
        send(app, "/orders/1/pay").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}
