//! Shared, exclusive and permit locks from several instances (each its own backend
//! client) against a real Redis and PostgreSQL, checked against a simple model: random
//! sequences of acquire/hold/release, and at no instant does a writer overlap anyone,
//! nor do more than `PERMITS` permit holders exist. Mixed modes under one name are in
//! the plans too: an instance's permit lock named like the read/write locks (as two
//! processes configured differently would be) holds against writers of that name, at
//! most `PERMITS` at once, beside readers. Through the fault proxy (one
//! instance's path delayed, blackholed or reset mid-run) an overlap may happen, but only
//! signalled: the holder it overlaps has been told its lease is lost — before the other
//! grant, or for a session lock whose connection was reset, within the bound its
//! backend documents (`Proxied::reset_notice`), unless it left by then.

// The model runs against Redis and PostgreSQL: with neither engine there is nothing to run.
#![cfg(any(feature = "redis", feature = "postgres"))]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio::time::Instant;
use tower_keyed_lock::{DistributedGuard, DistributedLocks, LeaseSignal, LockBackend};

use crate::support::fixtures::{Proxied, Remote};
use crate::support::tcp_proxy::TcpProxy;

/// Permits per key of the permit locks.
const PERMITS: usize = 2;
/// Instances per run.
const INSTANCES: usize = 3;
/// How long an acquisition may wait: well past a lease, so only a fault fails one.
const WAIT: Duration = Duration::from_secs(20);

/// What one step of an instance does: take the key in a mode, hold it a few ms, release.
#[derive(Debug, Clone, Copy)]
enum Step {
    Read(u64),
    Write(u64),
    Permit(u64),
    /// A permit of the permit lock named like the read/write locks.
    Mixed(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..4).prop_map(Step::Read),
        2 => (0u64..4).prop_map(Step::Write),
        2 => (0u64..4).prop_map(Step::Permit),
        2 => (0u64..4).prop_map(Step::Mixed),
    ]
}

fn plan() -> impl Strategy<Value = Vec<Vec<Step>>> {
    prop::collection::vec(prop::collection::vec(step(), 1..8), INSTANCES)
}

/// A fault of the proxied instance's path, from `after` ms into the run for `lasting` ms.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Delay,
    Blackhole,
    Reset,
}

/// The model: who holds what now, each with its lost signal.
#[derive(Default)]
struct Holders {
    readers: Vec<(usize, LeaseSignal)>,
    writers: Vec<(usize, LeaseSignal)>,
    permits: Vec<(usize, LeaseSignal)>,
    /// Permit holders under the read/write locks' name.
    mixed: Vec<(usize, LeaseSignal)>,
    next: usize,
    /// How long after another grant an overlapped holder may be told (0: before it).
    notice: Duration,
    /// Overlapped holders not yet told at the other grant: each must be told, or have
    /// left, by its deadline; the watcher says whether it was told in time.
    pending: Vec<(usize, Instant, tokio::task::JoinHandle<bool>)>,
    /// When each holder left.
    left: HashMap<usize, Instant>,
}

/// A grant that overlapped a holder not told it lost its lease.
#[derive(Debug)]
struct Unsignalled(String);

impl Holders {
    /// Enters a holder of `step`'s kind; the holders it conflicts with must all have
    /// lost their lease. Returns its id, to leave by.
    fn enter(&mut self, step: Step, signal: LeaseSignal) -> Result<usize, Unsignalled> {
        let live = |holders: &[(usize, LeaseSignal)]| {
            holders
                .iter()
                .filter(|(_, signal)| !signal.is_lost())
                .count()
        };
        let (live, allowed) = match step {
            Step::Read(_) => (live(&self.writers), live(&self.writers) == 0),
            Step::Write(_) => {
                let live = live(&self.writers) + live(&self.readers) + live(&self.mixed);
                (live, live == 0)
            }
            Step::Permit(_) => (live(&self.permits), live(&self.permits) < PERMITS),
            Step::Mixed(_) => (
                live(&self.writers) + live(&self.mixed),
                live(&self.writers) == 0 && live(&self.mixed) < PERMITS,
            ),
        };
        if !allowed && !self.notice.is_zero() {
            // A session lock freed with its reset connection: the holders in the way
            // must be told (or leave) within the notice; checked after the run.
            let deadline = Instant::now() + self.notice;
            let in_the_way: Vec<(usize, LeaseSignal)> = match step {
                Step::Read(_) => self.writers.clone(),
                Step::Write(_) => [
                    self.writers.clone(),
                    self.readers.clone(),
                    self.mixed.clone(),
                ]
                .concat(),
                Step::Permit(_) => self.permits.clone(),
                Step::Mixed(_) => [self.writers.clone(), self.mixed.clone()].concat(),
            };
            for (id, signal) in in_the_way.into_iter().filter(|(_, s)| !s.is_lost()) {
                let told = tokio::spawn(async move {
                    tokio::time::timeout_at(deadline, signal.lost())
                        .await
                        .is_ok()
                });
                self.pending.push((id, deadline, told));
            }
        } else if !allowed {
            return Err(Unsignalled(format!(
                "{step:?} granted beside {live} live conflicting holders \
                 (readers {}, writers {}, permits {}, permits under the writers' name {})",
                self.readers.len(),
                self.writers.len(),
                self.permits.len(),
                self.mixed.len()
            )));
        }
        self.next += 1;
        let entry = (self.next, signal);
        match step {
            Step::Read(_) => self.readers.push(entry),
            Step::Write(_) => self.writers.push(entry),
            Step::Permit(_) => self.permits.push(entry),
            Step::Mixed(_) => self.mixed.push(entry),
        }
        Ok(self.next)
    }

    fn leave(&mut self, id: usize) {
        self.left.insert(id, Instant::now());
        for list in [
            &mut self.readers,
            &mut self.writers,
            &mut self.permits,
            &mut self.mixed,
        ] {
            list.retain(|(entry, _)| *entry != id);
        }
    }

    /// After the run: every overlapped holder was told, or had left, by its deadline.
    async fn check_pending(model: &Mutex<Holders>) -> Result<(), TestCaseError> {
        let (pending, left) = {
            let mut model = model.lock().unwrap();
            (std::mem::take(&mut model.pending), model.left.clone())
        };
        for (id, deadline, told) in pending {
            let told = told.await.expect("a watcher panicked");
            let gone = left.get(&id).is_some_and(|at| *at <= deadline);
            prop_assert!(
                told || gone,
                "a holder overlapped after its connection reset was neither told nor gone \
                 within the notice"
            );
        }
        Ok(())
    }
}

/// One instance: read/write locks, permit locks, and permit locks under the read/write
/// locks' name, on one backend client of its own.
struct Instance {
    rw: DistributedLocks,
    permits: DistributedLocks,
    mixed: DistributedLocks,
}

impl Instance {
    fn on(backend: Arc<dyn LockBackend>) -> Self {
        Instance {
            rw: DistributedLocks::builder("model-rw")
                .shared_backend(backend.clone())
                .build(),
            mixed: DistributedLocks::builder("model-rw")
                .shared_backend(backend.clone())
                .permits(PERMITS)
                .build(),
            permits: DistributedLocks::builder("model-permits")
                .shared_backend(backend)
                .permits(PERMITS)
                .build(),
        }
    }
}

/// Runs every instance's steps at once; `faulty` instances may fail to acquire.
async fn run(
    instances: &[Arc<Instance>],
    plan: Vec<Vec<Step>>,
    faulty: &[bool],
    model: Arc<Mutex<Holders>>,
) -> Result<(), TestCaseError> {
    let mut tasks = Vec::new();
    for ((instance, steps), faulty) in instances.iter().zip(plan).zip(faulty) {
        let (instance, model, faulty) = (instance.clone(), model.clone(), *faulty);
        tasks.push(tokio::spawn(async move {
            for step in steps {
                let (acquire, hold) = match step {
                    Step::Read(ms) => (instance.rw.lock_shared_timeout("k", WAIT), ms),
                    Step::Write(ms) => (instance.rw.lock_timeout("k", WAIT), ms),
                    Step::Permit(ms) => (instance.permits.lock_timeout("k", WAIT), ms),
                    Step::Mixed(ms) => (instance.mixed.lock_timeout("k", WAIT), ms),
                };
                let guard: DistributedGuard = match acquire.await {
                    Ok(guard) => guard,
                    Err(_) if faulty => continue,
                    Err(error) => return Err(format!("{step:?} failed: {error}")),
                };
                let signal = guard.lease().expect("a remote lease").clone();
                let entered = model.lock().unwrap().enter(step, signal);
                let id = entered.map_err(|Unsignalled(what)| what)?;
                tokio::time::sleep(Duration::from_millis(hold)).await;
                model.lock().unwrap().leave(id);
                guard.release().await;
            }
            Ok(())
        }));
    }
    for task in tasks {
        task.await
            .expect("an instance panicked")
            .map_err(TestCaseError::fail)?;
    }
    Ok(())
}

/// Random plans against `fixture`'s server, every instance direct: nothing fails and
/// the model holds throughout.
fn model_holds<F: Remote + Proxied>(cases: u32) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let fixture = runtime.block_on(async { F::start() });
    let instances: Vec<Arc<Instance>> = runtime.block_on(async {
        let mut instances = Vec::new();
        for index in 0..INSTANCES {
            let backend = fixture.backend_named(&format!("model-{index}")).await;
            instances.push(Arc::new(Instance::on(backend)));
        }
        instances
    });
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&plan(), |plan| {
            let model = Arc::new(Mutex::new(Holders::default()));
            runtime.block_on(run(&instances, plan, &[false; INSTANCES], model))
        })
        .unwrap();
}

/// Random plans with the first instance behind the fault proxy, `fault` applied to its
/// path for a while mid-run: acquisitions through it may fail, and any overlap with a
/// holder it cut off must come after that holder was told.
fn model_holds_through<F: Remote + Proxied>(fault: Fault, cases: u32) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let fixture = runtime.block_on(async { F::start() });
    let (proxy, instances) = runtime.block_on(async {
        let proxy = TcpProxy::start(fixture.upstream()).await;
        let mut instances = vec![Arc::new(Instance::on(
            fixture.backend_via(&proxy.host_port()).await,
        ))];
        for index in 1..INSTANCES {
            let backend = fixture.backend_named(&format!("model-{index}")).await;
            instances.push(Arc::new(Instance::on(backend)));
        }
        (proxy, instances)
    });
    let proxy = Arc::new(proxy);
    let network = fixture.command_timeout();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let faulty = [true, false, false];
    let notice = match fault {
        Fault::Reset => fixture.reset_notice(),
        Fault::Delay | Fault::Blackhole => Duration::ZERO,
    };
    runner
        .run(&(plan(), 0u64..30, 1u64..4), |(plan, after_ms, lasting)| {
            let model = Arc::new(Mutex::new(Holders {
                notice,
                ..Holders::default()
            }));
            runtime.block_on(async {
                let proxy = proxy.clone();
                // The fault lasts 1 to 3 network timeouts: long enough to cut a lease
                // off, and heals before the next case.
                let lasting = network * u32::try_from(lasting).unwrap();
                let faults = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(after_ms)).await;
                    match fault {
                        Fault::Delay => proxy.delay(network / 4),
                        Fault::Blackhole => proxy.blackhole(),
                        Fault::Reset => proxy.reset(),
                    }
                    let until = Instant::now() + lasting;
                    tokio::time::sleep_until(until).await;
                    proxy.heal();
                    proxy.delay(Duration::ZERO);
                });
                let result = run(&instances, plan, &faulty, model.clone()).await;
                faults.await.unwrap();
                result?;
                Holders::check_pending(&model).await
            })
        })
        .unwrap();
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use crate::support::fixtures::Redis;

    #[test]
    fn shared_exclusive_and_permits_follow_the_model() {
        model_holds::<Redis>(24);
    }

    #[test]
    fn through_a_delayed_path() {
        model_holds_through::<Redis>(Fault::Delay, 6);
    }

    #[test]
    fn through_a_blackholed_path() {
        model_holds_through::<Redis>(Fault::Blackhole, 6);
    }

    #[test]
    fn through_a_reset_path() {
        model_holds_through::<Redis>(Fault::Reset, 6);
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use crate::support::fixtures::Postgres;

    #[test]
    fn shared_exclusive_and_permits_follow_the_model() {
        model_holds::<Postgres>(24);
    }

    #[test]
    fn through_a_delayed_path() {
        model_holds_through::<Postgres>(Fault::Delay, 6);
    }

    #[test]
    fn through_a_blackholed_path() {
        model_holds_through::<Postgres>(Fault::Blackhole, 6);
    }

    #[test]
    fn through_a_reset_path() {
        model_holds_through::<Postgres>(Fault::Reset, 6);
    }
}
