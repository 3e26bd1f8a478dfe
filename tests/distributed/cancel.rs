//! A `DistributedAcquire` dropped at each of its awaits — queued in process, after the
//! local grant, waiting at the backend, right after the remote grant — leaves nothing
//! held: the other instance takes the key within a bounded time and the local table is
//! empty. On a real Redis and PostgreSQL, and in process.

// Without a backend feature, the bodies for remote fixtures have nothing to run on.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

use std::task::Poll;
use std::time::{Duration, Instant};

use tower_keyed_lock::LockError;

use crate::support::fixtures::{
    eventually, locks_on, poll_once, state, wait_free, Counting, Fixture, Remote, FREED_WITHIN,
    PATIENCE,
};

for_each_fixture!(
    all: [
        dropped_while_queued_in_process,
        dropped_after_the_local_grant,
        dropped_at_any_moment,
        release_dropped_midway,
    ],
    remote: [
        dropped_while_waiting_at_the_backend,
        dropped_right_after_the_remote_grant,
    ],
);

/// Queued behind a holder of the same instance, then dropped.
async fn dropped_while_queued_in_process<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);

    let holder = a.lock("job").await.unwrap();
    let mut queued = a.lock("job");
    assert!(poll_once(&mut queued).is_pending());
    assert_eq!(state(&queued), "local");
    drop(queued);
    assert_eq!(a.len(), 1, "only the holder's key is left");

    holder.release().await;
    wait_free(&b, "job", FREED_WITHIN).await;
    assert!(a.is_empty() && b.is_empty());
}

/// The holder hands its local permit to a queued acquisition, which is dropped before it
/// runs again (the leak of every other keyed-lock crate).
async fn dropped_after_the_local_grant<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);

    let holder = a.lock("job").await.unwrap();
    let mut queued = a.lock("job");
    assert!(poll_once(&mut queued).is_pending());
    holder.release().await;
    // The permit is the queued acquisition's now, although it has not seen it.
    assert!(matches!(a.try_lock("job").await, Err(LockError::Busy)));
    assert_eq!(state(&queued), "local");
    drop(queued);

    assert!(a.is_empty(), "the handed-over permit leaked");
    wait_free(&b, "job", FREED_WITHIN).await;
    assert!(a.is_empty() && b.is_empty());
}

/// Waiting at the backend for another instance's key, then dropped: when that key is
/// released, the detached attempt may still win it, and must give it back.
async fn dropped_while_waiting_at_the_backend<F: Remote>() {
    let fixture = F::start();
    let counting = Counting::new(fixture.backend_named("a").await);
    let a = locks_on(counting.clone());
    let b = fixture.instance("b").await;

    let holder = b.lock("job").await.unwrap();
    let mut waiting = a.lock("job");
    assert!(poll_once(&mut waiting).is_pending());
    assert_eq!(state(&waiting), "remote");
    eventually("the attempt is at the backend", || {
        counting.in_flight() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(waiting);
    assert!(a.is_empty(), "the local key outlived the acquisition");

    holder.release().await;
    let took = wait_free(&b, "job", FREED_WITHIN).await;
    eprintln!("the key was free again {took:?} after the holder released it");
    // The detached attempt ended (given up or granted and given back).
    eventually("the detached attempt ends", || counting.in_flight() == 0).await;
    wait_free(&a, "job", FREED_WITHIN).await;
    assert!(a.is_empty() && b.is_empty());
}

/// The backend granted the key, but the acquisition is dropped before it saw the
/// grant: polled until its attempt was sent, it is not polled while the server grants
/// it, and its drop moves the attempt into a task of its own, which takes the answer
/// and gives the grant back.
async fn dropped_right_after_the_remote_grant<F: Remote>() {
    let fixture = F::start();
    let counting = Counting::new(fixture.backend_named("a").await);
    let a = locks_on(counting.clone());
    let b = fixture.instance("b").await;

    let mut unclaimed = 0;
    for _ in 0..20 {
        let calls = counting.calls();
        let mut granted = a.lock("job");
        let seen = tokio::time::timeout(PATIENCE, async {
            loop {
                if let Poll::Ready(result) = poll_once(&mut granted) {
                    // The answer came within a poll: the grant was claimed, not the
                    // case looked for here.
                    result.unwrap().release().await;
                    return false;
                }
                // Read without taking the key: only this acquisition asks for it.
                if b.holder("job").await.unwrap().is_some() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        if !seen.await.expect("the attempt is granted or answered") {
            continue;
        }
        assert_eq!(state(&granted), "remote");
        assert_eq!(counting.calls(), calls + 1);
        // Held at the backend by an acquisition that does not know it yet.
        assert!(matches!(b.try_lock("job").await, Err(LockError::Busy)));
        drop(granted);
        assert!(a.is_empty());

        let took = wait_free(&b, "job", FREED_WITHIN).await;
        eprintln!("an unclaimed grant was given back within {took:?}");
        eventually("the detached attempt ends", || counting.in_flight() == 0).await;
        unclaimed += 1;
        if unclaimed == 5 {
            break;
        }
    }
    assert_eq!(unclaimed, 5, "too few grants raced the drop");
    assert!(a.is_empty() && b.is_empty());
}

/// Dropped after 0, 1, 2, 4 ... 64 steps of a sixteenth of one uncontended grant as
/// this test measured it (at least 1 ms), with the key free or held by the other
/// instance for part of the time: whatever await it was at, nothing stays held. The
/// steps scale with the engine and the machine's load, so that some acquisitions are
/// cut short and some finish.
async fn dropped_at_any_moment<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let mut finished = 0;
    a.lock("job").await.unwrap().release().await;
    let started = Instant::now();
    a.lock("job").await.unwrap().release().await;
    let step = (started.elapsed() / 16).max(Duration::from_millis(1));

    for contended in [false, true] {
        for steps in [0, 1, 2, 4, 8, 16, 32, 64] {
            let holder = match contended {
                true => Some(b.lock("job").await.unwrap()),
                false => None,
            };
            // Dropped after 0 ms, the acquisition is cut short: the holder keeps the key
            // until then, however late the scheduler first polls the acquisition.
            let (timed, after) = match steps {
                0 => (None, holder),
                _ => (holder, None),
            };
            let delay = step * steps;
            let release_after = (delay / 2).max(Duration::from_millis(1));
            let release = tokio::spawn(async move {
                tokio::time::sleep(release_after).await;
                if let Some(holder) = timed {
                    holder.release().await;
                }
            });
            if let Ok(result) = tokio::time::timeout(delay, a.lock("job")).await {
                // Done before the deadline: the guard drops here.
                drop(result.unwrap());
                finished += 1;
            }
            if let Some(holder) = after {
                holder.release().await;
            }
            release.await.unwrap();
            wait_free(&b, "job", fixture.freed_within()).await;
            eventually("the table is empty", || a.is_empty() && b.is_empty()).await;
        }
    }
    // Some acquisitions were cut short, some not: both paths were taken.
    assert!(finished > 0 && finished < 16, "{finished} of 16 finished");
}

/// `release().await` is an await of its own: dropped after its first poll, or after
/// 0, 1, 2 ... ms, the key is still given back, remotely and locally.
async fn release_dropped_midway<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);

    for delay_ms in [None, Some(0), Some(1), Some(2), Some(4), Some(8)] {
        let guard = a.lock("job").await.unwrap();
        match delay_ms {
            None => {
                let _ = poll_once(&mut Box::pin(guard.release()));
                // Dropped after one poll: what it sent is answered, and nobody reads it.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Some(ms) => {
                let _ = tokio::time::timeout(Duration::from_millis(ms), guard.release()).await;
            }
        }
        wait_free(&b, "job", FREED_WITHIN).await;
        eventually("the table is empty", || a.is_empty()).await;
    }
}

/// The release script is not in Redis's script cache (after a failover, or `SCRIPT
/// FLUSH`), so releasing takes a second round trip; the release is dropped between the
/// two, and must still happen.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_release_dropped_during_a_script_reload() {
    let fixture = <crate::support::fixtures::Redis as Fixture>::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let mut admin = fixture
        .0
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();

    let mut cut_short = 0;
    for _ in 0..10 {
        let guard = a.lock("job").await.unwrap();
        ::redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async::<()>(&mut admin)
            .await
            .unwrap();
        let mut release = Box::pin(guard.release());
        if poll_once(&mut release).is_pending() {
            cut_short += 1;
        }
        // The first attempt is answered with NOSCRIPT; nobody polls for the retry.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(release);
        wait_free(&b, "job", FREED_WITHIN).await;
        eventually("the table is empty", || a.is_empty()).await;
    }
    // Nearly always: a release needs a round trip, and its answer comes in 50 ms.
    assert!(cut_short > 0, "every release ended within its first poll");
}
