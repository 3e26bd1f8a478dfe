//! The layer at an earlier revision (`old`) against the current one (`new`), in one
//! process: the same axum router bare, behind each layer, behind tower's
//! `ConcurrencyLimitLayer` and behind tower_governor's keyed layer (keyed by the
//! `x-order` header, with a limit no request reaches, as in `benches/layer.rs`), in
//! interleaved batches of requests (a new key each), so that the machine's noise falls
//! on all five alike. Prints the median over batches of what each adds to the bare
//! router per request, in wall time, the median of the per-batch ratios new / old, and
//! new's median as a multiple of each peer's. With `prometheus` as a second argument, the
//! Prometheus recorder is installed first (its upkeep on a thread of its own, as a
//! scrape would drain it), so every layer's metric handles are live. Built and run by
//! `scripts/bench-layer-against`.

use std::time::Instant;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::Request;
use tower::ServiceExt;

const BATCH: u64 = 5_000;
const ROUNDS: usize = 161;

fn routes() -> Router {
    Router::new().route("/orders/{order_id}/pay", post(|| async { "paid" }))
}

fn main() {
    let key = std::env::args().nth(1).unwrap_or_else(|| "path".into());
    let recorder = std::env::args().nth(2);
    if recorder.as_deref() == Some("prometheus") {
        let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of this process");
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
            handle.run_upkeep();
        });
    }
    let (old, new) = match key.as_str() {
        "path" => (
            routes().layer(old::KeyedLockLayer::by_path("order_id")),
            routes().layer(new::KeyedLockLayer::by_path("order_id")),
        ),
        "header" => (
            routes().layer(old::KeyedLockLayer::by_header("x-order")),
            routes().layer(new::KeyedLockLayer::by_header("x-order")),
        ),
        other => panic!("path or header, not {other:?}"),
    };
    let limit = routes().layer(tower::limit::ConcurrencyLimitLayer::new(1024));
    let governor = routes().layer(governor_layer());
    let routers = [routes(), old, new, limit, governor].map(|router| router.with_state(()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut next = 0u64;
    let mut per_request = vec![Vec::new(); routers.len()];
    for round in 0..ROUNDS {
        let mut order: Vec<usize> = (0..routers.len()).collect();
        order.rotate_left(round % routers.len());
        if round % 2 == 1 {
            order.reverse();
        }
        for variant in order {
            let requests: Vec<_> = (0..BATCH)
                .map(|_| {
                    next += 1;
                    Request::post(format!("/orders/{next}/pay"))
                        .header("x-order", next)
                        .body(Body::empty())
                        .expect("a request")
                })
                .collect();
            let router = routers[variant].clone();
            let start = Instant::now();
            runtime.block_on(async {
                for request in requests {
                    let response = router.clone().oneshot(request).await.expect("infallible");
                    assert!(response.status().is_success());
                }
            });
            if round > 0 {
                // The first round warms up.
                per_request[variant].push(start.elapsed().as_nanos() as f64 / BATCH as f64);
            }
        }
    }
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let added = |variant: usize| -> Vec<f64> {
        per_request[variant]
            .iter()
            .zip(&per_request[0])
            .map(|(v, bare)| v - bare)
            .collect()
    };
    let (old, new, limit, governor) = (added(1), added(2), added(3), added(4));
    // New / old per batch (the two are close); against the peers, the ratio of the
    // medians (what ConcurrencyLimitLayer adds is small enough that one batch's noise
    // would swing its ratio).
    let to_old = median(new.iter().zip(&old).map(|(n, o)| n / o).collect());
    let (new, limit, governor) = (median(new), median(limit), median(governor));
    let (to_limit, to_governor) = (new / limit, new / governor);
    let recorder = recorder.map_or(String::new(), |name| format!(" ({name})"));
    println!(
        "by_{key}{recorder}: bare {:.0} ns/request; added: old {:+.0} ns, new {:+.0} ns, \
         ConcurrencyLimitLayer {:+.0} ns, governor {:+.0} ns; new / old {to_old:.3}, \
         new / ConcurrencyLimitLayer {to_limit:.2}, new / governor {to_governor:.2}",
        median(per_request[0].clone()),
        median(old),
        new,
        limit,
        governor,
    );
}

/// tower_governor keyed by the `x-order` header.
#[derive(Clone)]
struct OrderHeader;

impl tower_governor::key_extractor::KeyExtractor for OrderHeader {
    type Key = String;

    fn extract<T>(&self, request: &Request<T>) -> Result<String, tower_governor::GovernorError> {
        let value = request.headers().get("x-order");
        let value = value.and_then(|v| v.to_str().ok());
        value
            .map(str::to_owned)
            .ok_or(tower_governor::GovernorError::UnableToExtractKey)
    }
}

/// A keyed rate limit that no request reaches: one token per nanosecond per key, and
/// a burst as large as it gets.
fn governor_layer(
) -> tower_governor::GovernorLayer<OrderHeader, governor::middleware::NoOpMiddleware, Body> {
    let config = tower_governor::governor::GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(OrderHeader)
        .finish()
        .expect("a valid governor configuration");
    tower_governor::GovernorLayer::new(config)
}
