//! `DistributedLocks` used the way jobs, workers and caches use it, on a real Redis and a
//! real PostgreSQL that each test starts, and in process: one instance of three runs
//! each tick of a scheduled job, a stampede of cache misses rebuilds once, and a holder
//! that crashes mid-job is taken over once its lease is gone.

#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Barrier;
use tower_keyed_lock::{DistributedLocks, LockError};

use crate::support::fixtures::{locks_on, within, Fixture, Remote, PATIENCE};
use crate::support::lateness::Lateness;

for_each_fixture!(
    all: [
        one_instance_of_three_runs_each_tick,
        a_stampede_of_misses_rebuilds_once,
        a_quick_job_keeps_its_tick_for_hold_at_least,
    ],
    remote: [a_crashed_holder_is_taken_over_after_its_lease],
);

const JOB: &str = "nightly-report";

/// Three instances fire the same job at every tick with `try_lock`: one runs it, the
/// other two are told `Busy` and skip.
async fn one_instance_of_three_runs_each_tick<F: Fixture>() {
    const TICKS: usize = 5;
    let fixture = F::start();
    let instances = [
        fixture.instance("a").await,
        fixture.instance("b").await,
        fixture.instance("c").await,
    ];
    for tick in 0..TICKS {
        let runs = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(instances.len()));
        let fired = instances.iter().map(|locks| {
            let (locks, runs, barrier) = (locks.clone(), runs.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                match locks.try_lock(JOB).await {
                    Ok(guard) => {
                        runs.fetch_add(1, SeqCst);
                        // The job outlasts every other instance's attempt at this tick.
                        let job = tokio::time::sleep(Duration::from_millis(300));
                        guard.run_while_held(job).await.expect("the lease held");
                        guard.release().await;
                        true
                    }
                    Err(LockError::Busy) => false,
                    Err(error) => panic!("tick {tick}: {error}"),
                }
            })
        });
        let fired: Vec<_> = fired.collect();
        let mut skipped = 0;
        for instance in fired {
            let ran = within("the tick ends", PATIENCE, instance).await.unwrap();
            skipped += usize::from(!ran);
        }
        assert_eq!(runs.load(SeqCst), 1, "tick {tick} ran {runs:?} times");
        assert_eq!(skipped, 2, "tick {tick}: {skipped} instances skipped");
    }
    assert!(instances.iter().all(DistributedLocks::is_empty));
}

/// A cache shared by every instance, whose missing entry is rebuilt under its key's
/// lock after a second look (the double-checked read).
#[derive(Default)]
struct Cache {
    entries: Mutex<HashMap<String, Arc<str>>>,
    rebuilds: AtomicUsize,
}

impl Cache {
    async fn get(&self, locks: &DistributedLocks, key: &str) -> Arc<str> {
        if let Some(value) = self.cached(key) {
            return value;
        }
        let guard = locks.lock_timeout(key, STAMPEDE_PATIENCE).await.unwrap();
        let value = match self.cached(key) {
            Some(value) => value,
            None => {
                self.rebuilds.fetch_add(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                let value: Arc<str> = format!("rebuilt {key}").into();
                self.entries
                    .lock()
                    .unwrap()
                    .insert(key.to_owned(), value.clone());
                value
            }
        };
        guard.release().await;
        value
    }

    fn cached(&self, key: &str) -> Option<Arc<str>> {
        self.entries.lock().unwrap().get(key).cloned()
    }
}

/// How long the last of 100 readers may wait: on a polling engine (moto answers one
/// request at a time) the queue drains slowly on a loaded machine, and the test is
/// about one rebuild, not about speed.
const STAMPEDE_PATIENCE: Duration = Duration::from_secs(60);

/// 100 readers on two instances miss one entry at the same moment: one rebuild, and
/// every reader gets its value.
async fn a_stampede_of_misses_rebuilds_once<F: Fixture>() {
    const READERS: usize = 100;
    let fixture = F::start();
    let instances = [fixture.instance("a").await, fixture.instance("b").await];
    let cache = Arc::new(Cache::default());
    let barrier = Arc::new(Barrier::new(READERS));
    let readers: Vec<_> = (0..READERS)
        .map(|reader| {
            let locks = instances[reader % 2].clone();
            let (cache, barrier) = (cache.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                cache.get(&locks, "dashboard:acme").await
            })
        })
        .collect();
    let mut values = Vec::new();
    for reader in readers {
        values.push(within("a reader", STAMPEDE_PATIENCE, reader).await.unwrap());
    }
    assert_eq!(cache.rebuilds.load(SeqCst), 1, "rebuilt more than once");
    assert!(values.iter().all(|value| Arc::ptr_eq(value, &values[0])));
    assert!(instances.iter().all(DistributedLocks::is_empty));
}

/// An instance takes the job and crashes in the middle of it: its runtime stops with
/// the key held, nothing released and nothing renewed, as when a process is killed.
/// Another instance takes the job over within the loss bound, with a higher token.
async fn a_crashed_holder_is_taken_over_after_its_lease<F: Remote + Sync>() {
    let fixture = F::start();
    let survivor = fixture.instance("b").await;
    let crashed_token = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .unwrap();
                let (locks, guard) = runtime.block_on(async {
                    let locks = locks_on(fixture.backend_named("a").await);
                    let guard = locks.try_lock(JOB).await.expect("the job is free");
                    (locks, guard)
                });
                let token = guard.fencing_token();
                // The crash: every task of the instance stops where it is.
                runtime.shutdown_background();
                // Without a runtime, dropping releases nothing at the server.
                drop((guard, locks));
                token
            })
            .join()
            .unwrap()
    });
    let crashed_at = Instant::now();
    let lateness = Lateness::watch();

    let guard = within(
        "the takeover",
        PATIENCE,
        survivor.lock_timeout(JOB, PATIENCE),
    )
    .await
    .expect("the survivor takes the job over");
    let took = crashed_at.elapsed();
    eprintln!(
        "takeover {took:?} after the crash (loss bound {:?})",
        fixture.loss_bound()
    );
    assert!(
        took < lateness.allowing(fixture.loss_bound() + Duration::from_secs(1)),
        "taken over after {took:?}"
    );
    assert!(
        guard.fencing_token() > crashed_token,
        "token {:?} after the crashed holder's {crashed_token:?}",
        guard.fencing_token()
    );
    guard.release().await;
}

/// A job that ends at once, under `hold_at_least`, keeps its key (here and on another
/// instance) until the minimum is over, whether its guard is dropped or released.
async fn a_quick_job_keeps_its_tick_for_hold_at_least<F: Fixture>() {
    const AT_LEAST: Duration = Duration::from_millis(800);
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    for (key, by_release) in [("tick-dropped", false), ("tick-released", true)] {
        let before = Instant::now();
        let mut guard = a.try_lock(key).await.unwrap();
        guard.hold_at_least(AT_LEAST);
        if by_release {
            guard.release().await;
            assert!(
                before.elapsed() >= AT_LEAST,
                "release returned before the minimum"
            );
        } else {
            drop(guard);
        }
        // Whoever takes the key next can do so only once the minimum is over.
        let next = within(key, PATIENCE, async {
            loop {
                match b.try_lock(key).await {
                    Ok(guard) => return guard,
                    Err(LockError::Busy) => tokio::time::sleep(Duration::from_millis(20)).await,
                    Err(error) => panic!("{key}: {error}"),
                }
            }
        })
        .await;
        assert!(
            before.elapsed() >= AT_LEAST,
            "{key}: taken {:?} after the grant, before its minimum hold",
            before.elapsed()
        );
        next.release().await;
    }
}
