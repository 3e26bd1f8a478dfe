//! [`DistributedGuard`]: a key held in this process and, with a backend, remotely.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::Inner;
use crate::backend::{Detach, Lease, LeaseSignal, LostReason};
use crate::key::Key;
use crate::locks::{KeyGuard, LockError};

/// Proof that a key is held: locally, and at the backend when the locks have one.
/// Owned, `Send` and `'static`. Dropping it releases the key — remotely first (in a
/// task of its own, since that is a round trip), then locally; [`release`](Self::release)
/// does the same and waits for it.
#[must_use = "the key is released as soon as the guard is dropped"]
pub struct DistributedGuard {
    locks: Arc<Inner>,
    /// `Some` until released.
    local: Option<KeyGuard<Key>>,
    // Boxed, as they are rare: the guard of every in-process request is moved from
    // the lock future into the response future, and stays small that way.
    lease: Option<Box<Lease>>,
    /// The backend error the guard was granted despite, with `fail_open`.
    failed: Option<Box<LockError>>,
    /// When the key was granted, for the hold-time histogram of metered locks.
    since: Instant,
    /// Set by [`hold_at_least`](Self::hold_at_least): the key is not given back before.
    hold_until: Option<tokio::time::Instant>,
    /// The lease's entry in the shutdown's list of leases it may cut off.
    shutdown_id: Option<u64>,
    /// What the remote acquisition found of a replay record it looked for; `None` if
    /// it did not look. Boxed, as the lease is.
    looked: Option<Box<Looked>>,
    /// The acquisition needed more than one attempt (see [`Self::contended`]).
    contended: bool,
}

/// What the remote acquisition found of the replay record it looked for.
#[derive(Debug)]
pub(crate) enum Looked {
    /// Not stored when the key was granted (nor can it be while the key is held).
    Absent,
    /// Stored: its bytes. The key is held in this process only.
    Stored(#[cfg_attr(not(feature = "replay"), allow(dead_code))] Vec<u8>),
}

/// The error of [`DistributedGuard::run_while_held`] when the lease was lost first:
/// the work was cancelled, because another instance may hold the key now.
/// [`reason`](Self::reason) says why it was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost {
    reason: LostReason,
}

impl LeaseLost {
    /// The error for a lease lost for `reason`.
    pub(crate) fn new(reason: LostReason) -> Self {
        Self { reason }
    }

    /// Why the lease was lost.
    pub fn reason(&self) -> LostReason {
        self.reason
    }
}

impl DistributedGuard {
    pub(super) fn new(
        locks: Arc<Inner>,
        local: KeyGuard<Key>,
        lease: Option<Lease>,
        failed: Option<LockError>,
    ) -> Self {
        let shutdown_id = lease
            .as_ref()
            .map(|lease| locks.shutdown.register(lease.cut_off()));
        let contended = lease.as_ref().is_some_and(Lease::contended);
        Self {
            contended,
            shutdown_id,
            locks,
            local: Some(local),
            lease: lease.map(Box::new),
            failed: failed.map(Box::new),
            since: Instant::now(),
            hold_until: None,
            looked: None,
        }
    }

    /// The guard of an acquisition that queued behind another holder in this process
    /// if `queued`.
    pub(super) fn queued_locally(mut self, queued: bool) -> Self {
        self.contended |= queued;
        self
    }

    /// The guard, with what its acquisition found of a replay record.
    pub(super) fn looked(mut self, looked: Looked) -> Self {
        self.looked = Some(Box::new(looked));
        self
    }

    /// What the remote acquisition found of the replay record it looked for, for the
    /// replay layer: the record, or (none stored) the lease's release, which a store
    /// may give back with the record it writes. `None` if it did not look.
    #[cfg(feature = "replay")]
    pub(crate) fn take_record_found(&mut self) -> Option<crate::backend::RecordFound> {
        use crate::backend::RecordFound;
        match *self.looked.take()? {
            Looked::Stored(record) => Some(RecordFound::Stored(record)),
            Looked::Absent => {
                let lease = self.lease.as_deref()?;
                Some(RecordFound::Absent(lease.release_slot()))
            }
        }
    }

    /// Keeps the key until it has been held for at least `duration`, however early the
    /// guard is released or dropped (ShedLock's `lockAtLeastFor`): a scheduled job that
    /// ends in 50 ms still holds its tick's key, so an instance whose timer fires late
    /// does not run the same tick again. Until then the lease stays renewed, and
    /// [`release`](Self::release) waits for it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_keyed_lock::{DistributedLocks, LockError};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let jobs = DistributedLocks::in_process("jobs");
    /// let mut tick = jobs.try_lock("report:09:00").await.unwrap();
    /// tick.hold_at_least(Duration::from_millis(200));
    /// drop(tick); // the job was quick…
    /// // …but the tick stays taken until 200 ms after it was granted.
    /// assert!(matches!(jobs.try_lock("report:09:00").await, Err(LockError::Busy)));
    /// # }
    /// ```
    pub fn hold_at_least(&mut self, duration: Duration) {
        let since = tokio::time::Instant::from_std(self.since);
        self.hold_until = Some(since + duration);
    }

    /// Records the hold, and a lease lost while held, in metered locks. Once: a
    /// released guard has no lease left to find lost when it drops.
    fn record_hold(&self) {
        if let (Some(reason), true) = (self.lost_reason(), self.local.is_some()) {
            self.locks
                .last_error
                .record(format_args!("a lease was lost: {reason}"));
        }
        if let (Some(metrics), true) = (self.locks.metrics(), self.local.is_some()) {
            metrics.hold.record(self.since.elapsed());
            let failures = self.lease().map_or(0, LeaseSignal::renewal_failures);
            metrics.lease_ended(self.lost_reason(), failures);
        }
    }

    /// The locks' shutdown cuts this guard's lease off as it begins, not at its
    /// deadline (a leadership steps down at once).
    pub(super) fn cut_off_when_shutdown_begins(&self) {
        if let Some(id) = self.shutdown_id {
            self.locks.shutdown.cut_off_at_start(id);
        }
    }

    /// Takes the lease off the shutdown's list: its guard gives it back itself.
    fn unregister(&mut self) {
        if let Some(id) = self.shutdown_id.take() {
            self.locks.shutdown.unregister(id);
        }
    }

    /// The key held.
    pub fn key(&self) -> &str {
        self.key_ref().as_str()
    }

    pub(crate) fn key_ref(&self) -> &Key {
        self.local.as_ref().expect("held until dropped").key()
    }

    /// The name of the locks (the namespace of the key at the backend).
    pub fn name(&self) -> &str {
        &self.locks.name
    }

    /// The fencing token issued with the remote grant: it grows with every grant of
    /// this key, so storage can refuse a write from an older holder. `None` in
    /// process, and from a backend that does not issue them. A shared holder's is the
    /// last writer's, or one at least that and below the next writer's (see
    /// [`DistributedLocks::lock_shared`](super::DistributedLocks::lock_shared)).
    pub fn fencing_token(&self) -> Option<u64> {
        self.lease.as_deref().and_then(Lease::fencing_token)
    }

    /// Whether the acquisition needed more than one attempt: it queued behind another
    /// holder in this process, or the backend found the key held elsewhere (or tried
    /// again after a failure) before granting it. What
    /// [`ACQUIRED_TOTAL`](crate::metrics::ACQUIRED_TOTAL) counts as `contended="true"`.
    pub fn contended(&self) -> bool {
        self.contended
    }

    /// The lost-lease signal of the remote lease; `None` in process.
    pub fn lease(&self) -> Option<&LeaseSignal> {
        self.lease.as_deref().map(Lease::signal)
    }

    /// Whether the key is held shared
    /// ([`DistributedLocks::lock_shared`](super::DistributedLocks::lock_shared)).
    pub fn is_shared(&self) -> bool {
        self.local.as_ref().is_some_and(KeyGuard::is_shared)
    }

    /// Whether the remote lease was lost: another instance may hold the key now.
    /// Always false in process.
    pub fn is_lost(&self) -> bool {
        self.lease().is_some_and(LeaseSignal::is_lost)
    }

    /// Why the remote lease was lost, once it is; always `None` in process.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.lease().and_then(LeaseSignal::lost_reason)
    }

    /// The error of work cut short by the loss of this lease.
    pub(super) fn lease_lost(&self) -> LeaseLost {
        // Asked once the lease is lost, so a reason is known; a passed deadline is
        // what the signal would say otherwise.
        LeaseLost::new(self.lost_reason().unwrap_or(LostReason::Expired))
    }

    /// Resolves when the remote lease is lost; never, in process.
    pub async fn lost(&self) {
        match self.lease() {
            Some(signal) => signal.lost().await,
            None => std::future::pending().await,
        }
    }

    /// The backend error this guard was granted despite: with
    /// [`fail_open`](super::DistributedLocksBuilder::fail_open), a backend failure
    /// leaves the key held in this process only.
    pub fn failed_open(&self) -> Option<&(dyn Error + Send + Sync + 'static)> {
        match self.failed.as_deref() {
            Some(LockError::Backend(error)) => Some(&**error),
            _ => None,
        }
    }

    /// Runs `work` while the key is held, and cancels it (drops it) if the lease is lost
    /// first. In process the lease cannot be lost, so `work` always runs to the end.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::DistributedLocks;
    /// # async fn rebuild_index() -> usize { 0 }
    /// # async fn run(jobs: DistributedLocks) {
    /// let guard = jobs.lock("search-index").await.unwrap();
    /// match guard.run_while_held(rebuild_index()).await {
    ///     Ok(documents) => println!("indexed {documents} documents"),
    ///     Err(lost) => eprintln!("{lost}: stopped the rebuild"),
    /// }
    /// # }
    /// ```
    pub async fn run_while_held<F: Future>(&self, work: F) -> Result<F::Output, LeaseLost> {
        let span = tracing::debug_span!(
            "keyed_lock.hold",
            name = &*self.locks.name,
            fencing_token = self.fencing_token(),
        );
        let work = tracing::Instrument::instrument(work, span.clone());
        let result = match self.is_lost() {
            true => Err(self.lease_lost()),
            false => tokio::select! {
                biased;
                () = self.lost() => Err(self.lease_lost()),
                output = work => Ok(output),
            },
        };
        if let Err(lost) = &result {
            tracing::warn!(parent: &span, name = &*self.locks.name, reason = lost.reason().as_str(), "the lease was lost: the work was cancelled");
        }
        result
    }

    /// Releases the key and waits until the backend has it back (or its release gave
    /// up), then releases it locally; with [`hold_at_least`](Self::hold_at_least), it
    /// first waits until then. Dropping this future midway does not stop the release:
    /// it goes on in a task of its own.
    pub async fn release(mut self) {
        if let Some((lease, local)) = self.end_hold().await {
            release_in_place(lease, local).await;
        }
    }

    /// What both releases do first: wait until [`hold_at_least`](Self::hold_at_least)'s
    /// end, count the hold and leave the registry. Returns the lease to give back and
    /// the local guard to drop after it; `None` for a key held in this process only,
    /// whose local guard is dropped here.
    async fn end_hold(&mut self) -> Option<(Lease, Option<KeyGuard<Key>>)> {
        // Not taken: a release cancelled during this sleep still holds the key till then.
        if let Some(until) = self.hold_until {
            tokio::time::sleep_until(until).await;
        }
        self.record_hold();
        self.unregister();
        let Some(lease) = self.lease.take() else {
            self.local.take();
            return None;
        };
        Some((*lease, self.local.take()))
    }
}

impl DistributedGuard {
    /// [`release`](Self::release), reporting a key that was already gone at the
    /// backend: `Err` when the lease was lost before the release (its signal was
    /// raised, or its deadline passed), or when the backend found at the release that
    /// the lock was no longer this holder's ([`LeaseLost::reason`] says why). The key
    /// is released either way. `Ok(())` for a key held in this process only.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::DistributedLocks;
    /// # async fn run(jobs: DistributedLocks) {
    /// let guard = jobs.lock("nightly-report").await.unwrap();
    /// // ... the work ...
    /// if let Err(lost) = guard.release_checked().await {
    ///     eprintln!("{lost}: the work may have overlapped another holder's");
    /// }
    /// # }
    /// ```
    pub async fn release_checked(mut self) -> Result<(), LeaseLost> {
        let Some((lease, local)) = self.end_hold().await else {
            return Ok(());
        };
        let lost_before = lease.signal().lost_reason();
        // Like `release`: dropping this future midway does not stop it.
        let released = Box::pin(async move {
            let released = lease.release_checked().await;
            drop(local);
            Some(released)
        });
        match Detach::new(released).await {
            Some(released) => released.map_err(LeaseLost::new),
            // The backend's release panicked: the key is not known to be released.
            None => Err(LeaseLost::new(
                lost_before.unwrap_or(LostReason::Unreachable),
            )),
        }
    }
}

impl Drop for DistributedGuard {
    fn drop(&mut self) {
        self.record_hold();
        self.unregister();
        let until = self
            .hold_until
            .filter(|until| *until > tokio::time::Instant::now());
        if self.lease.is_some() || until.is_some() {
            let lease = self.lease.take().map(|lease| *lease);
            let _ = release_detached(lease, self.local.take(), until);
        }
        // Else the local guard drops with the fields.
    }
}

/// Releases `lease`, then `local`, where it is polled; dropped midway, the release goes
/// on in a task of its own (see [`Detach`]). Remote first, then local, as
/// [`release_detached`].
async fn release_in_place(lease: Lease, local: Option<KeyGuard<Key>>) {
    let release = Box::pin(async move {
        lease.release().await;
        drop(local);
    });
    Detach::new(release).await;
}

/// Releases `lease`, then `local`, in a task of its own, so that the release completes
/// however its caller is cancelled; first holds both (the lease renewed) until `until`.
/// Remote first, then local: the next local waiter then finds the remote lock free
/// instead of racing the release. Without a runtime (it is shutting down) both are
/// dropped here: the lease runs out by itself.
fn release_detached(
    lease: Option<Lease>,
    local: Option<KeyGuard<Key>>,
    until: Option<tokio::time::Instant>,
) -> Option<JoinHandle<()>> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    Some(runtime.spawn(async move {
        if let Some(until) = until {
            tokio::time::sleep_until(until).await;
        }
        if let Some(lease) = lease {
            lease.release().await;
        }
        drop(local);
    }))
}

impl fmt::Debug for DistributedGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedGuard")
            .field("name", &self.locks.name)
            .field("key", &self.local.as_ref().map(KeyGuard::key))
            .field("fencing_token", &self.fencing_token())
            .field("lost", &self.is_lost())
            .field("failed_open", &self.failed.is_some())
            .finish()
    }
}

impl fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the lock's lease was lost ({}); another instance may hold the key",
            self.reason
        )
    }
}

impl Error for LeaseLost {}
