//! [`RetryLater`]: a backend error that may be shown to clients, with when to retry.

use std::fmt;
use std::time::Duration;

/// A cause of [`LockError::Backend`](crate::LockError::Backend) that the layer passes
/// on: its detail becomes the 503's problem detail and `retry_after` its
/// `Retry-After` (whole seconds, rounded up). Other causes stay in the logs, since
/// they may name hosts or internals; a backend uses this only for a reason that is
/// fine to show and that it logs itself, such as the Redis restart guard, so the layer
/// does not log it again for every request.
///
/// ```
/// use std::time::Duration;
/// use tower_keyed_lock::backend::RetryLater;
///
/// let later = RetryLater::new("grants resume in 2.5 s", Duration::from_millis(2500));
/// assert_eq!(later.to_string(), "grants resume in 2.5 s");
/// assert_eq!(later.retry_after(), Duration::from_millis(2500));
/// ```
#[derive(Debug, Clone)]
pub struct RetryLater {
    detail: String,
    retry_after: Duration,
}

impl RetryLater {
    /// Why nothing can be granted now (sent to clients: no keys, hosts or secrets),
    /// and how long until it can.
    pub fn new(detail: impl Into<String>, retry_after: Duration) -> Self {
        Self {
            detail: detail.into(),
            retry_after,
        }
    }

    /// Why nothing can be granted now.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// How long until a grant can succeed.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }
}

impl fmt::Display for RetryLater {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

impl std::error::Error for RetryLater {}
