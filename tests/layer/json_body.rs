//! Keys from the JSON request body (`by_json_body`): every 400 case answered like a bad
//! header key, the 500 for a body nobody buffered, pointer escapes, the body reaching
//! the handler intact, and two deliveries of one event id serialized.
#![cfg(feature = "json")]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_keyed_lock::{BufferRequestBodyLayer, KeyedLockLayer, LockInfo};

use crate::support::logs::Captured;

/// A webhook receiver keyed by the body's `pointer`; it answers `key|body`.
fn app(pointer: &str, gate: Arc<Semaphore>) -> Router {
    Router::new()
        .route(
            "/webhooks",
            post(move |info: LockInfo, body: String| async move {
                if body.contains("slow") {
                    drop(gate.acquire().await.unwrap());
                }
                format!("{}|{body}", info.key())
            }),
        )
        .layer(
            KeyedLockLayer::by_json_body(pointer)
                .name("json-body")
                .wait_timeout(Duration::ZERO)
                .max_key_len(24),
        )
        .layer(BufferRequestBodyLayer::new())
}

async fn post_body(app: &Router, body: &str) -> (StatusCode, String, String) {
    let request = Request::post("/webhooks")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        content_type,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

#[tokio::test]
async fn the_key_is_the_field_and_the_handler_gets_the_whole_body() {
    let app = app("/id", Arc::new(Semaphore::new(0)));
    let body = r#"{"id":"evt_1","created":1700000000,"data":{"object":{"amount":10}}}"#;
    let (status, _, answer) = post_body(&app, body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer, format!("evt_1|{body}"));
    let (status, _, answer) = post_body(&app, r#"{"id":42}"#).await;
    assert_eq!(
        (status, answer.as_str()),
        (StatusCode::OK, r#"42|{"id":42}"#)
    );
}

#[tokio::test]
async fn pointer_escapes_and_array_indices_reach_nested_fields() {
    let gate = Arc::new(Semaphore::new(0));
    let body = r#"{"a/b":{"m~n":"escaped"},"events":[{"id":"e0"},{"id":"e1"}]}"#;
    let (_, _, answer) = post_body(&app("/a~1b/m~0n", Arc::clone(&gate)), body).await;
    assert!(answer.starts_with("escaped|"), "{answer}");
    let (_, _, answer) = post_body(&app("/events/1/id", gate), body).await;
    assert!(answer.starts_with("e1|"), "{answer}");
}

#[tokio::test]
async fn every_unusable_body_key_gets_the_same_400_as_a_header_key() {
    let app = app("/id", Arc::new(Semaphore::new(0)));
    let cases = [
        (
            r#"{"type":"charge.succeeded"}"#,
            "missing_key",
            "carries no lock key",
        ),
        ("not json at all", "invalid_key", "not valid JSON"),
        ("", "invalid_key", "not valid JSON"),
        (r#"{"id":"#, "invalid_key", "not valid JSON"),
        (r#"{"id":""}"#, "invalid_key", "empty"),
        (
            r#"{"id":"0123456789abcdef012345678"}"#,
            "invalid_key",
            "over the limit of 24",
        ),
        (r#"{"id":"a\u0007b"}"#, "invalid_key", "control character"),
        (
            r#"{"id":1.5}"#,
            "invalid_key",
            "neither a string nor an integer",
        ),
        (
            r#"{"id":true}"#,
            "invalid_key",
            "neither a string nor an integer",
        ),
        (
            r#"{"id":null}"#,
            "invalid_key",
            "neither a string nor an integer",
        ),
        (
            r#"{"id":{"nested":"x"}}"#,
            "invalid_key",
            "neither a string nor an integer",
        ),
        (
            r#"{"id":["x"]}"#,
            "invalid_key",
            "neither a string nor an integer",
        ),
    ];
    for (body, reason, detail) in cases {
        let (status, content_type, answer) = post_body(&app, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert_eq!(content_type, "application/problem+json", "{body}");
        assert!(
            answer.contains(&format!(r#""reason":"{reason}""#)) && answer.contains(detail),
            "{body}: {answer}"
        );
    }
    // A header key refused the same way answers with the same problem.
    let by_header = Router::new()
        .route("/webhooks", post(|| async {}))
        .layer(KeyedLockLayer::by_header("webhook-id"));
    let (status, _, header_answer) = post_body(&by_header, "{}").await;
    let (_, _, body_answer) = post_body(&app, "{}").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(header_answer, body_answer);
}

#[tokio::test]
async fn a_body_nobody_buffered_is_a_server_error_logged_once() {
    let captured = Captured::default();
    let _logs = captured.install();
    let app = Router::new()
        .route("/webhooks", post(|| async { "ran" }))
        .layer(KeyedLockLayer::by_json_body("/id").name("unbuffered"));
    for _ in 0..3 {
        let (status, content_type, answer) = post_body(&app, r#"{"id":"evt_1"}"#).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
        assert_eq!(content_type, "application/problem+json");
        assert!(answer.contains(r#""reason":"misconfigured""#), "{answer}");
    }
    let logs = captured.text();
    let errors: Vec<_> = logs.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "{logs}");
    assert!(
        errors[0].contains("BufferRequestBodyLayer") && errors[0].contains("unbuffered"),
        "{logs}"
    );
}

#[tokio::test]
async fn two_deliveries_of_one_event_id_serialize_other_ids_do_not() {
    let gate = Arc::new(Semaphore::new(0));
    let app = app("/id", Arc::clone(&gate));
    let first = tokio::spawn({
        let app = app.clone();
        async move { post_body(&app, r#"{"id":"evt_1","note":"slow"}"#).await }
    });
    // Until the first delivery holds the key (then it waits on the gate), a duplicate
    // runs alone and answers 200; once it holds it, a duplicate must get 409.
    let mut duplicate = (StatusCode::OK, String::new(), String::new());
    for _ in 0..200 {
        duplicate = post_body(&app, r#"{"id":"evt_1","attempt":2}"#).await;
        if duplicate.0 == StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The same id while the first runs: busy (wait_timeout zero), not run beside it.
    assert_eq!(duplicate.0, StatusCode::CONFLICT, "{}", duplicate.2);
    assert!(
        duplicate.2.contains(r#""reason":"timeout""#),
        "{}",
        duplicate.2
    );
    // Another event id runs at once.
    let other = post_body(&app, r#"{"id":"evt_2"}"#).await;
    assert_eq!(other.0, StatusCode::OK, "{}", other.2);
    gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.0, StatusCode::OK);
    assert_eq!(first.2, r#"evt_1|{"id":"evt_1","note":"slow"}"#);
}
