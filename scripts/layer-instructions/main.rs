//! The requests `scripts/check-layer-instructions` counts under callgrind: the router of
//! `benches/layer.rs` (one route, a path parameter, a header) bare or under the layer
//! with its default settings, `KeyedLockLayer::by_path` or `by_header`, one distinct key
//! per request, no metrics recorder and no `tracing` subscriber.
//!
//! `layer-instructions <no-layer|by-path|by-header> <requests>`: one request first (so
//! the one-time setup is not counted per request), then that many, built beforehand.

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_keyed_lock::KeyedLockLayer;

async fn pay() -> &'static str {
    "paid"
}

fn request(order: u64) -> Request<Body> {
    Request::post(format!("/orders/{order}/pay"))
        .header("x-order", order)
        .body(Body::empty())
        .expect("a valid request")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [variant, count] = &args[..] else {
        panic!("usage: layer-instructions <no-layer|by-path|by-header> <requests>");
    };
    let count: u64 = count.parse().expect("a request count");
    let routes = Router::new().route("/orders/{order_id}/pay", post(pay));
    let router = match variant.as_str() {
        "no-layer" => routes,
        "by-path" => routes.layer(KeyedLockLayer::by_path("order_id")),
        "by-header" => routes.layer(KeyedLockLayer::by_header("x-order")),
        other => panic!("no variant {other:?}"),
    }
    // As `axum::serve` runs it: every handler made a route once.
    .with_state(());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a tokio runtime");
    let requests: Vec<_> = (0..=count).map(request).collect();
    rt.block_on(async {
        for request in requests {
            let response = router.clone().oneshot(request).await.expect("infallible");
            assert_eq!(response.status(), StatusCode::OK);
        }
    });
}
