//! Distributed backends: serialize a key across every instance of a service.
//!
//! Requests first queue on the layer's in-process table; only the local winner asks the
//! backend (two tiers: N local waiters on a hot key cost one remote contender, not N
//! pollers). When the local winner finishes it releases the remote lock first and then
//! the local one, so the next local waiter contends remotely in its turn. Between
//! instances, fairness is what the backend gives: PostgreSQL and etcd queue waiters in
//! arrival order; Redis wakes every waiter on a release and the fastest one wins.
//!
//! A backend implements [`LockBackend`]; the layer makes every acquisition cancel-safe:
//! it runs the acquire in a task of its own, so a dropped request detaches it instead of
//! cancelling it mid-round-trip, and an unwanted lease is released when the task ends.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::LockError;
use crate::key::Key;

#[cfg(feature = "azure-blob")]
#[cfg_attr(docsrs, doc(cfg(feature = "azure-blob")))]
pub mod azure_blob;
#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub mod dynamodb;
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub mod etcd;
mod holder;
#[cfg(any(feature = "etcd", feature = "zookeeper", feature = "azure-blob"))]
mod key_component;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redlock;
mod retry_later;
#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "etcd",
    feature = "azure-blob",
    feature = "zookeeper"
))]
mod ttl;
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub mod zookeeper;

#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "azure-blob",
    feature = "zookeeper",
    feature = "postgres"
))]
pub(crate) use holder::from_unix_millis;
#[cfg(any(feature = "dynamodb", feature = "azure-blob"))]
pub(crate) use holder::unix_millis;
pub use holder::{default_instance_id, Holder};
pub use retry_later::RetryLater;

// Defined at the crate root, which the replay stores and the layer share; re-exported
// here, where implementers of `LockBackend` look for it.
pub use crate::BoxFuture;

/// What [`LockBackend::acquire`] returns: a lease, or why there is none.
pub type Acquisition = BoxFuture<Result<Lease, LockError>>;

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
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition;

    /// Whether every lease carries a [fencing token](Lease::fencing_token) (the
    /// default). A replay store that orders its writes by token is refused under a
    /// backend that says no.
    fn issues_fencing_tokens(&self) -> bool {
        true
    }

    /// The engine's short name, for spans and logs: `"redis"`, `"postgres"`, …
    /// (`"custom"` unless the backend says).
    fn engine(&self) -> &'static str {
        "custom"
    }

    /// Why this backend issues no fencing tokens when no setting can change that (a
    /// Redlock quorum): the error of every configuration that needs them names it.
    /// `None` (the default) when it issues them, or a setting turns them on.
    fn no_fencing_tokens_reason(&self) -> Option<&'static str> {
        None
    }

    /// Who holds `key` (namespaced by `name`, as in [`acquire`](Self::acquire)) now,
    /// read without taking or extending the lock: `None` when the key is free. Fails
    /// with [`LockError::Unsupported`] (the default) when the backend cannot tell, or
    /// [`LockError::Backend`] when the engine errs.
    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let _ = (name, key);
        Box::pin(async { Err(LockError::Unsupported("inspecting the holder of a key")) })
    }
}

/// A shared backend is a backend: one client can serve several layers and job locks.
impl<B: LockBackend + ?Sized> LockBackend for Arc<B> {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        (**self).acquire(name, key, wait)
    }

    fn issues_fencing_tokens(&self) -> bool {
        (**self).issues_fencing_tokens()
    }

    fn engine(&self) -> &'static str {
        (**self).engine()
    }

    fn no_fencing_tokens_reason(&self) -> Option<&'static str> {
        (**self).no_fencing_tokens_reason()
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        (**self).holder(name, key)
    }
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
/// "Lost" is a fact of the clock: a lease with a validity deadline counts as lost from
/// the instant the monotonic clock passes it, whether or not the backend's renewal task
/// has run since. A holder whose runtime stalled past the deadline (a long pause, CPU
/// starvation) learns it at its next look, not when a task gets to run. Once lost, a
/// lease stays lost.
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
pub struct LeaseSignal(watch::Receiver<Validity>);

/// The backend's side of a [`LeaseSignal`]: moves its deadline on renewal and raises
/// it. Dropping it without raising it (the lease was released) freezes the signal as
/// not lost, unless the deadline had already passed.
#[derive(Debug)]
pub struct LeaseLostSender(watch::Sender<Validity>);

/// What a signal knows: raised, or valid until a deadline (`None`: no deadline, only
/// the backend can tell).
#[derive(Debug, Clone, Copy)]
struct Validity {
    lost: bool,
    valid_until: Option<Instant>,
}

impl Validity {
    fn is_lost_at(&self, now: Instant) -> bool {
        self.lost || self.valid_until.is_some_and(|deadline| now >= deadline)
    }
}

impl LeaseSignal {
    /// A signal without a deadline, and the sender that raises it: for a backend whose
    /// lease is lost only by an event it observes (a connection that ends).
    pub fn new() -> (LeaseLostSender, LeaseSignal) {
        Self::with_validity(None)
    }

    /// A signal that counts as lost from `valid_until` on (the grant's send time plus
    /// the lease, minus the drift margin), unless [`LeaseLostSender::extend`] moves it.
    pub fn with_deadline(valid_until: Instant) -> (LeaseLostSender, LeaseSignal) {
        Self::with_validity(Some(valid_until))
    }

    fn with_validity(valid_until: Option<Instant>) -> (LeaseLostSender, LeaseSignal) {
        let (sender, receiver) = watch::channel(Validity {
            lost: false,
            valid_until,
        });
        (LeaseLostSender(sender), LeaseSignal(receiver))
    }

    /// Whether the lease has been lost: raised by the backend, or its deadline passed.
    pub fn is_lost(&self) -> bool {
        // The clock is read before the state, so a reader that saw the deadline pass
        // read it before any `extend` that could move it; that `extend` then finds the
        // deadline passed too and refuses (see `LeaseLostSender::extend`).
        let now = Instant::now();
        self.0.borrow().is_lost_at(now)
    }

    /// The instant the lease counts as lost unless renewed first; `None` if the
    /// backend sets no deadline, or the lease is lost or released.
    pub fn valid_until(&self) -> Option<Instant> {
        let validity = *self.0.borrow();
        validity.valid_until.filter(|_| !validity.lost)
    }

    /// Resolves when the lease is lost (raised, or its deadline passed); never resolves
    /// if it is released first.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads the signal.
    pub async fn lost(&self) {
        let mut receiver = self.0.clone();
        loop {
            let now = Instant::now();
            let validity = *receiver.borrow_and_update();
            if validity.is_lost_at(now) {
                return;
            }
            let changed = match validity.valid_until {
                Some(deadline) => tokio::select! {
                    changed = receiver.changed() => changed,
                    () = tokio::time::sleep_until(deadline) => Ok(()),
                },
                None => receiver.changed().await,
            };
            if changed.is_err() {
                // Released: the sender froze the signal when it dropped.
                if receiver.borrow().is_lost_at(Instant::now()) {
                    return;
                }
                std::future::pending::<()>().await;
            }
        }
    }
}

impl LeaseLostSender {
    /// Raises the signal (once; later calls do nothing). Returns whether this call
    /// raised it.
    pub fn lose(&self) -> bool {
        self.0.send_if_modified(|validity| {
            let was_lost = std::mem::replace(&mut validity.lost, true);
            !was_lost
        })
    }

    /// Moves the deadline to `valid_until` after a renewal; returns `false` and raises
    /// the signal instead if the current deadline has already passed: a reader may
    /// have seen the lease lost, and a lost lease stays lost.
    pub fn extend(&self, valid_until: Instant) -> bool {
        let mut extended = false;
        self.0.send_if_modified(|validity| {
            if validity.is_lost_at(Instant::now()) {
                let was_lost = std::mem::replace(&mut validity.lost, true);
                return !was_lost;
            }
            validity.valid_until = Some(valid_until);
            extended = true;
            true
        });
        extended
    }
}

impl Drop for LeaseLostSender {
    fn drop(&mut self) {
        // The lease ends here (released, or its renewal task done): freeze the signal,
        // lost if its deadline has passed, else never lost.
        self.0.send_if_modified(|validity| {
            if validity.lost {
                return false;
            }
            validity.lost = validity.is_lost_at(Instant::now());
            validity.valid_until = None;
            true
        });
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
) -> Acquisition {
    let task = tokio::spawn(backend.acquire(name, key, wait));
    Box::pin(async move {
        match task.await {
            Ok(result) => result,
            Err(join_error) => Err(LockError::Backend(Box::new(join_error))),
        }
    })
}

#[cfg(all(test, not(loom)))]
mod lease_signal_tests {
    use std::time::Duration;

    use proptest::prelude::*;
    use tokio::time::Instant;

    use super::LeaseSignal;

    /// What can happen to a lease while a holder looks at its signal.
    #[derive(Debug, Clone)]
    enum Step {
        /// Time passes (ms).
        Wait(u64),
        /// A renewal answered: valid for this many ms from now.
        Extend(u64),
        /// The backend says the lease is gone.
        Lose,
        /// The lease is released (its sender dropped).
        Release,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u64..40).prop_map(Step::Wait),
            3 => (0u64..40).prop_map(Step::Extend),
            1 => Just(Step::Lose),
            1 => Just(Step::Release),
        ]
    }

    proptest! {
        /// Against a model: lost once raised or once the clock passed the deadline,
        /// and never un-lost — a renewal answered after the deadline does not revive
        /// it, and a release freezes what was true then.
        #[test]
        fn the_signal_follows_the_clock_and_stays_lost(steps in prop::collection::vec(step(), 1..40)) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(async {
                let (sender, signal) = LeaseSignal::with_deadline(Instant::now() + Duration::from_millis(20));
                let mut sender = Some(sender);
                // The model.
                let mut deadline = Some(Instant::now() + Duration::from_millis(20));
                let mut lost = false;
                let mut seen_lost = false;
                for step in steps {
                    match step {
                        Step::Wait(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
                        Step::Extend(ms) => {
                            if let Some(sender) = &sender {
                                let now = Instant::now();
                                let expired = lost || deadline.is_some_and(|d| now >= d);
                                let extended = sender.extend(now + Duration::from_millis(ms));
                                prop_assert_eq!(extended, !expired);
                                if expired { lost = true } else { deadline = Some(now + Duration::from_millis(ms)) }
                            }
                        }
                        Step::Lose => {
                            if let Some(sender) = &sender {
                                sender.lose();
                                lost = true;
                            }
                        }
                        Step::Release => {
                            if sender.take().is_some() {
                                lost = lost || deadline.is_some_and(|d| Instant::now() >= d);
                                deadline = None;
                            }
                        }
                    }
                    let expected = lost || deadline.is_some_and(|d| Instant::now() >= d);
                    prop_assert_eq!(signal.is_lost(), expected);
                    prop_assert!(!seen_lost || signal.is_lost(), "a lost lease came back");
                    seen_lost |= signal.is_lost();
                }
                Ok(())
            })?;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lost_resolves_at_the_deadline_without_the_sender() {
        let (sender, signal) =
            LeaseSignal::with_deadline(Instant::now() + Duration::from_millis(50));
        let started = Instant::now();
        signal.lost().await;
        assert_eq!(started.elapsed(), Duration::from_millis(50));
        drop(sender);
        // Released after the deadline: it stays lost.
        assert!(signal.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_lease_is_never_lost() {
        let (sender, signal) =
            LeaseSignal::with_deadline(Instant::now() + Duration::from_millis(50));
        drop(sender);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!signal.is_lost());
        assert!(tokio::time::timeout(Duration::from_secs(1), signal.lost())
            .await
            .is_err());
    }
}
