//! The layer's `tracing` spans, captured by a real subscriber: `keyed_lock.wait` with
//! its outcome, `keyed_lock.hold` around the handler, both with the layer's name and
//! the route template, and the key only when the layer opts in.

use std::sync::Arc;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::Request;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_keyed_lock::KeyedLockLayer;

use crate::support::logs::Captured;

const KEY: &str = "secret-order-7777";

/// Two requests for one key on this thread's runtime: the first holds it until
/// released, the second waits for it. Returns what the subscriber printed.
async fn two_requests(layer: KeyedLockLayer<tower_keyed_lock::PathParam>) -> String {
    let captured = Captured::default();
    let _subscriber = captured.install_with_spans();
    let release = Arc::new(Notify::new());
    let handler = {
        let release = release.clone();
        move || async move {
            tracing::info!("handling");
            release.notified().await;
        }
    };
    let app = Router::new()
        .route("/orders/{order_id}", post(handler))
        .layer(layer);
    let request = || {
        Request::post(format!("/orders/{KEY}"))
            .body(Body::empty())
            .unwrap()
    };
    // One thread: each spawned request runs until it blocks (in the handler, or
    // queued for the key) at the next yield.
    let first = tokio::spawn(app.clone().oneshot(request()));
    tokio::task::yield_now().await;
    let second = tokio::spawn(app.clone().oneshot(request()));
    tokio::task::yield_now().await;
    release.notify_one();
    first.await.unwrap().unwrap();
    release.notify_one();
    second.await.unwrap().unwrap();
    captured.text()
}

#[tokio::test]
async fn spans_carry_the_route_and_the_outcome_never_the_key() {
    let text = two_requests(KeyedLockLayer::by_path("order_id").name("traced")).await;
    let wait = text
        .lines()
        .find(|line| line.contains("keyed_lock.wait{"))
        .unwrap_or_else(|| panic!("no wait span:\n{text}"));
    for field in [
        r#"name="traced""#,
        r#"route="/orders/{order_id}""#,
        r#"outcome="acquired""#,
    ] {
        assert!(wait.contains(field), "{field} missing: {wait}");
    }
    let handled: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("handling"))
        .collect();
    assert_eq!(handled.len(), 2, "{text}");
    for line in handled {
        assert!(
            line.contains("keyed_lock.hold{"),
            "the handler ran outside the hold span: {line}"
        );
        assert!(line.contains(r#"route="/orders/{order_id}""#), "{line}");
    }
    assert!(
        !text.contains(KEY),
        "a span or event carried the raw key:\n{text}"
    );
}

#[tokio::test]
async fn trace_keys_puts_a_short_key_in_the_spans() {
    let layer = KeyedLockLayer::by_path("order_id")
        .name("traced-keys")
        .trace_keys(true);
    let text = two_requests(layer).await;
    let short = &KEY[..16];
    assert!(text.contains(&format!(r#"key="{short}…""#)), "{text}");
}
