//! [`HealthCheck`]: a layer's backend health check, for a readiness probe or a health
//! route (see [`Health`]).

use std::sync::{Arc, OnceLock};

use super::shared::Shared;
use crate::backend::{Health, LockBackend};

/// Checks the backend of a [`KeyedLockLayer`](crate::KeyedLockLayer) and reports the
/// last backend error its requests met; made by
/// [`KeyedLockLayer::health_check`](crate::KeyedLockLayer::health_check) before the
/// layer is applied, and cheap to clone into a handler.
#[derive(Clone)]
pub struct HealthCheck {
    backend: Option<Arc<dyn LockBackend>>,
    shared: Arc<OnceLock<Arc<Shared>>>,
}

impl HealthCheck {
    pub(super) fn new(
        backend: Option<Arc<dyn LockBackend>>,
        shared: Arc<OnceLock<Arc<Shared>>>,
    ) -> Self {
        Self { backend, shared }
    }

    /// Runs the check (see [`LockBackend::health`]); in process, unchecked and healthy.
    pub async fn check(&self) -> Health {
        // Once applied, the layer's locks also know the last error its requests met.
        if let Some(shared) = self.shared.get() {
            return shared.locks.health().await;
        }
        match &self.backend {
            Some(backend) => backend.health().await,
            None => Health::unchecked("in-process"),
        }
    }
}

impl std::fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthCheck")
            .field("distributed", &self.backend.is_some())
            .finish()
    }
}
