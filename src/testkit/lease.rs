//! Checks of what a holder that stops is owed: a stalled holder learns by the clock
//! that its lease is gone, and a crashed holder's key comes back.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;

use super::isolated::Isolated;
use super::mutual::eventually_free;
use super::{
    after_a_stall, instance, starting_over_past_a_stall, taken_after_crash, within, Deployment,
    PATIENCE,
};
use crate::backend::LostReason;
use crate::{DistributedGuard, DistributedLocks};

/// The holder's runtime stalls (none of its tasks runs: no renewal, no signal raised by
/// a task) until another instance has taken the key. When the holder looks again,
/// `is_lost()` must say so by the clock alone, and `run_while_held` must refuse to
/// start work.
pub async fn a_stalled_holder_sees_its_lease_lost<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-stall").await;
    let b = instance(deployment, "conformance-stall").await;
    let loss_bound = deployment.loss_bound();
    let isolated = Isolated::start();
    let guard = isolated
        .run(move |runtime| runtime.block_on(a.lock("k")))
        .await
        .expect("the first instance takes a free key");
    let guard: Arc<Mutex<Option<DistributedGuard>>> = Arc::new(Mutex::new(Some(guard)));
    let (b_holds, b_held) = mpsc::channel::<()>();
    let looked = isolated.run({
        let guard = guard.clone();
        move |runtime| {
            // The thread blocks, so its runtime stalls until the other instance holds.
            let b_granted = b_held.recv_timeout(2 * PATIENCE + loss_bound).is_ok();
            let _context = runtime.enter();
            let guard = guard.lock().unwrap_or_else(|e| e.into_inner());
            let guard = guard.as_ref().expect("held");
            let ran = AtomicBool::new(false);
            let refused = poll_to_end(guard.run_while_held(async { ran.store(true, SeqCst) }));
            (b_granted, guard.is_lost(), refused, ran.load(SeqCst))
        }
    });
    // The holder's lease runs out first: a backend whose shortest lease is longer than
    // the patience (Azure's 15 s) gets that long on top.
    let takeover = PATIENCE + loss_bound;
    let taken = tokio::time::timeout(takeover, b.lock_timeout("k", takeover))
        .await
        .unwrap_or_else(|_| {
            panic!("conformance: the takeover of a stalled holder's key did not happen within {takeover:?}")
        })
        .expect("conformance: another instance could not take a stalled holder's key");
    let _ = b_holds.send(());
    let (b_granted, lost, refused, ran) = looked.await;
    assert!(b_granted, "the stalled holder did not hear of the takeover");
    assert!(
        lost,
        "conformance: another instance holds the key, and the stalled holder's is_lost() says false"
    );
    assert_eq!(
        refused.map_err(|lost| lost.reason()),
        Err(LostReason::Expired),
        "conformance: run_while_held ran on a lost lease, or a stalled holder's lease was not lost by its deadline (nothing failed: the holder stalled)"
    );
    assert!(
        !ran,
        "conformance: run_while_held started work on a lost lease"
    );
    let guard = guard.lock().unwrap_or_else(|e| e.into_inner()).take();
    isolated
        .run(move |runtime| runtime.block_on(async move { drop(guard) }))
        .await;
    taken.release().await;
    isolated.kill();
}

/// The holder's process dies (its runtime is dropped, its guard never released).
/// Another instance that only ever waits 300 ms at a time still gets the key once the
/// loss bound has passed: what was seen of the dead holder is not forgotten between
/// acquisitions.
pub async fn a_crashed_holder_is_taken_over<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-crash").await;
    let b = instance(deployment, "conformance-crash").await;
    let crashed = crash_holding(a, "k").await;
    let limit = deployment.loss_bound() + PATIENCE;
    let taken = taken_after_crash(&b, "k", crashed, limit, "a crashed holder's key").await;
    taken.release().await;
}

/// Takes `key` with `locks` on a runtime of its own, then kills that runtime, the guard
/// never released: a holder's process that died. Returns when it died.
pub(super) async fn crash_holding(locks: DistributedLocks, key: &'static str) -> Instant {
    let isolated = Isolated::start();
    isolated
        .run(move |runtime| std::mem::forget(runtime.block_on(locks.lock(key)).unwrap()))
        .await;
    isolated.kill();
    Instant::now()
}

/// A holder keeps its key past a renewal, then releases it: nothing of that lease
/// renews the key afterwards (a renewal that outlives its release is a bug large
/// clients have shipped). Another instance then holds the key for a whole loss bound
/// without being told its lease is lost; once it releases, the key is free to either
/// instance, and still is a third of a loss bound later. (Renewals of the next holder
/// not answered in time, its loss signalled to it, start the check over on another
/// key, three attempts at most.)
pub async fn a_released_lease_is_never_renewed<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-renewed").await;
    let b = instance(deployment, "conformance-renewed").await;
    let loss_bound = deployment.loss_bound();
    let (a, b) = (&a, &b);
    starting_over_past_a_stall("a_released_lease_is_never_renewed", |key| async move {
        released_then_held_again(a, b, &key, loss_bound).await
    })
    .await;
}

/// One attempt on `key`: `None` when the next holder kept the key for a loss bound
/// and it was free after, or how long the next holder held it when told its lease was
/// lost after a stall (see `after_a_stall`).
async fn released_then_held_again(
    a: &DistributedLocks,
    b: &DistributedLocks,
    key: &str,
    loss_bound: Duration,
) -> Option<Duration> {
    let held = within("a free key's lock", a.lock(key))
        .await
        .expect("conformance: the first instance takes a free key");
    // Past the first renewal (a lease is renewed every third of it).
    tokio::time::sleep(loss_bound / 2).await;
    assert!(
        !held.is_lost(),
        "conformance: a held lease was lost within half the loss bound"
    );
    within("a release", held.release()).await;
    let next = within("the next holder", b.lock_timeout(key, PATIENCE))
        .await
        .expect("conformance: a released key is free to another instance");
    let granted = Instant::now();
    // Any renewal of the released lease would land within this time.
    tokio::time::sleep(loss_bound).await;
    match next.lost_reason() {
        None => {}
        Some(reason) if after_a_stall(reason) => {
            within("a release", next.release()).await;
            return Some(granted.elapsed());
        }
        Some(reason) => panic!(
            "conformance: the next holder lost its lease ({reason:?}) while a released one \
             could renew"
        ),
    }
    within("a release", next.release()).await;
    let limit = (loss_bound / 2).max(Duration::from_millis(100));
    for locks in [a, b] {
        eventually_free(locks, key, limit, loss_bound * 9 / 10).await;
        tokio::time::sleep(loss_bound / 3).await;
    }
    None
}

/// Polls `future` to its end on this thread, without driving any runtime.
fn poll_to_end<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
        std::thread::yield_now();
    }
}
