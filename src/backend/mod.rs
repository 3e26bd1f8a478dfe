//! Distributed backends: serialize a key across every instance of a service.
//!
//! Requests first queue on the layer's in-process table; only the local winner asks the
//! backend (two tiers: N local waiters on a hot key cost one remote contender, not N
//! pollers). When the local winner finishes it releases the remote lock first and then
//! the local one, so the next local waiter contends remotely in its turn. Between
//! instances, fairness is what the backend gives: PostgreSQL queues waiters in arrival
//! order; Redis wakes every waiter on a release and the fastest one wins.
//!
//! A backend implements [`LockBackend`]; the layer makes every acquisition cancel-safe:
//! it runs the acquire in a task of its own, so a dropped request detaches it instead of
//! cancelling it mid-round-trip, and an unwanted lease is released when the task ends.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::key::Key;
use crate::locks::LockError;

#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub mod dynamodb;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

// Defined at the crate root, which the replay stores and the layer share; re-exported
// here, where implementers of `LockBackend` look for it.
pub use crate::BoxFuture;

/// A lock service shared by every instance of an application.
pub trait LockBackend: Send + Sync + 'static {
    /// Acquires the remote lock of `key` (already namespaced by the layer `name`),
    /// waiting at most `wait`; fails with [`LockError::Timeout`] when the wait is over,
    /// or [`LockError::Backend`] when the backend cannot be reached or errs. Must not
    /// outlive `wait` by more than one network timeout.
    ///
    /// The layer runs the future in a task of its own and never drops it midway; a
    /// lease nobody waits for any more is dropped, which releases it. So
    /// implementations need not be cancel-safe themselves.
    fn acquire(&self, name: &str, key: &Key, wait: Duration)
        -> BoxFuture<Result<Lease, LockError>>;
}

/// A remote lock held: its fencing token and lost-lease signal. Dropping it releases
/// the lock (in a task of its own, since release is a round trip).
pub struct Lease {
    fencing_token: Option<u64>,
    signal: LeaseSignal,
    release: Option<Box<dyn ReleaseLease>>,
}

/// How a backend gives a lease back: stop renewing, then release remotely.
pub trait ReleaseLease: Send + Sync + 'static {
    /// Releases the lease; runs at most until its own network timeout.
    fn release(self: Box<Self>) -> BoxFuture<()>;
}

impl Lease {
    /// A lease that `release` gives back; `signal` reports its loss.
    pub fn new(
        fencing_token: Option<u64>,
        signal: LeaseSignal,
        release: impl ReleaseLease,
    ) -> Self {
        Self {
            fencing_token,
            signal,
            release: Some(Box::new(release)),
        }
    }

    /// The fencing token issued with the grant (strictly increasing per key), if the
    /// backend issues them.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// The lost-lease signal of this lease.
    pub fn signal(&self) -> &LeaseSignal {
        &self.signal
    }

    /// Releases the lease and waits until the backend has it back (or the release gave
    /// up). Dropping the lease instead releases it in the background.
    pub async fn release(mut self) {
        if let Some(release) = self.release.take() {
            release.release().await;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(release) = self.release.take() else {
            return;
        };
        // Without a runtime (it is shutting down) the lease runs out by itself.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release.release());
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("fencing_token", &self.fencing_token)
            .field("lost", &self.signal.is_lost())
            .finish()
    }
}

/// Tells a handler that its lease was lost: the lock expired or was taken over, so
/// another instance may now run for the same key. Cheap to clone.
///
/// ```
/// # async fn handler(info: tower_keyed_lock::LockInfo) {
/// if let Some(lease) = info.lease() {
///     tokio::select! {
///         _ = lease.lost() => { /* stop: another instance may hold the key now */ }
///         _ = do_the_work() => {}
///     }
/// }
/// # }
/// # async fn do_the_work() {}
/// ```
#[derive(Clone)]
pub struct LeaseSignal(watch::Receiver<bool>);

/// The backend's side of a [`LeaseSignal`].
#[derive(Debug)]
pub struct LeaseLostSender(watch::Sender<bool>);

impl LeaseSignal {
    /// A signal and the sender that raises it.
    pub fn new() -> (LeaseLostSender, LeaseSignal) {
        let (sender, receiver) = watch::channel(false);
        (LeaseLostSender(sender), LeaseSignal(receiver))
    }

    /// Whether the lease has been lost.
    pub fn is_lost(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves when the lease is lost; never resolves if it is released first.
    pub async fn lost(&self) {
        let mut receiver = self.0.clone();
        if receiver.wait_for(|lost| *lost).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl LeaseLostSender {
    /// Raises the signal (once; later calls do nothing). Returns whether this call
    /// raised it.
    pub fn lose(&self) -> bool {
        self.0
            .send_if_modified(|lost| !std::mem::replace(lost, true))
    }
}

impl fmt::Debug for LeaseSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseSignal")
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// Runs `backend.acquire` in a task of its own and waits for it. Dropping the returned
/// future detaches the task instead of cancelling it mid-round-trip: if it still gets
/// the lease, tokio drops the unclaimed output, and the lease's drop releases it. So no
/// cancellation can leave a remote lock held or a locked connection in a pool.
pub(crate) fn acquire_detached(
    backend: &Arc<dyn LockBackend>,
    name: &str,
    key: &Key,
    wait: Duration,
) -> BoxFuture<Result<Lease, LockError>> {
    let task = tokio::spawn(backend.acquire(name, key, wait));
    Box::pin(async move {
        match task.await {
            Ok(result) => result,
            Err(join_error) => Err(LockError::Backend(Box::new(join_error))),
        }
    })
}
