//! Several keys at once: [`KeyedLocks::lock_all`] and its guard.
//!
//! Keys are taken one by one in one canonical order — their table hash, which every
//! clone of a table shares — so two callers that want overlapping sets never each hold
//! what the other waits for. Keys that are equal, or whose hashes collide (they share a
//! slot), are taken once.

use std::fmt;
use std::hash::Hash;
use std::time::Duration;

use tokio::time::Instant;

use super::{KeyGuard, KeyedLocks, LockError};

/// Holds every key of a [`KeyedLocks::lock_all`] call; dropping it releases them all.
#[must_use = "the keys are released as soon as the guard is dropped"]
pub struct KeyGuards<K: Eq + Hash> {
    /// The distinct keys asked for, in the order they were taken.
    keys: Vec<K>,
    /// One guard per slot (fewer than `keys` when hashes collide), released on drop.
    _guards: Vec<KeyGuard<K>>,
}

impl<K: Eq + Hash> KeyGuards<K> {
    /// The distinct keys held, in the canonical order they were taken.
    pub fn keys(&self) -> &[K] {
        &self.keys
    }
}

impl<K: Eq + Hash + fmt::Debug> fmt::Debug for KeyGuards<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyGuards")
            .field("keys", &self.keys)
            .finish()
    }
}

impl<K: Eq + Hash + Clone + Send + Sync + 'static> KeyedLocks<K> {
    /// Waits for every key of `keys`, without a time limit, and holds them all under
    /// one guard: a transfer between two accounts holds both.
    ///
    /// Keys are taken in one canonical order (not the order given), so two calls for
    /// `[a, b]` and `[b, a]` cannot deadlock each other; duplicates are taken once. The
    /// future is cancel-safe: dropped at any point, it releases the keys it had taken.
    /// An empty `keys` holds nothing and succeeds at once.
    ///
    /// ```
    /// use tower_keyed_lock::{KeyedLocks, LockError};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let accounts = KeyedLocks::new();
    /// let transfer = accounts.lock_all(["alice", "bob"]).await.unwrap();
    /// assert!(matches!(accounts.try_lock("bob"), Err(LockError::Busy)));
    /// drop(transfer);
    /// assert!(accounts.is_empty());
    /// # }
    /// ```
    pub async fn lock_all(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<KeyGuards<K>, LockError> {
        self.take_all(keys, None).await
    }

    /// Waits for every key of `keys` at most `timeout` in all, then fails with
    /// [`LockError::Timeout`], releasing what it had taken. `Duration::ZERO` tries once.
    pub async fn lock_all_timeout(
        &self,
        keys: impl IntoIterator<Item = K>,
        timeout: Duration,
    ) -> Result<KeyGuards<K>, LockError> {
        self.take_all(keys, Some(Instant::now() + timeout)).await
    }

    /// Takes every key of `keys` if each is free now, else fails with
    /// [`LockError::Busy`] and holds none of them.
    pub fn try_lock_all(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<KeyGuards<K>, LockError> {
        let (keys, slots) = self.canonical(keys);
        let guards = slots
            .into_iter()
            .map(|at| self.try_lock(keys[at].clone()))
            .collect::<Result<_, _>>()?;
        Ok(KeyGuards {
            keys,
            _guards: guards,
        })
    }

    async fn take_all(
        &self,
        keys: impl IntoIterator<Item = K>,
        deadline: Option<Instant>,
    ) -> Result<KeyGuards<K>, LockError> {
        let (keys, slots) = self.canonical(keys);
        let mut guards = Vec::with_capacity(slots.len());
        for at in slots {
            let key = keys[at].clone();
            let guard = match deadline {
                None => self.lock(key).await?,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    self.lock_timeout(key, left).await?
                }
            };
            guards.push(guard);
        }
        Ok(KeyGuards {
            keys,
            _guards: guards,
        })
    }

    /// The distinct keys sorted by table hash, and the index of the first key of each
    /// hash (one slot each).
    fn canonical(&self, keys: impl IntoIterator<Item = K>) -> (Vec<K>, Vec<usize>) {
        let table = &self.inner().table;
        let mut hashed: Vec<(u64, K)> = keys
            .into_iter()
            .map(|key| (table.hash(&key), key))
            .collect();
        hashed.sort_unstable_by_key(|(hash, _)| *hash);
        let mut keys: Vec<K> = Vec::with_capacity(hashed.len());
        let mut slots = Vec::new();
        let mut last_hash = None;
        let mut group_start = 0;
        for (hash, key) in hashed {
            if last_hash != Some(hash) {
                last_hash = Some(hash);
                group_start = keys.len();
                slots.push(keys.len());
            } else if keys[group_start..].contains(&key) {
                continue;
            }
            keys.push(key);
        }
        (keys, slots)
    }
}
