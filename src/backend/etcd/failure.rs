//! What can fail in a talk with etcd, and what is tried again: a request that failed
//! for a transient reason (no answer in time, a member down or unreachable, a broken
//! connection, a leader election, no leader) is sent again after a jittered pause, as
//! long as its step's time lasts; a definite answer (a lease not found, a request etcd
//! refuses) ends the step at once.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::{sleep, timeout_at, Instant};
use tonic::Code;

use crate::backend::ttl::Backoff;
use crate::LockError;

/// The pauses before a request that failed for a transient reason is sent again within
/// its step (the client's balancer may then pick another member).
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(5);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(100);

/// Why an acquisition failed at etcd (inside [`LockError::Backend`]).
#[derive(Debug)]
pub enum EtcdLockError {
    /// etcd did not answer a step within the command timeout.
    TimedOut(&'static str),
    /// The waiter's own lease ran out while it queued (its keep-alives did not get
    /// through): its place in the queue is gone.
    LeaseLostWhileQueued,
    /// An answer that the lock recipe cannot use.
    Unexpected(&'static str),
}

impl fmt::Display for EtcdLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EtcdLockError::TimedOut(step) => {
                write!(f, "etcd did not answer within the command timeout ({step})")
            }
            EtcdLockError::LeaseLostWhileQueued => {
                f.write_str("the waiter's etcd lease ran out while it queued")
            }
            EtcdLockError::Unexpected(what) => write!(f, "unexpected etcd answer: {what}"),
        }
    }
}

impl std::error::Error for EtcdLockError {}

pub(super) fn backend(error: impl std::error::Error + Send + Sync + 'static) -> LockError {
    LockError::Backend(Box::new(error))
}

/// Why a step failed.
pub(super) enum Failure {
    /// The contender's key is gone: its lease expired.
    Gone,
    TimedOut,
    Etcd(etcd_client::Error),
}

impl Failure {
    /// Whether trying again later may succeed.
    pub(super) fn transient(&self) -> bool {
        match self {
            Failure::Gone => false,
            Failure::TimedOut => true,
            Failure::Etcd(error) => is_transient(error),
        }
    }

    /// The error of an acquisition whose step `what` failed.
    pub(super) fn into_error(self, what: &'static str) -> LockError {
        match self {
            Failure::Gone => backend(EtcdLockError::LeaseLostWhileQueued),
            Failure::TimedOut => backend(EtcdLockError::TimedOut(what)),
            Failure::Etcd(error) => backend(error),
        }
    }
}

/// Whether `error` may pass by itself: a member down, restarting or unreachable (a
/// transport error, a broken or reset connection, a stream that ended), a leader
/// election or no leader (etcd answers `Unavailable`, or "not leader"), etcd
/// overloaded (`ResourceExhausted`, "too many requests"), a request cancelled or timed
/// out on the way. Definite: a lease or key not found, invalid arguments, permissions
/// and authentication, a compacted revision, anything else.
pub(super) fn is_transient(error: &etcd_client::Error) -> bool {
    use etcd_client::Error;
    match error {
        Error::GRpcStatus(status) => match status.code() {
            // Transport failures reach tonic's callers as `Unknown` or `Internal`
            // (an HTTP/2 connection reset or gone away), `Cancelled` when the
            // connection dropped mid-request.
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::Aborted
            | Code::ResourceExhausted => true,
            Code::FailedPrecondition => status.message().contains("not leader"),
            _ => false,
        },
        Error::TransportError(_) | Error::IoError(_) | Error::WatchError(_) => true,
        Error::LeaseKeepAliveError(message) => !message.contains("lease not found"),
        _ => false,
    }
}

/// Whether etcd answered that the lease is gone (revoked, or expired).
pub(super) fn lease_not_found(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => status.code() == Code::NotFound,
        etcd_client::Error::LeaseKeepAliveError(message) => message.contains("lease not found"),
        _ => false,
    }
}

/// Runs one request until it is answered or `until` passes: each attempt is bounded by
/// the command timeout, and one that failed for a transient reason (or timed out) is
/// sent again after a jittered pause. Every step is safe to repeat: a lease granted
/// twice leaves one without a key, which expires; the queue's put writes the same key
/// again; reads and watches change nothing.
pub(super) async fn step<T, Fut>(
    until: Instant,
    command_timeout: Duration,
    mut request: impl FnMut() -> Fut,
) -> Result<T, Failure>
where
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let mut backoff = Backoff::new(RETRY_PAUSE_MIN, RETRY_PAUSE_MAX);
    loop {
        let limit = (Instant::now() + command_timeout).min(until);
        let failure = match timeout_at(limit, request()).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(error)) if is_transient(&error) => Failure::Etcd(error),
            Ok(Err(error)) => return Err(Failure::Etcd(error)),
            Err(_) => Failure::TimedOut,
        };
        let pause = backoff.pause();
        if Instant::now() + pause >= until {
            return Err(failure);
        }
        if let Failure::Etcd(error) = &failure {
            tracing::debug!(%error, "etcd request failed; sending it again");
        }
        sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::Error;
    use tonic::Status;

    #[test]
    fn elections_and_broken_connections_are_transient() {
        for status in [
            Status::unavailable("etcdserver: leader changed"),
            Status::unavailable("etcdserver: no leader"),
            Status::unavailable("etcdserver: request timed out"),
            Status::unknown("transport error"),
            Status::internal("h2 protocol error: error reading a body from connection"),
            Status::cancelled("operation was canceled"),
            Status::resource_exhausted("etcdserver: too many requests"),
            Status::failed_precondition("etcdserver: not leader"),
        ] {
            assert!(
                is_transient(&Error::GRpcStatus(status.clone())),
                "{status:?}"
            );
        }
        assert!(is_transient(&Error::WatchError("stream ended".into())));
        assert!(is_transient(&Error::LeaseKeepAliveError(
            "keep-alive stream ended".into()
        )));
    }

    #[test]
    fn refusals_and_lost_leases_are_definite() {
        for status in [
            Status::not_found("etcdserver: requested lease not found"),
            Status::invalid_argument("etcdserver: key is not provided"),
            Status::permission_denied("etcdserver: permission denied"),
            Status::unauthenticated("etcdserver: invalid auth token"),
            Status::out_of_range("etcdserver: mvcc: required revision has been compacted"),
            Status::failed_precondition("etcdserver: some other precondition"),
        ] {
            assert!(
                !is_transient(&Error::GRpcStatus(status.clone())),
                "{status:?}"
            );
        }
        let gone = Error::LeaseKeepAliveError("lease not found".into());
        assert!(!is_transient(&gone));
        assert!(lease_not_found(&gone));
        assert!(lease_not_found(&Error::GRpcStatus(Status::not_found(
            "etcdserver: requested lease not found"
        ))));
    }
}
