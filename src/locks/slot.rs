//! The per-key state of the lock table and the waiter hand-off.

use std::collections::VecDeque;
use std::task::Waker;

use crate::sync::{lock, Arc, Mutex};

/// How a key is held: alone (up to `permits` exclusive holders at once) or shared with
/// other shared holders (any number, while no exclusive holder has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Exclusive,
    Shared,
}

/// What the table holds for one key.
///
/// Invariant (every change happens under the key's shard lock): a waiter is queued only
/// while the one in front of it cannot be granted (FIFO: nobody passes a waiter, so a
/// waiting exclusive holder stops new shared holders from entering), and a release or
/// a withdrawal grants the front waiters that can now go. So the slot can be removed
/// exactly when it has no holder left.
///
/// A waiter that gives up is marked withdrawn and left where it is (finding it would
/// mean searching the queue under the shard lock); grants skip it, and the queue
/// drops all withdrawn entries at once when they outnumber the waiting ones, so each
/// withdrawal costs O(1) amortized.
#[derive(Default)]
pub(crate) struct Slot {
    holders: Holders,
    /// Created by the key's first waiter and kept as long as the slot (as a queue's
    /// buffer is). Boxed, so a slot is 16 bytes and the table can keep a few of them
    /// on its lock's cache lines.
    queue: Option<Box<Queue>>,
}

/// Who holds a key now.
#[derive(Default, Clone, Copy)]
struct Holders {
    /// Exclusive holders, at most `permits`.
    exclusive: u32,
    /// Shared holders, only while `exclusive == 0`.
    shared: u32,
}

impl Holders {
    /// Whether a holder in `mode` may enter now, waiters aside.
    fn admit(&self, mode: Mode, permits: u32) -> bool {
        match mode {
            Mode::Exclusive => self.shared == 0 && self.exclusive < permits,
            Mode::Shared => self.exclusive == 0,
        }
    }

    fn enter(&mut self, mode: Mode) {
        match mode {
            Mode::Exclusive => self.exclusive += 1,
            Mode::Shared => self.shared += 1,
        }
    }

    fn leave(&mut self, mode: Mode) {
        match mode {
            Mode::Exclusive => self.exclusive -= 1,
            Mode::Shared => self.shared -= 1,
        }
    }

    fn none(&self) -> bool {
        self.exclusive == 0 && self.shared == 0
    }
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

/// The wakers of the waiters a release or withdrawal granted, to call once the shard
/// lock is released. Mostly none or one: kept inline, a batch (shared holders) in a
/// vector that allocates only then.
#[derive(Default)]
pub(crate) enum Granted {
    #[default]
    Nobody,
    One(Waker),
    Many(Vec<Waker>),
}

impl Granted {
    fn push(&mut self, waker: Waker) {
        *self = match std::mem::take(self) {
            Granted::Nobody => Granted::One(waker),
            Granted::One(first) => Granted::Many(vec![first, waker]),
            Granted::Many(mut wakers) => {
                wakers.push(waker);
                Granted::Many(wakers)
            }
        };
    }

    pub(crate) fn wake(self) {
        match self {
            Granted::Nobody => {}
            Granted::One(waker) => waker.wake(),
            Granted::Many(wakers) => wakers.into_iter().for_each(Waker::wake),
        }
    }
}

/// A queue longer than this keeps no more than four times its length in capacity.
const QUEUE_CAPACITY_KEPT: usize = 64;

impl Slot {
    /// Adds the wakers of the waiters still waiting to `wakers`, leaving them queued: a
    /// shutdown wakes them so that each gives up by itself (and withdraws as usual).
    pub(crate) fn waiting_wakers(&self, wakers: &mut Vec<Waker>) {
        let Some(queue) = &self.queue else {
            return;
        };
        for waiter in &queue.entries {
            if let WaiterState::Waiting(waker) = &*lock(&waiter.state) {
                wakers.push(waker.clone());
            }
        }
    }

    /// Whether someone holds the key now (waiters aside): for read-only inspection.
    pub(crate) fn is_held(&self) -> bool {
        self.holders.exclusive > 0 || self.holders.shared > 0
    }

    /// Takes the key in `mode` if it is free for it and nobody waits; otherwise queues
    /// a waiter woken by `waker`, or reports why it did not (`waker` is `None` for a
    /// try-once attempt).
    pub(crate) fn acquire_or_enqueue(
        &mut self,
        mode: Mode,
        permits: u32,
        max_waiters: usize,
        waker: Option<&Waker>,
    ) -> Attempt {
        let waiting = self.queue.as_ref().map_or(0, |queue| queue.waiting);
        if waiting == 0 && self.holders.admit(mode, permits) {
            self.holders.enter(mode);
            return Attempt::Acquired;
        }
        let Some(waker) = waker else {
            return Attempt::Busy;
        };
        if waiting >= max_waiters {
            return Attempt::QueueFull;
        }
        let queue = self.queue.get_or_insert_default();
        let waiter = Arc::new(Waiter::new(waker.clone(), mode));
        queue.entries.push_back(waiter.clone());
        queue.waiting += 1;
        Attempt::Queued(waiter)
    }

    /// Gives up a hold in `mode` and grants the waiters that can now go. Returns their
    /// wakers and whether the slot is now unused and must be removed.
    #[inline]
    pub(crate) fn release(&mut self, mode: Mode, permits: u32) -> (Granted, bool) {
        self.holders.leave(mode);
        self.grant_front(permits)
    }

    /// Withdraws a waiter that is giving up. If the key was already handed to it, it is
    /// released instead, exactly as its holder would have. A waiter leaving the front
    /// may let the ones behind it go (shared holders behind a withdrawn exclusive one).
    pub(crate) fn withdraw(&mut self, waiter: &Waiter, permits: u32) -> (Granted, bool) {
        if !waiter.withdraw() {
            return self.release(waiter.mode, permits);
        }
        let queue = self
            .queue
            .as_mut()
            .expect("a withdrawing waiter is in the queue");
        queue.waiting -= 1;
        if queue.entries.len() > 2 * queue.waiting {
            queue.compact();
        }
        self.grant_front(permits)
    }

    /// Grants waiters from the front, in order, while the key admits them.
    #[inline]
    fn grant_front(&mut self, permits: u32) -> (Granted, bool) {
        let mut granted = Granted::default();
        if let Some(queue) = &mut self.queue {
            while let Some(next) = queue.entries.front() {
                if next.is_withdrawn() {
                    queue.entries.pop_front();
                    continue;
                }
                if !self.holders.admit(next.mode, permits) {
                    break;
                }
                self.holders.enter(next.mode);
                granted.push(next.grant());
                queue.entries.pop_front();
                queue.waiting -= 1;
            }
        }
        (granted, self.holders.none())
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
pub(crate) struct Waiter {
    state: Mutex<WaiterState>,
    mode: Mode,
}

enum WaiterState {
    /// Queued; the waker wakes the waiting future.
    Waiting(Waker),
    /// The permit was handed over by a releasing holder.
    Granted,
    /// The future gave up before it was granted; releases skip it.
    Withdrawn,
}

impl Waiter {
    fn new(waker: Waker, mode: Mode) -> Self {
        Waiter {
            state: Mutex::new(WaiterState::Waiting(waker)),
            mode,
        }
    }

    /// Hands the key over to a waiter still waiting; returns the waker to call.
    fn grant(&self) -> Waker {
        match std::mem::replace(&mut *lock(&self.state), WaiterState::Granted) {
            WaiterState::Waiting(waker) => waker,
            _ => unreachable!("only a waiting waiter is granted"),
        }
    }

    /// Marks the waiter withdrawn; false if it was granted the permit first.
    fn withdraw(&self) -> bool {
        let mut state = lock(&self.state);
        if matches!(*state, WaiterState::Granted) {
            return false;
        }
        *state = WaiterState::Withdrawn;
        true
    }

    fn is_withdrawn(&self) -> bool {
        matches!(*lock(&self.state), WaiterState::Withdrawn)
    }

    pub(crate) fn is_granted(&self) -> bool {
        matches!(*lock(&self.state), WaiterState::Granted)
    }

    /// Returns true once the permit is handed over; until then keeps `waker` registered.
    pub(crate) fn poll_granted(&self, waker: &Waker) -> bool {
        match &mut *lock(&self.state) {
            WaiterState::Waiting(current) => {
                current.clone_from(waker);
                false
            }
            WaiterState::Granted => true,
            WaiterState::Withdrawn => unreachable!("a withdrawn waiter polled"),
        }
    }
}
