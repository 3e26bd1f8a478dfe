//! Model checks of the lock table's hand-off and removal under every interleaving.
//!
//! Run with `LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" cargo test --no-default-features --test loom`.
#![cfg(loom)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use loom::future::block_on;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use tower_keyed_lock::KeyedLocks;

/// Runs a critical section, checking no one else holds the key.
fn hold(holders: &AtomicUsize) {
    assert_eq!(
        holders.fetch_add(1, Ordering::SeqCst),
        0,
        "two holders at once"
    );
    holders.fetch_sub(1, Ordering::SeqCst);
}

fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(Waker::noop()))
}

/// One task locks, the other polls once and is cancelled: whatever it was given
/// (nothing, a queue place, or the permit just handed over) is given back.
#[test]
fn cancelled_waiter_loses_no_permit_and_leaves_no_entry() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::new();
        let holders = Arc::new(AtomicUsize::new(0));

        let other = {
            let (locks, holders) = (locks.clone(), holders.clone());
            thread::spawn(move || {
                let guard = block_on(locks.lock(1)).unwrap();
                hold(&holders);
                drop(guard);
            })
        };

        let mut cancelled = locks.lock(1);
        if let Poll::Ready(guard) = poll_once(&mut cancelled) {
            hold(&holders);
            drop(guard);
        }
        drop(cancelled);

        other.join().unwrap();
        assert_eq!(locks.len(), 0, "entry left behind");
        assert!(locks.try_lock(1).is_ok(), "permit lost");
    });
}

/// A holder releases while a queued waiter is being cancelled and a third task waits:
/// the permit must reach the third task whichever way the race goes.
#[test]
fn hand_off_races_with_cancellation() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::new();
        let holders = Arc::new(AtomicUsize::new(0));
        let holder = locks.try_lock(1).unwrap();

        let mut cancelled = locks.lock(1);
        assert!(poll_once(&mut cancelled).is_pending());

        let waiter = {
            let (locks, holders) = (locks.clone(), holders.clone());
            thread::spawn(move || {
                let guard = block_on(locks.lock(1)).unwrap();
                hold(&holders);
                drop(guard);
            })
        };
        let canceller = thread::spawn(move || drop(cancelled));

        drop(holder);
        canceller.join().unwrap();
        waiter.join().unwrap();
        assert_eq!(locks.len(), 0, "entry left behind");
        assert!(locks.try_lock(1).is_ok(), "permit lost");
    });
}

/// Two permits, three tasks: never more than two holders, and a holder that drops
/// while the third task is being cancelled hands its permit to no one twice.
#[test]
fn two_permits_bound_holders_under_cancellation() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::builder().permits(2).build();
        let holders = Arc::new(AtomicUsize::new(0));
        let hold_one_of_two = |holders: &AtomicUsize| {
            assert!(
                holders.fetch_add(1, Ordering::SeqCst) < 2,
                "three holders of two permits"
            );
            holders.fetch_sub(1, Ordering::SeqCst);
        };

        let first = locks.try_lock(1).unwrap();
        let second = locks.try_lock(1).unwrap();
        let mut cancelled = locks.lock(1);
        assert!(poll_once(&mut cancelled).is_pending());

        let waiter = {
            let (locks, holders) = (locks.clone(), holders.clone());
            thread::spawn(move || {
                let guard = block_on(locks.lock(1)).unwrap();
                hold_one_of_two(&holders);
                drop(guard);
            })
        };
        let canceller = thread::spawn(move || drop(cancelled));
        drop(first);
        hold_one_of_two(&holders);
        drop(second);

        canceller.join().unwrap();
        waiter.join().unwrap();
        assert_eq!(locks.len(), 0, "entry left behind");
        let again = (locks.try_lock(1), locks.try_lock(1));
        assert!(again.0.is_ok() && again.1.is_ok(), "permit lost");
    });
}

/// With one waiter place, a waiter that leaves frees its place for the next one,
/// whatever the interleaving; a full queue answers `QueueFull` without queueing.
#[test]
fn max_waiters_place_is_freed_by_a_leaving_waiter() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::builder().max_waiters(1).build();
        let holder = locks.try_lock(1).unwrap();
        let mut first = locks.lock(1);
        assert!(poll_once(&mut first).is_pending());

        let leaver = thread::spawn(move || drop(first));
        let contender = {
            let locks = locks.clone();
            thread::spawn(move || {
                let mut second = locks.lock(1);
                match poll_once(&mut second) {
                    // Queued after the first waiter left, or refused while it was there.
                    Poll::Pending => true,
                    Poll::Ready(Err(tower_keyed_lock::LockError::QueueFull)) => false,
                    Poll::Ready(other) => panic!("unexpected {:?}", other.map(|_| ())),
                }
            })
        };

        leaver.join().unwrap();
        let _queued = contender.join().unwrap();
        drop(holder);
        assert_eq!(locks.len(), 0, "entry left behind");
        assert!(locks.try_lock(1).is_ok(), "permit lost");
    });
}

/// Two queued waiters; the one behind the front withdraws while the holder releases:
/// the front waiter gets the key, and its own release skips the withdrawn one, however
/// the withdrawal (a mark left in the queue) and the hand-offs interleave.
#[test]
fn withdrawn_waiter_behind_the_front_is_skipped() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::new();
        let holders = Arc::new(AtomicUsize::new(0));
        let holder = locks.try_lock(1).unwrap();
        let mut front = locks.lock(1);
        let mut behind = locks.lock(1);
        assert!(poll_once(&mut front).is_pending());
        assert!(poll_once(&mut behind).is_pending());

        let canceller = thread::spawn(move || drop(behind));
        drop(holder);
        let guard = block_on(front).unwrap();
        hold(&holders);
        drop(guard);

        canceller.join().unwrap();
        assert_eq!(locks.len(), 0, "entry left behind");
        assert!(locks.try_lock(1).is_ok(), "permit lost");
    });
}

/// Counts shared and exclusive holders of one key; panics if a writer ever overlaps
/// anyone.
#[derive(Default)]
struct ReadWrite {
    readers: AtomicUsize,
    writers: AtomicUsize,
}

impl ReadWrite {
    fn read(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
        assert_eq!(
            self.writers.load(Ordering::SeqCst),
            0,
            "a reader beside a writer"
        );
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }

    fn write(&self) {
        assert_eq!(
            self.writers.fetch_add(1, Ordering::SeqCst),
            0,
            "two writers"
        );
        assert_eq!(
            self.readers.load(Ordering::SeqCst),
            0,
            "a writer beside a reader"
        );
        self.writers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Two readers and a writer race on one key: the writer never overlaps a reader, and
/// every hand-off (a batch of readers after the writer, the writer after the last
/// reader) reaches its waiters.
#[test]
fn a_writer_never_overlaps_readers() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::new();
        let state = Arc::new(ReadWrite::default());
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (locks, state) = (locks.clone(), state.clone());
                thread::spawn(move || {
                    let guard = block_on(locks.lock_shared(1)).unwrap();
                    state.read();
                    drop(guard);
                })
            })
            .collect();
        let guard = block_on(locks.lock(1)).unwrap();
        state.write();
        drop(guard);
        for reader in readers {
            reader.join().unwrap();
        }
        assert_eq!(locks.len(), 0, "entry left behind");
        assert!(locks.try_lock(1).is_ok(), "key left held");
    });
}

/// A reader holds throughout; a writer queues and is cancelled while a second reader
/// arrives behind it: whichever way the withdrawal races the arrival, the second
/// reader gets in beside the first (waiting for the first to leave would deadlock
/// here), and nothing is left held.
#[test]
fn readers_behind_a_cancelled_writer_get_in() {
    loom::model(|| {
        let locks = KeyedLocks::<u8>::new();
        let state = Arc::new(ReadWrite::default());
        let reader = locks.try_lock_shared(1).unwrap();
        let mut writer = locks.lock(1);
        assert!(poll_once(&mut writer).is_pending());

        let second = {
            let (locks, state) = (locks.clone(), state.clone());
            thread::spawn(move || {
                let guard = block_on(locks.lock_shared(1)).unwrap();
                state.read();
                drop(guard);
            })
        };
        drop(writer);
        second.join().unwrap();
        drop(reader);

        assert_eq!(locks.len(), 0, "entry left behind");
        assert!(locks.try_lock(1).is_ok(), "key left held");
    });
}
