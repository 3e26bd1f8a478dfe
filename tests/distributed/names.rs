//! Layer names at a backend (DESIGN rule 14): `.backend(..)` does not change which
//! requests exclude each other. Two layer values never exclude each other in process,
//! so two layers under one name on one backend — the default name left on both, or one
//! name given to an exclusive and a counted layer — are refused when applied, with the
//! fix; layers with names of their own stay apart on one backend and meet their
//! namesakes on other instances; clones of one layer value share its name; a dropped
//! layer frees it. On every remote fixture.

// Without an engine's feature there is no remote fixture, and nothing here runs.
#![cfg_attr(
    not(any(
        feature = "redis",
        feature = "postgres",
        feature = "dynamodb",
        feature = "etcd",
        feature = "mysql",
        feature = "zookeeper",
        feature = "azure-blob"
    )),
    allow(dead_code)
)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_keyed_lock::backend::LockMode;
use tower_keyed_lock::{KeyedLockLayer, LockBackend, PathParam};

use crate::support::fixtures::{within, Remote, PATIENCE};

for_each_fixture!(
    all: [],
    remote: [
        two_layers_left_at_the_default_name_on_one_backend_are_refused,
        an_exclusive_and_a_counted_layer_under_one_name_are_refused,
        named_layers_exclude_their_namesakes_on_other_instances_only,
        clones_share_a_name_and_a_dropped_layer_frees_it,
    ],
);

/// Handlers that announce that they hold their key, then hold it until given a permit.
#[derive(Clone)]
struct Gate {
    open: Arc<Semaphore>,
    entered: Arc<Semaphore>,
}

impl Gate {
    fn new() -> Self {
        Self {
            open: Arc::new(Semaphore::new(0)),
            entered: Arc::new(Semaphore::new(0)),
        }
    }

    /// Waits until a handler holds its key.
    async fn entered(&self) {
        within("a handler holds its key", PATIENCE, self.entered.acquire())
            .await
            .unwrap()
            .forget();
    }

    /// `path` (`/orders/{order_id}/…`) behind `layer`, served the way `axum::serve`
    /// serves a router: the layer is applied to every route now.
    fn app(&self, path: &str, layer: KeyedLockLayer<PathParam>) -> Router {
        let gate = self.clone();
        let handler = move || async move {
            gate.entered.add_permits(1);
            gate.open.acquire().await.unwrap().forget();
            "done"
        };
        Router::new()
            .route(path, post(handler))
            .layer(layer)
            .with_state(())
    }
}

async fn send(app: &Router, path: &str) -> StatusCode {
    let request = Request::post(path).body(Body::empty()).unwrap();
    app.clone().oneshot(request).await.unwrap().status()
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

/// Pay and refund, both keyed by `order_id`, both left at the default name, on one
/// backend: the second is refused when applied, naming the fix. (Before, it was not,
/// and the refund of order 1 got 409 while its payment ran — which in process it does
/// not.)
async fn two_layers_left_at_the_default_name_on_one_backend_are_refused<F: Remote>() {
    let fixture = F::start();
    let backend = fixture.backend_named("a").await;
    let gate = Gate::new();
    let pay = gate.app(
        "/orders/{order_id}/pay",
        KeyedLockLayer::by_path("order_id").backend(backend.clone()),
    );
    let refund = KeyedLockLayer::by_path("order_id")
        .wait_timeout(Duration::ZERO)
        .backend(backend.clone());
    let refund = catch_unwind(AssertUnwindSafe(|| {
        gate.app("/orders/{order_id}/refund", refund)
    }));
    let refusal = match refund {
        Err(panic) => message(panic),
        Ok(refund) => {
            let paying = tokio::spawn({
                let pay = pay.clone();
                async move { send(&pay, "/orders/1/pay").await }
            });
            gate.entered().await;
            let status = send(&refund, "/orders/1/refund").await;
            gate.open.add_permits(2);
            let _ = paying.await;
            panic!(
                "not refused: the refund of order 1 got {status} while its payment ran \
                 (in process it runs)"
            );
        }
    };
    assert!(
        refusal.contains(r#"the name "default" on this backend"#),
        "{refusal}"
    );
    assert!(
        refusal.contains("give each layer its own `.name(..)`"),
        "{refusal}"
    );
    // The first layer still serves.
    gate.open.add_permits(1);
    assert_eq!(send(&pay, "/orders/1/pay").await, StatusCode::OK);
}

/// An exclusive layer and a `permits(2)` layer given one name on one backend: refused
/// when the second is applied (before, both ran at once on one key). Only on engines
/// that count permits: the others refuse `permits(2)` itself.
async fn an_exclusive_and_a_counted_layer_under_one_name_are_refused<F: Remote>() {
    let fixture = F::start();
    let backend = fixture.backend_named("a").await;
    if !backend.supports(LockMode::permits(2)) {
        return;
    }
    let gate = Gate::new();
    let exclusive = gate.app(
        "/orders/{order_id}/pay",
        KeyedLockLayer::by_path("order_id")
            .name("orders")
            .backend(backend.clone()),
    );
    let counted = KeyedLockLayer::by_path("order_id")
        .name("orders")
        .permits(2)
        .wait_timeout(Duration::ZERO)
        .backend(backend.clone());
    let counted = catch_unwind(AssertUnwindSafe(|| {
        gate.app("/orders/{order_id}/export", counted)
    }));
    let refusal = match counted {
        Err(panic) => message(panic),
        Ok(counted) => {
            let paying = tokio::spawn({
                let exclusive = exclusive.clone();
                async move { send(&exclusive, "/orders/1/pay").await }
            });
            gate.entered().await;
            let exporting = tokio::spawn({
                let counted = counted.clone();
                async move { send(&counted, "/orders/1/export").await }
            });
            let both = tokio::time::timeout(Duration::from_secs(2), gate.entered()).await;
            gate.open.add_permits(2);
            let (_, export) = (paying.await, exporting.await);
            panic!(
                "not refused: with the exclusive holder running, the counted request \
                 {} ({export:?})",
                match both {
                    Ok(()) => "ran too",
                    Err(_) => "did not run",
                }
            );
        }
    };
    assert!(
        refusal.contains("holding its keys exclusively"),
        "{refusal}"
    );
    assert!(
        refusal.contains("this one holds them with 2 permits"),
        "{refusal}"
    );
    drop(exclusive);
}

/// Layers with names of their own on one backend stay apart, as in process: the refund
/// of order 1 runs while its payment holds the key. And each meets its namesake on
/// another instance (another backend value on the same server): a second payment of
/// order 1 there gets 409.
async fn named_layers_exclude_their_namesakes_on_other_instances_only<F: Remote>() {
    let fixture = F::start();
    let a = fixture.backend_named("a").await;
    let b = fixture.backend_named("b").await;
    let gate = Gate::new();
    let layer = |name: &'static str, backend: &Arc<dyn LockBackend>| {
        KeyedLockLayer::by_path("order_id")
            .name(name)
            .wait_timeout(Duration::ZERO)
            .backend(backend.clone())
    };
    let pay_a = gate.app("/orders/{order_id}/pay", layer("pay", &a));
    let refund_a = gate.app("/orders/{order_id}/refund", layer("refund", &a));
    let pay_b = gate.app("/orders/{order_id}/pay", layer("pay", &b));

    let paying = tokio::spawn({
        let pay_a = pay_a.clone();
        async move { send(&pay_a, "/orders/1/pay").await }
    });
    gate.entered().await;
    assert_eq!(
        send(&pay_b, "/orders/1/pay").await,
        StatusCode::CONFLICT,
        "the payment's namesake on another instance waits for it"
    );
    let refunding = tokio::spawn({
        let refund_a = refund_a.clone();
        async move { send(&refund_a, "/orders/1/refund").await }
    });
    gate.entered().await; // the refund runs beside the payment
    gate.open.add_permits(2);
    assert_eq!(paying.await.unwrap(), StatusCode::OK);
    assert_eq!(refunding.await.unwrap(), StatusCode::OK);
}

/// One layer value applied to several routes (and cloned) shares one table and one
/// name: not refused. Dropped with every route it was applied to, it frees its name: a
/// layer built again under it is applied.
async fn clones_share_a_name_and_a_dropped_layer_frees_it<F: Remote>() {
    let fixture = F::start();
    let backend = fixture.backend_named("a").await;
    let gate = Gate::new();
    let orders = KeyedLockLayer::by_path("order_id")
        .name("orders")
        .wait_timeout(Duration::ZERO)
        .backend(backend.clone());
    let pay = gate.app("/orders/{order_id}/pay", orders.clone());
    let refund = gate.app("/orders/{order_id}/refund", orders.clone());
    let paying = tokio::spawn({
        let pay = pay.clone();
        async move { send(&pay, "/orders/1/pay").await }
    });
    gate.entered().await;
    assert_eq!(
        send(&refund, "/orders/1/refund").await,
        StatusCode::CONFLICT,
        "one layer value on two routes: one table"
    );
    gate.open.add_permits(1);
    assert_eq!(paying.await.unwrap(), StatusCode::OK);

    drop((orders, pay, refund));
    let again = KeyedLockLayer::by_path("order_id")
        .name("orders")
        .backend(backend.clone());
    let again = gate.app("/orders/{order_id}/pay", again);
    gate.open.add_permits(1);
    assert_eq!(send(&again, "/orders/1/pay").await, StatusCode::OK);
}
