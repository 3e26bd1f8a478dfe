//! Model-based property test of `KeyedLocks`: single-threaded and deterministic, every
//! operation is checked against a small reference model of holders and FIFO queues,
//! exclusive (`lock`) and shared (`lock_shared`) alike.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use tower_keyed_lock::{Acquire, KeyGuard, KeyedLocks, LockError};

const KEYS: u8 = 4;
const CASES: u32 = 4096;

#[derive(Debug, Clone, Copy)]
struct Limits {
    permits: usize,
    max_waiters: Option<usize>,
    max_keys: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Lock(u8),
    TryLock(u8),
    LockShared(u8),
    TryLockShared(u8),
    /// `lock_timeout(k, ZERO)`: try once, `Timeout` when busy; never touches the timer.
    LockNow(u8),
    Drop(usize),
    PollAll,
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        1..=3usize,
        proptest::option::of(0..=3usize),
        proptest::option::of(1..=4usize),
    )
        .prop_map(|(permits, max_waiters, max_keys)| Limits {
            permits,
            max_waiters,
            max_keys,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS).prop_map(Op::Lock),
        2 => (0..KEYS).prop_map(Op::TryLock),
        3 => (0..KEYS).prop_map(Op::LockShared),
        1 => (0..KEYS).prop_map(Op::TryLockShared),
        1 => (0..KEYS).prop_map(Op::LockNow),
        3 => any::<usize>().prop_map(Op::Drop),
        2 => Just(Op::PollAll),
    ]
}

/// What the model expects a first attempt to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Acquired,
    Queued,
    Busy,
    Timeout,
    QueueFull,
    TooManyKeys,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Holder,
    Waiter,
}

#[derive(Default)]
struct KeyModel {
    /// Exclusive holders.
    holders: usize,
    /// Shared holders.
    shared: usize,
    /// Ids of the live items waiting for the key, and whether shared, front first.
    waiters: VecDeque<(u64, bool)>,
}

impl KeyModel {
    fn admits(&self, lim: &Limits, shared: bool) -> bool {
        match shared {
            true => self.holders == 0,
            false => self.shared == 0 && self.holders < lim.permits,
        }
    }

    fn enter(&mut self, shared: bool) {
        match shared {
            true => self.shared += 1,
            false => self.holders += 1,
        }
    }

    /// Grants the front waiters while the key admits them, in order.
    fn grant_front(&mut self, lim: &Limits) -> Vec<u64> {
        let mut granted = Vec::new();
        while let Some(&(id, shared)) = self.waiters.front() {
            if !self.admits(lim, shared) {
                break;
            }
            self.waiters.pop_front();
            self.enter(shared);
            granted.push(id);
        }
        granted
    }
}

#[derive(Default)]
struct Model {
    keys: BTreeMap<u8, KeyModel>,
}

impl Model {
    /// The outcome of a first attempt. `queue` is false for try-once attempts, which
    /// report `busy` instead of queuing (or of `QueueFull`).
    fn attempt(&mut self, lim: &Limits, key: u8, id: u64, how: How, busy: Outcome) -> Outcome {
        let (queue, shared) = (how.queue, how.shared);
        let key_count = self.keys.len();
        match self.keys.get_mut(&key) {
            Some(k) if k.waiters.is_empty() && k.admits(lim, shared) => {
                k.enter(shared);
                Outcome::Acquired
            }
            Some(_) if !queue => busy,
            Some(k) if k.waiters.len() >= lim.max_waiters.unwrap_or(usize::MAX) => {
                Outcome::QueueFull
            }
            Some(k) => {
                k.waiters.push_back((id, shared));
                Outcome::Queued
            }
            None if key_count >= lim.max_keys.unwrap_or(usize::MAX) => Outcome::TooManyKeys,
            None => {
                let mut k = KeyModel::default();
                k.enter(shared);
                self.keys.insert(key, k);
                Outcome::Acquired
            }
        }
    }

    /// A holder of `key` leaves: the front waiters the key now admits become holders
    /// (returned, so the caller can mark them), and the key vanishes when unused.
    fn release(&mut self, lim: &Limits, key: u8, shared: bool) -> Vec<u64> {
        let k = self.keys.get_mut(&key).expect("a holder implies its key");
        match shared {
            true => k.shared -= 1,
            false => k.holders -= 1,
        }
        let granted = k.grant_front(lim);
        self.remove_if_unused(key);
        granted
    }

    /// A waiter leaves: those behind it may now go (shared waiters behind a withdrawn
    /// exclusive one).
    fn withdraw(&mut self, lim: &Limits, key: u8, id: u64) -> Vec<u64> {
        let k = self.keys.get_mut(&key).expect("a waiter implies its key");
        let at = k
            .waiters
            .iter()
            .position(|&(w, _)| w == id)
            .expect("queued");
        k.waiters.remove(at);
        let granted = k.grant_front(lim);
        self.remove_if_unused(key);
        granted
    }

    fn remove_if_unused(&mut self, key: u8) {
        let k = &self.keys[&key];
        if k.holders == 0 && k.shared == 0 {
            assert!(k.waiters.is_empty(), "waiters on a free key");
            self.keys.remove(&key);
        }
    }
}

/// How an attempt is made: whether it may queue, and in which mode.
#[derive(Debug, Clone, Copy)]
struct How {
    queue: bool,
    shared: bool,
}

enum Real {
    Guard(KeyGuard<u8>),
    Pending(Acquire<u8>),
}

struct Item {
    id: u64,
    key: u8,
    shared: bool,
    role: Role,
    real: Real,
}

fn poll_once(fut: &mut Acquire<u8>) -> Poll<Result<KeyGuard<u8>, LockError>> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(fut).poll(&mut cx)
}

/// Maps a real result onto the model's vocabulary (`Pending` = queued).
fn outcome(result: Poll<Result<KeyGuard<u8>, LockError>>) -> (Outcome, Option<KeyGuard<u8>>) {
    match result {
        Poll::Pending => (Outcome::Queued, None),
        Poll::Ready(Ok(guard)) => (Outcome::Acquired, Some(guard)),
        Poll::Ready(Err(LockError::Busy)) => (Outcome::Busy, None),
        Poll::Ready(Err(LockError::Timeout)) => (Outcome::Timeout, None),
        Poll::Ready(Err(LockError::QueueFull)) => (Outcome::QueueFull, None),
        Poll::Ready(Err(LockError::TooManyKeys)) => (Outcome::TooManyKeys, None),
        Poll::Ready(Err(other)) => panic!("unexpected error {other:?}"),
    }
}

struct Harness {
    lim: Limits,
    locks: KeyedLocks<u8>,
    model: Model,
    items: Vec<Item>,
    next_id: u64,
}

impl Harness {
    fn new(lim: Limits) -> Self {
        let mut builder = KeyedLocks::builder().permits(lim.permits);
        if let Some(n) = lim.max_waiters {
            builder = builder.max_waiters(n);
        }
        if let Some(n) = lim.max_keys {
            builder = builder.max_keys(n);
        }
        Harness {
            lim,
            locks: builder.build(),
            model: Model::default(),
            items: Vec::new(),
            next_id: 0,
        }
    }

    fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Lock(key)
            | Op::TryLock(key)
            | Op::LockNow(key)
            | Op::LockShared(key)
            | Op::TryLockShared(key) => {
                let id = self.next_id;
                self.next_id += 1;
                let shared = matches!(op, Op::LockShared(_) | Op::TryLockShared(_));
                let queue = matches!(op, Op::Lock(_) | Op::LockShared(_));
                let how = How { queue, shared };
                let (mut pending, got) = match op {
                    Op::Lock(_) | Op::LockShared(_) => {
                        let mut fut = match shared {
                            true => self.locks.lock_shared(key),
                            false => self.locks.lock(key),
                        };
                        let got = outcome(poll_once(&mut fut));
                        (Some(fut), got)
                    }
                    Op::TryLock(_) => (None, outcome(Poll::Ready(self.locks.try_lock(key)))),
                    Op::TryLockShared(_) => {
                        (None, outcome(Poll::Ready(self.locks.try_lock_shared(key))))
                    }
                    _ => {
                        let mut fut = self.locks.lock_timeout(key, Duration::ZERO);
                        (None, outcome(poll_once(&mut fut)))
                    }
                };
                let busy = match op {
                    Op::LockNow(_) => Outcome::Timeout,
                    _ => Outcome::Busy,
                };
                let expected = self.model.attempt(&self.lim, key, id, how, busy);
                let (got, guard) = got;
                prop_assert_eq!(got, expected, "{:?}", op);
                if let Some(guard) = guard {
                    prop_assert_eq!(*guard.key(), key);
                    prop_assert_eq!(guard.is_shared(), shared);
                    self.items.push(Item {
                        id,
                        key,
                        shared,
                        role: Role::Holder,
                        real: Real::Guard(guard),
                    });
                } else if got == Outcome::Queued {
                    self.items.push(Item {
                        id,
                        key,
                        shared,
                        role: Role::Waiter,
                        real: Real::Pending(pending.take().expect("only lock() queues")),
                    });
                }
            }
            Op::Drop(i) => {
                if self.items.is_empty() {
                    return Ok(());
                }
                let item = self.items.remove(i % self.items.len());
                if let Real::Guard(guard) = &item.real {
                    prop_assert_eq!(item.role, Role::Holder);
                    prop_assert_eq!(*guard.key(), item.key);
                }
                // The real drop first, so a hand-off it makes is what the model then
                // predicts (and is checked by the next `PollAll`).
                drop(item.real);
                let granted = match item.role {
                    Role::Holder => self.model.release(&self.lim, item.key, item.shared),
                    Role::Waiter => self.model.withdraw(&self.lim, item.key, item.id),
                };
                for next in granted {
                    let heir = self.items.iter_mut().find(|it| it.id == next);
                    let heir = heir.expect("a queued id is a live item");
                    prop_assert_eq!(heir.role, Role::Waiter);
                    heir.role = Role::Holder;
                }
            }
            Op::PollAll => {
                for item in &mut self.items {
                    let Real::Pending(fut) = &mut item.real else {
                        continue;
                    };
                    let (got, guard) = outcome(poll_once(fut));
                    match item.role {
                        // The permit was handed over: the future must take it now.
                        Role::Holder => {
                            prop_assert_eq!(got, Outcome::Acquired, "item {}", item.id);
                            let guard = guard.expect("acquired");
                            prop_assert_eq!(*guard.key(), item.key);
                            prop_assert_eq!(guard.is_shared(), item.shared);
                            item.real = Real::Guard(guard);
                        }
                        Role::Waiter => prop_assert_eq!(got, Outcome::Queued, "item {}", item.id),
                    }
                }
            }
        }
        self.check_len()
    }

    fn check_len(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.locks.len(), self.model.keys.len());
        prop_assert_eq!(self.locks.is_empty(), self.model.keys.is_empty());
        Ok(())
    }

    /// Drops every live item (in order, checking `len()` after each), then checks that
    /// every key offers exactly `permits` free permits: nothing leaked, nothing doubled.
    fn finish(mut self) -> Result<(), TestCaseError> {
        while !self.items.is_empty() {
            self.step(Op::Drop(0))?;
        }
        prop_assert_eq!(self.locks.len(), 0);
        prop_assert!(self.locks.is_empty());
        for key in 0..KEYS {
            let mut guards = Vec::new();
            for _ in 0..self.lim.permits {
                // One key at a time, so `max_keys` (at least 1) never interferes.
                match self.locks.try_lock(key) {
                    Ok(guard) => guards.push(guard),
                    Err(e) => return Err(TestCaseError::fail(format!("key {key}: {e:?}"))),
                }
            }
            prop_assert_eq!(self.locks.len(), 1);
            prop_assert!(matches!(self.locks.try_lock(key), Err(LockError::Busy)));
            prop_assert!(matches!(
                self.locks.try_lock_shared(key),
                Err(LockError::Busy)
            ));
            drop(guards);
            prop_assert_eq!(self.locks.len(), 0);
            // Shared holders: any number together, no exclusive one beside them.
            let readers: Vec<_> = (0..3).map(|_| self.locks.try_lock_shared(key)).collect();
            prop_assert!(readers.iter().all(Result::is_ok));
            prop_assert!(matches!(self.locks.try_lock(key), Err(LockError::Busy)));
            drop(readers);
            prop_assert_eq!(self.locks.len(), 0);
        }
        Ok(())
    }
}

fn run_case(lim: Limits, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut harness = Harness::new(lim);
    for &op in ops {
        harness.step(op)?;
    }
    harness.finish()
}

#[test]
fn keyed_locks_follow_the_model() {
    let config = Config {
        cases: CASES,
        // No regression files: this test may only add its own source file.
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let passed = std::cell::Cell::new(0u32);
    let strategy = (limits(), proptest::collection::vec(op(), 0..=60));
    let result = runner.run(&strategy, |(lim, ops)| {
        run_case(lim, &ops)?;
        passed.set(passed.get() + 1);
        Ok(())
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, (lim, ops))) => {
            panic!("{reason}\nminimal failing input: {lim:?}\n{ops:#?}")
        }
        Err(e) => panic!("{e}"),
    }
    let passed = passed.get();
    eprintln!("locks_model: {passed} cases passed");
    // The runner really ran every case (a strategy that rejects would lower this).
    assert_eq!(passed, CASES);
}

/// A hand-written case the model must get right: FIFO hand-off to a waiter that is
/// then dropped before it is polled again passes the permit to the next one.
#[test]
fn model_handoff_to_dropped_waiter() {
    let lim = Limits {
        permits: 1,
        max_waiters: None,
        max_keys: None,
    };
    let ops = [
        Op::Lock(0), // item 0 holds
        Op::Lock(0), // item 1 waits
        Op::Lock(0), // item 2 waits
        Op::Drop(0), // holder leaves: item 1 is handed the permit
        Op::Drop(0), // item 1 dropped unpolled: passes it to item 2
        Op::PollAll, // item 2 must be ready
        Op::Lock(0), // queues behind item 2
        Op::TryLock(0),
    ];
    run_case(lim, &ops).unwrap();
}
