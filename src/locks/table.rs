//! The map under the lock table, reduced to the three operations the table needs.
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

    /// Runs `f` on the slot of `key` if there is one.
    pub(crate) fn update<R>(&self, key: &K, f: impl FnOnce(&mut V) -> R) -> Option<R> {
        self.0.get_mut(key).map(|mut slot| f(&mut slot))
    }

    /// Runs `f` on the slot of `key`, inserting `init()` first if there is none;
    /// `f` learns whether the slot was inserted by this call.
    pub(crate) fn upsert<R>(
        &self,
        key: K,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> R,
    ) -> R {
        match self.0.entry(key) {
            dashmap::Entry::Occupied(mut slot) => f(slot.get_mut(), false),
            dashmap::Entry::Vacant(vacant) => f(&mut vacant.insert(init()), true),
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

    pub(crate) fn update<R>(&self, key: &K, f: impl FnOnce(&mut V) -> R) -> Option<R> {
        self.0.lock().unwrap().get_mut(key).map(f)
    }

    pub(crate) fn upsert<R>(
        &self,
        key: K,
        init: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, bool) -> R,
    ) -> R {
        let mut map = self.0.lock().unwrap();
        let inserted = !map.contains_key(&key);
        f(map.entry(key).or_insert_with(init), inserted)
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
