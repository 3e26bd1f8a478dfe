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
//! The locks record the same metrics as the layer, under their name (see
//! [`metrics`](crate::metrics)): waits by outcome, hold times, rejections, leases lost.
//!
//! Every acquisition is cancel-safe: dropping a [`DistributedAcquire`] at any point —
//! queued locally, or waiting at the backend — releases whatever it acquired, and the
//! remote attempt runs detached so a dropped request never leaves a remote lock held.
//!
//! # Files
//!
//! - `mod.rs`: [`DistributedLocks`] and its builder.
//! - `acquire.rs`: [`DistributedAcquire`], the wait in this process, then at the backend.
//! - `guard.rs`: [`DistributedGuard`], the key held in both tiers, and [`LeaseLost`].
//! - `all.rs`: several keys at once ([`DistributedLocks::lock_all`], [`DistributedGuards`]).
//! - `leader.rs`: leader election on one key ([`LeaderElection`], [`Leadership`]).

mod acquire;
mod all;
mod guard;
mod leader;

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use acquire::DistributedAcquire;
pub(crate) use acquire::SHARED_LOCKS;
pub use all::DistributedGuards;
pub use guard::{DistributedGuard, LeaseLost};
pub use leader::{LeaderElection, LeaderInfo, Leadership};

use crate::backend::{default_instance_id, Holder, LockBackend};
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
    fail_open: bool,
    max_key_len: usize,
    /// The locks' metrics, registered on first use (so a recorder installed after the
    /// locks were built is used); `None` under a layer, which records its own.
    metrics: Option<OnceLock<Metrics>>,
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
    /// In process only for now: with a backend it fails with
    /// [`LockError::Unsupported`](crate::LockError::Unsupported), since no backend
    /// holds a key shared across instances yet — never silently taken exclusively or
    /// in this process only.
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

    /// Whether the locks are shared with other instances through a backend.
    pub fn is_distributed(&self) -> bool {
        self.inner.backend.is_some()
    }

    /// Keys with a holder or a waiter in this process now.
    pub fn len(&self) -> usize {
        self.inner.local.len()
    }

    /// True when no key has a holder or a waiter in this process.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The in-process tier, for the layer's uncontended fast path.
    pub(crate) fn local(&self) -> &KeyedLocks<Key> {
        &self.inner.local
    }

    /// Waits for an already validated key.
    pub(crate) fn acquire(
        &self,
        key: Key,
        timeout: Option<Duration>,
        mode: Mode,
    ) -> DistributedAcquire {
        DistributedAcquire::for_key(self.inner.clone(), key, timeout, mode)
    }

    /// Goes on from a key already held locally (taken with `local().try_lock`): the
    /// backend next, if there is one.
    pub(crate) fn after_local(
        &self,
        local: KeyGuard<Key>,
        timeout: Option<Duration>,
    ) -> DistributedAcquire {
        DistributedAcquire::after_local(self.inner.clone(), local, timeout)
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

    /// Holders per key within this process (default 1). With a backend, each of them
    /// still contends remotely, where one holds the key at a time.
    ///
    /// # Panics
    /// If `permits` is 0.
    pub fn permits(mut self, permits: usize) -> Self {
        self.local = self.local.permits(permits);
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

    /// Whether the locks will have a backend.
    pub(crate) fn has_backend(&self) -> bool {
        self.backend.is_some()
    }

    /// Whether the locks will have a backend that issues no fencing tokens.
    #[cfg(feature = "replay")]
    pub(crate) fn lacks_fencing_tokens(&self) -> bool {
        (self.backend.as_ref()).is_some_and(|backend| !backend.issues_fencing_tokens())
    }

    /// Why the backend can never issue fencing tokens, if it says (Redlock).
    #[cfg(feature = "replay")]
    pub(crate) fn no_fencing_tokens_reason(&self) -> Option<&'static str> {
        (self.backend.as_ref()).and_then(|backend| backend.no_fencing_tokens_reason())
    }

    /// Builds the locks.
    pub fn build(self) -> DistributedLocks {
        DistributedLocks {
            inner: Arc::new(Inner {
                name: self.name,
                local: self.local.build(),
                backend: self.backend,
                fail_open: self.fail_open,
                max_key_len: self.max_key_len,
                metrics: self.metered.then(OnceLock::new),
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
