//! [`DistributedLocks`]: the two-tier keyed lock for any async code — scheduled jobs,
//! queue workers, cache rebuilds — and the lock under [`KeyedLockLayer`](crate::KeyedLockLayer).
//!
//! A key is taken in two steps: first in this process, on a [`KeyedLocks`] table
//! (waiters queue in arrival order), then, by the local winner only, at the
//! [`LockBackend`] that every instance shares. N waiters of one key in one instance
//! cost one remote contender. The guard releases remotely first, then locally, so the
//! next local waiter finds the remote lock free. Without a backend it is the in-process
//! lock alone.
//!
//! ```no_run
//! # #[cfg(feature = "redis")]
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_keyed_lock::{DistributedLocks, LockError, RedisBackend};
//! # async fn nightly_report() {}
//!
//! let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
//! let jobs = DistributedLocks::new("jobs", backend);
//!
//! // Every instance runs this each night; one of them does the work.
//! match jobs.try_lock("nightly-report").await {
//!     Ok(guard) => {
//!         // Cancelled if the lease is lost: another instance may hold the key then.
//!         match guard.run_while_held(nightly_report()).await {
//!             Ok(()) => println!("report written under fencing token {:?}", guard.fencing_token()),
//!             Err(lost) => eprintln!("{lost}; the report may be incomplete"),
//!         }
//!     }
//!     Err(LockError::Busy) => println!("another instance is running it; skipping"),
//!     Err(error) => return Err(error.into()),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Shared locks and permits across instances
//!
//! [`lock_shared`](DistributedLocks::lock_shared) and
//! [`permits`](DistributedLocksBuilder::permits) hold across instances too, on a
//! backend that [supports](LockBackend::supports) them (Redis, PostgreSQL with session
//! locks): every local holder holds the key at the backend in the same mode, with a
//! lease of its own. A mode the backend cannot give is refused (never downgraded):
//! `permits(n)` when the locks are built, `lock_shared` with
//! [`LockError::Unsupported`](crate::LockError::Unsupported).
//!
//! ```no_run
//! # #[cfg(feature = "redis")]
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_keyed_lock::{DistributedLocks, RedisBackend};
//! # async fn export(_tenant: &str) {}
//!
//! let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
//! // At most 3 exports per tenant at once, across all instances.
//! let exports = DistributedLocks::builder("exports").backend(backend).permits(3).build();
//! let permit = exports.lock("tenant-42").await?;
//! export("tenant-42").await;
//! permit.release().await;
//! # Ok(())
//! # }
//! ```
//!
//! The locks record the same metrics as the layer, under their name (see
//! [`metrics`](crate::metrics)): waits by outcome, hold times, rejections, leases lost.
//!
//! Every acquisition is cancel-safe: dropping a [`DistributedAcquire`] at any point —
//! queued locally, or waiting at the backend — releases whatever it acquired, and the
//! remote attempt then runs on detached, so a dropped request never leaves a remote
//! lock held.
//!
//! # Files
//!
//! - `mod.rs`: [`DistributedLocks`] and its builder.
//! - `acquire.rs`: [`DistributedAcquire`], the wait in this process, then at the backend.
//! - `guard.rs`: [`DistributedGuard`], the key held in both tiers, and [`LeaseLost`].
//! - `all.rs`: several keys at once ([`DistributedLocks::lock_all`], [`DistributedGuards`]).
//! - `shutdown.rs`: [`DistributedLocks::shutdown`] and its [`ShutdownReport`].
//! - `leader.rs`: leader election on one key ([`LeaderElection`], [`Leadership`]).

mod acquire;
mod all;
mod guard;
mod leader;
mod shutdown;

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use acquire::DistributedAcquire;
pub use all::DistributedGuards;
pub use guard::{DistributedGuard, LeaseLost};
pub use leader::{LeaderElection, LeaderInfo, Leadership};
pub use shutdown::ShutdownReport;

use crate::backend::health::LastErrorCell;
use crate::backend::{
    default_instance_id, DeploymentReport, Finding, Health, Holder, LockBackend, LockMode,
    RecordLookup,
};
use crate::key::{Key, DEFAULT_MAX_KEY_LEN};
use crate::locks::{KeyGuard, KeyedLocks, KeyedLocksBuilder, Mode};
use crate::metrics::Metrics;

/// A keyed lock shared by every instance that shares its backend. Clones share one
/// local table. See the [module docs](self).
#[derive(Clone)]
pub struct DistributedLocks {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    name: Cow<'static, str>,
    local: KeyedLocks<Key>,
    backend: Option<Arc<dyn LockBackend>>,
    /// Holders per key, in this process and, with a backend, across instances.
    permits: usize,
    fail_open: bool,
    max_key_len: usize,
    /// The locks' metrics, registered on first use (so a recorder installed after the
    /// locks were built is used); `None` under a layer, which records its own.
    metrics: Option<OnceLock<Metrics>>,
    /// For [`DistributedLocks::health`].
    last_error: LastErrorCell,
    /// Set once [`DistributedLocks::shutdown`] began; the remote leases it may cut off.
    pub(crate) shutdown: shutdown::Shutdown,
}

impl Inner {
    /// The metric handles, if these locks record any. Every acquisition asks before it
    /// touches the table, so the table is empty when the key gauge is attached.
    fn metrics(&self) -> Option<&Metrics> {
        let cell = self.metrics.as_ref()?;
        Some(cell.get_or_init(|| {
            let metrics = Metrics::new(&self.name);
            self.local.report_keys_to(metrics.keys.clone());
            metrics
        }))
    }
}

/// Configures a [`DistributedLocks`]; made by [`DistributedLocks::builder`].
///
/// ```
/// use tower_keyed_lock::DistributedLocks;
///
/// let locks = DistributedLocks::builder("cache")
///     .max_waiters(1_000) // local waiters per key, then `QueueFull`
///     .max_keys(100_000)  // keys in the local table, then `TooManyKeys`
///     .build();           // no backend: in process only
/// ```
#[derive(Clone)]
#[must_use]
pub struct DistributedLocksBuilder {
    name: Cow<'static, str>,
    backend: Option<Arc<dyn LockBackend>>,
    permits: usize,
    fail_open: bool,
    max_key_len: usize,
    /// Whether the locks record metrics (not under a layer, which records its own).
    metered: bool,
    /// The local table's permits and limits, checked where that table checks them.
    local: KeyedLocksBuilder<Key>,
}

impl DistributedLocks {
    /// Locks named `name` (the namespace of their keys at the backend) on `backend`.
    pub fn new(name: impl Into<Cow<'static, str>>, backend: impl LockBackend) -> Self {
        Self::builder(name).backend(backend).build()
    }

    /// Locks that serialize within this process only.
    ///
    /// ```
    /// use tower_keyed_lock::DistributedLocks;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let locks = DistributedLocks::in_process("cache");
    /// let guard = locks.lock("user:7").await.unwrap();
    /// assert_eq!(guard.fencing_token(), None); // fencing tokens come from a backend
    /// # }
    /// ```
    pub fn in_process(name: impl Into<Cow<'static, str>>) -> Self {
        Self::builder(name).build()
    }

    /// Starts configuring locks named `name`.
    pub fn builder(name: impl Into<Cow<'static, str>>) -> DistributedLocksBuilder {
        DistributedLocksBuilder {
            name: name.into(),
            backend: None,
            permits: 1,
            fail_open: false,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            metered: true,
            local: KeyedLocks::builder(),
        }
    }

    /// Waits for `key` without a time limit (in this process, then at the backend).
    ///
    /// Fails with [`LockError::InvalidKey`](crate::LockError::InvalidKey) for a key
    /// that is empty, too long or has control characters,
    /// [`LockError::Backend`](crate::LockError::Backend) when the backend fails, and at
    /// once with `QueueFull` or `TooManyKeys` when a local limit is reached.
    pub fn lock(&self, key: &str) -> DistributedAcquire {
        DistributedAcquire::new(self.inner.clone(), key, None, Mode::Exclusive)
    }

    /// Waits for `key` at most `timeout` across both tiers, then fails with
    /// [`LockError::Timeout`](crate::LockError::Timeout).
    pub fn lock_timeout(&self, key: &str, timeout: Duration) -> DistributedAcquire {
        DistributedAcquire::new(self.inner.clone(), key, Some(timeout), Mode::Exclusive)
    }

    /// Takes `key` only if no one holds it, here or on another instance; else fails
    /// with [`LockError::Busy`](crate::LockError::Busy): "another instance is already
    /// running this job, skip it". Still one round trip to the backend.
    pub fn try_lock(&self, key: &str) -> DistributedAcquire {
        DistributedAcquire::new(
            self.inner.clone(),
            key,
            Some(Duration::ZERO),
            Mode::Exclusive,
        )
    }

    /// Waits for `key` shared, without a time limit: shared holders hold a key
    /// together while no exclusive holder has it, as
    /// [`KeyedLocks::lock_shared`](crate::KeyedLocks::lock_shared) describes.
    ///
    /// With a backend, each shared holder also holds the key shared at the backend,
    /// with a lease of its own: readers of every instance hold it together, a writer
    /// of any instance waits for all of them, and a waiting writer stops new readers
    /// from entering everywhere. A backend that cannot hold a key shared
    /// ([`LockBackend::supports`]) fails it with
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) — never silently
    /// taken exclusively or in this process only.
    ///
    /// A reader's [fencing token](DistributedGuard::fencing_token) is the token of the
    /// last exclusive grant of the key before it (what it reads was written under that
    /// token, or later under a greater one), or `None` if the key has had none that
    /// the backend remembers; readers never move the key's tokens.
    pub fn lock_shared(&self, key: &str) -> DistributedAcquire {
        DistributedAcquire::new(self.inner.clone(), key, None, Mode::Shared)
    }

    /// Waits for `key` shared at most `timeout`; see [`lock_shared`](Self::lock_shared).
    pub fn lock_shared_timeout(&self, key: &str, timeout: Duration) -> DistributedAcquire {
        DistributedAcquire::new(self.inner.clone(), key, Some(timeout), Mode::Shared)
    }

    /// Takes `key` shared if no exclusive holder has it and nobody waits for it, else
    /// fails with `Busy`; see [`lock_shared`](Self::lock_shared).
    pub fn try_lock_shared(&self, key: &str) -> DistributedAcquire {
        DistributedAcquire::new(self.inner.clone(), key, Some(Duration::ZERO), Mode::Shared)
    }

    /// Who holds `key` now, read without taking or extending it: `None` when it is
    /// free. With a backend the engine answers (the holder's instance id, since when,
    /// its fencing token and lease left, as far as the engine can tell; see
    /// [`Holder`]); a backend that cannot tell fails with
    /// [`LockError::Unsupported`](crate::LockError::Unsupported). In process only, the
    /// local table answers: held or not, and the holder is this process
    /// ([`default_instance_id`]); no time, token
    /// or lease.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_keyed_lock::DistributedLocks;
    ///
    /// let jobs = DistributedLocks::in_process("jobs");
    /// assert_eq!(jobs.holder("nightly").await.unwrap(), None);
    /// let guard = jobs.lock("nightly").await.unwrap();
    /// let holder = jobs.holder("nightly").await.unwrap().expect("held");
    /// println!("skip: nightly is {holder}");
    /// drop(guard);
    /// assert_eq!(jobs.holder("nightly").await.unwrap(), None);
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads.
    pub async fn holder(&self, key: &str) -> Result<Option<Holder>, crate::LockError> {
        let key = Key::new(key, self.inner.max_key_len).map_err(crate::LockError::InvalidKey)?;
        match &self.inner.backend {
            Some(backend) => backend.holder(&self.inner.name, &key).await,
            None => Ok(self
                .inner
                .local
                .is_held(&key)
                .then(|| Holder::new().with_instance(default_instance_id()))),
        }
    }

    /// The name given at construction: the namespace of the keys at the backend.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether keys can be held in `mode` by these locks: always in process; with a
    /// backend, what it [supports](LockBackend::supports).
    ///
    /// ```
    /// use tower_keyed_lock::backend::LockMode;
    /// use tower_keyed_lock::DistributedLocks;
    ///
    /// let locks = DistributedLocks::in_process("cache");
    /// assert!(locks.supports(LockMode::Shared));
    /// ```
    pub fn supports(&self, mode: LockMode) -> bool {
        (self.inner.backend.as_ref()).is_none_or(|backend| backend.supports(mode))
    }

    /// Whether the locks are shared with other instances through a backend.
    pub fn is_distributed(&self) -> bool {
        self.inner.backend.is_some()
    }

    /// Checks the backend ([`LockBackend::health`]) and adds the last backend error
    /// these locks met (a failed acquisition, a lost lease); in process, unchecked
    /// and healthy. Once [`shutdown`](Self::shutdown) began, unhealthy
    /// ([`Health::is_shutting_down`]) without asking the backend.
    ///
    /// ```
    /// use tower_keyed_lock::DistributedLocks;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let jobs = DistributedLocks::in_process("jobs");
    /// let health = jobs.health().await;
    /// assert!(health.is_healthy());
    /// assert_eq!(health.round_trip(), None); // nothing to reach
    /// # }
    /// ```
    pub async fn health(&self) -> Health {
        if self.is_shutting_down() {
            let engine = (self.inner.backend.as_ref()).map_or("in-process", |b| b.engine());
            return Health::shutting_down(engine).and_last_error(self.inner.last_error.get());
        }
        let health = match &self.inner.backend {
            Some(backend) => backend.health().await,
            None => Health::unchecked("in-process"),
        };
        health.and_last_error(self.inner.last_error.get())
    }

    /// Asks whether the deployment is safe for these locks: the backend's engine
    /// configuration ([`LockBackend::check_configuration`]: an evicting Redis, a pooler
    /// in front of PostgreSQL, a far-off server clock, …), then a short live run under
    /// a scratch lock name that touches nothing else: a held key refused to a second
    /// acquisition, fencing tokens that go up, the round trip of a lock and of a
    /// hand-off, and no holder left behind. Each finding says what it saw, why it
    /// matters and the fix; the report prints as text and as JSON. In process there is
    /// nothing to check: one passing finding says so.
    ///
    /// For a start-up check or an operator's command (`cargo run --example
    /// check_deployment --features <engine> -- <url>` runs it on a URL). It takes a few
    /// locks, each waiting at most 5 s.
    ///
    /// ```
    /// use tower_keyed_lock::DistributedLocks;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let jobs = DistributedLocks::in_process("jobs");
    /// let report = jobs.check_deployment().await;
    /// assert!(report.is_safe());
    /// println!("{report}"); // or report.to_json()
    /// # }
    /// ```
    pub async fn check_deployment(&self) -> DeploymentReport {
        let Some(backend) = &self.inner.backend else {
            let only = Finding::pass(
                "engine",
                "no backend: the locks are this process's own",
                "nothing outside this process can break them",
            );
            return DeploymentReport::new("in-process", vec![only]);
        };
        // The live run first: an engine read through the `Date` of its answers knows its
        // clock better after it. The configuration comes first in the report.
        let live = crate::backend::deployment::live_run(&**backend).await;
        let mut findings = backend.check_configuration().await;
        findings.extend(live);
        DeploymentReport::new(backend.engine(), findings)
    }

    /// Keys with a holder or a waiter in this process now.
    pub fn len(&self) -> usize {
        self.inner.local.len()
    }

    /// True when no key has a holder or a waiter in this process.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shuts the locks down gracefully: from now on no key is granted (new callers and
    /// callers already waiting fail with [`LockError::ShuttingDown`](crate::LockError::ShuttingDown);
    /// under a layer that is 503 with `Retry-After`); holders keep running until they
    /// finish or `deadline` passes; then every remote lease still held is cut off: its
    /// holder's lost signal is raised (so a handler watching
    /// [`LeaseSignal::lost`](crate::LeaseSignal::lost) stops), and the lease is given
    /// back at the backend, so another instance takes the key at once instead of after
    /// the lease's expiry. In process (no backend) it is the same drain, with nothing
    /// remote to give back.
    ///
    /// Call it when the process is told to stop (SIGTERM), after the server stopped
    /// accepting connections or alongside its own graceful shutdown. Calling it again
    /// is harmless: it drains what is left and reports on that.
    ///
    /// Waiters queued in this process are refused at once; one whose remote attempt is
    /// under way (the local winner, waiting at the backend) when that attempt ends.
    /// None is ever granted the key.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_keyed_lock::{DistributedLocks, LockError};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let locks = DistributedLocks::in_process("jobs");
    /// let job = locks.lock("nightly").await.unwrap();
    /// tokio::spawn(async move {
    ///     tokio::time::sleep(Duration::from_millis(10)).await;
    ///     drop(job); // the job ends within the deadline
    /// });
    /// let report = locks.shutdown(Duration::from_secs(5)).await;
    /// assert_eq!((report.finished, report.cut_off), (1, 0));
    /// assert!(matches!(locks.try_lock("other").await, Err(LockError::ShuttingDown)));
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping the future midway leaves the locks shut (no key granted) and every
    /// holder running; their leases are given back when their guards drop, as always.
    /// A lease release the shutdown began runs to its end in a task of its own.
    pub async fn shutdown(&self, deadline: Duration) -> ShutdownReport {
        self.inner.shutdown.start();
        // Waiters queued here give up now rather than when next handed the key.
        self.inner.local.wake_waiters();
        let report = shutdown::drain(&self.inner.shutdown, || self.len(), deadline).await;
        tracing::info!(
            name = &*self.inner.name,
            finished = report.finished,
            cut_off = report.cut_off,
            leases_released = report.leases_released,
            "locks shut down"
        );
        report
    }

    /// Whether [`shutdown`](Self::shutdown) has begun: no key is granted any more.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown.is_started()
    }

    /// The in-process tier, for the layer's uncontended fast path.
    pub(crate) fn local(&self) -> &KeyedLocks<Key> {
        &self.inner.local
    }

    /// Waits for an already validated key.
    /// Waits for an already validated key; the remote acquisition looks for `lookup`'s
    /// replay record first.
    pub(crate) fn acquire(
        &self,
        key: Key,
        timeout: Option<Duration>,
        mode: Mode,
        lookup: Option<RecordLookup>,
    ) -> DistributedAcquire {
        DistributedAcquire::for_key(self.inner.clone(), key, timeout, mode).looking_up(lookup)
    }

    /// Goes on from a key already held locally (taken with `local().try_lock`): the
    /// backend next, if there is one, looking for `lookup`'s replay record first.
    pub(crate) fn after_local(
        &self,
        local: KeyGuard<Key>,
        timeout: Option<Duration>,
        lookup: Option<RecordLookup>,
    ) -> DistributedAcquire {
        DistributedAcquire::after_local(self.inner.clone(), local, timeout, lookup)
    }
}

impl DistributedLocksBuilder {
    /// Shares the locks with every instance that uses `backend` (Redis, PostgreSQL,
    /// DynamoDB or your own [`LockBackend`]).
    pub fn backend(mut self, backend: impl LockBackend) -> Self {
        self.backend = Some(Arc::new(backend));
        self
    }

    /// Like [`backend`](Self::backend), for a backend already shared.
    pub fn shared_backend(mut self, backend: Arc<dyn LockBackend>) -> Self {
        self.backend = Some(backend);
        self
    }

    /// When the backend fails, hold the key in this process only instead of failing:
    /// the guard says so ([`DistributedGuard::failed_open`]).
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }

    /// The longest key accepted, in bytes (default 256).
    pub fn max_key_len(mut self, max_len: usize) -> Self {
        self.max_key_len = max_len;
        self
    }

    /// Holders per key (default 1): in this process, and with a backend across every
    /// instance — at most `permits` holders of a key cluster-wide, each with a lease
    /// of its own (renewal, release, lost signal); a crashed holder's permit comes
    /// back when its lease runs out. Every instance must use the same number.
    ///
    /// ```
    /// use tower_keyed_lock::DistributedLocks;
    ///
    /// // At most 3 exports per tenant at once (here in process; with a Redis or
    /// // PostgreSQL backend, across all instances).
    /// let exports = DistributedLocks::builder("exports").permits(3).build();
    /// # let _ = exports;
    /// ```
    ///
    /// # Panics
    /// If `permits` is 0; and at [`build`](Self::build) if it is more than 1 and the
    /// backend cannot count permits ([`LockBackend::supports`]).
    pub fn permits(mut self, permits: usize) -> Self {
        self.local = self.local.permits(permits);
        self.permits = permits;
        self
    }

    /// Waiters per key in this process (default unbounded); one more fails at once with
    /// `QueueFull`.
    pub fn max_waiters(mut self, max_waiters: usize) -> Self {
        self.local = self.local.max_waiters(max_waiters);
        self
    }

    /// Keys in this process's table (default unbounded); a new key beyond it fails at
    /// once with `TooManyKeys`.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.local = self.local.max_keys(max_keys);
        self
    }

    /// Locks that record no metrics: a layer's, which records its own.
    pub(crate) fn unmetered(mut self) -> Self {
        self.metered = false;
        self
    }

    /// Renames the locks (a layer's [`name`](crate::KeyedLockLayer::name) setting).
    pub(crate) fn rename(mut self, name: Cow<'static, str>) -> Self {
        self.name = name;
        self
    }

    /// The name the locks will have.
    pub(crate) fn name(&self) -> &Cow<'static, str> {
        &self.name
    }

    /// The longest key the locks will accept.
    pub(crate) fn key_len_limit(&self) -> usize {
        self.max_key_len
    }

    /// The backend the locks will have, if any.
    pub(crate) fn backend_handle(&self) -> Option<Arc<dyn LockBackend>> {
        self.backend.clone()
    }

    /// Why the backend cannot hold keys in `mode`, naming it; `None` if it can (or
    /// there is no backend).
    pub(crate) fn refuses(&self, mode: LockMode) -> Option<String> {
        let backend = self.backend.as_ref()?;
        (!backend.supports(mode)).then(|| {
            format!(
                "the {} lock backend does not support {mode} across instances; only \
                 the Redis and PostgreSQL backends hold keys shared or counted",
                backend.engine()
            )
        })
    }

    /// The holders per key the locks will allow.
    pub(crate) fn permit_count(&self) -> usize {
        self.permits
    }

    /// Builds the locks.
    ///
    /// # Panics
    /// With a backend that cannot give the [`permits`](Self::permits) asked for: they
    /// would hold in this process only, never silently.
    pub fn build(self) -> DistributedLocks {
        if let Some(refusal) = self.refuses(LockMode::permits(self.permits)) {
            panic!("DistributedLocks::permits({}): {refusal}", self.permits);
        }
        DistributedLocks {
            inner: Arc::new(Inner {
                name: self.name,
                local: self.local.build(),
                backend: self.backend,
                permits: self.permits,
                fail_open: self.fail_open,
                max_key_len: self.max_key_len,
                metrics: self.metered.then(OnceLock::new),
                last_error: LastErrorCell::default(),
                shutdown: shutdown::Shutdown::default(),
            }),
        }
    }
}

impl fmt::Debug for DistributedLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedLocks")
            .field("name", &self.inner.name)
            .field("distributed", &self.is_distributed())
            .field("fail_open", &self.inner.fail_open)
            .field("local", &self.inner.local)
            .finish()
    }
}

impl fmt::Debug for DistributedLocksBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedLocksBuilder")
            .field("name", &self.name)
            .field("distributed", &self.backend.is_some())
            .field("fail_open", &self.fail_open)
            .field("max_key_len", &self.max_key_len)
            .field("local", &self.local)
            .finish()
    }
}
