//! The map under the lock table, reduced to the two operations the table needs.
//!
//! A key is known by its 64-bit hash alone, keyed with a random SipHash key per table:
//! the table stores no key, copies none and compares none. Two keys whose hashes
//! collide share one slot, so they serialize together: mutual exclusion per key still
//! holds, and no one can aim a collision at the random key (by chance, among a million
//! keys in use at once, a collision has odds of about 3 in 100 million).
//!
//! Each operation runs its closure while holding the lock of the hash's shard, so a
//! closure sees and changes a slot atomically with respect to every other operation on
//! that key. Closures never await: no shard lock is ever held across an `.await`.
//!
//! Under `cfg(loom)` a single `loom` mutex over a `HashMap` stands in for the sharded
//! table, so the model checker sees every lock acquisition.

use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;

#[cfg(not(loom))]
use crate::sync::{lock, AtomicUsize, CachePadded, Mutex, Ordering};

/// A shard keeps this much capacity while it has keys: below it, shrinking would free
/// and reallocate as a few keys come and go.
#[cfg(not(loom))]
const KEPT_CAPACITY: usize = 256;

/// Shards at least: enough that keys in use are mostly alone in theirs, in its inline
/// places (two cores then seldom meet on one shard lock, and a lock or release touches
/// only the shard's own cache lines). 128 bytes each, 32 KiB in all; with 64 keys held
/// on 2 cores, 64 / 128 / 256 / 512 shards measured 1.33 / 1.21 / 1.16 / 1.13 times
/// diy-dashmap's time per lock.
#[cfg(not(loom))]
const MIN_SHARDS: usize = 256;

/// Slots a shard keeps inline, beside its lock, before it uses its hash table.
#[cfg(not(loom))]
const INLINE: usize = 2;

/// One shard: the slots whose hash picks it, under one lock.
#[cfg(not(loom))]
struct Shard<V> {
    map: Mutex<ShardMap<V>>,
    /// The number of slots in `map`. Changed only under its lock, so a plain load and
    /// store do (no read-modify-write); atomic only so [`Table::len`] can read it
    /// without the lock.
    len: AtomicUsize,
}

/// A shard's slots by hash: the first few inline, so that with a lock on the same cache
/// lines a lock or release moves one pair of lines between cores, not also the hash
/// table's control bytes and bucket, which every insert and removal writes. A slot
/// stays where it was inserted until removed, and is looked for in both places.
#[cfg(not(loom))]
struct ShardMap<V> {
    inline: [Option<(u64, V)>; INLINE],
    table: hashbrown::HashTable<(u64, V)>,
}

/// A sharded hash table: a key's hash, computed once per lock and kept until its
/// release, is its identity and picks its shard and its bucket. Keys come from clients,
/// so the hasher is std's randomly keyed SipHash: no one can aim keys at one slot, one
/// shard or one probe sequence.
#[cfg(not(loom))]
pub(crate) struct Table<K, V> {
    hasher: std::hash::RandomState,
    shards: Box<[CachePadded<Shard<V>>]>,
    /// `64 - log2(shards.len())`.
    shard_shift: u32,
    _key: PhantomData<fn(&K)>,
}

#[cfg(not(loom))]
impl<K, V> Table<K, V> {
    /// The number of slots: exact whenever no insert or removal is in flight.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.len.load(Ordering::Relaxed))
            .sum()
    }

    /// Runs `f` on every slot, one shard lock at a time: for a rare sweep (a
    /// shutdown waking its waiters), never on a request's path.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&V)) {
        for shard in &*self.shards {
            let shard = lock(&shard.map);
            shard.inline.iter().flatten().for_each(|(_, slot)| f(slot));
            shard.table.iter().for_each(|(_, slot)| f(slot));
        }
    }
}

#[cfg(not(loom))]
impl<K: Hash, V> Table<K, V> {
    pub(crate) fn new() -> Self {
        // Four per core, as DashMap takes, but not below `MIN_SHARDS`; a power of two.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let shards = (cores * 4).max(MIN_SHARDS).next_power_of_two();
        Self {
            hasher: std::hash::RandomState::new(),
            shards: (0..shards)
                .map(|_| {
                    CachePadded(Shard {
                        map: Mutex::new(ShardMap {
                            inline: [const { None }; INLINE],
                            table: hashbrown::HashTable::new(),
                        }),
                        len: AtomicUsize::new(0),
                    })
                })
                .collect(),
            shard_shift: 64 - shards.trailing_zeros(),
            _key: PhantomData,
        }
    }

    /// The hash that stands for `key` in every operation. A caller computes it once per
    /// key and passes it to each operation, so a lock and its release hash the key once.
    pub(crate) fn hash(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of a hash: the bits below the top 7 (which the table keeps as a tag
    /// in its control bytes), far above the low bits that index buckets, so one
    /// shard's keys still spread over all its buckets.
    fn shard(&self, hash: u64) -> &Shard<V> {
        &self.shards[((hash << 7) >> self.shard_shift) as usize]
    }

    /// Runs `f` on the slot of `hash` (a key's [`hash`](Self::hash)), first inserting a
    /// default slot if there is none and `admit_new()` allows it. Returns `f`'s result,
    /// `None` when not admitted.
    pub(crate) fn with_slot<R>(
        &self,
        hash: u64,
        admit_new: impl FnOnce() -> bool,
        f: impl FnOnce(&mut V) -> R,
    ) -> Option<R>
    where
        V: Default,
    {
        let Shard { map, len } = self.shard(hash);
        let mut shard = lock(map);
        let ShardMap { inline, table } = &mut *shard;
        if let Some((_, slot)) = inline.iter_mut().flatten().find(|(h, _)| *h == hash) {
            return Some(f(slot));
        }
        // An empty table (the rule while keys are few) is not probed: its control bytes
        // would be one more cache line to fetch.
        if !table.is_empty() {
            if let Some((_, slot)) = table.find_mut(hash, |(h, _)| *h == hash) {
                return Some(f(slot));
            }
        }
        if !admit_new() {
            return None;
        }
        len.store(len.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        let entry = (hash, V::default());
        let slot = match inline.iter_mut().find(|place| place.is_none()) {
            Some(place) => &mut place.insert(entry).1,
            // A second probe, only once the inline places are taken.
            None => &mut table.insert_unique(hash, entry, |(h, _)| *h).into_mut().1,
        };
        Some(f(slot))
    }

    /// Runs `f` on the slot of `hash` and removes the slot if `f` returns true.
    /// Returns whether a slot was removed.
    ///
    /// A shard's table left less than a quarter full is shrunk to twice its length (not
    /// below [`KEPT_CAPACITY`]), so a burst of keys does not pin its peak memory. A
    /// shrink follows three quarters of a table's keys leaving since it last grew or
    /// shrank, which pays for the rehash.
    pub(crate) fn update_or_remove(&self, hash: u64, f: impl FnOnce(&mut V) -> bool) -> bool {
        let Shard { map, len } = self.shard(hash);
        let mut shard = lock(map);
        let ShardMap { inline, table } = &mut *shard;
        if let Some(place) = inline
            .iter_mut()
            .find(|place| place.as_ref().is_some_and(|(h, _)| *h == hash))
        {
            let (_, slot) = place.as_mut().expect("found above");
            let remove = f(slot);
            if remove {
                *place = None;
                len.store(len.load(Ordering::Relaxed) - 1, Ordering::Relaxed);
            }
            return remove;
        }
        let Ok(mut slot) = table.find_entry(hash, |(h, _)| *h == hash) else {
            return false;
        };
        if !f(&mut slot.get_mut().1) {
            return false;
        }
        slot.remove();
        len.store(len.load(Ordering::Relaxed) - 1, Ordering::Relaxed);
        let (len, capacity) = (table.len(), table.capacity());
        if capacity > KEPT_CAPACITY && len < capacity / 4 {
            // An emptied table frees everything: a small table left behind would keep
            // the allocator from returning the memory freed below it.
            let target = if len == 0 {
                0
            } else {
                (2 * len).max(KEPT_CAPACITY)
            };
            table.shrink_to(target, |(h, _)| *h);
        }
        true
    }
}

#[cfg(loom)]
pub(crate) struct Table<K, V>(
    loom::sync::Mutex<std::collections::HashMap<u64, V>>,
    PhantomData<fn(&K)>,
);

#[cfg(loom)]
impl<K, V> Table<K, V> {
    pub(crate) fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    pub(crate) fn for_each(&self, f: impl FnMut(&V)) {
        self.0.lock().unwrap().values().for_each(f);
    }
}

#[cfg(loom)]
impl<K: Hash, V> Table<K, V> {
    pub(crate) fn new() -> Self {
        Self(
            loom::sync::Mutex::new(std::collections::HashMap::new()),
            PhantomData,
        )
    }

    /// A fixed-key SipHash: models see the same hashes in every run.
    pub(crate) fn hash(&self, key: &K) -> u64 {
        std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default().hash_one(key)
    }

    pub(crate) fn with_slot<R>(
        &self,
        hash: u64,
        admit_new: impl FnOnce() -> bool,
        f: impl FnOnce(&mut V) -> R,
    ) -> Option<R>
    where
        V: Default,
    {
        let mut map = self.0.lock().unwrap();
        if let Some(slot) = map.get_mut(&hash) {
            return Some(f(slot));
        }
        if !admit_new() {
            return None;
        }
        Some(f(map.entry(hash).or_default()))
    }

    pub(crate) fn update_or_remove(&self, hash: u64, f: impl FnOnce(&mut V) -> bool) -> bool {
        let mut map = self.0.lock().unwrap();
        let remove = map.get_mut(&hash).is_some_and(f);
        if remove {
            map.remove(&hash);
        }
        remove
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::Table;

    /// Counts per hash, through `with_slot` (+1) and `update_or_remove` (−1, removed at 0).
    fn add(table: &Table<u64, u32>, hash: u64) {
        table.with_slot(hash, || true, |count| *count += 1);
    }

    fn sub(table: &Table<u64, u32>, hash: u64) -> bool {
        table.update_or_remove(hash, |count| {
            *count -= 1;
            *count == 0
        })
    }

    fn count(table: &Table<u64, u32>, hash: u64) -> Option<u32> {
        table.with_slot(hash, || false, |count| *count)
    }

    proptest! {
        /// Small hashes all pick shard 0, so a few dozen keys fill its inline places
        /// and spill into its hash table, and removals empty both in any order.
        #[test]
        fn one_shard_behaves_as_a_map(ops in prop::collection::vec((any::<bool>(), 0..40u64), 0..300)) {
            let table = Table::<u64, u32>::new();
            let mut model: HashMap<u64, u32> = HashMap::new();
            for (is_add, hash) in ops {
                if is_add || !model.contains_key(&hash) {
                    add(&table, hash);
                    *model.entry(hash).or_default() += 1;
                } else {
                    let left = model.get_mut(&hash).expect("checked");
                    *left -= 1;
                    let removed = *left == 0;
                    if removed {
                        model.remove(&hash);
                    }
                    prop_assert_eq!(sub(&table, hash), removed);
                }
                for probe in 0..40u64 {
                    prop_assert_eq!(count(&table, probe), model.get(&probe).copied());
                }
                prop_assert_eq!(table.len(), model.len());
            }
        }
    }

    #[test]
    fn a_crowded_shard_spills_shrinks_and_empties() {
        let table = Table::<u64, u32>::new();
        for round in 0..2 {
            for hash in 0..1_000 {
                add(&table, hash);
            }
            assert_eq!(count(&table, 999), Some(1), "round {round}");
            assert_eq!(table.len(), 1_000, "round {round}");
            // Newest first, then oldest first: both inline places and the table empty.
            let order: Vec<u64> = if round == 0 {
                (0..1_000).rev().collect()
            } else {
                (0..1_000).collect()
            };
            for hash in order {
                assert!(sub(&table, hash), "round {round}, hash {hash}");
            }
            assert!((0..1_000).all(|hash| count(&table, hash).is_none()));
            assert_eq!(table.len(), 0, "round {round}");
        }
    }

    #[test]
    fn a_shard_fits_its_cache_lines_whatever_the_key() {
        use super::{CachePadded, Shard};
        use crate::locks::slot::Slot;
        assert_eq!(std::mem::size_of::<CachePadded<Shard<Slot>>>(), 128);
    }
}
