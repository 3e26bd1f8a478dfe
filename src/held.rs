//! A key held by a request, with the accounting that goes with holding it.

use std::sync::Arc;
use std::time::Instant;

use crate::distributed::DistributedGuard;
use crate::shared::Shared;

/// Owns a request's guard; on drop releases it and records the hold time. Warns once
/// if the hold outlives the layer's long-hold threshold.
pub(crate) struct HeldKey {
    /// Released after `drop` below has recorded the hold (fields drop after it).
    guard: DistributedGuard,
    since: Instant,
    shared: Arc<Shared>,
    warned: bool,
}

impl HeldKey {
    pub(crate) fn new(guard: DistributedGuard, shared: Arc<Shared>) -> Self {
        Self {
            guard,
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
        self.shared.config.hold_until_body_end
    }

    /// Logs one warning per hold once it has lasted longer than the threshold. Checked
    /// whenever the request makes progress and at release: no timer per request.
    pub(crate) fn check_long_hold(&mut self) {
        let Some(threshold) = self.shared.config.long_hold else {
            return;
        };
        let held = self.since.elapsed();
        if !self.warned && held > threshold {
            self.warned = true;
            let key = self.guard.key_ref().short();
            tracing::warn!(
                layer = self.shared.name(),
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
        if self.guard.is_lost() {
            metrics.lease_lost.increment(1);
        }
        // Dropping the guard releases the key; a remote release runs as its own task.
    }
}
