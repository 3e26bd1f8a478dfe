//! The map under the lock table, reduced to the two operations the table needs.
//!
//! Each operation runs its closure while holding the lock of the key's shard, so a
//! closure sees and changes a slot atomically with respect to every other operation on
//! that key. Closures never await: no shard lock is ever held across an `.await`.
//!
//! Under `cfg(loom)` a single `loom` mutex over a `HashMap` stands in for `DashMap`, so
//! the model checker sees every lock acquisition.

use std::hash::Hash;

#[cfg(not(loom))]
pub(crate) struct Table<K, V>(dashmap::DashMap<K, V>);

#[cfg(not(loom))]
impl<K: Eq + Hash, V> Table<K, V> {
    pub(crate) fn new() -> Self {
        Self(dashmap::DashMap::new())
    }

    /// Runs `f` on the slot of `key`, first inserting a default slot if there is none
    /// and `admit_new()` allows it. Returns the key (the caller's own, or a clone when
    /// the table kept the original) and `f`'s result, `None` when not admitted.
    /// One lookup whether the key is there or not, and no clone when it is.
    pub(crate) fn with_slot<R>(
        &self,
        key: K,
        admit_new: impl FnOnce() -> bool,
        f: impl FnOnce(&mut V) -> R,
    ) -> (K, Option<R>)
    where
        K: Clone,
        V: Default,
    {
        match self.0.entry(key) {
            dashmap::Entry::Occupied(mut slot) => {
                let result = f(slot.get_mut());
                (slot.into_key(), Some(result))
            }
            dashmap::Entry::Vacant(vacant) => {
                if !admit_new() {
                    return (vacant.into_key(), None);
                }
                let key = vacant.key().clone();
                let result = f(&mut vacant.insert(V::default()));
                (key, Some(result))
            }
        }
    }

    /// Runs `f` on the slot of `key` and removes the slot if `f` returns true.
    /// Returns whether a slot was removed.
    pub(crate) fn update_or_remove(&self, key: &K, f: impl FnOnce(&mut V) -> bool) -> bool {
        self.0.remove_if_mut(key, |_, slot| f(slot)).is_some()
    }
}

#[cfg(loom)]
pub(crate) struct Table<K, V>(loom::sync::Mutex<std::collections::HashMap<K, V>>);

#[cfg(loom)]
impl<K: Eq + Hash, V> Table<K, V> {
    pub(crate) fn new() -> Self {
        Self(loom::sync::Mutex::new(std::collections::HashMap::new()))
    }

    pub(crate) fn with_slot<R>(
        &self,
        key: K,
        admit_new: impl FnOnce() -> bool,
        f: impl FnOnce(&mut V) -> R,
    ) -> (K, Option<R>)
    where
        K: Clone,
        V: Default,
    {
        let mut map = self.0.lock().unwrap();
        if let Some(slot) = map.get_mut(&key) {
            let result = f(slot);
            return (key, Some(result));
        }
        if !admit_new() {
            return (key, None);
        }
        let result = f(map.entry(key.clone()).or_default());
        (key, Some(result))
    }

    pub(crate) fn update_or_remove(&self, key: &K, f: impl FnOnce(&mut V) -> bool) -> bool {
        let mut map = self.0.lock().unwrap();
        let remove = map.get_mut(key).is_some_and(f);
        if remove {
            map.remove(key);
        }
        remove
    }
}
