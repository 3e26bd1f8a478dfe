//! [`LockError`]: why a key could not be locked, in process or at a backend.

use std::error::Error;
use std::fmt;

use crate::key::KeyError;

/// Why a key could not be locked.
#[derive(Debug)]
#[non_exhaustive]
pub enum LockError {
    /// The wait for the key exceeded its timeout.
    Timeout,
    /// [`KeyedLocks::try_lock`](crate::KeyedLocks::try_lock) found the key held.
    Busy,
    /// The key already has `max_waiters` waiters.
    QueueFull,
    /// The key is new and the table already holds `max_keys` keys.
    TooManyKeys,
    /// A distributed backend failed (unreachable, protocol error, …).
    Backend(Box<dyn Error + Send + Sync>),
    /// The key cannot be used (empty, too long, control characters): from
    /// [`DistributedLocks`](crate::DistributedLocks), which takes keys as text.
    InvalidKey(KeyError),
    /// The locks' backend cannot give what was asked (it names what: shared locks, …);
    /// nothing was locked.
    Unsupported(&'static str),
    /// The locks are shutting down
    /// ([`DistributedLocks::shutdown`](crate::DistributedLocks::shutdown)): no key is
    /// granted any more, to a new caller or to one already waiting.
    ShuttingDown,
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockError::Timeout => f.write_str("timed out waiting for the key"),
            LockError::Busy => f.write_str("the key is held"),
            LockError::QueueFull => f.write_str("too many waiters for the key"),
            LockError::TooManyKeys => f.write_str("too many keys in the lock table"),
            LockError::Backend(error) => write!(f, "lock backend failed: {error}"),
            LockError::InvalidKey(error) => write!(f, "invalid lock key: {error}"),
            LockError::Unsupported(what) => write!(f, "the lock backend does not support {what}"),
            LockError::ShuttingDown => f.write_str("the locks are shutting down"),
        }
    }
}

impl Error for LockError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            LockError::Backend(error) => Some(&**error),
            LockError::InvalidKey(error) => Some(error),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_error_keeps_its_source() {
        let error = LockError::Backend("connection refused".into());
        assert_eq!(error.to_string(), "lock backend failed: connection refused");
        assert!(error.source().is_some());
    }
}
