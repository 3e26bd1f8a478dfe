//! The check of what a holder that keeps running is owed: its key, for as long as it
//! holds it, however many leases that takes.

use tokio::time::Instant;

use super::{instance, within, within_for, Deployment, PATIENCE};
use crate::LockError;

/// How many waits of another instance the holder outlasts.
const ROUNDS: u32 = 2;

/// One instance holds a key while another waits for it, again and again, each wait a
/// loss bound and a half: time enough to take over a holder whose lease was not kept
/// (a TTL run out, a record unchanged for a lease, a session gone). Every wait ends
/// without the key, the holder is never told its lease is lost, and its checked release
/// finds the lease still its own; then the key is free to the other instance.
pub async fn renewal_keeps_a_key_held_past_several_leases<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-renewal").await;
    let b = instance(deployment, "conformance-renewal").await;
    let wait = deployment.loss_bound() * 3 / 2;
    let held = within("a free key's lock", a.lock("k"))
        .await
        .expect("conformance: the first instance takes a free key");
    let granted = Instant::now();
    for round in 1..=ROUNDS {
        let waiting = Instant::now();
        let outcome = within_for(
            "a wait for a held key",
            wait + PATIENCE,
            b.lock_timeout("k", wait),
        )
        .await;
        match outcome {
            Err(LockError::Timeout) => {}
            // A wait that ran out while its last look at the engine went unanswered (a
            // loaded machine) ends with that failure: not granted all the same.
            Err(LockError::Backend(_)) if waiting.elapsed() >= wait => {}
            Ok(_) => panic!(
                "conformance: another instance was granted a held key {:?} after the grant \
                 (wait {round} of {ROUNDS}): the holder's lease was not kept",
                granted.elapsed()
            ),
            Err(error) => panic!("conformance: a wait for a held key failed: {error}"),
        }
        assert!(
            !held.is_lost(),
            "conformance: a running holder was told its lease is lost {:?} after the grant",
            granted.elapsed()
        );
    }
    let kept = granted.elapsed();
    if let Err(lost) = within("a checked release", held.release_checked()).await {
        panic!(
            "conformance: the release of a lease held {kept:?} found it lost ({:?})",
            lost.reason()
        );
    }
    let next = within("the next holder", b.lock_timeout("k", PATIENCE))
        .await
        .expect("conformance: a released key is free to another instance");
    tracing::info!(?kept, "conformance: a key kept past several leases");
    within("a release", next.release()).await;
}
