//! Allocations on the uncontended path, counted by a real allocator (dhat).
//!
//! One test function: dhat allows one profiler per process.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tower_keyed_lock::KeyedLocks;

#[global_allocator]
static ALLOCATOR: dhat::Alloc = dhat::Alloc;

/// Heap blocks allocated while running `f`.
fn allocations<R>(f: impl FnOnce() -> R) -> (u64, R) {
    let before = dhat::HeapStats::get().total_blocks;
    let result = f();
    (dhat::HeapStats::get().total_blocks - before, result)
}

fn lock_now<K: Eq + std::hash::Hash + Clone + Send + Sync + 'static>(
    locks: &KeyedLocks<K>,
    key: K,
) -> tower_keyed_lock::KeyGuard<K> {
    let mut acquire = locks.lock(key);
    match Pin::new(&mut acquire).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(guard)) => guard,
        other => panic!(
            "uncontended lock did not resolve at once: {:?}",
            other.is_ready()
        ),
    }
}

#[test]
fn uncontended_locking_allocates_only_a_new_keys_copy() {
    let _profiler = dhat::Profiler::builder().testing().build();

    // u64 keys live inline in the table: once the table has room, nothing allocates.
    let locks = KeyedLocks::<u64>::builder().permits(2).build();
    for key in 0..10_000 {
        drop(lock_now(&locks, key)); // grow the table; removal keeps its capacity
    }
    let (new_key, guard) = allocations(|| lock_now(&locks, 1_000_001));
    assert_eq!(new_key, 0, "lock on a new u64 key allocated");
    let (existing, second) = allocations(|| lock_now(&locks, 1_000_001));
    assert_eq!(existing, 0, "lock on a key with an entry allocated");
    let (released, ()) = allocations(|| drop((guard, second)));
    assert_eq!(released, 0);
    assert!(locks.is_empty());

    // String keys: the table keeps one copy of a new key, and nothing for a key
    // that already has an entry.
    let locks = KeyedLocks::<String>::builder().permits(2).build();
    for key in 0..10_000 {
        drop(lock_now(&locks, key.to_string()));
    }
    let (key, again) = ("order-1000001".to_owned(), "order-1000001".to_owned());
    let (new_key, guard) = allocations(|| lock_now(&locks, key));
    assert_eq!(new_key, 1, "lock on a new String key");
    let (existing, second) = allocations(|| lock_now(&locks, again));
    assert_eq!(existing, 0, "lock on a String key with an entry allocated");
    drop((guard, second));
    assert!(locks.is_empty());

    // try_lock is the same path.
    let key = "x".to_owned();
    let (try_new, guard) = allocations(|| locks.try_lock(key).unwrap());
    assert_eq!(try_new, 1);
    drop(guard);
}
