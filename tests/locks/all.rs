//! Several keys at once (`KeyedLocks::lock_all`): no deadlock whatever order callers
//! name their keys in, nothing held after a failure or a cancellation at any await,
//! duplicates and colliding hashes taken once.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tower_keyed_lock::{KeyedLocks, LockError};

fn poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// Tasks lock random subsets of a few keys, in random order, on a multi-thread
/// runtime: every key has one holder at a time, and all of them finish (a deadlock
/// would stall them; the bound only turns a hang into a failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_sets_in_any_order_never_deadlock_nor_overlap() {
    const KEYS: usize = 6;
    const TASKS: u64 = 16;
    const ROUNDS: usize = 300;
    let locks = KeyedLocks::<usize>::new();
    let in_use: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let tasks: Vec<_> = (0..TASKS)
        .map(|seed| {
            let (locks, in_use) = (locks.clone(), in_use.clone());
            tokio::spawn(async move {
                let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = move || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state
                };
                for _ in 0..ROUNDS {
                    // A random subset, named in a random order, with repeats.
                    let keys: Vec<usize> = (0..1 + next() % 4)
                        .map(|_| (next() % KEYS as u64) as usize)
                        .collect();
                    let guard = locks.lock_all(keys.clone()).await.unwrap();
                    for &key in guard.keys() {
                        assert_eq!(
                            in_use[key].fetch_add(1, Ordering::SeqCst),
                            0,
                            "key {key} held twice"
                        );
                    }
                    tokio::task::yield_now().await;
                    for &key in guard.keys() {
                        in_use[key].fetch_sub(1, Ordering::SeqCst);
                    }
                    let mut held = guard.keys().to_vec();
                    held.sort_unstable();
                    let mut asked = keys;
                    asked.sort_unstable();
                    asked.dedup();
                    assert_eq!(held, asked);
                }
            })
        })
        .collect();
    let all = async {
        for task in tasks {
            task.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("lock_all stalled: a deadlock between overlapping key sets");
    assert!(locks.is_empty());
}

#[test]
fn try_lock_all_holds_nothing_when_one_key_is_busy() {
    let locks = KeyedLocks::new();
    let busy = locks.try_lock("b").unwrap();
    assert!(matches!(
        locks.try_lock_all(["a", "b", "c"]),
        Err(LockError::Busy)
    ));
    assert_eq!(locks.len(), 1, "keys taken before the busy one were kept");
    drop(busy);
    let all = locks.try_lock_all(["c", "a", "b", "a"]).unwrap();
    assert_eq!(all.keys().len(), 3);
    assert_eq!(locks.len(), 3);
    drop(all);
    assert!(locks.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_timeout_releases_what_was_taken() {
    let locks = KeyedLocks::new();
    // The canonical order, from a call that gets everything.
    let order = locks.try_lock_all(["a", "b", "c"]).unwrap().keys().to_vec();
    let last = locks.try_lock(order[2]).unwrap();
    let result = locks
        .lock_all_timeout(["a", "b", "c"], Duration::from_secs(1))
        .await;
    assert!(matches!(result, Err(LockError::Timeout)));
    assert_eq!(locks.len(), 1, "only the other holder's key is left");
    drop(last);
    assert!(locks.is_empty());
}

/// The future waits at each key in turn; dropped at each of those awaits, it gives back
/// the keys it had taken and its place in the queue.
#[test]
fn dropped_at_every_await_it_holds_nothing() {
    let locks = KeyedLocks::new();
    let order = locks.try_lock_all(["a", "b", "c"]).unwrap().keys().to_vec();
    for (at, &blocker) in order.iter().enumerate() {
        let blocked = locks.try_lock(blocker).unwrap();
        let mut all = Box::pin(locks.lock_all(["a", "b", "c"]));
        assert!(poll_once(all.as_mut()).is_pending(), "waits at key {at}");
        assert_eq!(locks.len(), at + 1, "took the keys before {at}");
        drop(all);
        assert_eq!(
            locks.len(),
            1,
            "dropped at key {at}: only the blocker is left"
        );
        // The blocker's release finds no stale waiter to hand the key to.
        drop(blocked);
        assert!(locks.is_empty());
        assert!(locks.try_lock_all(["a", "b", "c"]).is_ok());
    }
}

#[test]
fn colliding_hashes_are_taken_once() {
    /// Every value hashes alike: distinct keys that share one slot.
    #[derive(Clone, Debug, PartialEq, Eq)]
    struct Colliding(&'static str);
    impl std::hash::Hash for Colliding {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            state.write_u8(0);
        }
    }
    let locks = KeyedLocks::new();
    let all = locks
        .try_lock_all([Colliding("x"), Colliding("y"), Colliding("x")])
        .unwrap();
    assert_eq!(all.keys(), [Colliding("x"), Colliding("y")]);
    assert_eq!(locks.len(), 1);
    drop(all);
    assert!(locks.is_empty());
}

#[tokio::test]
async fn no_keys_holds_nothing() {
    let locks = KeyedLocks::<u8>::new();
    assert!(locks.lock_all([]).await.unwrap().keys().is_empty());
    assert!(locks.is_empty());
}
