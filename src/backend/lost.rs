//! [`LostReason`]: why a lease was lost, as its [`LeaseSignal`](super::LeaseSignal) tells.

use std::fmt;

/// Why a lease was lost: what [`LeaseSignal::lost_reason`](super::LeaseSignal::lost_reason)
/// answers, and the `reason` label of `keyed_lock_lease_lost_total`.
///
/// In each case another instance may hold the key now (or soon); the reason says where
/// to look: at the network and the engine, at this process, or at whoever else holds
/// the key.
///
/// ```
/// # async fn job(guard: tower_keyed_lock::DistributedGuard) {
/// use tower_keyed_lock::backend::LostReason;
///
/// if let Some(reason) = guard.lease().and_then(|lease| lease.lost_reason()) {
///     match reason {
///         LostReason::Unreachable => eprintln!("the lock engine could not be reached"),
///         LostReason::Expired => eprintln!("this process held the key past its lease"),
///         LostReason::NotOwner => eprintln!("the engine says the key is someone else's"),
///         _ => eprintln!("lease lost: {reason}"),
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostReason {
    /// The engine could not be reached in time: renewals went unanswered, or were
    /// answered only after the lease's deadline, or the connection or session that
    /// held the lock broke (PostgreSQL, MySQL, ZooKeeper).
    Unreachable,
    /// The lease's deadline passed on this process's clock with no renewal failing
    /// before it, and none on its way: renewal is off, or the maximum hold was reached,
    /// or this process stalled (a pause, CPU starvation) past the deadline.
    Expired,
    /// The engine answered that the lock is no longer this holder's: another holder
    /// took the key, or the engine dropped it (it expired there, an operator deleted
    /// it, a pooler moved the session).
    NotOwner,
    /// This process's graceful shutdown gave the lease back at its deadline, while the
    /// key was still held (see [`DistributedLocks::shutdown`](crate::DistributedLocks::shutdown));
    /// a leadership's as the shutdown began ([`LeaderElection`](crate::LeaderElection)).
    ShutDown,
}

impl LostReason {
    /// Every reason, in the order of [`index`](Self::index).
    pub(crate) const ALL: [LostReason; 4] = [
        Self::Unreachable,
        Self::Expired,
        Self::NotOwner,
        Self::ShutDown,
    ];

    /// The reason's label value: `unreachable`, `expired`, `not_owner` or `shut_down`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::Expired => "expired",
            Self::NotOwner => "not_owner",
            Self::ShutDown => "shut_down",
        }
    }

    /// Its position in [`ALL`](Self::ALL), for per-reason metric handles.
    pub(crate) fn index(self) -> usize {
        match self {
            Self::Unreachable => 0,
            Self::Expired => 1,
            Self::NotOwner => 2,
            Self::ShutDown => 3,
        }
    }
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Unreachable => "the lock engine could not be reached to renew the lease",
            Self::Expired => "the lease expired on this process's clock",
            Self::NotOwner => "the lock engine says another holder has the key",
            Self::ShutDown => "this process's shutdown gave the lease back",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::LostReason;

    #[test]
    fn every_reason_sits_at_its_index() {
        for (position, reason) in LostReason::ALL.into_iter().enumerate() {
            assert_eq!(reason.index(), position, "{reason:?}");
        }
    }
}
