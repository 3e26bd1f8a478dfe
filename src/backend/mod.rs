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
//! a dropped request moves the acquire into a task of its own instead of cancelling it
//! mid-round-trip, and an unwanted lease is released when that task ends.
//!
//! Besides exclusive locks, a backend may hold a key shared or as one of `n` permits
//! ([`LockMode`], [`LockBackend::acquire_mode`]); it says which in
//! [`LockBackend::supports`], and a mode it lacks is refused when the locks or the
//! layer are built. Redis and PostgreSQL (session locks) give every mode; the other
//! engines hold keys exclusively only.
//!
//! # Files
//!
//! - `mod.rs`: [`LockBackend`], [`Lease`], [`LeaseSignal`] and its sender: what every
//!   engine implements and hands out.
//! - `lost.rs`: [`LostReason`], why a lease was lost.
//! - `mode.rs`: [`LockMode`]: exclusive, shared, or one of `n` permits.
//! - `health.rs`: [`Health`], the health check every engine gets; `deployment/`: the
//!   deployment check ([`DeploymentReport`]), its findings and its live run.
//! - `holder.rs`: [`Holder`], who holds a key, and the default instance id.
//! - `retry_later.rs`: [`RetryLater`], an error that says when to come back.
//! - `record.rs`: [`RecordLookup`] and [`Acquired`]: a replay record read in an
//!   acquisition's own round trip; `RecordWrite`, one written in a release's.
//! - `engine_head.rs`: `engine_head!`, the part of `impl LockBackend` every built-in
//!   engine answers the same way (its name, its identity, its configuration check).
//! - `key_component.rs`: a key as a path component (etcd, ZooKeeper, Azure Blob, S3).
//! - `settings.rs`: the settings every lease engine's builder shares, and their check;
//!   `setup_error.rs`: [`SetupError`], why a backend could not be built.
//! - `ttl/`: the TTL-lease engine (attempt, renewal, give-back, timing) that the
//!   lease-based engines share.
//! - `server_clock.rs`: a lock server's clock, from the `Date` of its answers;
//!   `aws/`: what the engines on the AWS SDK share.
//! - `redis/`, `redlock/`, `postgres/`, `dynamodb/`, `etcd/`, `zookeeper/`, `mysql/`,
//!   `azure_blob/`, `s3/`: one engine each.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::LockError;
use crate::key::Key;

#[cfg(any(feature = "dynamodb", feature = "s3"))]
mod aws;
#[cfg(feature = "azure-blob")]
pub mod azure_blob;
pub mod deployment;
mod detach;
#[cfg(feature = "dynamodb")]
pub mod dynamodb;
mod engine_head;
#[cfg(feature = "etcd")]
pub mod etcd;
pub(crate) mod health;
mod holder;
#[cfg(any(
    feature = "etcd",
    feature = "zookeeper",
    feature = "azure-blob",
    feature = "s3"
))]
mod key_component;
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
mod located;
mod lost;
mod mode;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
mod record;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redlock;
mod retry_later;
#[cfg(feature = "s3")]
pub mod s3;
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
mod server_clock;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod session;
#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "etcd",
    feature = "zookeeper",
    feature = "azure-blob",
    feature = "s3"
))]
mod settings;
// Each engine's feature uses only some of the helpers.
#[allow(dead_code)]
mod backoff;
#[allow(dead_code)]
mod setup_error;
#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "etcd",
    feature = "azure-blob",
    feature = "zookeeper",
    feature = "s3"
))]
mod ttl;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

pub use deployment::{DeploymentReport, Finding, Verdict};
pub(crate) use detach::Detach;
pub use health::{Health, LastError, HEALTH_LOCK_NAME, HEALTH_PROBE_KEY, HEALTH_PROBE_WAIT};
pub use holder::{default_instance_id, Holder};
pub use lost::LostReason;
pub use mode::LockMode;
#[cfg(all(feature = "replay", any(feature = "redis", feature = "postgres")))]
pub(crate) use record::Place;
#[cfg(feature = "replay")]
pub(crate) use record::RecordFound;
#[cfg(feature = "replay")]
pub use record::RecordWrite;
pub use record::{Acquired, RecordLookup};
pub use retry_later::RetryLater;
pub use setup_error::{ServerFailure, SetupError};

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
    /// The layer never drops the future midway: a request dropped while it runs moves
    /// it into a task of its own, where it runs to its end; a lease nobody waits for
    /// any more is dropped, which releases it. So implementations need not be
    /// cancel-safe themselves.
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition;

    /// Acquires the remote lock of `key` in `mode`: [`acquire`](Self::acquire) for
    /// [`LockMode::Exclusive`] (the default does just that), a shared hold, or one of
    /// `n` permits. A backend that overrides it says so in
    /// [`supports`](Self::supports); the default refuses every other mode with
    /// [`LockError::Unsupported`], and [`DistributedLocks`](crate::DistributedLocks)
    /// and the layer refuse such a mode when they are built, before any request.
    ///
    /// Every holder of a shared or permit lease has a lease of its own: its own
    /// renewal, release and lost signal. An exclusive grant must wait for every shared
    /// holder, and its fencing token is greater than every token issued for the key
    /// before, whatever the mode.
    fn acquire_mode(&self, name: &str, key: &Key, mode: LockMode, wait: Duration) -> Acquisition {
        match mode {
            LockMode::Exclusive => self.acquire(name, key, wait),
            LockMode::Shared => Box::pin(async { Err(LockError::Unsupported(SHARED_LOCKS)) }),
            LockMode::Permit { .. } => Box::pin(async { Err(LockError::Unsupported(PERMITS)) }),
        }
    }

    /// Whether [`acquire_mode`](Self::acquire_mode) gives `mode` (only
    /// [`LockMode::Exclusive`] by default).
    ///
    /// ```
    /// use tower_keyed_lock::backend::{LockBackend, LockMode};
    ///
    /// fn can_share(backend: &dyn LockBackend) -> bool {
    ///     backend.supports(LockMode::Shared)
    /// }
    /// ```
    fn supports(&self, mode: LockMode) -> bool {
        mode == LockMode::Exclusive
    }

    /// Checks that the engine answers and lets this instance lock: by default it takes
    /// the reserved key [`HEALTH_PROBE_KEY`] under [`HEALTH_LOCK_NAME`], waiting at most
    /// [`HEALTH_PROBE_WAIT`], and gives it back (see [`Health`]), bounded by the
    /// backend's own timeouts. For a
    /// readiness probe or a health route; the Redis restart guard's remaining time is
    /// reported beside it.
    ///
    /// ```no_run
    /// # #[cfg(feature = "redis")]
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_keyed_lock::{LockBackend, RedisBackend};
    ///
    /// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
    /// let health = backend.health().await;
    /// println!("{health}"); // "redis: answered in 412µs"
    /// # Ok(())
    /// # }
    /// ```
    fn health(&self) -> BoxFuture<Health> {
        let engine = self.engine();
        let key = Key::new(HEALTH_PROBE_KEY, HEALTH_PROBE_KEY.len()).expect("a valid key");
        let acquisition = self.acquire(HEALTH_LOCK_NAME, &key, HEALTH_PROBE_WAIT);
        Box::pin(health::probe(engine, acquisition))
    }

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

    /// Acquires `key` exclusively as [`acquire`](Self::acquire) does, unless the replay
    /// record `record` names is stored: then answers with the record and takes nothing.
    /// Each attempt looks for the record and tries the key in one atomic step, so a
    /// completed request is replayed in one round trip, and a first request learns
    /// that it is one without a round trip of its own.
    ///
    /// `None` when this backend cannot read the record (the default, and any lookup
    /// made for another engine or server): the caller acquires as usual and asks the
    /// replay store once it holds the key.
    fn acquire_unless_recorded(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
        record: &RecordLookup,
    ) -> Option<BoxFuture<Result<Acquired, LockError>>> {
        let _ = (name, key, wait, record);
        None
    }

    /// Which backend value this is ([`BackendIdentity::of`] the state its clones
    /// share), so that two layers under one name on one backend are refused when
    /// applied: in process two layers never exclude each other, so they must not
    /// through the backend either (give each its own
    /// [`name`](crate::KeyedLockLayer::name)). `None` (the default): the backend
    /// cannot tell; shared as one `Arc<dyn LockBackend>` it is still told apart by
    /// that `Arc`.
    fn identity(&self) -> Option<BackendIdentity> {
        None
    }

    /// What the engine's configuration means for the locks, for
    /// [`DistributedLocks::check_deployment`](crate::DistributedLocks::check_deployment):
    /// one [`Finding`] per thing read from the servers (an eviction policy, a pooler in
    /// between, the server's clock against this machine's), each saying what it saw,
    /// why it matters and the fix. It reads only, and touches no key. The default: no
    /// findings (the check's live run still runs).
    fn check_configuration(&self) -> BoxFuture<Vec<Finding>> {
        Box::pin(async { Vec::new() })
    }
}

/// A shared backend is a backend: one client can serve several layers and job locks.
impl<B: LockBackend + ?Sized> LockBackend for Arc<B> {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        (**self).acquire(name, key, wait)
    }

    fn acquire_mode(&self, name: &str, key: &Key, mode: LockMode, wait: Duration) -> Acquisition {
        (**self).acquire_mode(name, key, mode, wait)
    }

    fn supports(&self, mode: LockMode) -> bool {
        (**self).supports(mode)
    }

    fn health(&self) -> BoxFuture<Health> {
        (**self).health()
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

    fn acquire_unless_recorded(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
        record: &RecordLookup,
    ) -> Option<BoxFuture<Result<Acquired, LockError>>> {
        (**self).acquire_unless_recorded(name, key, wait, record)
    }

    /// The shared backend's own identity, or else this `Arc`'s: every clone of one
    /// `Arc<dyn LockBackend>` is one backend.
    fn identity(&self) -> Option<BackendIdentity> {
        (**self)
            .identity()
            .or_else(|| Some(BackendIdentity::of(self)))
    }

    fn check_configuration(&self) -> BoxFuture<Vec<Finding>> {
        (**self).check_configuration()
    }
}

/// Which backend value a [`LockBackend`] is: equal for a backend and its clones (they
/// share its connections: one instance's way to the engine), different for backends
/// built separately. See [`LockBackend::identity`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendIdentity(usize);

impl BackendIdentity {
    /// The identity of the backend whose state every clone shares in `state`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_keyed_lock::backend::BackendIdentity;
    ///
    /// let state = Arc::new(());
    /// assert_eq!(BackendIdentity::of(&state), BackendIdentity::of(&state.clone()));
    /// ```
    pub fn of<T: ?Sized>(state: &Arc<T>) -> Self {
        Self(Arc::as_ptr(state).cast::<()>() as usize)
    }
}

/// What a backend without shared locks refuses them for.
pub(crate) const SHARED_LOCKS: &str = "shared locks across instances (this engine holds a \
    key exclusively only; use the Redis or PostgreSQL backend, or lock in process only)";

/// What a backend without counted permits refuses them for.
pub(crate) const PERMITS: &str = "several permits per key across instances (this engine \
    holds a key exclusively only; use the Redis or PostgreSQL backend, or one permit)";

/// A remote lock held: its fencing token and lost-lease signal. Dropping it releases
/// the lock (in a task of its own, since release is a round trip).
pub struct Lease {
    fencing_token: Option<u64>,
    /// The acquisition's first attempt did not get the key (see [`Lease::contended`]).
    contended: bool,
    signal: LeaseSignal,
    /// Shared with the locks' shutdown, which may give the lease back at its deadline
    /// while the holder still runs (see [`CutOff`]), and with a replay store that gives
    /// it back with its record; whoever takes it releases.
    release: ReleaseSlot,
}

/// A shutdown's hold on a lease it may have to cut off: raise the holder's lost signal,
/// then give the lease back at the backend, while the holder still runs.
pub(crate) struct CutOff {
    signal: LeaseSignal,
    release: ReleaseSlot,
}

/// A lease's release, in a slot its holders share: whoever takes it out releases.
pub(crate) type ReleaseSlot = Arc<std::sync::Mutex<Option<Box<dyn ReleaseLease>>>>;

impl CutOff {
    /// Raises the lost signal first (the holder is told before anyone else can be
    /// granted the key), then releases the lease unless its holder already did.
    pub(crate) async fn cut(self) {
        self.signal.raise();
        let release = take_release(&self.release);
        if let Some(release) = release {
            release.release().await;
        }
    }
}

/// Takes the release out of its slot; a poisoned slot still holds a whole value.
pub(crate) fn take_release(slot: &ReleaseSlot) -> Option<Box<dyn ReleaseLease>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

/// How a backend gives a lease back: stop renewing, then release remotely.
pub trait ReleaseLease: Send + Sync + 'static {
    /// Releases the lease; runs at most until its own network timeout.
    fn release(self: Box<Self>) -> BoxFuture<()>;

    /// Releases the lease like [`release`](Self::release), and says whether the engine
    /// showed the lock gone: `Err(reason)` when the lease was lost before the release
    /// (for `reason`), or when the release found the lock no longer this holder's.
    /// By default, releases and answers `Ok(())`: [`Lease::release_checked`] still
    /// reports a lease whose signal was raised before it.
    fn release_checked(self: Box<Self>) -> BoxFuture<Result<(), LostReason>> {
        let release = self.release();
        Box::pin(async move {
            release.await;
            Ok(())
        })
    }

    /// Stops renewing the lease, which is still released later (or dropped). Called
    /// before a step that may give the lease back by other means (a replay store
    /// writing its record and deleting the lock in one script), so that no renewal
    /// finds the lock gone and reports the lease lost. Nothing by default.
    fn stop_renewal(&self) {}

    /// Writes `record` and releases the lease in one round trip to the engine, the
    /// write first, so the record is durable before the key is free: a future of
    /// whether the write was done (not refused by a newer fencing token). The lease is
    /// released whether or not the write succeeds; awaiting the future is not needed
    /// for either. `None` (the default, and for a record made for another engine) when
    /// this lease cannot: nothing was done, and the lease is released as usual.
    #[cfg(feature = "replay")]
    fn release_writing(&self, record: RecordWrite) -> Option<BoxFuture<Result<bool, LockError>>> {
        let _ = record;
        None
    }
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
            contended: false,
            signal,
            release: Arc::new(std::sync::Mutex::new(Some(Box::new(release)))),
        }
    }

    /// This lease, saying whether its acquisition needed more than one attempt (see
    /// [`contended`](Self::contended)). A backend sets it on every lease it grants after
    /// finding the key held, queueing behind another holder, or trying again.
    pub fn with_contention(mut self, contended: bool) -> Self {
        self.contended = contended;
        self
    }

    /// Whether the acquisition needed more than one attempt: its first attempt found
    /// the key held elsewhere (or queued behind another holder at the engine), or failed
    /// and was tried again. Counted as `contended="true"` in
    /// [`ACQUIRED_TOTAL`](crate::metrics::ACQUIRED_TOTAL).
    pub fn contended(&self) -> bool {
        self.contended
    }

    /// The slot of this lease's release, for a replay store that gives the lease back
    /// with its record (see [`ReleaseSlot`]).
    #[cfg(feature = "replay")]
    pub(crate) fn release_slot(&self) -> ReleaseSlot {
        Arc::clone(&self.release)
    }

    /// What a shutdown needs to cut this lease off while its holder runs.
    pub(crate) fn cut_off(&self) -> CutOff {
        CutOff {
            signal: self.signal.clone(),
            release: Arc::clone(&self.release),
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
    pub async fn release(self) {
        let release = take_release(&self.release);
        if let Some(release) = release {
            release.release().await;
        }
    }

    /// [`release`](Self::release), reporting a lock that was already gone:
    /// `Err(reason)` when the lease was lost before the release (its signal was raised,
    /// or its deadline passed), or when the backend found at the release that the
    /// lock was no longer this holder's (see [`ReleaseLease::release_checked`]).
    /// `Ok(())` otherwise. Either way the lease is given back.
    pub async fn release_checked(self) -> Result<(), LostReason> {
        let lost_before = self.signal.lost_reason();
        let released = match take_release(&self.release) {
            Some(release) => release.release_checked().await,
            // Taken by a shutdown that cut the lease off: its signal says so.
            None => Ok(()),
        };
        match lost_before.or_else(|| self.signal.lost_reason()) {
            Some(reason) => Err(reason),
            None => released,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(release) = take_release(&self.release) else {
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
            .field("contended", &self.contended)
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
pub struct LeaseSignal(watch::Receiver<Validity>, watch::Sender<Validity>);

/// The backend's side of a [`LeaseSignal`]: moves its deadline on renewal and raises
/// it. Dropping it without raising it (the lease was released) freezes the signal as
/// not lost, unless the deadline had already passed.
#[derive(Debug)]
pub struct LeaseLostSender(watch::Sender<Validity>);

/// What a signal knows: raised (and why), or valid until a deadline (`None`: no
/// deadline, only the backend can tell).
#[derive(Debug, Clone, Copy)]
struct Validity {
    lost: Option<LostReason>,
    valid_until: Option<Instant>,
    /// A renewal went unanswered since the last one that was: if the deadline passes
    /// now, the engine was unreachable rather than this process late.
    unanswered: bool,
    /// A renewal (or liveness check) is on its way: if the deadline passes before its
    /// answer, the engine did not answer in time, rather than this process being late.
    asking: bool,
    /// Renewals of this lease that went unanswered, answered ones between them or not.
    renewal_failures: u32,
}

/// What a waiter on a [`LeaseSignal`] makes of its state.
enum Seen {
    Done,
    /// It will never be done.
    Never,
    Wait,
}

impl Validity {
    fn is_lost_at(&self, now: Instant) -> bool {
        self.lost_reason_at(now).is_some()
    }

    fn lost_reason_at(&self, now: Instant) -> Option<LostReason> {
        self.lost.or_else(|| {
            let passed = self.valid_until.is_some_and(|deadline| now >= deadline);
            passed.then(|| self.deadline_reason())
        })
    }

    /// Why the lease is lost when its deadline passes.
    fn deadline_reason(&self) -> LostReason {
        if self.unanswered || self.asking {
            LostReason::Unreachable
        } else {
            LostReason::Expired
        }
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
            lost: None,
            valid_until,
            unanswered: false,
            asking: false,
            renewal_failures: 0,
        });
        // The signal keeps a sender of its own, so that a shutdown can raise it (the
        // lease cut off at the deadline); the channel then never closes, and a released
        // lease's frozen value ends `lost()` the same way a closed channel did.
        (
            LeaseLostSender(sender.clone()),
            LeaseSignal(receiver, sender),
        )
    }

    /// Raises the signal from this side: the locks' shutdown cut the lease off.
    pub(crate) fn raise(&self) {
        let now = Instant::now();
        self.1.send_if_modified(|validity| {
            if validity.lost.is_some() {
                return false;
            }
            // A deadline already passed keeps the reason readers may have seen.
            validity.lost = Some(validity.lost_reason_at(now).unwrap_or(LostReason::ShutDown));
            true
        });
    }

    /// Whether the lease has been lost: raised by the backend, or its deadline passed.
    pub fn is_lost(&self) -> bool {
        // The clock is read before the state, so a reader that saw the deadline pass
        // read it before any `extend` that could move it; that `extend` then finds the
        // deadline passed too and refuses (see `LeaseLostSender::extend`).
        let now = Instant::now();
        self.0.borrow().is_lost_at(now)
    }

    /// Why the lease was lost, once it is (see [`LostReason`]); `None` while it is not.
    /// A lease whose deadline passed is lost for that reason at once, whether or not
    /// the backend has run since; once seen, the reason never changes.
    pub fn lost_reason(&self) -> Option<LostReason> {
        let now = Instant::now();
        self.0.borrow().lost_reason_at(now)
    }

    /// Whether the lease's last renewal went unanswered (a timeout, a broken
    /// connection) and none was answered since, while the lease is not lost: it still
    /// holds until [`valid_until`](Self::valid_until), and the renewal is being tried
    /// again. A time to finish or pause work that a loss would spoil. Engines that hold
    /// a key by a session (PostgreSQL, MySQL) renew nothing: for them this stays false,
    /// and a failed liveness check is a loss.
    pub fn is_renewal_failing(&self) -> bool {
        let now = Instant::now();
        let validity = *self.0.borrow();
        validity.unanswered && !validity.is_lost_at(now)
    }

    /// How many renewals of this lease went unanswered so far (the layer and
    /// [`DistributedLocks`](crate::DistributedLocks) add them to
    /// [`RENEWAL_FAILED_TOTAL`](crate::metrics::RENEWAL_FAILED_TOTAL) when the hold ends).
    pub fn renewal_failures(&self) -> u32 {
        self.0.borrow().renewal_failures
    }

    /// Resolves while [`is_renewal_failing`](Self::is_renewal_failing): at once if it
    /// is, else when a renewal goes unanswered. Never resolves once the lease is lost
    /// or released without a failing renewal: wait for [`lost`](Self::lost) beside it.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads the signal.
    pub async fn renewal_failed(&self) {
        self.until(|validity, now| match validity.is_lost_at(now) {
            true => Seen::Never,
            false if validity.unanswered => Seen::Done,
            false => Seen::Wait,
        })
        .await;
    }

    /// The instant the lease counts as lost unless renewed first; `None` if the
    /// backend sets no deadline, or the lease is lost or released.
    pub fn valid_until(&self) -> Option<Instant> {
        let validity = *self.0.borrow();
        validity.valid_until.filter(|_| validity.lost.is_none())
    }

    /// Resolves when the lease is lost (raised, or its deadline passed); never resolves
    /// if it is released first.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads the signal.
    pub async fn lost(&self) {
        self.until(|validity, now| match validity.is_lost_at(now) {
            true => Seen::Done,
            false => Seen::Wait,
        })
        .await;
    }

    /// Resolves once `see` says [`Seen::Done`] of the signal, looking again at every
    /// change and at the deadline; never once it says [`Seen::Never`], or once the
    /// lease is released and its frozen signal is not done.
    async fn until(&self, see: impl Fn(&Validity, Instant) -> Seen) {
        let mut receiver = self.0.clone();
        loop {
            let validity = *receiver.borrow_and_update();
            match see(&validity, Instant::now()) {
                Seen::Done => return,
                Seen::Never => std::future::pending::<()>().await,
                Seen::Wait => {}
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
                let frozen = *receiver.borrow();
                if let Seen::Done = see(&frozen, Instant::now()) {
                    return;
                }
                std::future::pending::<()>().await;
            }
        }
    }
}

impl LeaseLostSender {
    /// Raises the signal for `reason` (once; later calls do nothing, and a deadline
    /// that has already passed keeps its own reason). Returns whether this call raised
    /// it.
    pub fn lose(&self, reason: LostReason) -> bool {
        let now = Instant::now();
        self.0.send_if_modified(|validity| {
            if validity.lost.is_some() {
                return false;
            }
            validity.lost = Some(validity.lost_reason_at(now).unwrap_or(reason));
            true
        })
    }

    /// Raises the signal at its passed deadline, for the reason the deadline gives:
    /// [`LostReason::Unreachable`] after an [unanswered](Self::unanswered) renewal,
    /// else [`LostReason::Expired`].
    pub fn lose_at_deadline(&self) -> bool {
        let now = Instant::now();
        self.0.send_if_modified(|validity| {
            if validity.lost.is_some() {
                return false;
            }
            validity.lost = Some(
                validity
                    .lost_reason_at(now)
                    .unwrap_or(validity.deadline_reason()),
            );
            true
        })
    }

    /// Records that a renewal (or liveness check) was sent: should the deadline pass
    /// before it is answered, the lease is lost as [`LostReason::Unreachable`] (the
    /// engine did not answer in time), not [`LostReason::Expired`]. Cleared by
    /// [`extend`](Self::extend).
    pub fn asking(&self) {
        let now = Instant::now();
        self.0.send_if_modified(|validity| {
            // Once lost, the reason readers may have seen stays.
            if !validity.is_lost_at(now) {
                validity.asking = true;
            }
            false // nothing a waiter waits for changed
        });
    }

    /// Why the signal was raised, once it is.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn raised_for(&self) -> Option<LostReason> {
        self.0.borrow().lost
    }

    /// Records a renewal that went unanswered (a timeout, a broken connection): should
    /// the deadline pass before one is answered, the engine was unreachable. Cleared
    /// by [`extend`](Self::extend).
    pub fn unanswered(&self) {
        let now = Instant::now();
        self.0.send_if_modified(|validity| {
            // Once lost, the reason readers may have seen stays.
            if validity.is_lost_at(now) {
                return false;
            }
            validity.unanswered = true;
            validity.renewal_failures = validity.renewal_failures.saturating_add(1);
            true // wakes `renewal_failed`
        });
    }

    /// Moves the deadline to `valid_until` after a renewal; returns `false` and raises
    /// the signal instead if the current deadline has already passed: a reader may
    /// have seen the lease lost, and a lost lease stays lost (for the reason it was
    /// seen lost for).
    pub fn extend(&self, valid_until: Instant) -> bool {
        let mut extended = false;
        let now = Instant::now();
        self.0.send_if_modified(|validity| {
            if validity.lost.is_some() {
                return false;
            }
            if let Some(reason) = validity.lost_reason_at(now) {
                validity.lost = Some(reason);
                return true;
            }
            validity.valid_until = Some(valid_until);
            validity.unanswered = false;
            validity.asking = false;
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
        let now = Instant::now();
        self.0.send_if_modified(|validity| {
            if validity.lost.is_some() {
                return false;
            }
            validity.lost = validity.lost_reason_at(now);
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

#[cfg(all(test, not(loom)))]
mod lease_signal_tests {
    use std::time::Duration;

    use proptest::prelude::*;
    use tokio::time::Instant;

    use super::{LeaseSignal, LostReason};

    /// What can happen to a lease while a holder looks at its signal.
    #[derive(Debug, Clone)]
    enum Step {
        /// Time passes (ms).
        Wait(u64),
        /// A renewal answered: valid for this many ms from now.
        Extend(u64),
        /// A renewal went unanswered.
        Unanswered,
        /// A renewal was sent.
        Asking,
        /// The backend says the lease is gone, for this reason.
        Lose(LostReason),
        /// The backend's timer raises the signal at the deadline.
        LoseAtDeadline,
        /// The lease is released (its sender dropped).
        Release,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u64..40).prop_map(Step::Wait),
            3 => (0u64..40).prop_map(Step::Extend),
            2 => Just(Step::Unanswered),
            2 => Just(Step::Asking),
            1 => prop::sample::select(LostReason::ALL.to_vec()).prop_map(Step::Lose),
            1 => Just(Step::LoseAtDeadline),
            1 => Just(Step::Release),
        ]
    }

    /// The model's signal: raised with a reason, or a deadline, whether a renewal
    /// went unanswered since the last answered one, and whether one was sent since.
    struct Model {
        lost: Option<LostReason>,
        deadline: Option<Instant>,
        unanswered: bool,
        asking: bool,
        failures: u32,
    }

    impl Model {
        fn reason(&self, now: Instant) -> Option<LostReason> {
            self.lost.or_else(|| {
                let passed = self.deadline.is_some_and(|d| now >= d);
                passed.then_some(self.at_deadline())
            })
        }

        fn at_deadline(&self) -> LostReason {
            if self.unanswered || self.asking {
                LostReason::Unreachable
            } else {
                LostReason::Expired
            }
        }
    }

    proptest! {
        /// Against a model: lost once raised or once the clock passed the deadline,
        /// and never un-lost — a renewal answered after the deadline does not revive
        /// it, and a release freezes what was true then. The reason is the first one
        /// that held (a passed deadline: unreachable after an unanswered renewal or
        /// with one on its way, else expired), and once seen it never changes.
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
                let mut model = Model {
                    lost: None,
                    deadline: Some(Instant::now() + Duration::from_millis(20)),
                    unanswered: false,
                    asking: false,
                    failures: 0,
                };
                let mut seen: Option<LostReason> = None;
                for step in steps {
                    let now = Instant::now();
                    match (step, &sender) {
                        (Step::Wait(ms), _) => tokio::time::advance(Duration::from_millis(ms)).await,
                        (Step::Extend(ms), Some(sender)) => {
                            let expired = model.reason(now);
                            let extended = sender.extend(now + Duration::from_millis(ms));
                            prop_assert_eq!(extended, expired.is_none());
                            match expired {
                                Some(reason) => model.lost = Some(reason),
                                None => {
                                    model.deadline = Some(now + Duration::from_millis(ms));
                                    model.unanswered = false;
                                    model.asking = false;
                                }
                            }
                        }
                        (Step::Unanswered, Some(sender)) => {
                            sender.unanswered();
                            if model.reason(now).is_none() {
                                model.unanswered = true;
                                model.failures += 1;
                            }
                        }
                        (Step::Asking, Some(sender)) => {
                            sender.asking();
                            if model.reason(now).is_none() {
                                model.asking = true;
                            }
                        }
                        (Step::Lose(reason), Some(sender)) => {
                            sender.lose(reason);
                            model.lost = Some(model.reason(now).unwrap_or(reason));
                        }
                        (Step::LoseAtDeadline, Some(sender)) => {
                            sender.lose_at_deadline();
                            model.lost = Some(model.reason(now).unwrap_or(model.at_deadline()));
                        }
                        (Step::Release, Some(_)) => {
                            sender = None;
                            model.lost = model.reason(now);
                            model.deadline = None;
                        }
                        (_, None) => {}
                    }
                    let expected = model.reason(Instant::now());
                    prop_assert_eq!(signal.lost_reason(), expected);
                    prop_assert_eq!(signal.is_lost(), expected.is_some());
                    let failing = model.unanswered && expected.is_none();
                    prop_assert_eq!(signal.is_renewal_failing(), failing);
                    prop_assert_eq!(signal.renewal_failures(), model.failures);
                    let told = futures_now(signal.renewal_failed());
                    prop_assert_eq!(told, failing, "renewal_failed() disagrees with is_renewal_failing()");
                    if let Some(first) = seen {
                        prop_assert_eq!(signal.lost_reason(), Some(first), "a lost lease came back, or changed its reason");
                    }
                    seen = signal.lost_reason();
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

    /// A deadline that passes with a renewal on its way is the engine's (unreachable);
    /// once that renewal is answered, a later deadline is this process's (expired).
    #[tokio::test(start_paused = true)]
    async fn a_deadline_that_passes_with_a_renewal_on_its_way_is_unreachable() {
        let (sender, signal) =
            LeaseSignal::with_deadline(Instant::now() + Duration::from_millis(50));
        sender.asking();
        signal.lost().await;
        assert_eq!(signal.lost_reason(), Some(LostReason::Unreachable));

        let (sender, signal) =
            LeaseSignal::with_deadline(Instant::now() + Duration::from_millis(50));
        sender.asking();
        assert!(sender.extend(Instant::now() + Duration::from_millis(50)));
        signal.lost().await;
        assert_eq!(signal.lost_reason(), Some(LostReason::Expired));
    }

    /// Whether `future` is ready at its first poll.
    fn futures_now(future: impl std::future::Future<Output = ()>) -> bool {
        let mut future = std::pin::pin!(future);
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        future.as_mut().poll(&mut context).is_ready()
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_renewal_is_told_before_the_deadline() {
        let (sender, signal) =
            LeaseSignal::with_deadline(Instant::now() + Duration::from_millis(50));
        let waiting = tokio::spawn({
            let signal = signal.clone();
            async move { signal.renewal_failed().await }
        });
        tokio::time::advance(Duration::from_millis(10)).await;
        assert!(!waiting.is_finished());
        sender.unanswered();
        waiting.await.unwrap();
        assert!(signal.is_renewal_failing() && !signal.is_lost());
        // Answered again: no longer failing; the failure stays counted.
        assert!(sender.extend(Instant::now() + Duration::from_millis(50)));
        assert!(!signal.is_renewal_failing());
        assert_eq!(signal.renewal_failures(), 1);
        // Lost without a failing renewal: `renewal_failed` never resolves.
        sender.lose(LostReason::NotOwner);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), signal.renewal_failed())
                .await
                .is_err()
        );
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
