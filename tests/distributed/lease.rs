//! `DistributedGuard::run_while_held`: the work runs to its end while the lease holds
//! (renewed past its length), and is dropped, with `Err(LeaseLost)`, when the lease
//! runs out unrenewed or the server dies. On a real Redis, PostgreSQL and DynamoDB.
//! A holder that stalls or crashes is the conformance suite's
//! (`tests/backends/conformance.rs`).

// Without a backend feature, the bodies for remote fixtures have nothing to run on.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tower_keyed_lock::backend::LostReason;

use crate::support::fixtures::{wait_free, within, Fixture, Remote, FREED_WITHIN, PATIENCE};

for_each_fixture!(
    all: [
        work_under_a_held_lease_runs_to_the_end,
        dropped_run_while_held_keeps_the_key,
    ],
    remote: [],
    alone: [work_stops_when_the_server_dies],
);

/// Set when the work future is dropped.
#[derive(Clone, Default)]
struct Dropped(Arc<AtomicBool>);

impl Dropped {
    fn get(&self) -> bool {
        self.0.load(SeqCst)
    }
}

/// Lives in the work future; its drop is the work's cancellation.
struct DropProbe(Dropped);

impl Drop for DropProbe {
    fn drop(&mut self) {
        (self.0).0.store(true, SeqCst);
    }
}

/// Work that announces it started and never ends by itself.
async fn endless_work(dropped: Dropped, started: Arc<Notify>) {
    let _probe = DropProbe(dropped);
    started.notify_one();
    std::future::pending::<()>().await;
}

/// Longer than the Redis lease of the fixture (1 s), so it only ends well if the lease
/// is renewed.
async fn work_under_a_held_lease_runs_to_the_end<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let guard = a.lock("rollup").await.unwrap();

    let output = guard
        .run_while_held(async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            42
        })
        .await;
    assert_eq!(output, Ok(42));
    assert!(!guard.is_lost());
    assert!(matches!(
        b.try_lock("rollup").await,
        Err(tower_keyed_lock::LockError::Busy)
    ));
    guard.release().await;
    wait_free(&b, "rollup", FREED_WITHIN).await;
}

/// `run_while_held` dropped before the work ends (a caller's timeout): the work is
/// dropped with it, and the key stays held until the guard goes.
async fn dropped_run_while_held_keeps_the_key<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let guard = a.lock("rollup").await.unwrap();
    let (dropped, started) = (Dropped::default(), Arc::new(Notify::new()));

    let work = guard.run_while_held(endless_work(dropped.clone(), started.clone()));
    let cut = tokio::time::timeout(Duration::from_millis(50), work).await;
    assert!(cut.is_err(), "endless work ended: {cut:?}");
    assert!(dropped.get(), "the work future outlived run_while_held");
    assert!(!guard.is_lost());
    assert!(matches!(
        b.try_lock("rollup").await,
        Err(tower_keyed_lock::LockError::Busy)
    ));
    guard.release().await;
    wait_free(&b, "rollup", FREED_WITHIN).await;
}

/// The server is killed while the work runs: the lease is declared lost within the
/// backend's bound and the work is dropped.
async fn work_stops_when_the_server_dies<F: Remote>() {
    let mut fixture = F::start();
    let a = fixture.instance("a").await;
    let guard = a.lock("rollup").await.unwrap();
    let (dropped, started) = (Dropped::default(), Arc::new(Notify::new()));

    let running = tokio::spawn({
        let (dropped, started) = (dropped.clone(), started.clone());
        async move {
            let result = guard.run_while_held(endless_work(dropped, started)).await;
            (result, guard.is_lost())
        }
    });
    within("the work starts", PATIENCE, started.notified()).await;
    assert!(!dropped.get());
    fixture.kill();
    let killed = Instant::now();

    let bound = fixture.loss_bound() + Duration::from_millis(500);
    let (result, lost) = within("the loss is noticed", bound, running).await.unwrap();
    let took = killed.elapsed();
    // Renewals went unanswered (or the lock's connection broke) until the deadline; on
    // a loaded machine the deadline by the clock alone can come first.
    let reason = result.map(|_| ()).map_err(|lost| lost.reason());
    assert!(
        matches!(reason, Err(LostReason::Unreachable | LostReason::Expired)),
        "{reason:?}"
    );
    assert!(lost);
    assert!(dropped.get(), "the work future was not dropped");
    eprintln!(
        "the lease was declared lost {took:?} after the server was killed (bound {:?})",
        fixture.loss_bound()
    );
}

/// Redis with renewal off and a 300 ms lease: the work is stopped at the lease's local
/// deadline, and the other instance can take the key from then on (Redis let it
/// expire). The late holder's release does not free the new holder's key.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_work_stops_when_an_unrenewed_lease_runs_out() {
    use tower_keyed_lock::{LockError, RedisBackend};

    let fixture = <crate::support::fixtures::Redis as Fixture>::start();
    let lease = Duration::from_millis(300);
    let unrenewed = RedisBackend::builder(fixture.0.client())
        // A server started for this run: no instance can hold a key it lost.
        .restart_guard(false)
        .lease(lease)
        .renewal(false)
        .build()
        .await
        .unwrap();
    let a = crate::support::fixtures::locks_on(Arc::new(unrenewed));
    let b = fixture.instance("b").await;
    let (dropped, started) = (Dropped::default(), Arc::new(Notify::new()));

    let granted = Instant::now();
    let lateness = crate::support::lateness::Lateness::watch();
    let guard = a.lock("rollup").await.unwrap();
    let result = within(
        "the lease runs out",
        PATIENCE,
        guard.run_while_held(endless_work(dropped.clone(), started)),
    )
    .await;
    let took = granted.elapsed();
    // Nothing failed: the lease ran out as configured.
    assert_eq!(
        result.map_err(|lost| lost.reason()),
        Err(LostReason::Expired)
    );
    assert_eq!(guard.lost_reason(), Some(LostReason::Expired));
    assert!(dropped.get(), "the work future was not dropped");
    assert!(guard.is_lost());
    within("lost() resolves", PATIENCE, guard.lost()).await;
    assert!(
        took < lateness.allowing(lease + Duration::from_millis(200)),
        "lost after {took:?}"
    );
    // Never sooner: the acquire went out after `granted`, and its deadline is the lease
    // less the default drift margin (1% + 2 ms) from then.
    let deadline = lease - (lease / 100 + Duration::from_millis(2));
    assert!(took >= deadline, "lost after {took:?}, before {deadline:?}");
    eprintln!("an unrenewed {lease:?} lease was declared lost after {took:?}");
    // A lost lease stops new work at once, without running it.
    let ran = AtomicBool::new(false);
    let late = guard
        .run_while_held(async { ran.store(true, SeqCst) })
        .await;
    assert_eq!(late.map_err(|lost| lost.reason()), Err(LostReason::Expired));
    assert!(!ran.load(SeqCst));

    // Redis expires the key at the lease (the local deadline came a drift margin
    // earlier): the other instance takes over.
    let taken = within("b takes over", PATIENCE, b.lock("rollup"))
        .await
        .unwrap();
    let takeover = granted.elapsed();
    assert!(
        takeover < lease + Duration::from_millis(500),
        "after {takeover:?}"
    );
    // The late holder gives up: its release must leave the new holder's key alone.
    guard.release().await;
    assert!(matches!(
        fixture.instance("c").await.try_lock("rollup").await,
        Err(LockError::Busy)
    ));
    taken.release().await;
}
