//! The replay layer's own rejections.

use std::time::Duration;

use http::StatusCode;

use crate::reject::{Rejection, RejectionKind};

/// How long a client should wait before retrying when the replay store is unreachable.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Rejection {
    /// The replay store could not be reached (fail closed).
    pub(crate) fn store_unreachable() -> Self {
        Self::new(
            RejectionKind::Backend,
            StatusCode::SERVICE_UNAVAILABLE,
            Some(STORE_RETRY_AFTER),
            "the replay store is unreachable",
        )
    }

    /// A replay key used before for a different request.
    pub(crate) fn fingerprint_mismatch(status: StatusCode) -> Self {
        Self::new(
            RejectionKind::FingerprintMismatch,
            status,
            None,
            "this key was already used for a different request",
        )
    }
}
