//! [`HealthCheck`]: a layer's health check, for a readiness probe or a health route
//! (see [`Health`]).

use crate::backend::Health;
use crate::distributed::DistributedLocks;

/// Checks the backend of a [`KeyedLockLayer`](crate::KeyedLockLayer), reports the last
/// backend error its requests met, and turns unhealthy once the layer's shutdown began;
/// made by [`KeyedLockLayer::health_check`](crate::KeyedLockLayer::health_check) before
/// the layer is applied, and cheap to clone into a handler.
#[derive(Clone)]
pub struct HealthCheck {
    /// The layer's own locks: every handle taken from the layer value sees them.
    locks: DistributedLocks,
}

impl HealthCheck {
    pub(super) fn new(locks: DistributedLocks) -> Self {
        Self { locks }
    }

    /// Runs the check (see [`DistributedLocks::health`]): the backend's (in process,
    /// unchecked and healthy) with the last error the layer's requests met; unhealthy,
    /// without asking the backend, once the layer's shutdown began (a readiness probe
    /// then takes the instance out of rotation, as the layer already answers 503).
    pub async fn check(&self) -> Health {
        self.locks.health().await
    }
}

impl std::fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthCheck")
            .field("distributed", &self.locks.is_distributed())
            .finish()
    }
}

#[cfg(feature = "axum")]
/// The health check as a response: `200` when healthy, else `503`, with the JSON body
/// of the health as JSON.
impl axum::response::IntoResponse for Health {
    fn into_response(self) -> axum::response::Response {
        let status = match self.is_healthy() {
            true => http::StatusCode::OK,
            false => http::StatusCode::SERVICE_UNAVAILABLE,
        };
        let body = self.to_json();
        (
            status,
            [(http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}
