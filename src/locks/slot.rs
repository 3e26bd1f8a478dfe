//! The per-key state of the lock table and the waiter hand-off.

use std::collections::VecDeque;
use std::task::Waker;

use crate::sync::{lock, Arc, Mutex};

/// What the table holds for one key.
///
/// Invariant (every change happens under the key's shard lock): a waiter is queued only
/// while all permits are taken, and a releasing holder hands its permit to the front
/// waiter instead of returning it. So `queue` is non-empty only when
/// `holders == permits`, and the slot can be removed exactly when `holders == 0`.
///
/// A waiter that gives up is marked withdrawn and left where it is (finding it would
/// mean searching the queue under the shard lock); a release skips it, and the queue
/// drops all withdrawn entries at once when they outnumber the waiting ones, so each
/// withdrawal costs O(1) amortized.
#[derive(Default)]
pub(crate) struct Slot {
    holders: usize,
    /// Created by the key's first waiter and kept as long as the slot (as a queue's
    /// buffer is). Boxed, so a slot is 16 bytes and the table can keep a few of them
    /// on its lock's cache lines.
    queue: Option<Box<Queue>>,
}

/// The waiters of a busy key.
#[derive(Default)]
struct Queue {
    /// Waiters in arrival order, withdrawn ones included until skipped or compacted.
    entries: VecDeque<Arc<Waiter>>,
    /// Entries still waiting: what `max_waiters` bounds.
    waiting: usize,
}

/// The outcome of a first attempt on a slot.
pub(crate) enum Attempt {
    Acquired,
    Queued(Arc<Waiter>),
    Busy,
    QueueFull,
}

/// A queue longer than this keeps no more than four times its length in capacity.
const QUEUE_CAPACITY_KEPT: usize = 64;

impl Slot {
    /// Takes a permit if one is free; otherwise queues a waiter woken by `waker`,
    /// or reports why it did not (`waker` is `None` for a try-once attempt).
    pub(crate) fn acquire_or_enqueue(
        &mut self,
        permits: usize,
        max_waiters: usize,
        waker: Option<&Waker>,
    ) -> Attempt {
        if self.holders < permits {
            debug_assert!(
                self.queue
                    .as_ref()
                    .is_none_or(|queue| queue.entries.is_empty()),
                "waiters queued beside a free permit"
            );
            self.holders += 1;
            return Attempt::Acquired;
        }
        let Some(waker) = waker else {
            return Attempt::Busy;
        };
        let waiting = self.queue.as_ref().map_or(0, |queue| queue.waiting);
        if waiting >= max_waiters {
            return Attempt::QueueFull;
        }
        let queue = self.queue.get_or_insert_default();
        let waiter = Arc::new(Waiter::new(waker.clone()));
        queue.entries.push_back(waiter.clone());
        queue.waiting += 1;
        Attempt::Queued(waiter)
    }

    /// Gives up one permit: hands it to the first waiter still waiting, if any.
    /// Returns the waker to call (after the shard lock is released) and whether the
    /// slot is now unused and must be removed.
    pub(crate) fn release(&mut self) -> (Option<Waker>, bool) {
        if let Some(queue) = &mut self.queue {
            while let Some(next) = queue.entries.pop_front() {
                if let Some(waker) = next.grant() {
                    queue.waiting -= 1;
                    return (Some(waker), false);
                }
            }
        }
        self.holders -= 1;
        (None, self.holders == 0)
    }

    /// Withdraws a waiter that is giving up. If the permit was already handed to it,
    /// the permit is released instead, exactly as its holder would have.
    pub(crate) fn withdraw(&mut self, waiter: &Waiter) -> (Option<Waker>, bool) {
        if !waiter.withdraw() {
            return self.release();
        }
        let queue = self
            .queue
            .as_mut()
            .expect("a withdrawing waiter is in the queue");
        queue.waiting -= 1;
        if queue.entries.len() > 2 * queue.waiting {
            queue.compact();
        }
        // A queued waiter implies a holder, so the slot stays.
        (None, false)
    }
}

impl Queue {
    /// Drops the withdrawn entries; they are at least half the queue, which pays for
    /// the pass.
    fn compact(&mut self) {
        self.entries.retain(|waiter| !waiter.is_withdrawn());
        let kept = (4 * self.entries.len()).max(QUEUE_CAPACITY_KEPT);
        if self.entries.capacity() > kept {
            self.entries.shrink_to(kept);
        }
    }
}

/// A queued acquisition, shared by the queue and the waiting future. Its state changes
/// from `Waiting` only under the key's shard lock; the future reads it without that
/// lock.
pub(crate) struct Waiter(Mutex<WaiterState>);

enum WaiterState {
    /// Queued; the waker wakes the waiting future.
    Waiting(Waker),
    /// The permit was handed over by a releasing holder.
    Granted,
    /// The future gave up before it was granted; releases skip it.
    Withdrawn,
}

impl Waiter {
    fn new(waker: Waker) -> Self {
        Waiter(Mutex::new(WaiterState::Waiting(waker)))
    }

    /// Hands the permit over and returns the waker to call, or `None` if the waiter
    /// has withdrawn and the permit must go to the next one.
    fn grant(&self) -> Option<Waker> {
        let mut state = lock(&self.0);
        match std::mem::replace(&mut *state, WaiterState::Granted) {
            WaiterState::Waiting(waker) => Some(waker),
            WaiterState::Withdrawn => {
                *state = WaiterState::Withdrawn;
                None
            }
            WaiterState::Granted => unreachable!("a permit granted twice"),
        }
    }

    /// Marks the waiter withdrawn; false if it was granted the permit first.
    fn withdraw(&self) -> bool {
        let mut state = lock(&self.0);
        if matches!(*state, WaiterState::Granted) {
            return false;
        }
        *state = WaiterState::Withdrawn;
        true
    }

    fn is_withdrawn(&self) -> bool {
        matches!(*lock(&self.0), WaiterState::Withdrawn)
    }

    pub(crate) fn is_granted(&self) -> bool {
        matches!(*lock(&self.0), WaiterState::Granted)
    }

    /// Returns true once the permit is handed over; until then keeps `waker` registered.
    pub(crate) fn poll_granted(&self, waker: &Waker) -> bool {
        match &mut *lock(&self.0) {
            WaiterState::Waiting(current) => {
                current.clone_from(waker);
                false
            }
            WaiterState::Granted => true,
            WaiterState::Withdrawn => unreachable!("a withdrawn waiter polled"),
        }
    }
}
