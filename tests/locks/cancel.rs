//! Deterministic cancellation of `KeyedLocks` acquisitions: a lock future dropped
//! before its first poll, while queued, or after the permit was handed to it must give
//! back what it got and leave no entry behind.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tower_keyed_lock::{Acquire, KeyGuard, KeyedLocks, LockError};

fn poll_once<K: Eq + std::hash::Hash + Clone>(
    fut: &mut Acquire<K>,
) -> Poll<Result<KeyGuard<K>, LockError>> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(fut).poll(&mut cx)
}

fn assert_queued<K: Eq + std::hash::Hash + Clone>(fut: &mut Acquire<K>) {
    assert!(
        poll_once(fut).is_pending(),
        "expected the lock future to wait"
    );
}

fn expect_ready<K: Eq + std::hash::Hash + Clone>(fut: &mut Acquire<K>) -> KeyGuard<K> {
    match poll_once(fut) {
        Poll::Ready(Ok(guard)) => guard,
        Poll::Ready(Err(e)) => panic!("expected the key, got {e:?}"),
        Poll::Pending => panic!("expected the key, still waiting"),
    }
}

const MANY: u32 = 1000;

/// The leak every other keyed-lock crate has: the holder hands the permit to a queued
/// waiter, whose future is then dropped before it runs again.
#[test]
fn waiter_dropped_after_handoff_releases_key_one_by_one() {
    let locks = KeyedLocks::<u32>::new();
    for key in 0..MANY {
        let holder = locks.try_lock(key).unwrap();
        let mut waiter = locks.lock(key);
        assert_queued(&mut waiter);
        assert_eq!(locks.len(), 1);
        drop(holder);
        // The permit now belongs to the waiter: the key stays.
        assert_eq!(locks.len(), 1);
        assert!(matches!(locks.try_lock(key), Err(LockError::Busy)));
        drop(waiter);
        assert_eq!(locks.len(), 0, "key {key} leaked");
    }
    let all: Vec<_> = (0..MANY).map(|k| locks.try_lock(k).unwrap()).collect();
    assert_eq!(locks.len(), MANY as usize);
    drop(all);
    assert!(locks.is_empty());
}

/// Same, with all 1000 keys in flight at once.
#[test]
fn waiter_dropped_after_handoff_releases_key_all_at_once() {
    let locks = KeyedLocks::<u32>::new();
    let holders: Vec<_> = (0..MANY).map(|k| locks.try_lock(k).unwrap()).collect();
    let mut waiters: Vec<_> = (0..MANY).map(|k| locks.lock(k)).collect();
    waiters.iter_mut().for_each(assert_queued);
    assert_eq!(locks.len(), MANY as usize);
    drop(holders);
    assert_eq!(locks.len(), MANY as usize);
    drop(waiters);
    assert_eq!(locks.len(), 0);
    // Every key is free at once.
    let all: Vec<_> = (0..MANY).map(|k| locks.try_lock(k).unwrap()).collect();
    drop(all);
    assert!(locks.is_empty());
}

/// With several permits, a hand-off goes to the waiter and stays counted: the dropped
/// waiter gives back exactly one permit.
#[test]
fn handoff_then_drop_with_two_permits() {
    let locks: KeyedLocks<&str> = KeyedLocks::builder().permits(2).build();
    let a = locks.try_lock("k").unwrap();
    let b = locks.try_lock("k").unwrap();
    let mut waiter = locks.lock("k");
    assert_queued(&mut waiter);
    drop(a);
    // Still two holders: `b` and the (unpolled) waiter.
    assert!(matches!(locks.try_lock("k"), Err(LockError::Busy)));
    drop(waiter);
    let c = locks.try_lock("k").unwrap();
    assert!(matches!(locks.try_lock("k"), Err(LockError::Busy)));
    drop((b, c));
    assert_eq!(locks.len(), 0);
}

#[test]
fn dropped_before_first_poll() {
    let locks = KeyedLocks::<u32>::new();
    drop(locks.lock(1));
    assert_eq!(locks.len(), 0);

    // On a held key it does not queue either.
    let holder = locks.try_lock(1).unwrap();
    drop(locks.lock(1));
    assert_eq!(locks.len(), 1);
    drop(holder);
    assert_eq!(locks.len(), 0);
    drop(locks.try_lock(1).unwrap());
}

#[test]
fn queued_waiter_dropped_while_holder_holds() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(7).unwrap();
    let mut waiter = locks.lock(7);
    assert_queued(&mut waiter);
    drop(waiter);
    // The holder still owns the entry.
    assert_eq!(locks.len(), 1);
    assert!(matches!(locks.try_lock(7), Err(LockError::Busy)));
    drop(holder);
    assert_eq!(locks.len(), 0);
    drop(locks.try_lock(7).unwrap());
}

#[test]
fn dropped_queued_waiter_is_skipped() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(3).unwrap();
    let mut a = locks.lock(3);
    let mut b = locks.lock(3);
    assert_queued(&mut a);
    assert_queued(&mut b);
    drop(a);
    // B waits as long as the holder holds.
    assert_queued(&mut b);
    drop(holder);
    let guard_b = expect_ready(&mut b);
    assert_eq!(*guard_b.key(), 3);
    assert_eq!(locks.len(), 1);
    drop(guard_b);
    assert_eq!(locks.len(), 0);
}

/// Waiters are served in arrival order, skipping the ones that left (whether queued
/// or already handed the permit).
#[test]
fn fifo_survives_cancellations() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(0).unwrap();
    let mut waiters: Vec<Option<Acquire<u32>>> = (0..6).map(|_| Some(locks.lock(0))).collect();
    for w in waiters.iter_mut().flatten() {
        assert_queued(w);
    }
    // 1 and 4 leave while queued.
    waiters[1] = None;
    waiters[4] = None;
    drop(holder);
    // 0 was handed the permit; it leaves without running: 2 is next.
    waiters[0] = None;
    let mut served = Vec::new();
    loop {
        let mut ready = Vec::new();
        for (i, slot) in waiters.iter_mut().enumerate() {
            if let Some(w) = slot {
                if let Poll::Ready(result) = poll_once(w) {
                    ready.push((i, result.unwrap()));
                    *slot = None;
                }
            }
        }
        // One permit: at most one waiter is ready per release.
        assert!(ready.len() <= 1, "{} ready at once", ready.len());
        let Some((i, guard)) = ready.pop() else { break };
        served.push(i);
        drop(guard);
    }
    assert_eq!(served, [2, 3, 5]);
    assert!(waiters.iter().all(Option::is_none));
    assert_eq!(locks.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn timeout_while_queued_leaves_entry_to_holder() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(9).unwrap();
    let start = tokio::time::Instant::now();
    let result = locks.lock_timeout(9, Duration::from_millis(100)).await;
    assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
    assert!(start.elapsed() >= Duration::from_millis(100));
    // The entry is still the holder's.
    assert_eq!(locks.len(), 1);
    assert!(matches!(locks.try_lock(9), Err(LockError::Busy)));
    drop(holder);
    assert_eq!(locks.len(), 0);
    drop(locks.try_lock(9).unwrap());
}

/// A waiter timing out leaves the queue: the one behind it is next.
#[tokio::test(start_paused = true)]
async fn timed_out_waiter_is_skipped() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(9).unwrap();
    let mut impatient = locks.lock_timeout(9, Duration::from_millis(50));
    let mut patient = locks.lock(9);
    assert_queued(&mut impatient);
    assert_queued(&mut patient);
    assert!(matches!(impatient.await, Err(LockError::Timeout)));
    assert_queued(&mut patient);
    drop(holder);
    let guard = expect_ready(&mut patient);
    assert_eq!(locks.len(), 1);
    drop(guard);
    assert_eq!(locks.len(), 0);
}

/// The permit is handed over after the deadline passed but before the future noticed:
/// whichever way the future resolves, the permit must not be lost.
#[tokio::test(start_paused = true)]
async fn grant_racing_the_deadline_is_not_lost() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(5).unwrap();
    let mut waiter = locks.lock_timeout(5, Duration::from_millis(10));
    assert_queued(&mut waiter);
    tokio::time::advance(Duration::from_millis(20)).await;
    drop(holder);
    match poll_once(&mut waiter) {
        Poll::Ready(Ok(guard)) => {
            assert_eq!(locks.len(), 1);
            drop(guard);
        }
        Poll::Ready(Err(LockError::Timeout)) => {}
        other => panic!("unexpected {other:?}"),
    }
    drop(waiter);
    assert_eq!(locks.len(), 0);
    drop(locks.try_lock(5).unwrap());
}

/// The lock is granted in time when the holder leaves before the deadline.
#[tokio::test(start_paused = true)]
async fn lock_timeout_granted_before_deadline() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(4).unwrap();
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        drop(holder);
    });
    let guard = locks
        .lock_timeout(4, Duration::from_millis(100))
        .await
        .unwrap();
    releaser.await.unwrap();
    assert_eq!(locks.len(), 1);
    drop(guard);
    assert_eq!(locks.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn zero_timeout_tries_once() {
    let locks = KeyedLocks::<u32>::new();
    let holder = locks.try_lock(2).unwrap();
    let result = locks.lock_timeout(2, Duration::ZERO).await;
    assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
    assert_eq!(locks.len(), 1);
    drop(holder);
    assert_eq!(locks.len(), 0);
}
