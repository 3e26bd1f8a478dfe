//! What the handler learns about the lock it runs under.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::LeaseSignal;
use crate::key::Key;
use crate::shared::Shared;

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
///
/// When several lock layers wrap one handler, it sees the innermost layer's `LockInfo`.
#[derive(Clone)]
pub struct LockInfo {
    /// The layer (and so the table) that holds the key.
    shared: Arc<Shared>,
    key: Key,
    waited: Duration,
    fencing_token: Option<u64>,
    lease: Option<LeaseSignal>,
    /// The `LockInfo` of an outer lock layer on the same request, if any.
    outer: Option<Box<LockInfo>>,
}

impl LockInfo {
    pub(crate) fn new(
        shared: Arc<Shared>,
        key: Key,
        waited: Duration,
        fencing_token: Option<u64>,
        lease: Option<LeaseSignal>,
    ) -> Self {
        Self {
            shared,
            key,
            waited,
            fencing_token,
            lease,
            outer: None,
        }
    }

    /// Puts `self` into `extensions`, keeping the `LockInfo` of an outer lock layer
    /// reachable, so an inner layer knows every key the request already holds.
    pub(crate) fn insert_into(self, extensions: &mut http::Extensions) {
        if let Some(outer) = extensions.insert(self) {
            let inner = extensions.get_mut::<LockInfo>().expect("just inserted");
            inner.outer = Some(Box::new(outer));
        }
    }

    /// Whether this request already holds `key` in `shared`'s table (the same layer
    /// value applied twice on its path): then it must not wait for itself.
    pub(crate) fn holds(&self, shared: &Arc<Shared>, key: &Key) -> bool {
        let mut info = Some(self);
        while let Some(held) = info {
            if Arc::ptr_eq(&held.shared, shared) && held.key == *key {
                return true;
            }
            info = held.outer.as_deref();
        }
        false
    }

    /// The [`name`](crate::KeyedLockLayer::name) of the layer that holds the key (it
    /// namespaces the key at a distributed backend).
    pub fn layer(&self) -> &str {
        self.shared.name()
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

impl fmt::Debug for LockInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockInfo")
            .field("layer", &self.layer())
            .field("key", &self.key)
            .field("waited", &self.waited)
            .field("fencing_token", &self.fencing_token)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}
