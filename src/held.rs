//! A key held by a request, with the accounting that goes with holding it.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::Lease;
use crate::key::Key;
use crate::layer::Shared;
use crate::locks::KeyGuard;

/// Owns a request's guard; on drop releases it, records the hold time and updates the
/// key gauge. Warns once if the hold outlives the layer's long-hold threshold.
pub(crate) struct HeldKey {
    /// `Some` until dropped, so the gauge can be read after the release.
    guard: Option<KeyGuard<Key>>,
    /// The remote lease, when the layer has a backend; released before the local guard.
    lease: Option<Lease>,
    since: Instant,
    shared: Arc<Shared>,
    warned: bool,
}

impl HeldKey {
    pub(crate) fn new(guard: KeyGuard<Key>, lease: Option<Lease>, shared: Arc<Shared>) -> Self {
        shared.metrics().keys.set(shared.locks.len() as f64);
        Self {
            guard: Some(guard),
            lease,
            since: Instant::now(),
            shared,
            warned: false,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Whether the key stays held until the response body ends.
    pub(crate) fn until_body_end(&self) -> bool {
        self.shared.hold_until_body_end
    }

    /// Logs one warning per hold once it has lasted longer than the threshold. Checked
    /// whenever the request makes progress and at release: no timer per request.
    pub(crate) fn check_long_hold(&mut self) {
        let Some(threshold) = self.shared.long_hold else {
            return;
        };
        let held = self.since.elapsed();
        if !self.warned && held > threshold {
            self.warned = true;
            let key = self
                .guard
                .as_ref()
                .map(|g| g.key().short())
                .unwrap_or_default();
            tracing::warn!(
                layer = self.shared.name,
                held_ms = held.as_millis() as u64,
                key = %key,
                "key held longer than the long-hold threshold"
            );
        }
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        self.check_long_hold();
        let metrics = self.shared.metrics();
        metrics.hold.record(self.since.elapsed());
        let guard = self.guard.take();
        let Some(lease) = self.lease.take() else {
            drop(guard);
            metrics.keys.set(self.shared.locks.len() as f64);
            return;
        };
        if lease.signal().is_lost() {
            metrics.lease_lost.increment(1);
        }
        // Release remotely first, then locally: the next local waiter then finds the
        // remote lock free instead of racing the release.
        let shared = self.shared.clone();
        let release = async move {
            lease.release().await;
            drop(guard);
            shared.metrics().keys.set(shared.locks.len() as f64);
        };
        // Without a runtime (it is shutting down) the lease runs out by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release);
        }
    }
}
