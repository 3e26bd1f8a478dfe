//! What the Azure Blob backend promises beyond the conformance suite, on Azurite:
//! exclusion across instances, a crashed holder's blob taken over one lease later, a
//! lease broken by an operator signalled to its holder, Azurite killed mid-hold, fencing
//! tokens across holders and across a deleted blob, and the blob names seen from Azure.
//!
//! Azure's shortest lease is 15 s: the four checks that wait one out run at once, in
//! one test (`crashed_broken_and_cut_off_holders_within_one_lease`, about 17 s).
#![cfg(feature = "azure-blob")]
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use azure_storage_blob::models::{
    BlobClientBreakLeaseOptions, BlobClientGetPropertiesResultHeaders,
};
use tokio::time::{sleep, Instant};
use tower_keyed_lock::backend::azure_blob::AzureBlobBackend;
use tower_keyed_lock::{DistributedLocks, LockError};

use crate::support::fixtures::{self as servers, locks_on, within, Fixture, Remote, PATIENCE};

const LEASE: Duration = servers::AZURE_LEASE;

/// The fixture's server, and a backend on it for looking at blobs.
async fn start() -> (servers::AzureBlob, AzureBlobBackend) {
    let fixture = servers::AzureBlob::start();
    let probe = fixture.azure_backend().await;
    (fixture, probe)
}

/// How long after a grant Azure's clock is surely past its token, with the fixture's
/// command timeout: two command timeouts and the clock's doubt (under a second). Tokens
/// go up across a blob or container deleted by hand after that (module docs, "Blobs
/// deleted by hand").
const PAST_A_TOKEN: Duration =
    Duration::from_millis(2 * servers::GENEROUS_TIMEOUT.as_millis() as u64 * 101 / 100 + 1_100);

/// The properties of the blob of `key` (the fixture's layer name), as Azure has them.
async fn blob_fence(probe: &AzureBlobBackend, key: &str) -> Option<u64> {
    let blob = probe
        .container()
        .blob_client(&probe.blob_name(servers::NAME, key));
    let properties = blob.get_properties(None).await.ok()?;
    properties.metadata().ok()?.get("fence")?.parse().ok()
}

/// Three instances add one to a counter 20 times each with a read, a pause and a
/// write: under the lock no increment is lost, and the tokens the holders saw strictly
/// increase in the order they held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_exclude_each_other_around_a_shared_counter() {
    let (fixture, probe) = start().await;
    let counter = Arc::new(AtomicU64::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut instances = Vec::new();
    for name in ["a", "b", "c"] {
        let locks = fixture.instance(name).await;
        let (counter, tokens) = (counter.clone(), tokens.clone());
        instances.push(tokio::spawn(async move {
            for _ in 0..20 {
                let guard = locks.lock_timeout("counter", PATIENCE).await.unwrap();
                let read = counter.load(SeqCst);
                sleep(Duration::from_millis(1)).await;
                counter.store(read + 1, SeqCst);
                tokens.lock().unwrap().push(guard.fencing_token().unwrap());
                guard.release().await;
            }
        }));
    }
    for instance in instances {
        within("an instance's increments", 6 * PATIENCE, instance)
            .await
            .unwrap();
    }
    assert_eq!(counter.load(SeqCst), 60, "an increment was lost");
    let tokens = tokens.lock().unwrap().clone();
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens out of holding order: {tokens:?}"
    );
    // The blob holds the last token issued.
    assert_eq!(blob_fence(&probe, "counter").await, tokens.last().copied());
}

/// The holder's process dies without releasing (its runtime dropped, no renewal):
/// another instance is refused until Azure's lease ends, then gets the blob.
async fn a_crashed_holder_is_taken_over_one_lease_later(fixture: &servers::AzureBlob) {
    let backend = fixture.backend_named("crashed").await;
    let granted = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let granted = runtime.block_on(async {
            let sent = Instant::now();
            let guard = locks_on(backend).lock("crash").await.unwrap();
            std::mem::forget(guard);
            sent
        });
        // The crash: every task of the holder (its renewal) stops here.
        drop(runtime);
        granted
    })
    .join()
    .unwrap();
    let other = fixture.instance("other").await;
    let taken = within(
        "the takeover of a crashed holder's blob",
        LEASE + PATIENCE,
        other.lock_timeout("crash", LEASE + PATIENCE),
    )
    .await
    .expect("the crashed holder's blob is free one lease later");
    let after = granted.elapsed();
    eprintln!("crashed holder: taken over {after:?} after its acquire was sent");
    // Azure counts the lease from when it received the acquire, after it was sent.
    assert!(
        after >= LEASE,
        "taken over {after:?} after the crashed holder's acquire, within its lease {LEASE:?}"
    );
    taken.release().await;
}

/// An operator breaks the holder's lease with a break period of zero: the blob is free
/// at once, and the holder is told at its next renewal (within lease/3 and a command
/// timeout).
async fn a_lease_broken_at_once_is_signalled_at_the_next_renewal(fixture: &servers::AzureBlob) {
    let probe = fixture.azure_backend().await;
    let holder = fixture.instance("holder").await;
    let other = fixture.instance("other").await;
    let blob = probe
        .container()
        .blob_client(&probe.blob_name(servers::NAME, "broken-now"));
    let guard = holder.lock("broken-now").await.unwrap();
    let broken = Instant::now();
    let options = BlobClientBreakLeaseOptions {
        break_period: Some(0),
        ..Default::default()
    };
    blob.break_lease(Some(options)).await.unwrap();
    let freed = other.try_lock("broken-now").await;
    assert!(
        freed.is_ok(),
        "a lease broken at once still holds: {freed:?}"
    );
    within("the holder is told of the break", LEASE, guard.lost()).await;
    let told = broken.elapsed();
    eprintln!("broken at once: the holder was told after {told:?}");
    assert!(
        told < LEASE / 3 + Duration::from_millis(500) + Duration::from_secs(1),
        "told {told:?} after the break, later than its next renewal"
    );
    drop(guard);
    freed.unwrap().release().await;
}

/// With Azure's default break period (the rest of the lease), nobody else is granted
/// the blob before the holder is told.
async fn a_lease_broken_with_the_default_period_is_signalled_first(fixture: &servers::AzureBlob) {
    let probe = fixture.azure_backend().await;
    let holder = fixture.instance("holder").await;
    let other = fixture.instance("other").await;
    let blob = probe
        .container()
        .blob_client(&probe.blob_name(servers::NAME, "broken-later"));
    let guard = holder.lock("broken-later").await.unwrap();
    let signal = guard.lease().unwrap().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    blob.break_lease(None).await.unwrap();
    let taken = within(
        "another instance takes the broken lease's blob",
        LEASE + PATIENCE,
        other.lock_timeout("broken-later", LEASE + PATIENCE),
    )
    .await
    .expect("the blob is free once the break period is over");
    let granted = Instant::now();
    let told = within("the holder is told", PATIENCE, told).await.unwrap();
    assert!(
        told <= granted,
        "unsignalled overlap: granted {:?} before the holder was told",
        told - granted
    );
    eprintln!(
        "broken with the default period: told {:?} before the next grant",
        granted - told
    );
    drop(guard);
    taken.release().await;
}

/// Azurite dies while a key is held: the holder is told by its local deadline (the last
/// answered renewal + lease − drift), by the clock alone, and acquisitions fail within
/// their wait plus a command timeout, never hang.
async fn azurite_killed_mid_hold_is_a_lost_lease_and_a_prompt_error(
    mut fixture: servers::AzureBlob,
) {
    let holder = fixture.instance("holder").await;
    let guard = holder.lock("down").await.unwrap();
    let deadline = guard.lease().unwrap().valid_until().unwrap();
    fixture.kill();
    let killed = Instant::now();
    within("the holder is told", LEASE + PATIENCE, guard.lost()).await;
    let told = Instant::now();
    eprintln!(
        "azurite killed: the holder was told {:?} after the kill",
        told - killed
    );
    // No renewal can be answered after the kill: the deadline it had is at most one
    // renewal period older than the one it is told at.
    assert!(
        told <= deadline + LEASE / 3 + PATIENCE / 10,
        "told {:?} after the deadline it had at the kill",
        told - deadline
    );
    assert!(guard.is_lost());
    drop(guard);
    let started = Instant::now();
    let outcome = holder
        .lock_timeout("down-2", Duration::from_millis(300))
        .await;
    assert!(
        matches!(outcome, Err(LockError::Backend(_))),
        "no backend error with Azurite down: {outcome:?}"
    );
    assert!(
        started.elapsed()
            < Duration::from_millis(300) + 2 * Duration::from_millis(500) + PATIENCE / 10,
        "an acquisition took {:?} with Azurite down",
        started.elapsed()
    );
}

/// The checks that wait out a lease (Azure's shortest is 15 s) run at once, so the
/// binary waits about one lease for all four.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crashed_broken_and_cut_off_holders_within_one_lease() {
    let shared = servers::AzureBlob::start();
    // Killed by its check.
    let doomed = servers::AzureBlob::start();
    tokio::join!(
        a_crashed_holder_is_taken_over_one_lease_later(&shared),
        a_lease_broken_at_once_is_signalled_at_the_next_renewal(&shared),
        a_lease_broken_with_the_default_period_is_signalled_first(&shared),
        azurite_killed_mid_hold_is_a_lost_lease_and_a_prompt_error(doomed),
    );
}

/// One key locked and released over and over by two instances in turn: each
/// release's background delete finds the blob changed and is refused, and the blob
/// goes after the last release, within the record window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_keys_blob_goes_after_its_last_release() {
    let (fixture, probe) = start().await;
    let a = fixture.instance("a").await;
    let b = fixture.instance("b").await;
    for turn in 0..10 {
        let locks = if turn % 2 == 0 { &a } else { &b };
        let guard = within("a turn", PATIENCE, locks.lock_timeout("hot", PATIENCE))
            .await
            .expect("the key is free between turns");
        guard.release().await;
    }
    let released = Instant::now();
    let limit =
        tower_keyed_lock::backend::azure_blob::record_window(servers::GENEROUS_TIMEOUT) + PATIENCE;
    let blob = probe
        .container()
        .blob_client(&probe.blob_name(servers::NAME, "hot"));
    while blob.get_properties(None).await.is_ok() {
        assert!(
            released.elapsed() < limit,
            "the hot key's blob stays {limit:?} after its last release"
        );
        sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "hot key: blob gone {:?} after the last release",
        released.elapsed()
    );
}

/// A key nobody holds is never answered "held": each release's deferred delete of its
/// blob (once Azure's clock is past its token) can land between the next try's read
/// and its lease, and that try then reads again instead of answering busy. Tries run
/// back to back for longer than [`PAST_A_TOKEN`], so the first releases' deletes land
/// among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_free_key_is_never_busy_while_its_released_blobs_go() {
    let (fixture, _probe) = start().await;
    let a = fixture.instance("a").await;
    let started = Instant::now();
    let mut tries = 0;
    while started.elapsed() < PAST_A_TOKEN + Duration::from_secs(2) {
        let guard = within("a try", PATIENCE, a.try_lock("free"))
            .await
            .unwrap_or_else(|error| panic!("try {tries} of a free key: {error}"));
        guard.release().await;
        tries += 1;
    }
    eprintln!("{tries} tries of a free key, each granted");
}

/// Tokens strictly increase from holder to holder and across a blob deleted in
/// between (once Azure's clock is past its token): the counter starts again from
/// Azure's clock in microseconds, above every token the old blob issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_increase_across_holders_and_a_deleted_blob() {
    let (fixture, probe) = start().await;
    let a = fixture.instance("a").await;
    let b = fixture.instance("b").await;
    let mut tokens = Vec::new();
    for locks in [&a, &b, &a, &b] {
        let guard = locks.lock("deleted").await.unwrap();
        tokens.push(guard.fencing_token().unwrap());
        guard.release().await;
    }
    sleep(PAST_A_TOKEN).await;
    let blob = probe
        .container()
        .blob_client(&probe.blob_name(servers::NAME, "deleted"));
    // By hand, unless the release's own deletion came first (it is due about now).
    if let Err(error) = blob.delete(None).await {
        assert_eq!(
            error.http_status(),
            Some(azure_core::http::StatusCode::NotFound),
            "a free lock's blob can be deleted: {error}"
        );
    }
    assert_eq!(blob_fence(&probe, "deleted").await, None);
    for locks in [&a, &b] {
        let guard = locks.lock("deleted").await.unwrap();
        tokens.push(guard.fencing_token().unwrap());
        guard.release().await;
    }
    eprintln!("tokens across a deleted blob: {tokens:?}");
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens went backwards across a deleted blob: {tokens:?}"
    );
}

/// Keys with separators, `%`, dots, non-ASCII text and more than 128 bytes each get a
/// blob of their own under the layer name, which holds the token the holder got.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_keys_map_to_one_blob_each() {
    let (fixture, probe) = start().await;
    let locks: DistributedLocks = fixture.instance("odd").await;
    let long = "é".repeat(100);
    let keys = [
        "a/b",
        "a%2Fb",
        "..",
        ".",
        "x.",
        "é",
        long.as_str(),
        "#",
        "a b",
        "?q=1&r",
    ];
    let mut guards = Vec::new();
    for key in keys {
        // Each is free although the others are held: no two share a blob.
        let guard = locks.try_lock(key).await.expect("a blob of its own");
        let name = probe.blob_name(servers::NAME, key);
        assert!(name.starts_with("keyed-lock/jobs/"), "{name}");
        assert_eq!(name.matches('/').count(), 2, "{name}");
        assert!(!name.ends_with('.'), "{name}");
        assert_eq!(
            blob_fence(&probe, key).await,
            guard.fencing_token(),
            "the blob of {key:?} ({name}) does not hold its holder's token"
        );
        guards.push(guard);
    }
    for guard in guards {
        guard.release().await;
    }
}

/// The container is deleted (by hand, or an in-memory Azurite restarted empty) while a
/// loop acquires and releases one key with a wait of 2 s each: every acquisition
/// succeeds within its wait (the container is made again), and the tokens still
/// strictly increase across the deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_container_is_made_again_within_the_wait() {
    const WAIT: Duration = Duration::from_secs(2);
    let (fixture, probe) = start().await;
    let locks = fixture.instance("loop").await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looping = {
        let stop = stop.clone();
        tokio::spawn(async move {
            // (started, ended, the token or the error)
            let mut outcomes = Vec::new();
            while !stop.load(SeqCst) {
                let started = Instant::now();
                let outcome = match locks.lock_timeout("container", WAIT).await {
                    Ok(guard) => {
                        let token = guard.fencing_token().unwrap();
                        guard.release().await;
                        Ok(token)
                    }
                    Err(error) => Err(error.to_string()),
                };
                outcomes.push((started, Instant::now(), outcome));
            }
            outcomes
        })
    };
    sleep(Duration::from_millis(500)).await;
    let deleted = Instant::now();
    probe
        .container()
        .delete(None)
        .await
        .expect("the container can be deleted");
    sleep(3 * WAIT).await;
    stop.store(true, SeqCst);
    let outcomes = within("the loop ends", PATIENCE, looping).await.unwrap();
    let before = outcomes.iter().filter(|(_, end, _)| *end < deleted).count();
    let after: Vec<_> = outcomes
        .iter()
        .filter(|(_, end, _)| *end >= deleted)
        .collect();
    let failures: Vec<&String> = after
        .iter()
        .filter_map(|(_, _, outcome)| outcome.as_ref().err())
        .collect();
    let first_grant = after
        .iter()
        .find(|(_, _, outcome)| outcome.is_ok())
        .map(|(_, end, _)| end.saturating_duration_since(deleted));
    eprintln!(
        "deleted container: {before} acquisitions before the deletion, {} after, {} \
         failed, the first grant {first_grant:?} after it; first failure: {:?}",
        after.len(),
        failures.len(),
        failures.first()
    );
    assert!(
        failures.is_empty(),
        "{} of {} acquisitions failed after the container was deleted, e.g. {}",
        failures.len(),
        after.len(),
        failures[0]
    );
    assert!(first_grant.is_some(), "nothing granted after the deletion");
    let tokens: Vec<u64> = outcomes
        .iter()
        .filter_map(|(_, _, outcome)| outcome.as_ref().ok().copied())
        .collect();
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens went backwards across a deleted container: {tokens:?}"
    );
}

/// A holder's token `t1`, then the whole container deleted: the next holder of the key,
/// in a container made again without the blob or its counter, gets a token above
/// `t1`, from this instance and from another one (the container deleted once Azure's
/// clock is past `t1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_increase_across_a_deleted_container() {
    let (fixture, probe) = start().await;
    let a = fixture.instance("a").await;
    let b = fixture.instance("b").await;
    let guard = a.lock("gone").await.unwrap();
    let t1 = guard.fencing_token().unwrap();
    guard.release().await;
    sleep(PAST_A_TOKEN).await;
    probe
        .container()
        .delete(None)
        .await
        .expect("the container can be deleted");
    let mut tokens = vec![t1];
    for locks in [&a, &b] {
        let guard = within(
            "a grant in a container made again",
            PATIENCE,
            locks.lock("gone"),
        )
        .await
        .expect("granted once the container is made again");
        tokens.push(guard.fencing_token().unwrap());
        guard.release().await;
    }
    eprintln!("tokens across a deleted container: {tokens:?}");
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens went backwards across a deleted container: {tokens:?}"
    );
    assert_eq!(blob_fence(&probe, "gone").await, tokens.last().copied());
}

/// A container nothing answers for, at build and at an acquisition: the error names
/// the engine and the container's address, then the cause; never the SAS token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_container_is_named_with_its_address_and_cause() {
    fn check(message: &str, port: u16) {
        assert!(message.contains("Azure Blob Storage"), "{message}");
        let address = format!("127.0.0.1:{port}/devstoreaccount1/locks");
        assert!(message.contains(&address), "{message}");
        assert!(!message.contains("sig="), "the SAS token leaked: {message}");
        // The cause follows the address.
        let address_end = message.find(&address).unwrap() + address.len();
        assert!(message.len() > address_end + 2, "no cause: {message}");
    }
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = crate::support::azurite_server::container_url(&format!("127.0.0.1:{port}"), "locks");
    let error = AzureBlobBackend::builder(url)
        .build()
        .await
        .expect_err("nothing listens there");
    let message = error.to_string();
    eprintln!("unreachable at build: {message}");
    check(&message, port);

    let mut fixture = servers::AzureBlob::start();
    let locks = fixture.instance("cut-off").await;
    let port = fixture.0.port();
    fixture.0.kill();
    let error = locks
        .try_lock("k")
        .await
        .map(|_| ())
        .expect_err("Azurite is down");
    let message = error.to_string();
    eprintln!("unreachable at acquire: {message}");
    check(&message, port);
}

/// The container is deleted while a key is held (Azure deletes a container whatever
/// its blobs' leases): the key is free at once, as with a lease broken at once, and the
/// holder is told at its next renewal (within lease/3 and a command timeout), whether
/// or not another instance took the key meanwhile; its token is higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_whose_container_is_deleted_is_told_at_its_next_renewal() {
    let (fixture, probe) = start().await;
    let holder = fixture.instance("holder").await;
    let other = fixture.instance("other").await;
    let guard = holder.lock("deleted-held").await.unwrap();
    sleep(PAST_A_TOKEN).await;
    let deleted = Instant::now();
    probe
        .container()
        .delete(None)
        .await
        .expect("a container with a leased blob can be deleted");
    let taken = within(
        "another instance takes the key",
        PATIENCE,
        other.lock_timeout("deleted-held", PATIENCE),
    )
    .await
    .expect("the key is free once its container is gone");
    let granted = deleted.elapsed();
    assert!(
        taken.fencing_token() > guard.fencing_token(),
        "the token went back: {:?} after {:?}",
        taken.fencing_token(),
        guard.fencing_token()
    );
    within("the holder is told", LEASE, guard.lost()).await;
    let told = deleted.elapsed();
    eprintln!(
        "container deleted mid-hold: another instance granted after {granted:?}, the \
         holder told after {told:?}"
    );
    assert!(
        told < LEASE / 3 + Duration::from_millis(500) + Duration::from_secs(1),
        "told {told:?} after the deletion, later than its next renewal"
    );
    drop(guard);
    taken.release().await;
}
