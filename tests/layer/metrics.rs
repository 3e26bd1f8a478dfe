//! The metrics and the long-hold warning, recorded through real recorders.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use metrics_util::debugging::DebugValue;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_keyed_lock::KeyedLockLayer;

use crate::support::logs::Captured;
use crate::support::recorder;

/// One series: metric name and its labels other than `name`.
type Series = (String, BTreeMap<String, String>);

/// Every series of the layer called `layer`. Panics if any label value holds a key.
fn series_of(layer: &str, keys: &[&str]) -> BTreeMap<Series, DebugValue> {
    let mut found = BTreeMap::new();
    for (composite, value) in recorder::snapshot() {
        let key = composite.key();
        let labels: BTreeMap<String, String> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        for value in labels.values() {
            assert!(
                !keys.iter().any(|k| value.contains(k)),
                "a key leaked into a label: {value}"
            );
        }
        if labels.get("name").map(String::as_str) == Some(layer) {
            let mut labels = labels;
            labels.remove("name");
            found.insert((key.name().to_owned(), labels), value);
        }
    }
    found
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn counter(series: &BTreeMap<Series, DebugValue>, name: &str, pairs: &[(&str, &str)]) -> u64 {
    match series.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Counter(value)) => *value,
        other => panic!("{name} {pairs:?}: {other:?}"),
    }
}

fn samples(series: &BTreeMap<Series, DebugValue>, name: &str, pairs: &[(&str, &str)]) -> Vec<f64> {
    match series.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.into_inner()).collect(),
        other => panic!("{name} {pairs:?}: {other:?}"),
    }
}

fn gauge(series: &BTreeMap<Series, DebugValue>, name: &str) -> f64 {
    match series.get(&(name.to_owned(), BTreeMap::new())) {
        Some(DebugValue::Gauge(value)) => value.into_inner(),
        other => panic!("{name}: {other:?}"),
    }
}

fn post_to(uri: &str) -> Request<Body> {
    Request::post(uri).body(Body::empty()).unwrap()
}

/// All outcomes in one test: the debugging recorder drains histograms on every
/// snapshot, so tests in parallel would steal each other's samples.
#[tokio::test]
async fn every_outcome_is_recorded_with_its_labels() {
    recorder::install();
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = KeyedLockLayer::by_path("order_id")
        .name("orders")
        .max_waiters(1)
        .max_keys(1)
        .max_key_len(20)
        .wait_timeout(Duration::from_millis(300));
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
        .route("/orders/{order_id}", post(|| async {}))
        .route("/orders/{order_id}/gate", post(gate))
        .route("/unkeyed", post(|| async {}))
        .layer(layer.clone());

    // Uncontended.
    let app2 = app.clone();
    assert_eq!(
        app2.oneshot(post_to("/orders/secret-1"))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );

    // Contended, then a queue-full rejection, a timeout and a table-full rejection.
    let holder = tokio::spawn(app.clone().oneshot(post_to("/orders/secret-2/gate")));
    started.notified().await;
    let waiter = tokio::spawn(app.clone().oneshot(post_to("/orders/secret-2")));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let full = app
        .clone()
        .oneshot(post_to("/orders/secret-2"))
        .await
        .unwrap();
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
    let table_full = app
        .clone()
        .oneshot(post_to("/orders/secret-3"))
        .await
        .unwrap();
    assert_eq!(table_full.status(), StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(30)).await;
    finish.notify_one();
    holder.await.unwrap().unwrap();
    assert_eq!(waiter.await.unwrap().unwrap().status(), StatusCode::OK);

    let holder = tokio::spawn(app.clone().oneshot(post_to("/orders/secret-4/gate")));
    started.notified().await;
    let timed_out = app
        .clone()
        .oneshot(post_to("/orders/secret-4"))
        .await
        .unwrap();
    assert_eq!(timed_out.status(), StatusCode::CONFLICT);
    finish.notify_one();
    holder.await.unwrap().unwrap();

    // A route without the key's parameter (a server bug), and an invalid key.
    let misconfigured = app.clone().oneshot(post_to("/unkeyed")).await.unwrap();
    assert_eq!(misconfigured.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let too_long = app
        .clone()
        .oneshot(post_to("/orders/secret-5-is-far-too-long"))
        .await
        .unwrap();
    assert_eq!(too_long.status(), StatusCode::BAD_REQUEST);

    let series = series_of("orders", &["secret"]);
    let acquired = "keyed_lock_acquired_total";
    assert_eq!(counter(&series, acquired, &[("contended", "false")]), 3);
    assert_eq!(counter(&series, acquired, &[("contended", "true")]), 1);
    let rejected = "keyed_lock_rejected_total";
    for (reason, count) in [
        ("timeout", 1),
        ("queue_full", 1),
        ("too_many_keys", 1),
        ("missing_key", 0),
        ("misconfigured", 1),
        ("invalid_key", 1),
        ("backend", 0),
    ] {
        assert_eq!(
            counter(&series, rejected, &[("reason", reason)]),
            count,
            "{reason}"
        );
    }
    let wait = "keyed_lock_wait_seconds";
    let acquired_waits = samples(&series, wait, &[("outcome", "acquired")]);
    assert_eq!(acquired_waits.len(), 4);
    assert_eq!(acquired_waits.iter().filter(|w| **w == 0.0).count(), 3);
    assert!(
        acquired_waits.iter().any(|w| *w >= 0.04),
        "{acquired_waits:?}"
    );
    let timeout_waits = samples(&series, wait, &[("outcome", "timeout")]);
    assert!(
        timeout_waits.len() == 1 && timeout_waits[0] >= 0.29,
        "{timeout_waits:?}"
    );
    assert_eq!(
        samples(&series, wait, &[("outcome", "queue_full")]).len(),
        1
    );
    let holds = samples(&series, "keyed_lock_hold_seconds", &[]);
    assert_eq!(holds.len(), 4);
    assert!(holds.iter().any(|h| *h >= 0.04), "{holds:?}");
    assert_eq!(gauge(&series, "keyed_lock_waiting"), 0.0);
    assert_eq!(gauge(&series, "keyed_lock_keys"), 0.0);
    for reason in ["unreachable", "expired", "not_owner", "shut_down"] {
        assert_eq!(
            counter(
                &series,
                "keyed_lock_lease_lost_total",
                &[("reason", reason)]
            ),
            0
        );
    }
    assert_eq!(layer.active_keys(), 0);
}

#[tokio::test]
async fn a_long_hold_is_warned_about_once() {
    let captured = Captured::default();
    let _logs = captured.install();

    let app = Router::new()
        .route(
            "/orders/{order_id}",
            post(
                |axum::extract::Path(id): axum::extract::Path<String>| async move {
                    // Several wake-ups past the threshold: still one warning.
                    let steps = if id.starts_with("slow") { 6 } else { 0 };
                    for _ in 0..steps {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
            ),
        )
        .layer(
            KeyedLockLayer::by_path("order_id")
                .name("slow-orders")
                .warn_long_hold(Duration::from_millis(50)),
        );

    app.clone()
        .oneshot(post_to("/orders/fast-1"))
        .await
        .unwrap();
    assert!(
        !captured.text().contains("long-hold threshold"),
        "a fast hold was warned about"
    );

    app.oneshot(post_to("/orders/slow-0123456789abcdefghij"))
        .await
        .unwrap();
    let log = captured.text();
    assert_eq!(log.matches("long-hold threshold").count(), 1, "{log}");
    assert!(log.contains("slow-orders"), "{log}");
    assert!(log.contains("slow-0123456789a"), "{log}");
    assert!(
        !log.contains("abcdefghij"),
        "the whole key was logged: {log}"
    );
}

/// A router whose `/orders/{id}/gate` handler signals `started` and waits for `finish`.
fn gated_app(
    layer: KeyedLockLayer<tower_keyed_lock::PathParam>,
) -> (Router, Arc<Notify>, Arc<Notify>) {
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
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
        .route("/orders/{order_id}", post(|| async {}))
        .route("/orders/{order_id}/gate", post(gate))
        .layer(layer);
    (app, started, finish)
}

#[tokio::test]
async fn a_hand_off_cancelled_before_it_runs_leaves_no_phantom_key() {
    recorder::install();
    let layer = KeyedLockLayer::by_path("order_id").name("handoff");
    let (app, started, finish) = gated_app(layer.clone());
    let holder = tokio::spawn(app.clone().oneshot(post_to("/orders/1/gate")));
    started.notified().await;
    let mut waiter = Box::pin(app.clone().oneshot(post_to("/orders/1")));
    let queued = tokio::time::timeout(Duration::from_millis(50), &mut waiter).await;
    assert!(queued.is_err(), "the second request did not wait");

    finish.notify_one();
    holder.await.unwrap().unwrap();
    // The key was handed to the waiter, whose client leaves before it runs.
    drop(waiter);

    assert_eq!(layer.active_keys(), 0);
    let series = series_of("handoff", &[]);
    assert_eq!(gauge(&series, "keyed_lock_keys"), 0.0);
    assert_eq!(gauge(&series, "keyed_lock_waiting"), 0.0);
    let cancelled = samples(
        &series,
        "keyed_lock_wait_seconds",
        &[("outcome", "cancelled")],
    );
    assert_eq!(
        cancelled.len(),
        1,
        "the disconnected waiter was not recorded"
    );
    assert!(cancelled[0] >= 0.04, "{cancelled:?}");
}

#[tokio::test]
async fn layers_sharing_a_name_add_up_in_the_key_gauge() {
    recorder::install();
    let (first, started_1, finish_1) = gated_app(KeyedLockLayer::by_path("order_id").name("twins"));
    let (second, started_2, finish_2) =
        gated_app(KeyedLockLayer::by_path("order_id").name("twins"));
    let holder_1 = tokio::spawn(first.oneshot(post_to("/orders/1/gate")));
    started_1.notified().await;
    let holder_2 = tokio::spawn(second.oneshot(post_to("/orders/2/gate")));
    started_2.notified().await;
    assert_eq!(gauge(&series_of("twins", &[]), "keyed_lock_keys"), 2.0);

    finish_1.notify_one();
    holder_1.await.unwrap().unwrap();
    assert_eq!(gauge(&series_of("twins", &[]), "keyed_lock_keys"), 1.0);
    finish_2.notify_one();
    holder_2.await.unwrap().unwrap();
    assert_eq!(gauge(&series_of("twins", &[]), "keyed_lock_keys"), 0.0);
}

/// With a backend, a waiter handed the key locally can still fail at the backend; the
/// key leaves the table then, and the gauge must follow it down.
#[cfg(feature = "redis")]
mod with_a_backend {
    use super::*;
    use crate::support::redis_server::RedisServer;
    use tower_keyed_lock::backend::redis::RedisBackend;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wait_that_fails_at_the_backend_leaves_no_phantom_key() {
        recorder::install();
        let mut redis = RedisServer::start();
        let backend = RedisBackend::builder(redis.client())
            .command_timeout(Duration::from_millis(200))
            .restart_guard(false)
            .build()
            .await
            .expect("backend connects");
        let layer = KeyedLockLayer::by_path("order_id")
            .name("backend-fails")
            .backend(backend)
            .wait_timeout(Duration::from_secs(5));
        let (app, started, finish) = gated_app(layer.clone());
        let holder = tokio::spawn(app.clone().oneshot(post_to("/orders/1/gate")));
        started.notified().await;
        let waiter = tokio::spawn(app.clone().oneshot(post_to("/orders/1")));
        crate::support::eventually("the second request waits", || {
            gauge(&series_of("backend-fails", &[]), "keyed_lock_waiting") == 1.0
        })
        .await;
        assert_eq!(
            gauge(&series_of("backend-fails", &[]), "keyed_lock_keys"),
            1.0
        );

        // The backend goes away: the holder's release fails, the waiter is handed the
        // key locally and then fails at the backend.
        redis.stop();
        finish.notify_one();
        holder.await.unwrap().unwrap();
        let answer = waiter.await.unwrap().unwrap();
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);

        crate::support::eventually("the key leaves the table", || layer.active_keys() == 0).await;
        assert_eq!(
            gauge(&series_of("backend-fails", &[]), "keyed_lock_keys"),
            0.0
        );
    }
}

/// Two instances' layers on one engine: a request that waited for the other
/// instance's holder counts as contended, though nothing waited in its own process.
#[cfg(feature = "testkit")]
#[tokio::test]
async fn a_wait_at_the_backend_counts_as_contended() {
    use tower_keyed_lock::testkit::MemoryBackend;

    recorder::install();
    let engine = MemoryBackend::new();
    let layer = || {
        KeyedLockLayer::by_path("order_id")
            .name("across-instances")
            .backend(engine.clone())
    };
    let (first, started, finish) = gated_app(layer());
    let (second, _, _) = gated_app(layer());
    let holder = tokio::spawn(first.oneshot(post_to("/orders/1/gate")));
    started.notified().await;
    let mut waiter = Box::pin(second.oneshot(post_to("/orders/1")));
    let queued = tokio::time::timeout(Duration::from_millis(50), &mut waiter).await;
    assert!(queued.is_err(), "the other instance's request did not wait");
    finish.notify_one();
    holder.await.unwrap().unwrap();
    assert_eq!(waiter.await.unwrap().status(), StatusCode::OK);

    let series = series_of("across-instances", &[]);
    let acquired = "keyed_lock_acquired_total";
    assert_eq!(counter(&series, acquired, &[("contended", "false")]), 1);
    assert_eq!(counter(&series, acquired, &[("contended", "true")]), 1);
}
