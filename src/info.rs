//! What the handler learns about the lock it runs under.

use std::time::Duration;

use crate::backend::LeaseSignal;
use crate::key::Key;

/// Put in the request extensions by the layer before the inner service is called.
///
/// ```
/// use axum::{routing::post, Extension, Router};
/// use tower_keyed_lock::{KeyedLockLayer, LockInfo};
///
/// async fn pay(Extension(lock): Extension<LockInfo>) -> String {
///     format!("paid {} after waiting {:?}", lock.key(), lock.waited())
/// }
///
/// let app: Router = Router::new()
///     .route("/orders/{order_id}/pay", post(pay))
///     .layer(KeyedLockLayer::by_path("order_id"));
/// ```
#[derive(Debug, Clone)]
pub struct LockInfo {
    key: Key,
    waited: std::time::Duration,
    fencing_token: Option<u64>,
    lease: Option<LeaseSignal>,
}

impl LockInfo {
    pub(crate) fn new(
        key: Key,
        waited: Duration,
        fencing_token: Option<u64>,
        lease: Option<LeaseSignal>,
    ) -> Self {
        Self {
            key,
            waited,
            fencing_token,
            lease,
        }
    }

    /// The key this request holds.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// How long the request waited for the key (zero when it was free).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// A number that grows with every grant of this key, for fencing writes to storage.
    /// `None` in process: only distributed backends issue fencing tokens.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// The lost-lease signal of the distributed lease this request holds; `None` in
    /// process (an in-process lock cannot be lost).
    pub fn lease(&self) -> Option<&LeaseSignal> {
        self.lease.as_ref()
    }

    /// Whether the distributed lease was lost: another instance may now hold the key.
    /// Always false in process.
    pub fn is_lease_lost(&self) -> bool {
        self.lease.as_ref().is_some_and(LeaseSignal::is_lost)
    }
}
