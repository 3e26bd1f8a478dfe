//! A key held by a request, with the accounting that goes with holding it.

use std::sync::Arc;
use std::time::Instant;

use crate::key::Key;
use crate::layer::Shared;
use crate::locks::KeyGuard;

/// Owns a request's guard; on drop releases it, records the hold time and updates the
/// key gauge. Warns once if the hold outlives the layer's long-hold threshold.
pub(crate) struct HeldKey {
    /// `Some` until dropped, so the gauge can be read after the release.
    guard: Option<KeyGuard<Key>>,
    since: Instant,
    shared: Arc<Shared>,
    warned: bool,
}

impl HeldKey {
    pub(crate) fn new(guard: KeyGuard<Key>, shared: Arc<Shared>) -> Self {
        shared.metrics().keys.set(shared.locks.len() as f64);
        Self {
            guard: Some(guard),
            since: Instant::now(),
            shared,
            warned: false,
        }
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
        drop(self.guard.take());
        let metrics = self.shared.metrics();
        metrics.hold.record(self.since.elapsed());
        metrics.keys.set(self.shared.locks.len() as f64);
    }
}
