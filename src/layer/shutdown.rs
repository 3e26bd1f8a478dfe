//! [`ShutdownHandle`]: a layer's graceful shutdown, reachable after `Router::layer`
//! consumed the layer.

use std::time::Duration;

use crate::distributed::{DistributedLocks, ShutdownReport};

/// Shuts down the lock table of a [`KeyedLockLayer`](crate::KeyedLockLayer) (and of
/// every clone and route it was applied to); made by
/// [`KeyedLockLayer::shutdown_handle`](crate::KeyedLockLayer::shutdown_handle). Cheap
/// to clone.
///
/// After [`shutdown`](Self::shutdown) begins, every request that needs a key gets 503
/// with `Retry-After` (reason `shutting_down`), including those already waiting;
/// requests that hold their key run on until the deadline, when their remote leases
/// are given back and their lost signal raised. The layer's
/// [`HealthCheck`](crate::HealthCheck) answers 503 (`shutting_down`) from the moment it
/// begins, so a readiness probe takes the instance out of rotation while it drains.
///
/// Every handle and health check taken from one layer value (after its last setting:
/// a setting changed afterwards panics) sees the same table and the same shutdown.
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use tower_keyed_lock::KeyedLockLayer;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = KeyedLockLayer::by_path("order_id");
/// let shutdown = layer.shutdown_handle();
/// let app: Router = Router::new()
///     .route("/orders/{order_id}/pay", post(|| async { "paid" }))
///     .layer(layer);
/// // On SIGTERM, beside axum's graceful shutdown:
/// let report = shutdown.shutdown(Duration::from_secs(10)).await;
/// assert_eq!((report.finished, report.cut_off), (0, 0));
/// assert!(shutdown.is_shutting_down());
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    locks: DistributedLocks,
}

impl ShutdownHandle {
    pub(crate) fn new(locks: DistributedLocks) -> Self {
        Self { locks }
    }

    /// Refuses every new key, waits for the holders up to `deadline`, then cuts off the
    /// remote leases still held; see [`DistributedLocks::shutdown`].
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLocks::shutdown`]: dropped midway, the layer still refuses new
    /// keys and the leases are given back as their requests end.
    pub async fn shutdown(&self, deadline: Duration) -> ShutdownReport {
        self.locks.shutdown(deadline).await
    }

    /// Whether the shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.locks.is_shutting_down()
    }
}
