//! The per-key state of the lock table and the waiter hand-off.

use std::collections::VecDeque;
use std::task::Waker;

use crate::sync::{lock, Arc, Mutex};

/// What the table holds for one key.
///
/// Invariant (every change happens under the key's shard lock): a waiter is queued only
/// while all permits are taken, and a releasing holder hands its permit to the front
/// waiter instead of returning it. So `waiters` is non-empty only when
/// `holders == permits`, and the slot can be removed exactly when `holders == 0`.
#[derive(Default)]
pub(crate) struct Slot {
    holders: usize,
    waiters: VecDeque<Arc<Waiter>>,
}

/// The outcome of a first attempt on a slot.
pub(crate) enum Attempt {
    Acquired,
    Queued(Arc<Waiter>),
    Busy,
    QueueFull,
}

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
                self.waiters.is_empty(),
                "waiters queued beside a free permit"
            );
            self.holders += 1;
            return Attempt::Acquired;
        }
        let Some(waker) = waker else {
            return Attempt::Busy;
        };
        if self.waiters.len() >= max_waiters {
            return Attempt::QueueFull;
        }
        let waiter = Arc::new(Waiter::new(waker.clone()));
        self.waiters.push_back(waiter.clone());
        Attempt::Queued(waiter)
    }

    /// Gives up one permit: hands it to the front waiter if there is one.
    /// Returns the waker to call (after the shard lock is released) and whether the
    /// slot is now unused and must be removed.
    pub(crate) fn release(&mut self) -> (Option<Waker>, bool) {
        match self.waiters.pop_front() {
            Some(next) => (next.grant(), false),
            None => {
                self.holders -= 1;
                (None, self.holders == 0)
            }
        }
    }

    /// Withdraws a waiter that is giving up. If the permit was already handed to it,
    /// the permit is released instead, exactly as its holder would have.
    pub(crate) fn withdraw(&mut self, waiter: &Arc<Waiter>) -> (Option<Waker>, bool) {
        if waiter.is_granted() {
            return self.release();
        }
        if let Some(at) = self.waiters.iter().position(|w| Arc::ptr_eq(w, waiter)) {
            self.waiters.remove(at);
        }
        // A queued waiter implies a holder, so the slot stays.
        (None, false)
    }
}

/// A queued acquisition. `granted` is set only by the releasing holder, under the
/// key's shard lock; the waiter itself reads it without that lock.
pub(crate) struct Waiter(Mutex<WaiterState>);

struct WaiterState {
    granted: bool,
    waker: Option<Waker>,
}

impl Waiter {
    fn new(waker: Waker) -> Self {
        Waiter(Mutex::new(WaiterState {
            granted: false,
            waker: Some(waker),
        }))
    }

    /// Marks the permit as handed over and returns the waker to call.
    fn grant(&self) -> Option<Waker> {
        let mut state = lock(&self.0);
        state.granted = true;
        state.waker.take()
    }

    pub(crate) fn is_granted(&self) -> bool {
        lock(&self.0).granted
    }

    /// Returns true once the permit is handed over; until then keeps `waker` registered.
    pub(crate) fn poll_granted(&self, waker: &Waker) -> bool {
        let mut state = lock(&self.0);
        if !state.granted {
            match &mut state.waker {
                Some(current) => current.clone_from(waker),
                None => state.waker = Some(waker.clone()),
            }
        }
        state.granted
    }
}
