//! Checks of exclusion across instances: one holder, waits that end as promised, the
//! hand-over on release, fencing order, and cancelled acquisitions.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::inside::Inside;
use super::{instance, while_turns_are_taken, within, Deployment, PATIENCE, TURN_WAIT};
use crate::{DistributedLocks, LockError};

/// Three instances, four tasks each, five turns per task on one key: never two
/// holders at once (unless the first had been told its lease was lost), and every turn
/// is taken.
pub async fn one_holder_at_a_time<D: Deployment>(deployment: &D) {
    const TASKS: usize = 4;
    const TURNS: usize = 5;
    let inside = Arc::new(Inside::new(1));
    let turns = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let locks = instance(deployment, "conformance-exclusion").await;
        for _ in 0..TASKS {
            let (locks, inside, turns) = (locks.clone(), inside.clone(), turns.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..TURNS {
                    let guard = locks.lock_timeout("k", TURN_WAIT).await.unwrap();
                    let ticket =
                        inside.enter(0, guard.lease(), "two instances held the key at once");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    inside.leave(0, ticket);
                    turns.fetch_add(1, SeqCst);
                    guard.release().await;
                }
            }));
        }
    }
    while_turns_are_taken("exclusion", &turns, tasks).await;
    assert_eq!(
        turns.load(SeqCst),
        3 * TASKS * TURNS,
        "conformance: a turn was lost"
    );
}

/// While one instance holds a key, another's `try_lock` is `Busy` and its
/// `lock_timeout` ends in `Timeout`, not before its wait is over; after the release the
/// key can be taken.
pub async fn busy_and_timeout<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-busy").await;
    let b = instance(deployment, "conformance-busy").await;
    let guard = a.lock("k").await.unwrap();
    assert!(
        matches!(b.try_lock("k").await, Err(LockError::Busy)),
        "conformance: try_lock was not Busy while another instance held the key"
    );
    let wait = Duration::from_millis(200);
    let started = Instant::now();
    let timed_out = b.lock_timeout("k", wait).await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout)),
        "conformance: lock_timeout on a held key ended in {timed_out:?}, not Timeout"
    );
    assert!(
        started.elapsed() >= wait,
        "conformance: lock_timeout gave up after {:?}, before its wait of {wait:?}",
        started.elapsed()
    );
    guard.release().await;
    eventually_free(&b, "k", PATIENCE, PATIENCE).await;
}

/// A waiter of another instance gets the key once it is released: woken by the
/// release (or its backend's poll), long before its wait runs out.
pub async fn release_hands_over<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-handover").await;
    let b = instance(deployment, "conformance-handover").await;
    let guard = a.lock("k").await.unwrap();
    let waiter = tokio::spawn(async move {
        let guard = b.lock_timeout("k", 3 * PATIENCE).await;
        (guard, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let released = Instant::now();
    guard.release().await;
    let (granted, at) = within("the hand-over to a waiting instance", waiter)
        .await
        .unwrap();
    let granted = granted.expect("conformance: the waiter was not granted the released key");
    tracing::info!(
        hand_over = ?at.saturating_duration_since(released),
        "conformance: release to next grant"
    );
    granted.release().await;
}

/// Two instances take a key in turns: the fencing tokens strictly increase, or — for
/// a backend whose [`issues_fencing_tokens`](crate::LockBackend::issues_fencing_tokens)
/// says it issues none (Redlock) — no lease carries one: a backend never hands out a
/// token it does not vouch for.
pub async fn fencing_tokens_increase<D: Deployment>(deployment: &D) {
    let issues_tokens = deployment.backend().await.issues_fencing_tokens();
    let a = instance(deployment, "conformance-fencing").await;
    let b = instance(deployment, "conformance-fencing").await;
    let mut tokens = Vec::new();
    for turn in 0..6 {
        let locks = if turn % 2 == 0 { &a } else { &b };
        let guard = locks.lock_timeout("k", PATIENCE).await.unwrap();
        tokens.push(guard.fencing_token());
        guard.release().await;
    }
    if !issues_tokens {
        assert!(
            tokens.iter().all(Option::is_none),
            "conformance: a backend that issues no fencing tokens handed some out: {tokens:?}"
        );
        tracing::info!("conformance: the backend issues no fencing tokens, and none was seen");
        return;
    }
    let tokens: Vec<u64> = tokens
        .into_iter()
        .map(|token| token.expect("conformance: a backend issued a fencing token only sometimes"))
        .collect();
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "conformance: fencing tokens did not strictly increase: {tokens:?}"
    );
}

/// Acquisitions dropped at many points — queued while another instance holds, racing
/// the grant of a free key — leave the key free: another instance takes it at once,
/// not after a lease.
pub async fn dropped_acquisitions_leave_nothing_held<D: Deployment>(deployment: &D) {
    let a = instance(deployment, "conformance-cancel").await;
    let b = instance(deployment, "conformance-cancel").await;
    // Longer than a give-back on a loaded machine, shorter than a lease: a key left to
    // expire instead of released is caught. A give-back may first wait for the cut
    // acquisition's answer, then release: three times the slowest grant and release
    // this check saw, the two round trips a user's instance would pay.
    let loss_bound = deployment.loss_bound();
    let mut freed_within = (loss_bound / 2).max(Duration::from_millis(100));
    let cap = loss_bound * 9 / 10;
    for micros in [0, 100, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000] {
        let cut = Duration::from_micros(micros);
        // Held elsewhere: the acquisition is cut while it waits.
        let granting = Instant::now();
        let guard = a.lock("held").await.unwrap();
        let granted = granting.elapsed();
        let _ = tokio::time::timeout(cut, b.lock_timeout("held", PATIENCE)).await;
        let releasing = Instant::now();
        guard.release().await;
        let give_back = 3 * (granted + releasing.elapsed());
        freed_within = freed_within.max(give_back.min(cap));
        eventually_free(&a, "held", freed_within, cap).await;
        // Free: the acquisition is cut before, during or after its grant.
        let _ = tokio::time::timeout(cut, b.lock_timeout("free", PATIENCE)).await;
        eventually_free(&a, "free", freed_within, cap).await;
    }
}

/// Takes `key` with `try_lock` until it is free, failing after `limit` (see
/// [`FreeWithin`]).
pub(super) async fn eventually_free(
    locks: &DistributedLocks,
    key: &str,
    limit: Duration,
    cap: Duration,
) {
    let mut within = FreeWithin::new(limit, cap);
    loop {
        match within.look(locks.try_lock(key)).await {
            Ok(guard) => return guard.release().await,
            Err(LockError::Busy) => {}
            Err(error) => panic!("conformance: try_lock({key:?}) failed: {error}"),
        }
        within
            .again(|allowed| {
                format!("conformance: {key:?} still held {allowed:?} after it should be free")
            })
            .await;
    }
}

/// The looks of a check that waits for a key to be free after a release or a cut
/// acquisition. It allows `limit`, or three of the slowest look's round trips if that
/// is longer (a give-back takes two), up to `cap`: the engine's pace (moto serves one
/// request at a time) is measured, not guessed. The looks back off (5 ms doubling to
/// 50 ms) so as not to queue ahead of the give-back they wait for.
pub(super) struct FreeWithin {
    started: Instant,
    allowed: Duration,
    cap: Duration,
    pause: Duration,
}

impl FreeWithin {
    pub(super) fn new(limit: Duration, cap: Duration) -> Self {
        Self {
            started: Instant::now(),
            allowed: limit,
            cap,
            pause: Duration::from_millis(5),
        }
    }

    /// One look, timed.
    pub(super) async fn look<T>(&mut self, look: impl std::future::Future<Output = T>) -> T {
        let sent = Instant::now();
        let answer = look.await;
        self.allowed = self.allowed.max((3 * sent.elapsed()).min(self.cap));
        answer
    }

    /// Fails the check with `failure(allowed)` once the allowance is over; else
    /// pauses before the next look.
    pub(super) async fn again(&mut self, failure: impl FnOnce(Duration) -> String) {
        assert!(
            self.started.elapsed() < self.allowed,
            "{}",
            failure(self.allowed)
        );
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_millis(50));
    }
}
