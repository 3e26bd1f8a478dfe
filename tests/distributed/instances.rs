//! `DistributedLocks` between "instances" — each a `DistributedLocks` with backend
//! connections of its own — on a real Redis, a real Redis Cluster and a real
//! PostgreSQL (shared by the tests running at once, each in a scope of its own), and
//! in process. Every test body is generic and runs on each fixture.
//! Cancellation is in `cancel.rs`, lost leases in `lease.rs`.
//!
//! The exclusion test runs 10 rounds per worker; a longer soak:
//! `DISTRIBUTED_ROUNDS=250 cargo test --all-features --test distributed one_holder`.

// Without a backend feature, the bodies for remote fixtures have nothing to run on.
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_keyed_lock::{DistributedLocks, LockError};

use crate::support::fixtures::{
    eventually, locks_on, wait_free, within, Counting, Fixture, Remote, FREED_WITHIN, PATIENCE,
};
use crate::support::lateness::Lateness;
use crate::support::Overlap;

for_each_fixture!(
    all: [
        one_holder_at_a_time_across_instances,
        try_lock_is_busy_while_another_instance_holds,
        lock_timeout_gives_up_at_the_deadline,
        release_hands_the_key_over_at_once,
        waits_of_any_length_are_accepted,
    ],
    remote: [
        fencing_tokens_increase_across_instances,
        local_waiters_share_one_remote_contender,
    ],
    alone: [server_down_fails_closed_or_open],
);

/// Two instances, four workers each, all on one key: never two inside at once, and in
/// the order they got in, the fencing tokens strictly increase.
async fn one_holder_at_a_time_across_instances<F: Fixture>() {
    let rounds: usize = std::env::var("DISTRIBUTED_ROUNDS")
        .map(|rounds| rounds.parse().expect("DISTRIBUTED_ROUNDS is a number"))
        .unwrap_or(10);
    let fixture = F::start();
    let instances = [fixture.instance("a").await, fixture.instance("b").await];
    let overlap = Arc::new(Overlap::default());
    let tokens = Arc::new(Mutex::new(Vec::new()));

    let mut workers = Vec::new();
    for worker in 0..8 {
        let locks = instances[worker % 2].clone();
        let (overlap, tokens) = (overlap.clone(), tokens.clone());
        workers.push(tokio::spawn(async move {
            for round in 0..rounds {
                let guard = locks.lock("nightly-report").await.unwrap();
                {
                    let _inside = overlap.enter();
                    tokens.lock().unwrap().push(guard.fencing_token());
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                // Both ways of letting go: waiting for the release, and dropping.
                if round % 2 == 0 {
                    guard.release().await;
                } else {
                    drop(guard);
                }
            }
        }));
    }
    for worker in workers {
        within(
            "the workers finish",
            PATIENCE * (3 + rounds as u32 / 10),
            worker,
        )
        .await
        .unwrap();
    }

    assert_eq!(overlap.max(), 1, "two holders of one key at once");
    eprintln!("{} grants, at most one holder at a time", 8 * rounds);
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), 8 * rounds);
    if instances[0].is_distributed() {
        let tokens: Vec<u64> = tokens.into_iter().map(Option::unwrap).collect();
        assert!(
            tokens.windows(2).all(|pair| pair[0] < pair[1]),
            "fencing tokens out of order: {tokens:?}"
        );
    } else {
        assert!(tokens.iter().all(Option::is_none));
    }
    for locks in &instances {
        eventually("every key is let go", || locks.is_empty()).await;
    }
}

async fn try_lock_is_busy_while_another_instance_holds<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);

    let held = a.try_lock("invoice-run").await.unwrap();
    assert_eq!(held.key(), "invoice-run");
    assert!(matches!(
        b.try_lock("invoice-run").await,
        Err(LockError::Busy)
    ));
    // Busy in the holder's own process too, from its local tier.
    assert!(matches!(
        a.try_lock("invoice-run").await,
        Err(LockError::Busy)
    ));
    // Another key is free.
    b.try_lock("cleanup").await.unwrap().release().await;

    held.release().await;
    let taken = b.try_lock("invoice-run").await.unwrap();
    assert!(matches!(
        a.try_lock("invoice-run").await,
        Err(LockError::Busy)
    ));
    taken.release().await;
    assert!(a.is_empty() && b.is_empty());
}

/// A wait for a key another instance holds ends with `Timeout` at the deadline, not
/// much later, and leaves nothing behind.
async fn lock_timeout_gives_up_at_the_deadline<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let wait = Duration::from_millis(300);

    let held = b.lock("export").await.unwrap();
    let lateness = Lateness::watch();
    let started = Instant::now();
    let result = within("lock_timeout", PATIENCE, a.lock_timeout("export", wait)).await;
    let took = started.elapsed();
    assert!(matches!(result, Err(LockError::Timeout)), "{result:?}");
    assert!(took >= wait, "gave up early, after {took:?}");
    assert!(
        took < lateness.allowing(wait + Duration::from_millis(500)),
        "gave up {:?} past the deadline",
        took - wait
    );
    eprintln!("lock_timeout({wait:?}) gave up after {took:?}");

    held.release().await;
    // The key is free again at once, for the instance that timed out too.
    a.try_lock("export").await.unwrap().release().await;
    assert!(a.is_empty() && b.is_empty());
}

/// `release().await` returns once the key is free everywhere; a dropped guard frees it
/// soon after (the remote release runs in a task of its own).
async fn release_hands_the_key_over_at_once<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);

    for _ in 0..5 {
        a.lock("sync").await.unwrap().release().await;
        // No retry: the key must be free the moment `release` returns.
        let guard = b.try_lock("sync").await.expect("free right after release");
        drop(guard);
        let took = wait_free(&a, "sync", FREED_WITHIN).await;
        eprintln!("a dropped guard freed the key within {took:?}");
        // The dropped guard's task lets go in b's process just after the remote
        // release that `wait_free` saw; until then b's next try would find it Busy.
        eventually("b lets go locally", || b.is_empty()).await;
    }
    assert!(a.is_empty() && b.is_empty());
}

/// `lock` (no limit), and limits far beyond any real wait, wait for the key like any
/// other: PostgreSQL's `lock_timeout` stops at 24.8 days, and `Instant + Duration::MAX`
/// overflows.
async fn waits_of_any_length_are_accepted<F: Fixture>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let month = Duration::from_secs(31 * 24 * 3600);
    for limit in [None, Some(month), Some(Duration::MAX)] {
        let held = b.lock("archive").await.unwrap();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move {
                match limit {
                    None => a.lock("archive").await,
                    Some(limit) => a.lock_timeout("archive", limit).await,
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        held.release().await;
        let granted = within("the long waiter gets the key", PATIENCE, waiter).await;
        let guard = granted.unwrap();
        guard
            .unwrap_or_else(|error| panic!("{limit:?}: {error}"))
            .release()
            .await;
    }
}

/// Grants alternate between instances, with and without a wait at the backend; every
/// fencing token is above the one before.
async fn fencing_tokens_increase_across_instances<F: Remote>() {
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    let mut last = 0;
    let mut check = |token: Option<u64>| {
        let token = token.expect("a backend grant has a fencing token");
        assert!(token > last, "token {token} after {last}");
        last = token;
    };

    for round in 0..6 {
        let locks = if round % 2 == 0 { &a } else { &b };
        let guard = locks.lock("ledger").await.unwrap();
        check(guard.fencing_token());
        guard.release().await;
    }
    // Granted after waiting at the backend for the other instance.
    let held = a.lock("ledger").await.unwrap();
    check(held.fencing_token());
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.lock("ledger").await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    held.release().await;
    let granted = within("the waiter gets the key", PATIENCE, waiter)
        .await
        .unwrap();
    check(granted.fencing_token());
}

/// Ten waiters of one key in one instance: while another instance holds the key, one
/// of them waits at the backend; then each gets its own remote grant, one at a time.
async fn local_waiters_share_one_remote_contender<F: Remote>() {
    const WAITERS: usize = 10;
    let fixture = F::start();
    let counting = Counting::new(fixture.backend_named("a").await);
    let a = locks_on(counting.clone());
    let b = fixture.instance("b").await;

    let held = b.lock("rebuild").await.unwrap();
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let a = a.clone();
            tokio::spawn(async move {
                let guard = a.lock("rebuild").await.unwrap();
                let token = guard.fencing_token();
                guard.release().await;
                token
            })
        })
        .collect();
    eventually("one waiter contends at the backend", || {
        counting.calls() == 1
    })
    .await;
    // Let the others queue, and a contender that was going to poll, poll.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(counting.calls(), 1, "more than one remote contender");
    assert_eq!(counting.in_flight(), 1);
    assert_eq!(a.len(), 1);

    held.release().await;
    let mut tokens = Vec::new();
    for waiter in waiters {
        tokens.push(within("a waiter", PATIENCE, waiter).await.unwrap().unwrap());
    }
    assert_eq!(
        counting.calls(),
        WAITERS,
        "one remote acquisition per grant"
    );
    assert_eq!(
        counting.most_in_flight(),
        1,
        "local waiters contended remotely"
    );
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), WAITERS, "every grant has a token of its own");
    assert!(a.is_empty());
}

/// With the server gone, an acquisition fails with `Backend` promptly (fail closed),
/// or, with `fail_open(true)`, holds the key in process and says so.
async fn server_down_fails_closed_or_open<F: Remote>() {
    let mut fixture = F::start();
    let closed = fixture.instance("closed").await;
    let open = DistributedLocks::builder(crate::support::fixtures::NAME)
        .shared_backend(fixture.backend_named("open").await)
        .fail_open(true)
        .build();
    // Both reach the server while it is up.
    closed.lock("payout").await.unwrap().release().await;
    let guard = open.lock("payout").await.unwrap();
    assert!(guard.failed_open().is_none());
    guard.release().await;

    // Only the wait bounds the waiting (DESIGN rule 11): an engine that retries a
    // refused connection within the wait fails when the wait ends, so it is short.
    const WAIT: Duration = Duration::from_millis(300);
    fixture.kill();
    let lateness = Lateness::watch();
    let started = Instant::now();
    let result = within("fail closed", PATIENCE, closed.lock_timeout("payout", WAIT)).await;
    let took = started.elapsed();
    assert!(matches!(result, Err(LockError::Backend(_))), "{result:?}");
    // The wait, and one connection attempt or command that started before its end.
    assert!(
        took < lateness.allowing(WAIT + Duration::from_secs(2)),
        "failed after {took:?}"
    );
    assert!(
        closed.is_empty(),
        "the local key was kept after the failure"
    );
    eprintln!("with the server down, lock failed with Backend after {took:?}");

    let guard = within("fail open", PATIENCE, open.lock_timeout("payout", WAIT))
        .await
        .unwrap();
    let error = guard.failed_open().expect("the guard says it failed open");
    assert!(!error.to_string().is_empty());
    assert_eq!(guard.fencing_token(), None);
    assert!(!guard.is_lost());
    // Still one holder per key in this process.
    assert!(matches!(
        open.try_lock("payout").await,
        Err(LockError::Busy)
    ));
    drop(guard);
    assert!(open.is_empty());
}

/// Bad keys are refused before any lock is touched: no panic, nothing held.
#[tokio::test]
async fn invalid_keys_are_refused() {
    let locks = DistributedLocks::builder(crate::support::fixtures::NAME)
        .max_key_len(8)
        .build();
    for key in ["", "line\nbreak", "longer than eight"] {
        for result in [
            locks.lock(key).await,
            locks.try_lock(key).await,
            locks.lock_timeout(key, Duration::from_secs(1)).await,
        ] {
            assert!(matches!(result, Err(LockError::InvalidKey(_))), "{key:?}");
        }
    }
    assert!(locks.is_empty());
}

/// Redis frozen (SIGSTOP: connections open, nothing answers): waits still end by their
/// deadline plus one command timeout (500 ms here), and the key is usable again once
/// Redis resumes.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_silent_server_ends_waits_in_time() {
    let fixture = <crate::support::fixtures::Redis as Fixture>::start();
    let a = fixture.instance("a").await;
    a.lock("report").await.unwrap().release().await;
    let command_timeout = Duration::from_millis(500);
    let lateness = Lateness::watch();

    fixture.0.pause();
    for (what, wait) in [
        ("try_lock", Duration::ZERO),
        ("lock_timeout", Duration::from_millis(300)),
    ] {
        let started = Instant::now();
        let result = within(what, PATIENCE, a.lock_timeout("report", wait)).await;
        let took = started.elapsed();
        assert!(
            matches!(result, Err(LockError::Backend(_))),
            "{what}: {result:?}"
        );
        assert!(
            took < lateness.allowing(wait + command_timeout + Duration::from_millis(300)),
            "{what} ({wait:?}) returned after {took:?}"
        );
        eprintln!("{what} ({wait:?}) against a frozen Redis: {result:?} after {took:?}");
        assert!(a.is_empty());
    }
    fixture.0.resume();
    let guard = within("Redis is back", PATIENCE, a.lock("report"))
        .await
        .unwrap();
    guard.release().await;
}
