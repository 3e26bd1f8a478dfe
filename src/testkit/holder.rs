//! The check of read-only inspection: who holds a key (`DistributedLocks::holder`).

use std::time::{Duration, Instant, SystemTime};

use super::{instance, within, Deployment};
use crate::LockError;

/// Inspection tells the truth and changes nothing: a free key has no holder; a held
/// key names the holder's instance id and the guard's fencing token, granted not in the
/// future; after the release there is no holder again (a lease later at most, if the
/// release gave up); and reading never takes the
/// key (another instance's `try_lock` right after it succeeds) nor keeps it (the key is
/// free at once after its holder releases it, however often it was read).
pub async fn the_holder_is_read_without_taking_the_key<D: Deployment>(deployment: &D) {
    const KEY: &str = "inspected";
    let a = instance(deployment, "conformance-holder").await;
    let b = instance(deployment, "conformance-holder").await;
    let read = |locks: &crate::DistributedLocks| {
        let locks = locks.clone();
        async move {
            match within("reading the holder", locks.holder(KEY)).await {
                Ok(holder) => holder,
                Err(LockError::Unsupported(what)) => {
                    panic!("conformance: the backend does not support {what}")
                }
                Err(error) => panic!("conformance: reading the holder failed: {error}"),
            }
        }
    };

    assert_eq!(read(&b).await, None, "conformance: a free key has a holder");
    // Reading took nothing: another instance gets the key at once.
    let before = SystemTime::now();
    let guard = within("try_lock after a read", a.try_lock(KEY))
        .await
        .expect("conformance: a read of the holder left the key taken");

    for _ in 0..3 {
        let holder = read(&b)
            .await
            .expect("conformance: a held key reads as free from another instance");
        assert_eq!(
            holder.instance(),
            Some(deployment.instance_id().as_str()),
            "conformance: the holder is not the instance that holds the key ({holder})"
        );
        if let Some(token) = guard.fencing_token() {
            assert_eq!(
                holder.fencing_token(),
                Some(token),
                "conformance: the holder's fencing token is not the guard's ({holder})"
            );
        }
        if let Some(since) = holder.since() {
            // Engines record whole milliseconds (some whole seconds): a second of slack.
            assert!(
                since <= SystemTime::now() + Duration::from_secs(1),
                "conformance: the holder was granted in the future ({holder})"
            );
            assert!(
                since + Duration::from_secs(1) >= before,
                "conformance: the holder's grant time is older than the grant ({holder})"
            );
        }
    }
    assert!(
        matches!(b.try_lock(KEY).await, Err(LockError::Busy)),
        "conformance: another instance took a held key"
    );

    within("the release", guard.release()).await;
    // No holder once the release is through. A release that gave up (its command
    // unanswered on a loaded machine) leaves the record to its lease, and no longer.
    let released = Instant::now();
    while read(&b).await.is_some() {
        assert!(
            released.elapsed() <= deployment.loss_bound() + Duration::from_secs(1),
            "conformance: a released key still has a holder a lease later"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing read above kept the key: it is free at once.
    let again = within("try_lock after the release", b.try_lock(KEY))
        .await
        .expect("conformance: reading the holder kept the key held");
    assert_eq!(
        read(&a).await.map(|h| h.fencing_token()),
        Some(again.fencing_token())
    );
    within("the release", again.release()).await;
}
