//! The locks one backend holds on sessions, and where each is watched: young ones
//! together, by one task that looks at their sessions every few milliseconds, until
//! their first liveness check is due; then each by a holding task of its own
//! (`hold::watch`).
//!
//! Most locks are released before their first check is due (a request's hold against
//! a liveness interval of a second), and so cost no task: their release unlocks on the
//! caller's task, where a task of their own would cost a spawn and two wake-ups per
//! lock. Nothing needs one before that check: the deadline lives in the lease's
//! signal, and what shows a session gone early (its connection task ended, seen
//! without a round trip) the looking task sees for all of them at once. An engine
//! that cannot see that without a round trip (MySQL keeps a statement pending
//! instead) has every lease handed to its task at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::{Instant, MissedTickBehavior};

use super::watch::{watch, Ended, Watched};
use super::SessionLock;

/// A lock held on a session, not yet handed to a task of its own.
pub(super) struct YoungLease<E: SessionLock> {
    pub(super) engine: Arc<E>,
    pub(super) session: E::Session,
    pub(super) held: E::Held,
    pub(super) watched: Watched,
    /// When its first liveness check is due.
    pub(super) due: Instant,
}

/// A lock handed to its holding task: how to stop it (until taken by the release, or
/// by a record's write), and its end.
pub(super) struct Running<E: SessionLock> {
    pub(super) stop: Option<oneshot::Sender<E::Release>>,
    pub(super) task: JoinHandle<Ended>,
}

/// A held lock as its release finds it.
pub(super) enum Taken<E: SessionLock> {
    Young(YoungLease<E>),
    Running(Running<E>),
}

/// The locks one backend holds (shared by the clones of a builder: each lease brings
/// its own engine).
pub(crate) struct Holds<E: SessionLock> {
    shared: Arc<Shared<E>>,
}

impl<E: SessionLock> Clone for Holds<E> {
    fn clone(&self) -> Self {
        Holds {
            shared: self.shared.clone(),
        }
    }
}

struct Shared<E: SessionLock> {
    state: Mutex<State<E>>,
    /// How often the young sessions are looked at; `None`: no young leases, every
    /// lease is handed to its task at once.
    looks: Option<Duration>,
}

struct State<E: SessionLock> {
    young: HashMap<u64, YoungLease<E>>,
    running: HashMap<u64, Running<E>>,
    next_id: u64,
    /// The looking task, while it runs: it clears this under the lock as it ends (none
    /// young for a while); one that ended without saying so (its runtime shut down) is
    /// replaced by the next young lease.
    looking: Option<AbortHandle>,
}

impl<E: SessionLock> Holds<E> {
    /// No locks; young sessions looked at every `looks` (see [`Shared::looks`]).
    pub(crate) fn new(looks: Option<Duration>) -> Self {
        let state = State {
            young: HashMap::new(),
            running: HashMap::new(),
            next_id: 0,
            looking: None,
        };
        Holds {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                looks,
            }),
        }
    }

    /// Adds a held lock; returns its id, for [`take`](Self::take).
    pub(super) fn add(&self, lease: YoungLease<E>) -> u64 {
        let mut state = self.shared.lock();
        let id = state.next_id;
        state.next_id += 1;
        let Some(period) = self.shared.looks else {
            state.hand_over(id, lease);
            return id;
        };
        state.young.insert(id, lease);
        if state.looking.as_ref().is_none_or(AbortHandle::is_finished) {
            let task = tokio::spawn(look(self.shared.clone(), period));
            state.looking = Some(task.abort_handle());
        }
        id
    }

    /// Takes the lock `id` out, for its release; `None` if taken already.
    pub(super) fn take(&self, id: u64) -> Option<Taken<E>> {
        let mut state = self.shared.lock();
        if let Some(young) = state.young.remove(&id) {
            return Some(Taken::Young(young));
        }
        state.running.remove(&id).map(Taken::Running)
    }

    /// The sender that stops the lock `id`'s holding task, handing a young lock to one
    /// first; `None` once taken.
    #[cfg(feature = "replay")]
    pub(super) fn stop(&self, id: u64) -> Option<oneshot::Sender<E::Release>> {
        let mut state = self.shared.lock();
        if let Some(young) = state.young.remove(&id) {
            state.hand_over(id, young);
        }
        state.running.get_mut(&id)?.stop.take()
    }

    /// How many locks are young, and how many have a task: for tests.
    #[cfg(test)]
    pub(super) fn counts(&self) -> (usize, usize) {
        let state = self.shared.lock();
        (state.young.len(), state.running.len())
    }

    /// Whether the looking task runs: for tests.
    #[cfg(test)]
    pub(super) fn is_looking(&self) -> bool {
        let state = self.shared.lock();
        state
            .looking
            .as_ref()
            .is_some_and(|task| !task.is_finished())
    }
}

impl<E: SessionLock> Shared<E> {
    fn lock(&self) -> MutexGuard<'_, State<E>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<E: SessionLock> State<E> {
    /// Spawns the holding task of `lease` (under the lock: a release that finds the
    /// lock in neither map knows it was taken).
    fn hand_over(&mut self, id: u64, lease: YoungLease<E>) {
        let (stop, stopped) = oneshot::channel();
        let YoungLease {
            engine,
            session,
            held,
            watched,
            due: _,
        } = lease;
        let task = tokio::spawn(watch(engine, session, held, watched, stopped));
        let stop = Some(stop);
        self.running.insert(id, Running { stop, task });
    }
}

/// How many looks in a row find no young lock before the looking task ends. Ended at
/// the first, it was spawned again every few locks of a steady stream, and each spawn
/// woke a parked worker to run it: more than the looks of an idle backend cost.
pub(super) const IDLE_LOOKS: u32 = 100;

/// The looking task: every `period`, hands the young locks whose check is due, or
/// whose session shows it ended, to tasks of their own; ends once none was young for
/// [`IDLE_LOOKS`] looks.
async fn look<E: SessionLock>(shared: Arc<Shared<E>>, period: Duration) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut ready = Vec::new();
    let mut idle = 0;
    loop {
        ticks.tick().await;
        let mut state = shared.lock();
        if state.young.is_empty() {
            idle += 1;
            if idle >= IDLE_LOOKS {
                state.looking = None;
                return;
            }
            continue;
        }
        idle = 0;
        let now = Instant::now();
        ready.extend(state.young.iter().filter_map(|(id, lease)| {
            (lease.due <= now || lease.engine.is_closed(&lease.session)).then_some(*id)
        }));
        for id in ready.drain(..) {
            let lease = state.young.remove(&id).expect("listed just now");
            state.hand_over(id, lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::fmt;

    use proptest::prelude::*;

    use super::*;
    use crate::backend::session::{hold, Checked, Timing};
    use crate::backend::{Lease, LeaseLostSender, LostReason};

    const LOOKS: Duration = Duration::from_millis(5);
    const TIMING: Timing = Timing {
        liveness_interval: Duration::from_millis(100),
        command_timeout: Duration::from_millis(50),
    };

    /// Sessions numbered by lease; the test ends them (`closed`). Checks answer at once
    /// when due, and fail once the session ended; how each session went back is
    /// written down.
    struct Engine {
        closed: Mutex<HashSet<u64>>,
        ended: Mutex<Vec<(u64, &'static str)>>,
        holds: Holds<Engine>,
        /// Sessions whose unlock never answers.
        hanging: Mutex<HashSet<u64>>,
    }

    fn engine() -> Arc<Engine> {
        Arc::new(Engine {
            closed: Mutex::default(),
            ended: Mutex::default(),
            holds: Holds::new(Some(LOOKS)),
            hanging: Mutex::default(),
        })
    }

    struct Held(u64);

    impl fmt::Display for Held {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{}", self.0)
        }
    }

    impl Engine {
        fn ended(&self, session: u64) -> bool {
            self.closed.lock().unwrap().contains(&session)
        }
    }

    impl SessionLock for Engine {
        type Session = u64;
        type Held = Held;
        type Release = ();

        const ENGINE: &'static str = "model";
        const SHARED_SESSION: &'static str = "shared";

        async fn check(
            &self,
            session: &mut u64,
            _: &Held,
            deadline: Instant,
            _: &LeaseLostSender,
        ) -> Checked {
            let due = TIMING.check_due(deadline);
            while Instant::now() < due && !self.ended(*session) {
                tokio::time::sleep(LOOKS).await;
            }
            match self.ended(*session) {
                true => Checked::Failed("ended".into()),
                false => Checked::Alive(Instant::now()),
            }
        }

        async fn unlock(&self, session: &mut u64, _: &Held, (): ()) -> Result<(), LostReason> {
            if self.hanging.lock().unwrap().contains(session) {
                std::future::pending::<()>().await;
            }
            match self.ended(*session) {
                true => Err(LostReason::Unreachable),
                false => Ok(()),
            }
        }

        fn give_back(&self, session: u64) {
            self.ended.lock().unwrap().push((session, "give back"));
        }

        async fn close(&self, session: u64, _: &Held, _: LostReason) {
            self.ended.lock().unwrap().push((session, "close"));
        }

        fn holds(&self) -> &Holds<Self> {
            &self.holds
        }

        fn is_closed(&self, session: &u64) -> bool {
            self.ended(*session)
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Hold,
        Advance(u64),
        Release(usize),
        End(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Hold),
            3 => (0..250u64).prop_map(Op::Advance),
            2 => any::<usize>().prop_map(Op::Release),
            1 => any::<usize>().prop_map(Op::End),
        ]
    }

    /// What the model knows of a lease: its lease (until released), and when its
    /// session ended.
    struct Modelled {
        lease: Option<Lease>,
        ended_at: Option<Instant>,
    }

    /// Against a model of holds: every lease not released is young or running; one
    /// whose session ended is lost within two looks, and closed at its release; any
    /// other is never lost, and is unlocked and pooled at its release; each session
    /// goes back once; the looking task ends [`IDLE_LOOKS`] looks after the last young
    /// lease.
    async fn run(ops: Vec<Op>) {
        let engine = engine();
        let mut leases: Vec<Modelled> = Vec::new();
        for op in ops {
            match op {
                Op::Hold => {
                    let session = leases.len() as u64;
                    let lease = hold(
                        engine.clone(),
                        TIMING,
                        session,
                        Held(session),
                        None,
                        Instant::now(),
                    );
                    leases.push(Modelled {
                        lease: Some(lease),
                        ended_at: None,
                    });
                }
                Op::Advance(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                Op::Release(i) if !leases.is_empty() => {
                    let i = i % leases.len();
                    let Some(lease) = leases[i].lease.take() else {
                        continue;
                    };
                    let released = lease.release_checked().await;
                    let expected = match leases[i].ended_at {
                        Some(_) => Err(LostReason::Unreachable),
                        None => Ok(()),
                    };
                    assert_eq!(released, expected, "lease {i}");
                }
                Op::End(i) if !leases.is_empty() => {
                    let i = i % leases.len();
                    if leases[i].lease.is_some() && leases[i].ended_at.is_none() {
                        engine.closed.lock().unwrap().insert(i as u64);
                        leases[i].ended_at = Some(Instant::now());
                    }
                }
                Op::Release(_) | Op::End(_) => {}
            }
            let now = Instant::now();
            let mut held = 0;
            for (i, modelled) in leases.iter().enumerate() {
                let Some(lease) = &modelled.lease else {
                    continue;
                };
                held += 1;
                match modelled.ended_at {
                    Some(at) if now >= at + 2 * LOOKS => {
                        assert_eq!(
                            lease.signal().lost_reason(),
                            Some(LostReason::Unreachable),
                            "lease {i}"
                        );
                    }
                    Some(_) => {}
                    None => assert!(!lease.signal().is_lost(), "lease {i} lost"),
                }
            }
            let (young, running) = engine.holds.counts();
            assert_eq!(young + running, held);
        }
        for modelled in &mut leases {
            if let Some(lease) = modelled.lease.take() {
                lease.release().await;
            }
        }
        let mut ended = engine.ended.lock().unwrap().clone();
        ended.sort();
        let expected: Vec<_> = leases
            .iter()
            .enumerate()
            .map(|(i, modelled)| {
                let how = match modelled.ended_at {
                    Some(_) => "close",
                    None => "give back",
                };
                (i as u64, how)
            })
            .collect();
        assert_eq!(ended, expected);
        assert_eq!(engine.holds.counts(), (0, 0));
        tokio::time::sleep((IDLE_LOOKS + 1) * LOOKS).await;
        assert!(!engine.holds.is_looking());
    }

    /// A release dropped at its unlock: a young lease's session is dropped with it
    /// (closed: the server frees the lock), never pooled; a running one's task goes on
    /// and unlocks. Nothing is left in the holds either way.
    #[tokio::test(start_paused = true)]
    async fn a_release_dropped_at_its_unlock_pools_nothing_unsure_and_leaves_nothing() {
        let engine = engine();
        engine.hanging.lock().unwrap().insert(0);
        let watched_hanging = hold(engine.clone(), TIMING, 0, Held(0), None, Instant::now());
        let watched = hold(engine.clone(), TIMING, 1, Held(1), None, Instant::now());
        tokio::time::sleep(TIMING.liveness_interval + 2 * LOOKS).await;
        assert_eq!(engine.holds.counts(), (0, 2), "both handed over");
        let young_hanging = hold(engine.clone(), TIMING, 2, Held(2), None, Instant::now());
        engine.hanging.lock().unwrap().insert(2);
        assert_eq!(engine.holds.counts(), (1, 2));

        for lease in [young_hanging, watched_hanging] {
            let release = lease.release_checked();
            assert!(tokio::time::timeout(LOOKS, release).await.is_err());
        }
        drop(watched.release_checked());
        tokio::time::sleep(LOOKS).await;
        assert_eq!(engine.holds.counts(), (0, 0));
        // Session 0's task waits at its unlock still; 2 was dropped unpooled.
        assert_eq!(*engine.ended.lock().unwrap(), [(1, "give back")]);
    }

    proptest! {
        #[test]
        fn holds_follow_the_model(ops in proptest::collection::vec(op(), 1..40)) {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap()
                .block_on(run(ops));
        }
    }
}
