//! The check of what a holder that keeps running is owed: its key, for as long as it
//! holds it, however many leases that takes.

use std::time::Duration;

use tokio::time::Instant;

use super::{
    after_a_stall, instance, starting_over_past_a_stall, within, within_for, Deployment, PATIENCE,
};
use crate::{DistributedLocks, LockError};

/// How many waits of another instance the holder outlasts.
const ROUNDS: u32 = 2;

/// One instance holds a key while another waits for it, again and again, each wait a
/// loss bound and a half: time enough to take over a holder whose lease was not kept
/// (a TTL run out, a record unchanged for a lease, a session gone). Every wait ends
/// without the key, the holder is never told its lease is lost, and its checked release
/// finds the lease still its own; then the key is free to the other instance.
///
/// Renewals not answered in time for a whole lease (a machine too loaded to serve
/// them) take the lease away, and the holder is told so, as it must be. The check
/// then starts over on another key, three attempts at most; a grant to the waiter
/// that the holder was not told of fails it at once.
pub async fn renewal_keeps_a_key_held_past_several_leases<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-renewal").await;
    let b = instance(deployment, "conformance-renewal").await;
    let wait = deployment.loss_bound() * 3 / 2;
    let (a, b) = (&a, &b);
    starting_over_past_a_stall(
        "renewal_keeps_a_key_held_past_several_leases",
        |key| async move { unanswered_renewals(a, b, &key, wait).await },
    )
    .await;
}

/// One attempt on `key`: `None` when the holder kept it through every wait of `b`,
/// or how long the holder had held it when told its lease was lost after a stall
/// (see `after_a_stall`).
async fn unanswered_renewals(
    a: &DistributedLocks,
    b: &DistributedLocks,
    key: &str,
    wait: Duration,
) -> Option<Duration> {
    let held = within("a free key's lock", a.lock(key))
        .await
        .expect("conformance: the first instance takes a free key");
    let granted = Instant::now();
    for round in 1..=ROUNDS {
        let waiting = Instant::now();
        let outcome = within_for(
            "a wait for a held key",
            wait + PATIENCE,
            b.lock_timeout(key, wait),
        )
        .await;
        match outcome {
            Err(LockError::Timeout) => {}
            // A wait that ran out while its last look at the engine went unanswered (a
            // loaded machine) ends with that failure: not granted all the same.
            Err(LockError::Backend(_)) if waiting.elapsed() >= wait => {}
            Ok(taken) => {
                let after = granted.elapsed();
                match held.lost_reason() {
                    Some(reason) if after_a_stall(reason) => {
                        within("a release", taken.release()).await;
                        drop(held);
                        return Some(after);
                    }
                    reason => panic!(
                        "conformance: another instance was granted a held key {after:?} \
                         after the grant (wait {round} of {ROUNDS}): the holder's lease was \
                         not kept, and the holder was told {reason:?}"
                    ),
                }
            }
            Err(error) => panic!("conformance: a wait for a held key failed: {error}"),
        }
        match held.lost_reason() {
            None => {}
            Some(reason) if after_a_stall(reason) => return Some(granted.elapsed()),
            Some(reason) => panic!(
                "conformance: a running holder was told its lease is lost ({reason:?}) {:?} \
                 after the grant",
                granted.elapsed()
            ),
        }
    }
    let kept = granted.elapsed();
    if let Err(lost) = within("a checked release", held.release_checked()).await {
        match lost.reason() {
            reason if after_a_stall(reason) => return Some(kept),
            reason => panic!(
                "conformance: the release of a lease held {kept:?} found it lost ({reason:?})"
            ),
        }
    }
    let next = within("the next holder", b.lock_timeout(key, PATIENCE))
        .await
        .expect("conformance: a released key is free to another instance");
    tracing::info!(?kept, "conformance: a key kept past several leases");
    within("a release", next.release()).await;
    None
}
