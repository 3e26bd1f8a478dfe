//! `DistributedLocks` records the layer's series under its own name: waits by outcome,
//! acquisitions by contention, rejections by reason, hold times, waiting and keys
//! gauges, and leases lost while held.

use std::future::Future;
use std::time::Duration;

use metrics_util::debugging::DebugValue;
use tower_keyed_lock::backend::{
    Acquisition, Lease, LeaseSignal, LockBackend, LostReason, ReleaseLease,
};
use tower_keyed_lock::{BoxFuture, DistributedLocks, Key, LockError};

use crate::support::recorder;

/// The samples of histogram `metric` of locks `name` with `outcome` (if given).
fn samples(metric: &str, name: &str, outcome: Option<&str>) -> usize {
    recorder::snapshot()
        .into_iter()
        .filter_map(|(composite, value)| {
            let key = composite.key();
            let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
            let named = labels.contains(&("name", name));
            let outcome_ok = outcome.is_none_or(|o| labels.contains(&("outcome", o)));
            match value {
                DebugValue::Histogram(all) if key.name() == metric && named && outcome_ok => {
                    Some(all.len())
                }
                _ => None,
            }
        })
        .sum()
}

fn gauge(metric: &str, name: &str) -> f64 {
    recorder::snapshot()
        .into_iter()
        .find_map(|(composite, value)| {
            let key = composite.key();
            let named = key.labels().any(|l| l.key() == "name" && l.value() == name);
            match value {
                DebugValue::Gauge(n) if key.name() == metric && named => Some(n.into_inner()),
                _ => None,
            }
        })
        .unwrap_or(0.0)
}

#[tokio::test]
async fn in_process_locks_record_every_outcome() {
    recorder::install();
    const NAME: &str = "metrics-jobs";
    let locks = DistributedLocks::in_process(NAME);
    let held = locks.lock("a").await.unwrap();
    assert!(matches!(locks.try_lock("a").await, Err(LockError::Busy)));
    let timed_out = locks.lock_timeout("a", Duration::from_millis(20)).await;
    assert!(matches!(timed_out, Err(LockError::Timeout)));
    // A waiter dropped while it waits.
    let cancelled = tokio::time::timeout(Duration::from_millis(20), locks.lock("a")).await;
    assert!(cancelled.is_err());
    assert_eq!(gauge("keyed_lock_waiting", NAME), 0.0, "every wait ended");
    // A contended acquisition: released while the waiter waits.
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("a").await.unwrap().release().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    held.release().await;
    waiter.await.unwrap();

    let acquired = |contended| {
        recorder::counter(
            "keyed_lock_acquired_total",
            NAME,
            &[("contended", contended)],
        )
    };
    assert_eq!((acquired("false"), acquired("true")), (1, 1));
    assert_eq!(
        recorder::counter("keyed_lock_rejected_total", NAME, &[("reason", "timeout")]),
        2
    );
    assert_eq!(
        samples("keyed_lock_wait_seconds", NAME, Some("acquired")),
        2
    );
    assert_eq!(samples("keyed_lock_wait_seconds", NAME, Some("timeout")), 2);
    assert_eq!(
        samples("keyed_lock_wait_seconds", NAME, Some("cancelled")),
        1
    );
    assert_eq!(samples("keyed_lock_hold_seconds", NAME, None), 2);
    assert_eq!(gauge("keyed_lock_keys", NAME), 0.0);
    assert_eq!(gauge("keyed_lock_waiting", NAME), 0.0);
}

/// A backend whose every lease is lost as soon as it is granted.
pub(crate) struct LosesEveryLease;

struct Nothing;

impl ReleaseLease for Nothing {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        Box::pin(async {})
    }
}

impl LockBackend for LosesEveryLease {
    fn acquire(&self, _: &str, _: &Key, _: Duration) -> Acquisition {
        Box::pin(async {
            let (sender, signal) = LeaseSignal::new();
            sender.lose(LostReason::NotOwner);
            Ok(Lease::new(Some(1), signal, Nothing))
        })
    }
}

#[tokio::test]
async fn a_lease_lost_while_held_is_counted() {
    recorder::install();
    const NAME: &str = "metrics-lost";
    let locks = DistributedLocks::new(NAME, LosesEveryLease);
    let guard = locks.lock("a").await.unwrap();
    assert_eq!(guard.lost_reason(), Some(LostReason::NotOwner));
    drop(guard);
    // Counted under its reason, and under no other.
    assert_eq!(
        recorder::counter(
            "keyed_lock_lease_lost_total",
            NAME,
            &[("reason", "not_owner")]
        ),
        1
    );
    for other in ["unreachable", "expired", "shut_down"] {
        assert_eq!(
            recorder::counter("keyed_lock_lease_lost_total", NAME, &[("reason", other)]),
            0
        );
    }
    assert_eq!(samples("keyed_lock_hold_seconds", NAME, None), 1);
}

/// A backend that answers after a round trip's pause, and says its grant was
/// contended when `contended`.
struct AnswersLater {
    contended: bool,
}

impl LockBackend for AnswersLater {
    fn acquire(&self, _: &str, _: &Key, _: Duration) -> Acquisition {
        let contended = self.contended;
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let (_sender, signal) = LeaseSignal::new();
            Ok(Lease::new(Some(1), signal, Nothing).with_contention(contended))
        })
    }
}

/// Contention is what the backend says of its attempts, or a wait in this process: a
/// remote acquisition is not contended for having waited on the network.
#[tokio::test]
async fn contention_is_the_backends_word_or_a_local_wait() {
    recorder::install();
    let acquired = |name, contended| {
        recorder::counter(
            "keyed_lock_acquired_total",
            name,
            &[("contended", contended)],
        )
    };

    // The backend's word, passed on and counted.
    for (name, contended) in [
        ("metrics-remote-free", false),
        ("metrics-remote-held", true),
    ] {
        let locks = DistributedLocks::new(name, AnswersLater { contended });
        let guard = locks.lock("a").await.unwrap();
        assert_eq!(guard.contended(), contended, "{name}");
        drop(guard);
        let counted = (acquired(name, "false"), acquired(name, "true"));
        assert_eq!(
            counted,
            (u64::from(!contended), u64::from(contended)),
            "{name}"
        );
    }

    // Queued behind a holder of this process, then granted at once remotely.
    const LOCAL: &str = "metrics-local-queue";
    let locks = DistributedLocks::new(LOCAL, AnswersLater { contended: false });
    let held = locks.lock("a").await.unwrap();
    let mut waiter = locks.lock("a");
    std::future::poll_fn(|cx| {
        let polled = std::pin::Pin::new(&mut waiter).poll(cx);
        assert!(polled.is_pending(), "a held key was granted again");
        std::task::Poll::Ready(())
    })
    .await;
    drop(held);
    let granted = waiter.await.unwrap();
    assert!(granted.contended(), "a local wait was not contention");
    drop(granted);
    assert_eq!((acquired(LOCAL, "false"), acquired(LOCAL, "true")), (1, 1));
}
