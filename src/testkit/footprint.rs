//! The check of the lock server's footprint: what stays on the server after keys are
//! released.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::{instance, within, Deployment, PATIENCE};

/// How many distinct keys [`released_keys_leave_no_records`] locks and releases when
/// the environment variable `FOOTPRINT_KEYS` does not say (the long run sets 100 000).
pub const FOOTPRINT_KEYS: usize = 1_000;

/// The most records the check's namespace may keep once every key is released and the
/// record window has passed. Two covers a namespace-wide fencing counter (a counter row
/// or item) and a namespace node that stays while it has been in use; anything kept
/// per key released exceeds it as soon as more than two keys were used.
pub const MOST_RECORDS_AT_REST: usize = 2;

/// How many keys the check has in flight at once: enough to be done within seconds on
/// a slow emulator, few enough that an emulator on a loaded machine answers each call
/// within a command timeout.
const IN_FLIGHT: usize = 8;

/// The check's lock name: [`Deployment::records`] counts under it.
const NAME: &str = "conformance-footprint";

/// The lock server's state follows the keys in use, not the keys ever locked: one
/// instance locks and releases `FOOTPRINT_KEYS` (default [`FOOTPRINT_KEYS`]) distinct
/// keys, eight at a time; once the deployment's
/// [`record_window`](Deployment::record_window) has passed after the last release, the
/// namespace holds at most [`MOST_RECORDS_AT_REST`] records
/// ([`Deployment::records`]). First, a held key must count (at least one record), so a
/// deployment that counts nothing cannot pass. While the window runs the count may be anything; the
/// check looks again until a [`PATIENCE`] past the window, so a server that deletes in
/// batches (ZooKeeper's container sweep) passes once its batch ran.
pub async fn released_keys_leave_no_records<D: Deployment>(deployment: &D) {
    let keys = std::env::var("FOOTPRINT_KEYS")
        .ok()
        .map(|keys| keys.parse().expect("FOOTPRINT_KEYS is a number of keys"))
        .unwrap_or(FOOTPRINT_KEYS);
    let locks = instance(deployment, NAME).await;
    // The count sees a held key: a deployment that counts nothing fails here.
    let held = within("a held key's lock", locks.lock("held"))
        .await
        .expect("conformance: locking a key failed");
    let while_held = within("counting the records", deployment.records(NAME)).await;
    assert!(
        while_held >= 1,
        "conformance: Deployment::records counts no record while a key is held"
    );
    within("a release", held.release()).await;
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let started = Instant::now();
    // The first failure stops the run: no more keys are started after it.
    let failure: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let mut tasks = Vec::with_capacity(keys);
    for n in 0..keys {
        let slot = slots.clone().acquire_owned().await.expect("never closed");
        if failure.lock().unwrap().is_some() {
            break;
        }
        let (locks, failure) = (locks.clone(), failure.clone());
        tasks.push(tokio::spawn(async move {
            let _slot = slot;
            let key = format!("released-{n}");
            let failed =
                match tokio::time::timeout(PATIENCE, locks.lock_timeout(&key, PATIENCE)).await {
                    Ok(Ok(guard)) => {
                        within("a release", guard.release()).await;
                        return;
                    }
                    Ok(Err(error)) => format!("locking {key:?} failed: {error}"),
                    Err(_) => format!("locking {key:?} took over {PATIENCE:?}"),
                };
            failure.lock().unwrap().get_or_insert(failed);
        }));
    }
    for task in tasks {
        task.await.expect("a lock and release panicked");
    }
    if let Some(failed) = failure.lock().unwrap().take() {
        panic!("conformance: {failed}");
    }
    let released = Instant::now();
    let window = deployment.record_window();
    let mut at_window = None;
    tokio::time::sleep(window).await;
    loop {
        let records = within("counting the records", deployment.records(NAME)).await;
        at_window.get_or_insert(records);
        if records <= MOST_RECORDS_AT_REST {
            tracing::info!(
                keys,
                records,
                at_window = at_window.unwrap_or(records),
                locked_in = ?(released - started),
                at_rest_after = ?released.elapsed(),
                "footprint: released keys left no records"
            );
            return;
        }
        assert!(
            released.elapsed() < window + PATIENCE,
            "conformance: {records} records stay on the server {:?} after {keys} keys \
             were locked and released (record window {window:?}; at most \
             {MOST_RECORDS_AT_REST} allowed)",
            released.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
