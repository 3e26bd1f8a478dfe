//! The check of what an acquisition says of its contention
//! ([`DistributedGuard::contended`](crate::DistributedGuard::contended)), which the
//! `contended` label of the acquisitions metric counts.

use std::time::{Duration, Instant};

use super::{instance, within, Deployment, PATIENCE};

/// An acquisition granted only after another instance released the key says it was
/// contended; acquisitions of free keys say they were not. Of three on fresh keys one
/// at least: an attempt may fail in passing and be tried again, which counts as
/// contention too, while a backend that calls every grant contended fails.
pub async fn contention_is_reported<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-contention").await;
    let b = instance(deployment, "conformance-contention").await;

    let mut slowest = Duration::ZERO;
    let mut uncontended = 0;
    for key in ["free-1", "free-2", "free-3"] {
        let started = Instant::now();
        let guard = within("a lock on a free key", b.lock_timeout(key, PATIENCE))
            .await
            .expect("conformance: a free key was refused");
        slowest = slowest.max(started.elapsed());
        uncontended += usize::from(!guard.contended());
        within("the release", guard.release()).await;
    }
    assert!(
        uncontended > 0,
        "conformance: three acquisitions of free keys, each on its first try as far as \
         the caller could tell, all said they were contended"
    );

    let held = within("a lock on a free key", a.lock_timeout("held", PATIENCE))
        .await
        .expect("conformance: a free key was refused");
    let waiter = tokio::spawn(async move { b.lock_timeout("held", 3 * PATIENCE).await });
    // The waiter's first attempt has reached the engine long before the release: ten
    // times its slowest uncontended acquisition above, and 50 ms.
    let margin = (slowest * 10 + Duration::from_millis(50)).min(PATIENCE / 2);
    tokio::time::sleep(margin).await;
    within("the release", held.release()).await;
    let granted = within("the hand-over to the waiting instance", waiter)
        .await
        .expect("the waiting task panicked")
        .expect("conformance: the waiter was not granted the released key");
    assert!(
        granted.contended(),
        "conformance: an acquisition granted only after another instance released the \
         key ({margin:?} after it began waiting) said it was not contended"
    );
    within("the release", granted.release()).await;
}
