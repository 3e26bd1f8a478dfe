//! The in-process keyed lock: [`KeyedLocks`] and its guard.
//!
//! ```
//! use std::time::Duration;
//! use tower_keyed_lock::{KeyedLocks, LockError};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let locks = KeyedLocks::new();
//! let order_42 = locks.lock("order-42").await.unwrap();
//!
//! // Another key is independent…
//! let order_7 = locks.try_lock("order-7").unwrap();
//! // …the same key is not.
//! assert!(matches!(locks.try_lock("order-42"), Err(LockError::Busy)));
//! assert!(matches!(
//!     locks.lock_timeout("order-42", Duration::from_millis(10)).await,
//!     Err(LockError::Timeout)
//! ));
//!
//! drop((order_42, order_7));
//! assert!(locks.is_empty()); // entries leave with their last holder
//! # }
//! ```
//!
//! # Files
//!
//! - `mod.rs`: [`KeyedLocks`], its builder and [`KeyGuard`]; [`LockError`] is
//!   `crate::error`'s, re-exported here.
//! - `table.rs`: the sharded map of keys, known by their hash.
//! - `slot.rs`: one key's holders and waiters, and the hand-off to the next waiter.
//! - `acquire.rs`: [`Acquire`], the cancel-safe wait for a key.
//! - `all.rs`: several keys at once ([`KeyedLocks::lock_all`], [`KeyGuards`]).
//! - `count.rs`: the bound on the number of keys (`max_keys`).

mod acquire;
mod all;
mod count;
mod slot;
mod table;

use std::fmt;
use std::hash::Hash;
use std::task::Waker;
use std::time::Duration;

pub use acquire::Acquire;
pub use all::KeyGuards;

// Re-exported: the lock's error was first defined here, and the backends name it by
// this path.
pub use crate::error::LockError;
use crate::sync::{Arc, CachePadded};
use count::KeyBound;
pub(crate) use slot::Mode;
use slot::{Attempt, Granted, Slot, Waiter};
use table::Table;

/// A table of async locks, one per key, created on demand and removed the moment the
/// last holder or waiter of a key leaves.
///
/// The table knows a key by a 64-bit SipHash of it, keyed at random per table, and keeps
/// no copy of the key: locking a new `String` key allocates nothing. Two keys whose
/// hashes collide share one lock and so run one at a time, which never breaks mutual
/// exclusion; a collision cannot be aimed at the random key, and by chance, among a
/// million keys in use at once, has odds of about 3 in 100 million. [`len`](Self::len)
/// counts such keys once.
///
/// A table takes about 36 KiB up front (256 shards on cache lines of their own, so two
/// cores seldom meet on one shard, and per-thread handles): make one per use, shared by
/// its clones, not one per request.
///
/// Clones share one table. Waiters of a key are served in arrival order (FIFO); at most
/// `permits` holders hold a key at once (1 unless set with
/// [`KeyedLocksBuilder::permits`]). A lock future dropped at any point — before it was
/// polled, while queued, or after a releasing holder handed it the permit but before it
/// ran — gives back what it was given, so cancellation never leaks a permit or an entry.
///
/// See the [module docs](crate::locks) for an example.
pub struct KeyedLocks<K> {
    /// One handle per thread stripe, all on the same table. The array never changes,
    /// so it needs no model under loom: a std `Arc`.
    handles: std::sync::Arc<[Arc<Handle<K>>]>,
}

/// A counted reference to the table: every lock future and guard holds one, which keeps
/// the table alive. Each takes the handle of its thread's stripe, so two cores locking
/// and releasing do not both write one reference count (a cache line moving between
/// them twice per lock). The padding keeps that count off the line of the pointer that
/// every operation reads.
struct Handle<K>(CachePadded<Arc<Inner<K>>>);

impl<K> std::ops::Deref for Handle<K> {
    type Target = Inner<K>;

    fn deref(&self) -> &Inner<K> {
        &self.0
    }
}

struct Inner<K> {
    /// Read by every call; padded away from the `Arc`'s reference counts in front of
    /// it, which change on every call, and from `bound`, which changes as keys come and
    /// go.
    table: CachePadded<Table<K, Slot>>,
    /// The shared count that enforces `max_keys`, if it is set.
    bound: Option<KeyBound>,
    /// A gauge that follows the key count step by step, set by the layer that owns the
    /// table. Moving it by ±1 (rather than setting it) lets layers that share a metric
    /// name add up.
    keys_gauge: std::sync::OnceLock<metrics::Gauge>,
    /// Exclusive holders per key (checked to fit when built).
    permits: u32,
    max_waiters: usize,
    max_keys: usize,
}

/// Configures a [`KeyedLocks`]; every limit defaults to "none" and `permits` to 1.
///
/// ```
/// use tower_keyed_lock::KeyedLocks;
///
/// let locks: KeyedLocks<u64> = KeyedLocks::builder()
///     .permits(2)        // two holders per key
///     .max_waiters(16)   // then `QueueFull`
///     .max_keys(10_000)  // then `TooManyKeys` for a new key
///     .build();
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct KeyedLocksBuilder<K> {
    permits: usize,
    max_waiters: usize,
    max_keys: usize,
    _key: std::marker::PhantomData<fn() -> K>,
}

/// Proof that a key is held; dropping it releases the key (or hands it to the next
/// waiter). Owned, `Send` and `'static`, so it can move into a spawned task.
#[must_use = "the key is released as soon as the guard is dropped"]
pub struct KeyGuard<K: Eq + Hash> {
    /// The table, through the handle of the thread that locked.
    inner: Arc<Handle<K>>,
    key: K,
    /// The key's table hash, kept so the release does not hash the key again.
    hash: u64,
    mode: Mode,
}

/// A key held through [`KeyedLocks::try_hold`], known by its table hash. It does not
/// release on drop: its owner must pass it to [`KeyedLocks::release`] of the same table.
#[must_use = "a held key must be given back with `KeyedLocks::release`"]
pub(crate) struct HashHold {
    hash: u64,
    mode: Mode,
}

impl<K: Eq + Hash + Clone + Send + Sync + 'static> KeyedLocks<K> {
    /// A table with one holder per key and no limits.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder for permits per key, a waiter bound per key and a key bound.
    pub fn builder() -> KeyedLocksBuilder<K> {
        KeyedLocksBuilder {
            permits: 1,
            max_waiters: usize::MAX,
            max_keys: usize::MAX,
            _key: std::marker::PhantomData,
        }
    }

    /// Waits for `key` without a time limit.
    ///
    /// The returned future is cancel-safe: dropping it at any point releases whatever it
    /// acquired. It fails at once with [`LockError::QueueFull`] or
    /// [`LockError::TooManyKeys`] when a limit is reached.
    pub fn lock(&self, key: K) -> Acquire<K> {
        self.acquire(key, None, Mode::Exclusive)
    }

    /// Waits for `key` at most `timeout`, then fails with [`LockError::Timeout`].
    /// `Duration::ZERO` tries once and never waits. Needs a Tokio runtime with time
    /// enabled when it has to wait.
    pub fn lock_timeout(&self, key: K, timeout: Duration) -> Acquire<K> {
        self.acquire(key, Some(timeout), Mode::Exclusive)
    }

    /// Takes `key` if a permit is free now, else fails with [`LockError::Busy`].
    pub fn try_lock(&self, key: K) -> Result<KeyGuard<K>, LockError> {
        let HashHold { hash, mode } = self.try_hold(&key, Mode::Exclusive)?;
        Ok(KeyGuard::new(self.handle(), key, hash, mode))
    }

    /// Waits for `key` shared, without a time limit: any number of shared holders hold
    /// a key together, while no exclusive holder ([`lock`](Self::lock)) has it.
    ///
    /// Waiters are served in arrival order whatever their mode: a waiting exclusive
    /// holder stops new shared holders from entering (writers are not starved by a
    /// stream of readers), and the shared holders queued behind it enter together once
    /// it leaves. Cancel-safe as [`lock`](Self::lock).
    ///
    /// ```
    /// use tower_keyed_lock::{KeyedLocks, LockError};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let locks = KeyedLocks::new();
    /// let reader = locks.lock_shared("order-42").await.unwrap();
    /// let another = locks.try_lock_shared("order-42").unwrap(); // readers together
    /// assert!(matches!(locks.try_lock("order-42"), Err(LockError::Busy))); // no writer
    /// drop((reader, another));
    /// let writer = locks.try_lock("order-42").unwrap();
    /// assert!(matches!(locks.try_lock_shared("order-42"), Err(LockError::Busy)));
    /// # drop(writer);
    /// # }
    /// ```
    pub fn lock_shared(&self, key: K) -> Acquire<K> {
        self.acquire(key, None, Mode::Shared)
    }

    /// Waits for `key` shared at most `timeout`, as [`lock_timeout`](Self::lock_timeout).
    pub fn lock_shared_timeout(&self, key: K, timeout: Duration) -> Acquire<K> {
        self.acquire(key, Some(timeout), Mode::Shared)
    }

    /// Takes `key` shared if no exclusive holder has it and nobody waits for it, else
    /// fails with [`LockError::Busy`].
    pub fn try_lock_shared(&self, key: K) -> Result<KeyGuard<K>, LockError> {
        let HashHold { hash, mode } = self.try_hold(&key, Mode::Shared)?;
        Ok(KeyGuard::new(self.handle(), key, hash, mode))
    }

    /// Waits for `key` in `mode`, at most `timeout` if set: what every lock method
    /// makes.
    pub(crate) fn acquire(&self, key: K, timeout: Option<Duration>, mode: Mode) -> Acquire<K> {
        Acquire::new(self.handle(), key, timeout, mode)
    }

    /// Like [`try_lock`](Self::try_lock), for a holder that keeps the table alive by
    /// other means and gives the key back with [`release`](Self::release): no guard, so
    /// no reference count on the table and no copy of the key.
    pub(crate) fn try_hold(&self, key: &K, mode: Mode) -> Result<HashHold, LockError> {
        let hash = self.inner().table.hash(key);
        match self.inner().attempt(hash, mode, None) {
            Ok(Attempt::Acquired) => Ok(HashHold { hash, mode }),
            Ok(_) => Err(LockError::Busy),
            Err(error) => Err(error),
        }
    }

    /// Gives back a key taken with [`try_hold`](Self::try_hold).
    pub(crate) fn release(&self, hold: HashHold) {
        self.inner().release(hold.hash, hold.mode);
    }

    /// Whether `key` has a holder now, read without taking it (and without adding a
    /// slot for a key not in the table).
    pub(crate) fn is_held(&self, key: &K) -> bool {
        let hash = self.inner().table.hash(key);
        self.inner()
            .table
            .with_slot(hash, || false, |slot| slot.is_held())
            .unwrap_or(false)
    }

    /// Keys that have a holder or a waiter now (exact when no call is in flight).
    pub fn len(&self) -> usize {
        self.inner().table.len()
    }

    /// True when no key has a holder or a waiter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes `gauge` follow the key count from now on. Called once, while the table is
    /// still empty, so the gauge starts right.
    pub(crate) fn report_keys_to(&self, gauge: metrics::Gauge) {
        debug_assert!(self.is_empty(), "the key gauge set on a table in use");
        let _ = self.inner().keys_gauge.set(gauge);
    }
}

impl<K: Eq + Hash> Inner<K> {
    /// First attempt on the key of table hash `hash`: acquire, or queue with `waker`,
    /// or say why not.
    fn attempt(
        &self,
        hash: u64,
        mode: Mode,
        waker: Option<&std::task::Waker>,
    ) -> Result<Attempt, LockError> {
        let attempt = self.table.with_slot(
            hash,
            || {
                let admitted = self.bound.as_ref().is_none_or(KeyBound::admit);
                if let (true, Some(gauge)) = (admitted, self.keys_gauge.get()) {
                    gauge.increment(1.0);
                }
                admitted
            },
            |slot| slot.acquire_or_enqueue(mode, self.permits, self.max_waiters, waker),
        );
        attempt.ok_or(LockError::TooManyKeys)
    }

    fn release(&self, hash: u64, mode: Mode) {
        self.finish(hash, |slot| slot.release(mode, self.permits));
    }

    fn withdraw(&self, hash: u64, waiter: &Arc<Waiter>) {
        self.finish(hash, |slot| slot.withdraw(waiter, self.permits));
    }

    /// Applies a leaving step to the slot of hash `hash`, removes the slot when it says
    /// so, and wakes the holders it granted after the shard lock is released.
    fn finish(&self, hash: u64, step: impl FnOnce(&mut Slot) -> (Granted, bool)) {
        let mut next = Granted::default();
        let removed = self.table.update_or_remove(hash, |slot| {
            let (granted, remove) = step(slot);
            next = granted;
            remove
        });
        if removed {
            if let Some(bound) = &self.bound {
                bound.removed();
            }
            if let Some(gauge) = self.keys_gauge.get() {
                gauge.decrement(1.0);
            }
        }
        next.wake();
    }
}

impl<K> Clone for KeyedLocks<K> {
    fn clone(&self) -> Self {
        Self {
            handles: self.handles.clone(),
        }
    }
}

impl<K: Eq + Hash + Clone + Send + Sync + 'static> Default for KeyedLocks<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> KeyedLocks<K> {
    fn inner(&self) -> &Inner<K> {
        &self.handles[0]
    }

    /// Wakes every waiter without granting it anything, so that a future that wraps
    /// the wait (a distributed acquisition of locks shutting down) looks again whether
    /// it still wants the key. The wakers are called after the shard locks are released.
    pub(crate) fn wake_waiters(&self) {
        let mut wakers = Vec::new();
        self.inner()
            .table
            .for_each(|slot| slot.waiting_wakers(&mut wakers));
        wakers.into_iter().for_each(Waker::wake);
    }

    /// A new reference to the table, on this thread's handle.
    fn handle(&self) -> Arc<Handle<K>> {
        // The number of handles is a power of two.
        self.handles[count::stripe() & (self.handles.len() - 1)].clone()
    }
}

impl<K> fmt::Debug for KeyedLocks<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLocks")
            .field("keys", &self.inner().table.len())
            .field("permits", &self.inner().permits)
            .field("max_waiters", &self.inner().max_waiters)
            .field("max_keys", &self.inner().max_keys)
            .finish()
    }
}

impl<K: Eq + Hash + Clone + Send + Sync + 'static> KeyedLocksBuilder<K> {
    /// Holders allowed per key at once (default 1).
    ///
    /// # Panics
    /// If `permits` is 0: no request could ever run.
    pub fn permits(mut self, permits: usize) -> Self {
        // The one check of `permits`: the distributed builder and the layer pass theirs here.
        assert!(
            permits > 0,
            "permits must be at least 1: no request could ever run"
        );
        assert!(
            u32::try_from(permits).is_ok(),
            "permits must fit in a u32 (at most {})",
            u32::MAX
        );
        self.permits = permits;
        self
    }

    /// Waiters allowed per key (default unbounded); a `lock` beyond it fails at once
    /// with [`LockError::QueueFull`]. 0 means a busy key is never waited for.
    pub fn max_waiters(mut self, max_waiters: usize) -> Self {
        self.max_waiters = max_waiters;
        self
    }

    /// Keys allowed in the table at once (default unbounded); a `lock` on a new key
    /// beyond it fails at once with [`LockError::TooManyKeys`].
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Builds the table.
    pub fn build(self) -> KeyedLocks<K> {
        let inner = Arc::new(Inner {
            table: CachePadded(Table::new()),
            bound: KeyBound::new(self.max_keys),
            keys_gauge: std::sync::OnceLock::new(),
            permits: u32::try_from(self.permits).expect("checked by `permits`"),
            max_waiters: self.max_waiters,
            max_keys: self.max_keys,
        });
        // One handle under loom, so models see the same reference count as threads.
        let handles = if cfg!(loom) { 1 } else { count::STRIPES };
        let handles: Vec<_> = (0..handles)
            .map(|_| Arc::new(Handle(CachePadded(inner.clone()))))
            .collect();
        KeyedLocks {
            handles: handles.into(),
        }
    }
}

impl<K: Eq + Hash> KeyGuard<K> {
    fn new(inner: Arc<Handle<K>>, key: K, hash: u64, mode: Mode) -> Self {
        Self {
            inner,
            key,
            hash,
            mode,
        }
    }

    /// The key this guard holds.
    pub fn key(&self) -> &K {
        &self.key
    }

    /// Whether the key is held shared ([`KeyedLocks::lock_shared`]) rather than
    /// exclusively.
    pub fn is_shared(&self) -> bool {
        self.mode == Mode::Shared
    }
}

impl<K: Eq + Hash> Drop for KeyGuard<K> {
    fn drop(&mut self) {
        self.inner.release(self.hash, self.mode);
    }
}

impl<K: Eq + Hash + fmt::Debug> fmt::Debug for KeyGuard<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyGuard")
            .field("key", &self.key)
            .field("shared", &self.is_shared())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// Polls `future` once with a waker that does nothing.
    fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        Pin::new(future).poll(&mut Context::from_waker(Waker::noop()))
    }

    /// A waker that counts its wakes.
    struct Counting(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Counting {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn wake_waiters_wakes_every_waiter_and_grants_nothing() {
        let locks = KeyedLocks::new();
        let held = [locks.try_lock("a").unwrap(), locks.try_lock("b").unwrap()];
        let counter = std::sync::Arc::new(Counting(std::sync::atomic::AtomicUsize::new(0)));
        let waker = Waker::from(std::sync::Arc::clone(&counter));
        let mut waiters: Vec<_> = ["a", "a", "b"].map(|key| Box::pin(locks.lock(key))).into();
        for waiter in &mut waiters {
            assert!(waiter
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
        }
        locks.wake_waiters();
        assert_eq!(counter.0.load(std::sync::atomic::Ordering::SeqCst), 3);
        // Still queued, in order: woken is not granted.
        for waiter in &mut waiters {
            assert!(poll_once(waiter).is_pending());
        }
        drop(held);
        let granted = poll_once(&mut waiters[0]);
        assert!(matches!(granted, Poll::Ready(Ok(_))));
        assert!(poll_once(&mut waiters[1]).is_pending());
        drop(granted);
        drop(waiters);
        assert!(locks.is_empty());
    }

    #[test]
    fn same_key_excludes_other_keys_do_not() {
        let locks = KeyedLocks::new();
        let a = locks.try_lock("a").unwrap();
        assert!(matches!(locks.try_lock("a"), Err(LockError::Busy)));
        let b = locks.try_lock("b").unwrap();
        assert_eq!((a.key(), b.key(), locks.len()), (&"a", &"b", 2));
        drop(a);
        assert_eq!(locks.len(), 1);
        drop(locks.try_lock("a").unwrap());
        drop(b);
        assert!(locks.is_empty());
    }

    #[test]
    fn keys_whose_hashes_collide_serialize_together() {
        /// A key type whose every value hashes alike, standing for a 64-bit collision.
        #[derive(Clone, PartialEq, Eq)]
        struct Colliding(&'static str);
        impl std::hash::Hash for Colliding {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                state.write_u8(0);
            }
        }
        let locks = KeyedLocks::new();
        let a = locks.try_lock(Colliding("a")).unwrap();
        assert!(matches!(
            locks.try_lock(Colliding("b")),
            Err(LockError::Busy)
        ));
        assert_eq!(locks.len(), 1);
        drop(a);
        let b = locks.try_lock(Colliding("b")).unwrap();
        assert_eq!(b.key().0, "b");
        drop(b);
        assert!(locks.is_empty());
    }

    #[test]
    fn a_hold_by_hash_excludes_like_a_guard_and_is_given_back() {
        let locks = KeyedLocks::builder().max_keys(1).build();
        let hold = locks.try_hold(&"a", Mode::Exclusive).unwrap();
        assert!(matches!(locks.try_lock("a"), Err(LockError::Busy)));
        assert!(matches!(
            locks.try_hold(&"a", Mode::Shared),
            Err(LockError::Busy)
        ));
        assert!(matches!(
            locks.try_hold(&"b", Mode::Exclusive),
            Err(LockError::TooManyKeys)
        ));
        assert_eq!(locks.len(), 1);
        locks.release(hold);
        assert!(locks.is_empty());
        let guard = locks.try_lock("b").unwrap();
        assert!(matches!(
            locks.try_hold(&"b", Mode::Exclusive),
            Err(LockError::Busy)
        ));
        drop(guard);
        locks.release(locks.try_hold(&"a", Mode::Exclusive).unwrap());
        assert!(locks.is_empty());
    }

    #[test]
    fn permits_bound_the_holders_of_a_key() {
        let locks = KeyedLocks::builder().permits(2).build();
        let first = locks.try_lock(1).unwrap();
        let _second = locks.try_lock(1).unwrap();
        assert!(matches!(locks.try_lock(1), Err(LockError::Busy)));
        drop(first);
        let _third = locks.try_lock(1).unwrap();
        assert_eq!(locks.len(), 1);
    }

    #[test]
    #[should_panic(expected = "at least 1")]
    fn zero_permits_is_refused_at_build_time() {
        let _ = KeyedLocks::<u8>::builder().permits(0);
    }

    #[test]
    fn waiters_are_served_in_arrival_order() {
        let locks = KeyedLocks::new();
        let holder = locks.try_lock(7).unwrap();
        let mut waiters: Vec<_> = (0..5).map(|_| locks.lock(7)).collect();
        for waiter in &mut waiters {
            assert!(poll_once(waiter).is_pending());
        }
        drop(holder);
        for i in 0..waiters.len() {
            // Only the front waiter holds; everyone behind it still waits.
            let Poll::Ready(Ok(guard)) = poll_once(&mut waiters[i]) else {
                panic!("waiter {i} was not served in order");
            };
            for later in &mut waiters[i + 1..] {
                assert!(poll_once(later).is_pending());
            }
            drop(guard);
        }
        assert!(locks.is_empty());
    }

    #[test]
    fn queue_full_fails_at_once_and_leaves_the_queue_intact() {
        let locks = KeyedLocks::builder().max_waiters(1).build();
        let holder = locks.try_lock("k").unwrap();
        let mut queued = locks.lock("k");
        assert!(poll_once(&mut queued).is_pending());
        assert!(matches!(
            poll_once(&mut locks.lock("k")),
            Poll::Ready(Err(LockError::QueueFull))
        ));
        drop(holder);
        assert!(matches!(poll_once(&mut queued), Poll::Ready(Ok(_))));
        assert!(locks.is_empty());
    }

    #[test]
    fn zero_max_waiters_never_queues() {
        let locks = KeyedLocks::builder().max_waiters(0).build();
        let _holder = locks.try_lock(1).unwrap();
        assert!(matches!(
            poll_once(&mut locks.lock(1)),
            Poll::Ready(Err(LockError::QueueFull))
        ));
    }

    #[test]
    fn too_many_keys_refuses_only_new_keys() {
        let locks = KeyedLocks::builder().max_keys(2).build();
        let _a = locks.try_lock("a").unwrap();
        let b = locks.try_lock("b").unwrap();
        assert!(matches!(locks.try_lock("c"), Err(LockError::TooManyKeys)));
        assert!(matches!(
            poll_once(&mut locks.lock("c")),
            Poll::Ready(Err(LockError::TooManyKeys))
        ));
        // An existing key may still queue.
        assert!(poll_once(&mut locks.lock("a")).is_pending());
        assert_eq!(locks.len(), 2);
        drop(b);
        let _c = locks.try_lock("c").unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lock_timeout_expires_and_withdraws() {
        let locks = KeyedLocks::new();
        let holder = locks.try_lock(1).unwrap();
        let result = locks.lock_timeout(1, Duration::from_secs(2)).await;
        assert!(matches!(result, Err(LockError::Timeout)));
        assert_eq!(locks.len(), 1);
        drop(holder);
        assert!(locks.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn lock_timeout_succeeds_when_released_in_time() {
        let locks = KeyedLocks::new();
        let holder = locks.try_lock(1).unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(holder);
        });
        let guard = locks.lock_timeout(1, Duration::from_secs(2)).await.unwrap();
        assert_eq!(*guard.key(), 1);
    }

    #[test]
    fn zero_timeout_tries_once_without_a_runtime() {
        let locks = KeyedLocks::new();
        let holder = locks.try_lock(1).unwrap();
        let mut attempt = locks.lock_timeout(1, Duration::ZERO);
        assert!(matches!(
            poll_once(&mut attempt),
            Poll::Ready(Err(LockError::Timeout))
        ));
        drop(holder);
        assert!(matches!(
            poll_once(&mut locks.lock_timeout(1, Duration::ZERO)),
            Poll::Ready(Ok(_))
        ));
        assert!(locks.is_empty());
    }

    #[test]
    fn clones_share_one_table() {
        let locks = KeyedLocks::new();
        let clone = locks.clone();
        let _held = locks.try_lock("k").unwrap();
        assert!(matches!(clone.try_lock("k"), Err(LockError::Busy)));
        assert_eq!(clone.len(), 1);
    }

    #[test]
    fn guard_moves_into_a_spawned_task() {
        fn assert_send_static<T: Send + 'static>(_: &T) {}
        let locks = KeyedLocks::<String>::new();
        let guard = locks.try_lock("k".to_owned()).unwrap();
        assert_send_static(&guard);
        assert_send_static(&locks.lock("k".to_owned()));
    }
}
