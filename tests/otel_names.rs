//! `metrics::use_naming(Naming::OpenTelemetry)`: every series of the process (the
//! layer's, a job lock's, the replay layer's) gets its OpenTelemetry-style name, with
//! its unit in the metadata, and the choice cannot change once made. A process of its
//! own: the naming is process-wide.
#![cfg(all(feature = "axum", feature = "replay"))]

use std::collections::BTreeMap;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::Request;
use metrics::Unit;
use metrics_util::debugging::DebuggingRecorder;
use tower::ServiceExt;
use tower_keyed_lock::metrics::{use_naming, Naming, NamingAlreadyFixed};
use tower_keyed_lock::replay::{MemoryStore, ReplayLayer};
use tower_keyed_lock::{DistributedLocks, KeyedLockLayer};

#[tokio::test]
async fn every_series_is_named_in_opentelemetry_style() {
    use_naming(Naming::OpenTelemetry).expect("nothing recorded yet");
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    let app = Router::new()
        .route("/orders/{order_id}", post(|| async { "paid" }))
        .layer(
            KeyedLockLayer::by_path("order_id")
                .name("otel")
                .replay(ReplayLayer::new(MemoryStore::default())),
        );
    for _ in 0..2 {
        let request = Request::post("/orders/7")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(request).await.unwrap();
    }
    let locks = DistributedLocks::in_process("otel-jobs");
    locks.lock("nightly").await.unwrap().release().await;

    let series: BTreeMap<String, Option<Unit>> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, unit, _, _)| (key.key().name().to_owned(), unit))
        .collect();
    for name in [
        "keyed_lock.wait.duration",
        "keyed_lock.hold.duration",
        "keyed_lock.acquired",
        "keyed_lock.rejected",
        "keyed_lock.waiting",
        "keyed_lock.keys",
        "keyed_lock.lease.lost",
        "keyed_lock.replayed",
        "keyed_lock.stored",
    ] {
        assert!(series.contains_key(name), "{name} missing from {series:?}");
    }
    assert!(
        series.keys().all(|name| !name.starts_with("keyed_lock_")),
        "a Prometheus-style name beside the OpenTelemetry ones: {series:?}"
    );
    assert_eq!(series["keyed_lock.wait.duration"], Some(Unit::Seconds));
    assert_eq!(series["keyed_lock.hold.duration"], Some(Unit::Seconds));
    assert_eq!(
        use_naming(Naming::Prometheus),
        Err(NamingAlreadyFixed(Naming::OpenTelemetry))
    );
    assert_eq!(use_naming(Naming::OpenTelemetry), Ok(()));
}
