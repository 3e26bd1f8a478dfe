//! Withdrawing a waiter costs the same wherever it sits in the queue (issue 11.6): a
//! queue of many waiters on one hot key, cancelled newest-first, once took seconds of
//! shard-locked time because each withdrawal searched the queue from the front.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tower_keyed_lock::{Acquire, KeyedLocks, LockError};

/// Waiters on the one key; enough that a scan per withdrawal (n²/2 steps) takes
/// hundreds of times longer than a constant-time withdrawal, even in a debug build.
const WAITERS: usize = 20_000;

fn queue_waiters(locks: &KeyedLocks<u32>, count: usize) -> Vec<Acquire<u32>> {
    (0..count)
        .map(|_| {
            let mut waiter = locks.lock(0);
            let polled = Pin::new(&mut waiter).poll(&mut Context::from_waker(Waker::noop()));
            assert!(polled.is_pending(), "a waiter got a held key");
            waiter
        })
        .collect()
}

/// Time to withdraw `WAITERS` queued waiters, in the order `order` puts them.
fn withdraw_all(order: fn(&mut Vec<Acquire<u32>>)) -> Duration {
    let locks = KeyedLocks::new();
    let holder = locks.try_lock(0).unwrap();
    let mut waiters = queue_waiters(&locks, WAITERS);
    order(&mut waiters);
    let start = Instant::now();
    // `Vec` drops its elements front to back.
    drop(waiters);
    let elapsed = start.elapsed();
    // Nothing is left queued: the holder's release frees the key.
    drop(holder);
    assert!(locks.is_empty());
    elapsed
}

/// A ratio in one run, not a wall-clock bound: newest-first must cost about what
/// oldest-first costs (oldest-first was always cheap: the first waiter searched is it).
/// Best of three of each, so a descheduled moment on a shared machine does not decide.
#[test]
fn newest_first_withdrawal_costs_what_oldest_first_costs() {
    let (mut oldest_first, mut newest_first) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        oldest_first = oldest_first.min(withdraw_all(|_| {}));
        newest_first = newest_first.min(withdraw_all(|waiters| waiters.reverse()));
    }
    let ratio = newest_first.as_secs_f64() / oldest_first.as_secs_f64();
    println!("{WAITERS} withdrawals: oldest-first {oldest_first:?}, newest-first {newest_first:?}, ratio {ratio:.2}");
    assert!(
        ratio < 4.0,
        "newest-first withdrawal took {ratio:.1}x oldest-first ({newest_first:?} vs {oldest_first:?})"
    );
}

/// Withdrawn waiters do not count against `max_waiters`, wherever they sat, and the
/// waiters that stay are still served in arrival order.
#[test]
fn withdrawn_waiters_free_their_places_and_keep_fifo() {
    let locks = KeyedLocks::builder().max_waiters(4).build();
    let holder = locks.try_lock(0).unwrap();
    let mut waiters: Vec<Option<Acquire<u32>>> =
        queue_waiters(&locks, 4).into_iter().map(Some).collect();
    let mut extra = locks.lock(0);
    let full = Pin::new(&mut extra).poll(&mut Context::from_waker(Waker::noop()));
    assert!(matches!(full, Poll::Ready(Err(LockError::QueueFull))));

    // The newest and a middle one leave: two places free up, no more.
    waiters[3] = None;
    waiters[1] = None;
    waiters.extend(queue_waiters(&locks, 2).into_iter().map(Some));
    let mut extra = locks.lock(0);
    let full = Pin::new(&mut extra).poll(&mut Context::from_waker(Waker::noop()));
    assert!(matches!(full, Poll::Ready(Err(LockError::QueueFull))));

    // Served in arrival order: 0, 2, then the two newcomers.
    drop(holder);
    let mut served = Vec::new();
    while let Some(index) = waiters.iter_mut().position(|slot| {
        slot.as_mut().is_some_and(|waiter| {
            Pin::new(waiter)
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_ready()
        })
    }) {
        served.push(index);
        // Dropping the served future drops nothing held: its guard went with the poll
        // result, released at once, which hands the key on.
        waiters[index] = None;
    }
    assert_eq!(served, [0, 2, 4, 5]);
    assert!(locks.is_empty());
}
