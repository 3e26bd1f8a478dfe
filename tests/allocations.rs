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
fn uncontended_locking_allocates_nothing() {
    let _profiler = dhat::Profiler::builder().testing().build();

    // The table knows a key by its hash and keeps no copy of it: once the table has
    // room, locking allocates nothing, whatever the key type.
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

    // String keys: no copy of a new key either.
    let locks = KeyedLocks::<String>::builder().permits(2).build();
    for key in 0..10_000 {
        drop(lock_now(&locks, key.to_string()));
    }
    let (key, again) = ("order-1000001".to_owned(), "order-1000001".to_owned());
    let (new_key, guard) = allocations(|| lock_now(&locks, key));
    assert_eq!(new_key, 0, "lock on a new String key allocated");
    let (existing, second) = allocations(|| lock_now(&locks, again));
    assert_eq!(existing, 0, "lock on a String key with an entry allocated");
    drop((guard, second));
    assert!(locks.is_empty());

    // try_lock is the same path.
    let key = "x".to_owned();
    let (try_new, guard) = allocations(|| locks.try_lock(key).unwrap());
    assert_eq!(try_new, 0);
    drop(guard);

    layer_allocations();
}

/// Allocations one request through `KeyedLockLayer::by_header` adds to the inner
/// service's own, uncontended, in process: the `LockInfo` box in the extensions, and a
/// copy of the key only when it is longer than the 40 bytes a key keeps inline.
fn layer_allocations() {
    use http::{Request, Response};
    use tower::{Layer, Service};
    use tower_keyed_lock::KeyedLockLayer;

    let inner = tower::service_fn(|_: Request<()>| async {
        Ok::<_, std::convert::Infallible>(Response::new(()))
    });
    let layer = KeyedLockLayer::by_header("idempotency-key");
    let mut layered = layer.layer(inner);
    let mut bare = inner;
    let request = |key: &str| {
        let mut request = Request::post("/")
            .header("idempotency-key", key)
            .body(())
            .unwrap();
        // Room for one more extension, as a router's request has: the map's own
        // growth is not the layer's.
        request.extensions_mut().insert(0u8);
        request.extensions_mut().insert(0u16);
        request
    };
    let run = |service: &mut dyn FnMut(Request<()>) -> bool, key: &str| {
        let request = request(key);
        allocations(|| assert!(service(request))).0
    };
    let mut call_layered = |request| poll_ok(layered.call(request));
    let mut call_bare = |request| poll_ok(bare.call(request));
    // Warm up: metric handles are registered on the first request, and every shard
    // of the table gets its (kept) storage.
    for key in 0..1_000 {
        run(&mut call_layered, &key.to_string());
    }

    let uuid = "67e55044-10b1-426f-9247-bb680e5fe0c8";
    let added = run(&mut call_layered, uuid) - run(&mut call_bare, uuid);
    assert_eq!(added, 1, "a request with a UUID key: only the LockInfo box");
    let long = "k".repeat(64);
    let added = run(&mut call_layered, &long) - run(&mut call_bare, &long);
    assert_eq!(
        added, 2,
        "a 64-byte key: the LockInfo box and one copy of the key"
    );
    assert_eq!(layer.active_keys(), 0);
}

/// Polls a response future once; true if it completed with `Ok`.
fn poll_ok<F: Future<Output = Result<T, E>>, T, E>(future: F) -> bool {
    let mut future = std::pin::pin!(future);
    matches!(
        future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop())),
        Poll::Ready(Ok(_))
    )
}
