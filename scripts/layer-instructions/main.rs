//! The requests `scripts/check-layer-instructions` counts under callgrind: the router of
//! `benches/layer.rs` (one route, a path parameter, a header) bare or under the layer
//! with its default settings, `KeyedLockLayer::by_path` or `by_header`, one distinct key
//! per request, no metrics recorder and no `tracing` subscriber.
//!
//! `layer-instructions <no-layer|by-path|by-header> <requests>`: one request first (so
//! the one-time setup is not counted per request), then that many, built beforehand.
//!
//! Built with the `peers` feature (`scripts/check-layer-instructions --peers`), it also
//! runs the peers of `benches/layer.rs`: tower's `ConcurrencyLimitLayer`
//! (`concurrency-limit`) and tower_governor's keyed layer (`governor-keyed`, keyed by
//! the same header, with a limit no request reaches), so the layer's cost can be
//! stated against theirs without a quiet machine.

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
        panic!("usage: layer-instructions <variant> <requests>");
    };
    let count: u64 = count.parse().expect("a request count");
    let routes = Router::new().route("/orders/{order_id}/pay", post(pay));
    let router = match variant.as_str() {
        "no-layer" => routes,
        "by-path" => routes.layer(KeyedLockLayer::by_path("order_id")),
        "by-header" => routes.layer(KeyedLockLayer::by_header("x-order")),
        #[cfg(feature = "peers")]
        "concurrency-limit" => routes.layer(tower::limit::ConcurrencyLimitLayer::new(1024)),
        #[cfg(feature = "peers")]
        "governor-keyed" => routes.layer(peers::governor_layer()),
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

#[cfg(feature = "peers")]
mod peers {
    use axum::body::Body;
    use http::Request;
    use tower_governor::governor::GovernorConfigBuilder;
    use tower_governor::key_extractor::KeyExtractor;
    use tower_governor::{GovernorError, GovernorLayer};

    /// tower_governor keyed by the `x-order` header, like `by-header`.
    #[derive(Clone)]
    pub struct OrderHeader;

    impl KeyExtractor for OrderHeader {
        type Key = String;

        fn extract<T>(&self, request: &Request<T>) -> Result<String, GovernorError> {
            let value = request.headers().get("x-order");
            let value = value.and_then(|v| v.to_str().ok());
            value
                .map(str::to_owned)
                .ok_or(GovernorError::UnableToExtractKey)
        }
    }

    /// A keyed rate limit that no request reaches: one token per nanosecond per key,
    /// and a burst as large as it gets (as in `benches/layer.rs`).
    pub fn governor_layer(
    ) -> GovernorLayer<OrderHeader, governor::middleware::NoOpMiddleware, Body> {
        let config = GovernorConfigBuilder::default()
            .per_nanosecond(1)
            .burst_size(u32::MAX)
            .key_extractor(OrderHeader)
            .finish()
            .expect("a valid governor configuration");
        GovernorLayer::new(config)
    }
}
