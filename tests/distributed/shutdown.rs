//! `DistributedLocks::shutdown`: no key granted once it begins (to new callers or to
//! those already waiting), holders drained up to the deadline, and a holder that
//! outlives it cut off — told through its lost signal, its lease given back — so that
//! another instance takes the key at once. On every fixture: in process, Redis (single
//! and Cluster), PostgreSQL, DynamoDB, MySQL, ZooKeeper.

// Without a backend feature, the bodies for remote fixtures have nothing to run on.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

use std::time::Duration;

#[cfg(feature = "axum")]
use axum::{body::Body, routing::post, Router};
#[cfg(feature = "axum")]
use http::{Request, StatusCode};
#[cfg(feature = "axum")]
use http_body_util::BodyExt;
#[cfg(feature = "axum")]
use tokio::sync::Semaphore;
#[cfg(feature = "axum")]
use tower::ServiceExt;
use tower_keyed_lock::backend::LostReason;
use tower_keyed_lock::LockError;
#[cfg(feature = "axum")]
use tower_keyed_lock::{KeyedLockLayer, LockInfo};

use crate::support::fixtures::{
    poll_once, wait_free, within, Fixture, Remote, FREED_WITHIN, PATIENCE,
};

for_each_fixture!(
    all: [
        a_shutdown_refuses_new_and_waiting_acquisitions_and_counts_finished_holders,
        a_second_shutdown_is_harmless,
        health_turns_unhealthy_as_a_shutdown_begins,
    ],
    remote: [
        a_holder_past_the_deadline_is_cut_off_and_another_instance_takes_the_key,
        a_dropped_shutdown_leaves_the_locks_shut_and_frees_leases_by_drop,
        a_shutdown_dropped_while_cutting_off_still_gives_the_lease_back,
    ],
);

/// Through the HTTP layer: the `axum` feature too.
#[cfg(feature = "axum")]
mod layer {
    // Used by the remote fixtures' tests: none without an engine's feature.
    #[allow(unused_imports)]
    use super::{
        a_layer_shut_down_answers_503_with_retry_after_and_hands_the_key_over,
        a_layers_readiness_turns_503_as_its_shutdown_begins,
    };

    for_each_fixture!(
        all: [],
        remote: [
            a_layer_shut_down_answers_503_with_retry_after_and_hands_the_key_over,
            a_layers_readiness_turns_503_as_its_shutdown_begins,
        ],
    );
}

/// A holder, a waiter queued behind it, then the shutdown: a new acquisition fails at
/// once with `ShuttingDown`, the waiter is refused while the holder still holds (woken
/// by the shutdown, not by a grant or its own timeout, which is longer than the test
/// waits), and the report counts the holder, finished within the deadline.
async fn a_shutdown_refuses_new_and_waiting_acquisitions_and_counts_finished_holders<F: Fixture>() {
    let fixture = F::start();
    let locks = fixture.instance("a").await;
    let holder = locks.lock("order-1").await.unwrap();
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock_timeout("order-1", 3 * PATIENCE).await.map(drop) }
    });
    // Time to queue (setup only: a waiter not yet queued is refused all the same).
    tokio::time::sleep(Duration::from_millis(50)).await;

    let shutdown = tokio::spawn({
        let locks = locks.clone();
        async move { locks.shutdown(PATIENCE).await }
    });
    within("the shutdown begins", PATIENCE, async {
        while !locks.is_shutting_down() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    for attempt in [locks.try_lock("order-2").await, locks.lock("order-3").await] {
        assert!(
            matches!(attempt, Err(LockError::ShuttingDown)),
            "{attempt:?}"
        );
    }

    let waited = within("the waiter is refused", PATIENCE, waiter)
        .await
        .unwrap();
    assert!(matches!(waited, Err(LockError::ShuttingDown)), "{waited:?}");
    assert_eq!(holder.key(), "order-1", "still held");
    drop(holder);
    let report = within("the drain ends", PATIENCE, shutdown).await.unwrap();
    assert_eq!((report.finished, report.cut_off), (1, 0), "{report}");
    assert_eq!(report.leases_released, 0);
    assert!(locks.is_empty());
}

/// Shutting down twice: the second call finds nothing to drain and reports zeros.
async fn a_second_shutdown_is_harmless<F: Fixture>() {
    let fixture = F::start();
    let locks = fixture.instance("a").await;
    let first = locks.shutdown(Duration::from_millis(10)).await;
    let second = locks.shutdown(Duration::from_millis(10)).await;
    assert_eq!((first.finished, first.cut_off), (0, 0));
    assert_eq!(second, first);
    assert!(matches!(
        locks.try_lock("k").await,
        Err(LockError::ShuttingDown)
    ));
}

/// A holder still running at the deadline: its lost signal is raised and its lease
/// given back, so another instance's single `try_lock` gets the key while the first
/// guard is still alive. Without the cut-off that guard's renewals would keep the key
/// taken for as long as it lives, so the grant proves ownership moved, not that a lease
/// ran out; the fencing token moves on too.
async fn a_holder_past_the_deadline_is_cut_off_and_another_instance_takes_the_key<F: Remote>() {
    let fixture = F::start();
    let a = fixture.instance("a").await;
    let b = fixture.instance("b").await;
    let held = a.lock("order-1").await.unwrap();
    assert!(!held.is_lost());
    // Held across a few renewals first: the lease is live, not about to run out.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(matches!(b.try_lock("order-1").await, Err(LockError::Busy)));

    let report = a.shutdown(Duration::from_millis(50)).await;
    assert_eq!((report.finished, report.cut_off), (0, 1), "{report}");
    assert_eq!(report.leases_released, 1, "{report}");
    // Told before anyone else could be granted the key, and why.
    assert!(held.is_lost());
    assert_eq!(held.lost_reason(), Some(LostReason::ShutDown));
    within("the lost signal resolves", PATIENCE, held.lost()).await;

    let taken = b.try_lock("order-1").await;
    let taken = taken.expect("another instance takes the cut-off key at once");
    if let (Some(before), Some(after)) = (held.fencing_token(), taken.fencing_token()) {
        assert!(after > before, "{after} after {before}");
    }
    // The cut-off guard dropping later gives back nothing of the new holder's.
    drop(held);
    tokio::time::sleep(FREED_WITHIN).await;
    let c = fixture.instance("c").await;
    assert!(matches!(c.try_lock("order-1").await, Err(LockError::Busy)));
    drop(taken);
}

/// The shutdown future dropped midway (polled once, inside its drain): the locks stay
/// shut, nothing hangs, and the holder's lease is given back when its guard drops.
async fn a_dropped_shutdown_leaves_the_locks_shut_and_frees_leases_by_drop<F: Remote>() {
    let fixture = F::start();
    let a = fixture.instance("a").await;
    let b = fixture.instance("b").await;
    let held = a.lock("order-1").await.unwrap();
    {
        let mut shutdown = Box::pin(a.shutdown(PATIENCE));
        assert!(poll_once(&mut shutdown).is_pending());
    }
    assert!(a.is_shutting_down());
    assert!(matches!(
        a.try_lock("order-2").await,
        Err(LockError::ShuttingDown)
    ));
    assert!(!held.is_lost(), "not cut off: the deadline never came");
    drop(held);
    wait_free(&b, "order-1", FREED_WITHIN).await;
}

/// The shutdown future dropped at its last await, while the cut-off runs (deadline
/// zero: straight to it): the release it began runs on in its own task, so the lease
/// is given back and its holder told while the holder's guard still lives.
async fn a_shutdown_dropped_while_cutting_off_still_gives_the_lease_back<F: Remote>() {
    let fixture = F::start();
    let a = fixture.instance("a").await;
    let b = fixture.instance("b").await;
    let held = a.lock("order-1").await.unwrap();
    {
        let mut shutdown = Box::pin(a.shutdown(Duration::ZERO));
        // Mostly pending, waiting for the release; on a quick server (the release task
        // runs on another worker) it may already be done: dropped either way.
        let _ = poll_once(&mut shutdown);
    }
    within("the holder is told", PATIENCE, held.lost()).await;
    wait_free(&b, "order-1", PATIENCE).await;
    assert!(held.is_lost());
    drop(held);
}

/// The layer on a real backend: a request in flight when the shutdown begins holds its
/// key past the deadline and hears that its lease was lost; a new request gets 503 with
/// `Retry-After` (reason `shutting_down`); another instance then takes the key at once.
#[cfg(feature = "axum")]
async fn a_layer_shut_down_answers_503_with_retry_after_and_hands_the_key_over<F: Remote>() {
    let fixture = F::start();
    let gate = std::sync::Arc::new(Semaphore::new(0));
    let entered = std::sync::Arc::new(Semaphore::new(0));
    let layer = KeyedLockLayer::by_header("idempotency-key")
        .name(crate::support::fixtures::NAME)
        .backend(fixture.backend_named("a").await);
    let shutdown = layer.shutdown_handle();
    let app = Router::new()
        .route(
            "/pay",
            post({
                let gate = std::sync::Arc::clone(&gate);
                let entered = std::sync::Arc::clone(&entered);
                move |info: LockInfo| async move {
                    entered.add_permits(1);
                    let lease = info.lease().expect("a remote lease").clone();
                    tokio::select! {
                        () = lease.lost() => "stopped: lease lost",
                        _ = gate.acquire() => "paid",
                    }
                }
            }),
        )
        .layer(layer);
    let send = |key: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/pay")
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (parts, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    let in_flight = tokio::spawn(send("order-1"));
    let other = fixture.instance("b").await;
    // The handler runs: the key is granted (a grant still on its way when the
    // shutdown begins is refused, as it should be).
    within("the request holds its key", PATIENCE, entered.acquire())
        .await
        .unwrap()
        .forget();
    assert!(matches!(
        other.try_lock("order-1").await,
        Err(LockError::Busy)
    ));

    let draining = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { shutdown.shutdown(Duration::from_millis(200)).await }
    });
    within("the shutdown begins", PATIENCE, async {
        while !shutdown.is_shutting_down() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let (refused, body) = send("order-2").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(refused.headers.contains_key("retry-after"), "{refused:?}");
    assert_eq!(refused.headers["content-type"], "application/problem+json");
    assert!(body.contains(r#""reason":"shutting_down""#), "{body}");

    let report = within("the drain ends", PATIENCE, draining).await.unwrap();
    let (answered, body) = within("the cut-off request ends", PATIENCE, in_flight)
        .await
        .unwrap();
    assert_eq!(
        (report.finished, report.cut_off, report.leases_released),
        (0, 1, 1),
        "{answered:?} {body}"
    );
    assert_eq!(
        (answered.status, body.as_str()),
        (StatusCode::OK, "stopped: lease lost")
    );
    let taken = other.try_lock("order-1").await;
    assert!(taken.is_ok(), "{taken:?}");
}

/// `DistributedLocks::health` while a holder drains (a deadline longer than the test
/// waits): healthy before, unhealthy and `shutting_down` from the moment the shutdown
/// begins, without waiting for the drain.
async fn health_turns_unhealthy_as_a_shutdown_begins<F: Fixture>() {
    let fixture = F::start();
    let locks = fixture.instance("a").await;
    let before = locks.health().await;
    assert!(before.is_healthy(), "{before}");
    let holder = locks.lock("order-1").await.unwrap();
    let draining = tokio::spawn({
        let locks = locks.clone();
        async move { locks.shutdown(3 * PATIENCE).await }
    });
    within("the shutdown begins", PATIENCE, async {
        while !locks.is_shutting_down() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let during = locks.health().await;
    assert!(!during.is_healthy(), "{during}");
    assert!(
        during.to_json().contains(r#""status":"shutting_down""#),
        "{}",
        during.to_json()
    );
    assert!(!draining.is_finished(), "the holder still runs");
    drop(holder);
    let report = within("the drain ends", PATIENCE, draining).await.unwrap();
    assert_eq!((report.finished, report.cut_off), (1, 0), "{report}");
}

/// A layer on a backend, its health check taken before it is applied: the readiness
/// route answers 200 (the engine answered) until the shutdown begins, then 503
/// `shutting_down` while the request holding its key still runs — as the layer itself
/// answers 503 `shutting_down` to a new request.
#[cfg(feature = "axum")]
async fn a_layers_readiness_turns_503_as_its_shutdown_begins<F: Remote>() {
    use axum::response::IntoResponse;

    let fixture = F::start();
    let gate = std::sync::Arc::new(Semaphore::new(0));
    let entered = std::sync::Arc::new(Semaphore::new(0));
    let layer = KeyedLockLayer::by_header("idempotency-key")
        .name(crate::support::fixtures::NAME)
        .backend(fixture.backend_named("a").await);
    let health = layer.health_check();
    let shutdown = layer.shutdown_handle();
    let app = Router::new()
        .route(
            "/pay",
            post({
                let (gate, entered) = (gate.clone(), entered.clone());
                move || async move {
                    entered.add_permits(1);
                    gate.acquire().await.unwrap().forget();
                    "paid"
                }
            }),
        )
        .layer(layer);
    let send = |key: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/pay")
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap();
            app.oneshot(request).await.unwrap().status()
        }
    };
    let readiness = || async { health.check().await.into_response().status() };
    assert_eq!(
        readiness().await,
        StatusCode::OK,
        "{}",
        health.check().await
    );

    let in_flight = tokio::spawn(send("order-1"));
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
    assert_eq!(send("order-2").await, StatusCode::SERVICE_UNAVAILABLE);
    let during = health.check().await;
    assert_eq!(
        readiness().await,
        StatusCode::SERVICE_UNAVAILABLE,
        "{during}"
    );
    assert!(
        during.to_json().contains(r#""status":"shutting_down""#),
        "{during}"
    );
    assert!(!draining.is_finished(), "the request still holds its key");

    gate.add_permits(1);
    assert_eq!(in_flight.await.unwrap(), StatusCode::OK);
    let report = within("the drain ends", PATIENCE, draining).await.unwrap();
    assert_eq!((report.finished, report.cut_off), (1, 0), "{report}");
}
