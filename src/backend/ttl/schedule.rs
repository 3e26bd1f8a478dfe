//! One renewal schedule for every lease of a backend: a lease gets a task of its own
//! (`renewal::keep`) only once it is due for its first renewal, a lease/3 after its grant.
//! Before that nothing can happen to it that needs a task: its deadline is later (the
//! drift margin is under half the lease, and the signal reads the clock itself), and
//! what the backend could show gone before the first renewal, the schedule watches for
//! all of them at once. Most leases are released sooner (a request's hold), and cost
//! no task, no timer and no wake-up: an entry in an ordered map, taken out again by the
//! release.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::{sleep_until, Instant};

use super::renewal::keep;
use super::TtlBackend;
use crate::backend::{BoxFuture, LeaseLostSender};

/// What resolves when the backend shows that every hold may be gone (what
/// [`TtlBackend::gone`] shows for each): a fresh future at each call.
pub(crate) type GoneForAll = Box<dyn Fn() -> BoxFuture<()> + Send + Sync>;

/// The schedule of one backend, for a [`TtlBackend::schedule`] whose
/// [`gone`](TtlBackend::gone) does not depend on the target.
pub(crate) struct Schedule<B: TtlBackend> {
    shared: Arc<Shared<B>>,
}

struct Shared<B: TtlBackend> {
    state: Mutex<State<B>>,
    /// Wakes the task for a lease due before the time it sleeps until.
    wake: Notify,
    gone: GoneForAll,
}

struct State<B: TtlBackend> {
    /// Leases not yet handed to a task of their own, by when they are due.
    waiting: BTreeMap<(Instant, u64), Waiting<B>>,
    /// Leases handed to a task of their own, until it ends.
    running: HashMap<u64, AbortHandle>,
    next_id: u64,
    /// Until when the schedule's task sleeps; `None` when it does not run.
    sleeps_until: Option<Instant>,
    /// The schedule's task, if one was started: one that ended without saying so (its
    /// runtime shut down) is replaced by the next `add`.
    task: Option<AbortHandle>,
}

/// What `keep` needs for a lease.
struct Waiting<B: TtlBackend> {
    target: B::Target,
    token: String,
    acquired_at: Instant,
    lost: LeaseLostSender,
}

/// Where a scheduled lease is, for its release.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    due: Instant,
    id: u64,
}

impl<B: TtlBackend> Schedule<B> {
    /// An empty schedule; `gone` as for [`GoneForAll`].
    // Only the engines of the `redis` feature keep one.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn new(gone: GoneForAll) -> Self {
        let state = State {
            waiting: BTreeMap::new(),
            running: HashMap::new(),
            next_id: 0,
            sleeps_until: None,
            task: None,
        };
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                wake: Notify::new(),
                gone,
            }),
        }
    }

    /// Schedules the lease of `token` on `target`, granted at `acquired_at`, to get a
    /// task of its own at `due`.
    pub(crate) fn add(
        &self,
        backend: &Arc<B>,
        target: B::Target,
        token: String,
        acquired_at: Instant,
        lost: LeaseLostSender,
        due: Instant,
    ) -> Entry {
        let waiting = Waiting {
            target,
            token,
            acquired_at,
            lost,
        };
        let mut state = self.shared.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.waiting.insert((due, id), waiting);
        // Not running: it ended with nothing left to wait for (it says so under this
        // lock), or with its runtime.
        let running = state.sleeps_until.is_some()
            && state.task.as_ref().is_some_and(|task| !task.is_finished());
        if !running {
            state.sleeps_until = Some(due);
            let (shared, backend) = (self.shared.clone(), Arc::downgrade(backend));
            state.task = Some(tokio::spawn(run(shared, backend)).abort_handle());
        } else if state.sleeps_until.is_some_and(|until| due < until) {
            state.sleeps_until = Some(due);
            drop(state);
            self.shared.wake.notify_one();
        }
        Entry { due, id }
    }

    /// Stops the renewal of the lease at `entry`: out of the schedule, or its task
    /// aborted. Again, or after its task ended: nothing.
    pub(crate) fn cancel(&self, entry: Entry) {
        let mut state = self.shared.lock();
        let waiting = state.waiting.remove(&(entry.due, entry.id));
        if waiting.is_none() {
            if let Some(task) = state.running.remove(&entry.id) {
                task.abort();
            }
        }
        drop(state);
        // Its signal is frozen outside the lock (the drop wakes its watchers).
        drop(waiting);
    }
}

impl<B: TtlBackend> Shared<B> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands every lease due by `now` (every lease, with `None`) to a task of its own.
    fn hand_over(self: &Arc<Self>, backend: &Arc<B>, now: Option<Instant>) {
        let mut state = self.lock();
        while let Some(first) = state.waiting.first_entry() {
            if now.is_some_and(|now| first.key().0 > now) {
                break;
            }
            let ((_, id), lease) = first.remove_entry();
            let (shared, backend) = (self.clone(), backend.clone());
            // Spawned under the lock: a release that finds the lease in neither map
            // knows its task has ended.
            let task = tokio::spawn(async move {
                let Waiting {
                    target,
                    token,
                    acquired_at,
                    lost,
                } = lease;
                keep(backend, target, token, acquired_at, lost).await;
                shared.lock().running.remove(&id);
            });
            state.running.insert(id, task.abort_handle());
        }
    }
}

/// The schedule's task: sleeps until the first lease is due, or the backend shows
/// holds gone, and hands leases over; ends once none waits (the next `add` starts it
/// again). It keeps no backend alive: every lease it waits for holds one.
async fn run<B: TtlBackend>(shared: Arc<Shared<B>>, backend: Weak<B>) {
    loop {
        let gone = (shared.gone)();
        let next = {
            let mut state = shared.lock();
            match state.waiting.first_key_value() {
                Some(((due, _), _)) => {
                    let due = *due;
                    state.sleeps_until = Some(due);
                    due
                }
                None => {
                    state.sleeps_until = None;
                    return;
                }
            }
        };
        let all = tokio::select! {
            biased;
            () = gone => true,
            () = shared.wake.notified() => continue,
            () = sleep_until(next) => false,
        };
        let Some(backend) = backend.upgrade() else {
            shared.lock().sleeps_until = None;
            return;
        };
        // Gone: each lease's own task looks at what the backend shows for it, and
        // ends it.
        let now = (!all).then(Instant::now);
        shared.hand_over(&backend, now);
    }
}
