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
use std::time::Duration;

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

/// How long the schedule's task waits for the next lease once none waits, before it
/// ends. Ended at once, it was spawned again for nearly every lock of a stream of short
/// ones (each released before the task first ran), and each spawn woke a parked worker.
const IDLE: Duration = Duration::from_millis(500);

/// The schedule's task: sleeps until the first lease is due, or the backend shows
/// holds gone, and hands leases over; ends once none waited for [`IDLE`] (the next
/// `add` starts it again). It keeps no backend alive: every lease it waits for holds
/// one.
async fn run<B: TtlBackend>(shared: Arc<Shared<B>>, backend: Weak<B>) {
    let mut idle_since = None;
    loop {
        let gone = (shared.gone)();
        let next = {
            let mut state = shared.lock();
            let now = Instant::now();
            let next = match state.waiting.first_key_value() {
                Some(((due, _), _)) => {
                    idle_since = None;
                    *due
                }
                None => {
                    let ends = *idle_since.get_or_insert(now) + IDLE;
                    if now >= ends {
                        state.sleeps_until = None;
                        return;
                    }
                    ends
                }
            };
            state.sleeps_until = Some(next);
            next
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
        if all {
            // Every lease went to a task of its own, and what the backend shows gone
            // may stay so: with none waiting, end rather than look at it again.
            let mut state = shared.lock();
            if state.waiting.is_empty() {
                state.sleeps_until = None;
                return;
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::backend::ttl::{GiveBack, Renewal, Timing};
    use crate::backend::LeaseSignal;

    /// A backend whose schedule is all there is to it; `gone_for_all` as given.
    struct Scheduled {
        schedule: Schedule<Scheduled>,
    }

    impl Scheduled {
        fn new(gone: GoneForAll) -> Arc<Self> {
            Arc::new(Scheduled {
                schedule: Schedule::new(gone),
            })
        }

        /// Adds a lease due in a second; its signal is dropped (nobody watches it).
        fn add(self: &Arc<Self>) -> Entry {
            let now = Instant::now();
            let (lost, _signal) = LeaseSignal::with_deadline(now + Duration::from_secs(3));
            let due = now + Duration::from_secs(1);
            self.schedule
                .add(self, (), "token".to_owned(), now, lost, due)
        }

        /// The schedule's task, the last one started.
        fn task_id(&self) -> Option<tokio::task::Id> {
            let state = self.schedule.shared.lock();
            state.task.as_ref().map(AbortHandle::id)
        }

        /// Whether the schedule's task runs, and how many leases have tasks of their own.
        fn task(&self) -> (bool, usize) {
            let state = self.schedule.shared.lock();
            let runs = state.sleeps_until.is_some()
                && state.task.as_ref().is_some_and(|task| !task.is_finished());
            (runs, state.running.len())
        }
    }

    impl TtlBackend for Scheduled {
        type Target = ();

        fn timing(&self) -> Timing {
            Timing::new(
                Duration::from_secs(3),
                Duration::ZERO,
                Duration::from_millis(100),
            )
        }

        async fn renew(&self, _: &(), _: &str, _: Duration, _: Instant, _: Instant) -> Renewal {
            Renewal::Unknown
        }

        async fn try_give_back(&self, _: &(), _: &str) -> GiveBack {
            GiveBack::Cleared
        }

        fn engine(&self) -> &'static str {
            "scheduled"
        }

        fn schedule(&self) -> Option<&Schedule<Self>> {
            Some(&self.schedule)
        }
    }

    /// Short leases one after the other, each released before the schedule's task
    /// looked at it: the task started for the first one is still there for the next,
    /// and ends once none waited for `IDLE`.
    #[tokio::test(start_paused = true)]
    async fn the_task_outlives_a_gap_between_short_leases_and_then_ends() {
        let backend = Scheduled::new(Box::new(|| Box::pin(std::future::pending())));
        let first = backend.add();
        let task = backend.task_id();
        backend.schedule.cancel(first);
        for _ in 0..5 {
            tokio::time::sleep(IDLE / 10).await;
            let entry = backend.add();
            tokio::task::yield_now().await;
            backend.schedule.cancel(entry);
            assert_eq!(backend.task_id(), task, "a task of its own per lease");
        }
        assert_eq!(backend.task(), (true, 0));
        tokio::time::sleep(IDLE + IDLE / 10).await;
        assert_eq!(backend.task(), (false, 0), "still there with none waiting");
    }

    /// What the backend shows gone may stay so: once it handed every lease to a task
    /// of its own, the schedule's task ends instead of looking at it again and again.
    #[tokio::test(start_paused = true)]
    async fn the_task_ends_once_gone_handed_every_lease_over() {
        let backend = Scheduled::new(Box::new(|| Box::pin(std::future::ready(()))));
        let entry = backend.add();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(backend.task(), (false, 1));
        backend.schedule.cancel(entry);
        assert_eq!(backend.task(), (false, 0));
    }
}
