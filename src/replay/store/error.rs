//! [`StoreError`]: what a replay store's failure looks like to the layer.

use std::fmt;
use std::time::Duration;

/// A store failed: unreachable, timed out, or it holds a record it cannot read.
#[derive(Debug)]
pub struct StoreError(Box<dyn std::error::Error + Send + Sync>);

impl StoreError {
    /// An error that wraps `error`.
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self(error.into())
    }

    /// A store call that took longer than `limit`.
    pub(crate) fn timeout(limit: Duration) -> Self {
        Self::new(format!("the replay store did not answer within {limit:?}"))
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replay store: {}", self.0)
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}
