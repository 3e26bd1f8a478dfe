//! [`RejectionKind`]: why a request was answered instead of served, the one list that
//! the responses (`reject.rs`) and the `reason` metric labels (`metrics.rs`) share. It
//! knows nothing of HTTP, so the lock core can count its failures by it.

use crate::error::LockError;
use crate::key::KeyError;

/// Why the layer answered instead of calling the inner service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectionKind {
    /// The key stayed busy for the whole wait timeout.
    Timeout,
    /// The key already had as many waiters as allowed.
    QueueFull,
    /// The lock table already held as many keys as allowed.
    TooManyKeys,
    /// The request carries no key.
    MissingKey,
    /// The request carries a key that cannot be used (empty, not UTF-8,
    /// control characters, too long).
    InvalidKey,
    /// The distributed lock backend could not be reached.
    Backend,
    /// The distributed lease was lost while the request held it.
    LeaseLost,
    /// The key was used before for a different request (a different fingerprint).
    FingerprintMismatch,
    /// The request body is longer than the limit of the body-buffering layer.
    BodyTooLarge,
    /// The request body did not arrive within the read timeout, or broke off.
    BodyUnread,
    /// The layers are set up in a way that cannot work (an `error` is logged).
    Misconfigured,
    /// The instance is shutting down: it takes no new key (503 with `Retry-After`, so
    /// the client retries on another instance).
    ShuttingDown,
}

impl RejectionKind {
    /// The kind of a lock that could not be taken.
    pub(crate) fn of(error: &LockError) -> Self {
        match error {
            LockError::Timeout | LockError::Busy => RejectionKind::Timeout,
            LockError::QueueFull => RejectionKind::QueueFull,
            LockError::TooManyKeys => RejectionKind::TooManyKeys,
            LockError::Backend(_) => RejectionKind::Backend,
            LockError::InvalidKey(_) => RejectionKind::InvalidKey,
            LockError::Unsupported(_) => RejectionKind::Misconfigured,
            LockError::ShuttingDown => RejectionKind::ShuttingDown,
        }
    }

    /// Every kind, in the order of [`as_str`](Self::as_str)'s list: the one list that
    /// the responses and the `reason` metric labels share.
    pub(crate) const ALL: [RejectionKind; 12] = [
        RejectionKind::Timeout,
        RejectionKind::QueueFull,
        RejectionKind::TooManyKeys,
        RejectionKind::MissingKey,
        RejectionKind::InvalidKey,
        RejectionKind::Backend,
        RejectionKind::LeaseLost,
        RejectionKind::FingerprintMismatch,
        RejectionKind::BodyTooLarge,
        RejectionKind::BodyUnread,
        RejectionKind::Misconfigured,
        RejectionKind::ShuttingDown,
    ];

    /// The `reason` metric label and the `reason` field of the response body:
    /// `timeout`, `queue_full`, `too_many_keys`, `missing_key`, `invalid_key`,
    /// `backend`, `lease_lost`, `fingerprint_mismatch`, `body_too_large`,
    /// `body_unread`, `misconfigured` or `shutting_down`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionKind::Timeout => "timeout",
            RejectionKind::QueueFull => "queue_full",
            RejectionKind::TooManyKeys => "too_many_keys",
            RejectionKind::MissingKey => "missing_key",
            RejectionKind::InvalidKey => "invalid_key",
            RejectionKind::Backend => "backend",
            RejectionKind::LeaseLost => "lease_lost",
            RejectionKind::FingerprintMismatch => "fingerprint_mismatch",
            RejectionKind::BodyTooLarge => "body_too_large",
            RejectionKind::BodyUnread => "body_unread",
            RejectionKind::Misconfigured => "misconfigured",
            RejectionKind::ShuttingDown => "shutting_down",
        }
    }
}

/// Every kind has its place in [`RejectionKind::ALL`]; `kind as usize` indexes it.
const _: () = {
    let mut i = 0;
    while i < RejectionKind::ALL.len() {
        assert!(RejectionKind::ALL[i] as usize == i);
        i += 1;
    }
};

impl From<&KeyError> for RejectionKind {
    /// [`KeyError::Missing`] is [`RejectionKind::MissingKey`],
    /// [`KeyError::Misconfigured`] is [`RejectionKind::Misconfigured`]; every other
    /// error is [`RejectionKind::InvalidKey`].
    fn from(error: &KeyError) -> Self {
        match error {
            KeyError::Missing => RejectionKind::MissingKey,
            KeyError::Misconfigured { .. } => RejectionKind::Misconfigured,
            _ => RejectionKind::InvalidKey,
        }
    }
}
