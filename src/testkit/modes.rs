//! Checks of shared and permit locks across instances, for the backends that hold a key
//! in those modes ([`LockBackend::supports`](crate::LockBackend::supports)): readers
//! together, a writer alone, a waiting writer not starved, at most n permit holders, a
//! crashed holder's permit back after its lease, fencing order across modes.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::lease::crash_holding;
use super::mutual::{eventually_free, FreeWithin};
use super::{taken_after_crash, within, Deployment, PATIENCE};
use crate::{DistributedLocks, LockError};

/// One instance whose locks have `permits` holders per key.
async fn counted<D: Deployment>(
    deployment: &D,
    check: &'static str,
    permits: usize,
) -> DistributedLocks {
    DistributedLocks::builder(check)
        .shared_backend(deployment.backend().await)
        .permits(permits)
        .build()
}

/// Two instances hold a key shared at once; meanwhile a third instance's `try_lock` is
/// `Busy`, and it gets the key once both readers released it.
pub async fn readers_hold_together<D: Deployment>(deployment: &D) {
    let a = counted(deployment, "conformance-readers", 1).await;
    let b = counted(deployment, "conformance-readers", 1).await;
    let writer = counted(deployment, "conformance-readers", 1).await;
    let first = within("a first reader", a.lock_shared("k")).await.unwrap();
    let second = within("a second reader beside the first", b.try_lock_shared("k"))
        .await
        .expect("conformance: a reader was refused while only another reader held the key");
    assert!(
        matches!(writer.try_lock("k").await, Err(LockError::Busy)),
        "conformance: a writer got the key while two readers held it"
    );
    first.release().await;
    assert!(
        matches!(writer.try_lock("k").await, Err(LockError::Busy)),
        "conformance: a writer got the key while a reader still held it"
    );
    second.release().await;
    let alone = within("the writer after the readers", writer.lock("k"))
        .await
        .unwrap();
    alone.release().await;
}

/// While a writer holds a key, another instance's readers and writers are `Busy`; once
/// it releases, a waiting reader of another instance gets the key.
pub async fn a_writer_excludes_everyone<D: Deployment>(deployment: &D) {
    let a = counted(deployment, "conformance-writer", 1).await;
    let b = counted(deployment, "conformance-writer", 1).await;
    let guard = within("a writer", a.lock("k")).await.unwrap();
    assert!(
        matches!(b.try_lock_shared("k").await, Err(LockError::Busy)),
        "conformance: a reader got the key while a writer held it"
    );
    assert!(
        matches!(b.try_lock("k").await, Err(LockError::Busy)),
        "conformance: two writers held the key at once"
    );
    let reader = tokio::spawn(async move {
        let guard = b.lock_shared_timeout("k", PATIENCE).await;
        guard.map(|guard| tokio::spawn(guard.release()))
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !reader.is_finished(),
        "conformance: a reader did not wait for the writer"
    );
    guard.release().await;
    within("the reader after the writer", reader)
        .await
        .unwrap()
        .expect("conformance: the waiting reader did not get the key after the writer");
}

/// A reader holds a key; a writer of another instance waits for it; a third instance's
/// new reader is then refused (it would starve the writer), and the writer gets the key
/// when the first reader leaves, before the new reader.
pub async fn a_waiting_writer_is_not_starved<D: Deployment>(deployment: &D) {
    let a = counted(deployment, "conformance-starve", 1).await;
    let writer = counted(deployment, "conformance-starve", 1).await;
    let late = counted(deployment, "conformance-starve", 1).await;
    let reader = within("a reader", a.lock_shared("k")).await.unwrap();
    let waiting = tokio::spawn(async move { writer.lock_timeout("k", PATIENCE).await });
    // The writer is waiting once a new reader is turned away; until it has made its
    // first attempt, a new reader may still enter (and is let go at once).
    let started = Instant::now();
    loop {
        match late.try_lock_shared("k").await {
            Err(LockError::Busy) => break,
            Ok(guard) => guard.release().await,
            Err(error) => panic!("conformance: try_lock_shared failed: {error}"),
        }
        assert!(
            started.elapsed() < PATIENCE,
            "conformance: new readers kept entering while a writer waited"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !waiting.is_finished(),
        "conformance: the writer did not wait for the reader"
    );
    reader.release().await;
    let guard = within("the writer after the reader", waiting)
        .await
        .unwrap()
        .expect("conformance: the waiting writer did not get the key");
    assert!(
        matches!(late.try_lock_shared("k").await, Err(LockError::Busy)),
        "conformance: a reader got the key while the writer held it"
    );
    guard.release().await;
}

/// Four instances with 3 permits per key, three tasks each taking turns: never more
/// than 3 holders at once, 3 at once at some point, and every turn taken; a fourth
/// `try_lock` is `Busy` while 3 hold.
pub async fn at_most_n_permit_holders<D: Deployment>(deployment: &D) {
    const PERMITS: usize = 3;
    let instances = [
        counted(deployment, "conformance-permits", PERMITS).await,
        counted(deployment, "conformance-permits", PERMITS).await,
        counted(deployment, "conformance-permits", PERMITS).await,
        counted(deployment, "conformance-permits", PERMITS).await,
    ];
    let mut held = Vec::new();
    for locks in &instances[..PERMITS] {
        held.push(within("a permit", locks.lock("k")).await.unwrap());
    }
    assert!(
        matches!(instances[3].try_lock("k").await, Err(LockError::Busy)),
        "conformance: a fourth holder got one of 3 permits"
    );
    let mut tokens: Vec<_> = held.iter().map(|guard| guard.fencing_token()).collect();
    tokens.dedup();
    assert_eq!(
        tokens.len(),
        PERMITS,
        "conformance: two permit holders share a token"
    );
    for guard in held {
        guard.release().await;
    }

    let holders = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let turns = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for locks in &instances {
        for _ in 0..3 {
            let (locks, holders, most, turns) =
                (locks.clone(), holders.clone(), most.clone(), turns.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..4 {
                    let guard = locks.lock_timeout("k", PATIENCE).await.unwrap();
                    let now = holders.fetch_add(1, SeqCst) + 1;
                    assert!(now <= PERMITS, "conformance: {now} holders of 3 permits");
                    most.fetch_max(now, SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    holders.fetch_sub(1, SeqCst);
                    turns.fetch_add(1, SeqCst);
                    guard.release().await;
                }
            }));
        }
    }
    for task in tasks {
        within("every permit turn", task)
            .await
            .expect("a turn panicked");
    }
    assert_eq!(
        turns.load(SeqCst),
        4 * 3 * 4,
        "conformance: a turn was lost"
    );
}

/// An instance crashes holding one of 2 permits: the other permit stays free to take,
/// and the crashed one comes back after the loss bound.
pub async fn a_crashed_permit_comes_back<D: Deployment>(deployment: &D) {
    let crashed = counted(deployment, "conformance-permit-crash", 2).await;
    let b = counted(deployment, "conformance-permit-crash", 2).await;
    let at = crash_holding(crashed, "k").await;
    let other = within("the permit left free", b.try_lock("k"))
        .await
        .expect("conformance: the second permit was not free beside a crashed holder");
    let limit = deployment.loss_bound() + PATIENCE;
    let second = taken_after_crash(&b, "k", at, limit, "a crashed holder's permit").await;
    other.release().await;
    second.release().await;
}

/// Fencing across modes: a writer's token is greater than every token before it,
/// whatever the mode; a reader's is at least the last writer's (what it reads was
/// written under it) and below the next writer's; permit holders' tokens increase too.
/// (Redis gives a reader exactly the last writer's token; PostgreSQL the last one its
/// sequence issued, for any key.)
pub async fn fencing_tokens_across_modes<D: Deployment>(deployment: &D) {
    let a = counted(deployment, "conformance-fencing-modes", 1).await;
    let b = counted(deployment, "conformance-fencing-modes", 1).await;
    let first = within("a first writer", a.lock("k")).await.unwrap();
    let written = first
        .fencing_token()
        .expect("conformance: a writer got no fencing token");
    first.release().await;
    let reader = within("a reader", b.lock_shared("k")).await.unwrap();
    let read = reader
        .fencing_token()
        .expect("conformance: a reader after a writer got no token");
    assert!(
        read >= written,
        "conformance: a reader's token {read} is below the last writer's {written}"
    );
    reader.release().await;
    let second = within("a second writer", b.lock("k")).await.unwrap();
    let later = second.fencing_token().unwrap();
    assert!(
        later > written,
        "conformance: writer tokens went {written} then {later}"
    );
    assert!(
        later > read,
        "conformance: a writer's token {later} is not above the reader's before it {read}"
    );
    second.release().await;

    let permits = counted(deployment, "conformance-fencing-modes", 2).await;
    let mut last = 0;
    for _ in 0..3 {
        let guard = within("a permit", permits.lock("p")).await.unwrap();
        let token = guard.fencing_token().expect("a permit holder got no token");
        assert!(
            token > last,
            "conformance: permit tokens went {last} then {token}"
        );
        last = token;
        guard.release().await;
    }
}

/// Shared and permit acquisitions cut at any point (0 to 50 ms; queued behind a holder,
/// or racing a grant) leave nothing held: a writer then gets the key, and every permit
/// can be taken, within half the loss bound (or three of the slowest round trips seen,
/// still under a lease).
pub async fn dropped_shared_and_permit_acquisitions_leave_nothing_held<D: Deployment>(
    deployment: &D,
) {
    let a = counted(deployment, "conformance-cancel-modes", 1).await;
    let b = counted(deployment, "conformance-cancel-modes", 1).await;
    let permits_a = counted(deployment, "conformance-cancel-permits", 2).await;
    let permits_b = counted(deployment, "conformance-cancel-permits", 2).await;
    let freed_within = (deployment.loss_bound() / 2).max(Duration::from_millis(100));
    let cap = deployment.loss_bound() * 9 / 10;
    for micros in [0, 100, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000] {
        let cut = Duration::from_micros(micros);
        // A reader cut while a writer holds the key, then while it is free.
        let writer = a.lock("held").await.unwrap();
        let _ = tokio::time::timeout(cut, b.lock_shared_timeout("held", PATIENCE)).await;
        writer.release().await;
        eventually_free(&a, "held", freed_within, cap).await;
        let _ = tokio::time::timeout(cut, b.lock_shared_timeout("free", PATIENCE)).await;
        eventually_free(&a, "free", freed_within, cap).await;
        // A permit holder cut while both permits are taken, then while they are free.
        let first = permits_a.lock("held").await.unwrap();
        let second = permits_a.lock("held").await.unwrap();
        let _ = tokio::time::timeout(cut, permits_b.lock_timeout("held", PATIENCE)).await;
        first.release().await;
        second.release().await;
        both_permits_eventually(&permits_a, "held", freed_within, cap).await;
        let _ = tokio::time::timeout(cut, permits_b.lock_timeout("free", PATIENCE)).await;
        both_permits_eventually(&permits_a, "free", freed_within, cap).await;
    }
}

/// Takes both permits of `key` at once with `try_lock`, failing after `limit`.
async fn both_permits_eventually(
    locks: &DistributedLocks,
    key: &str,
    limit: Duration,
    cap: Duration,
) {
    let mut within = FreeWithin::new(limit, cap);
    let mut held = Vec::new();
    while held.len() < 2 {
        match within.look(locks.try_lock(key)).await {
            Ok(guard) => held.push(guard),
            Err(LockError::Busy) => {
                within
                    .again(|allowed| {
                        format!(
                            "conformance: a permit of {key:?} still held {allowed:?} after a \
                             cut acquisition"
                        )
                    })
                    .await
            }
            Err(error) => panic!("conformance: try_lock({key:?}) failed: {error}"),
        }
    }
    for guard in held {
        guard.release().await;
    }
}

/// Two instances under one name, one exclusive and one with 2 permits (two
/// configurations that cannot be refused when built, being in different processes):
/// they exclude each other on a key. While the writer holds it, the permit holder is
/// `Busy` and a waiting one gets it only after the release; while a permit is held,
/// the writer is `Busy` and a waiting one gets it only after the permit's release;
/// the second permit stays free beside the first.
pub async fn exclusive_and_permits_exclude_each_other<D: Deployment>(deployment: &D) {
    let writer = counted(deployment, "conformance-mixed-modes", 1).await;
    let permits = counted(deployment, "conformance-mixed-modes", 2).await;
    let other = counted(deployment, "conformance-mixed-modes", 2).await;

    let held = within("a writer", writer.lock("k")).await.unwrap();
    assert!(
        matches!(permits.try_lock("k").await, Err(LockError::Busy)),
        "conformance: a permit holder got the key while a writer of another instance \
         held it under the same name"
    );
    let waiting = tokio::spawn(async move { permits.lock_timeout("k", PATIENCE).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !waiting.is_finished(),
        "conformance: a permit holder did not wait for the writer"
    );
    held.release().await;
    let permit = within("the permit after the writer", waiting)
        .await
        .unwrap()
        .expect("conformance: the waiting permit holder did not get the key after the writer");

    let second = within("the second permit beside the first", other.try_lock("k"))
        .await
        .expect("conformance: the second permit was refused beside the first");
    assert!(
        matches!(writer.try_lock("k").await, Err(LockError::Busy)),
        "conformance: a writer got the key while permit holders of another instance held \
         it under the same name"
    );
    second.release().await;
    assert!(
        matches!(writer.try_lock("k").await, Err(LockError::Busy)),
        "conformance: a writer got the key while a permit holder still held it"
    );
    let waiting = tokio::spawn(async move { writer.lock_timeout("k", PATIENCE).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !waiting.is_finished(),
        "conformance: a writer did not wait for the permit holder"
    );
    permit.release().await;
    let alone = within("the writer after the permit", waiting)
        .await
        .unwrap()
        .expect("conformance: the waiting writer did not get the key after the permit");
    assert!(
        matches!(other.try_lock("k").await, Err(LockError::Busy)),
        "conformance: a permit holder got the key while the writer held it"
    );
    alone.release().await;
}
