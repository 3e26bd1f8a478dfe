//! `LeaderElection` on every fixture: one leader at a time, a step-down elects the
//! next candidate, a cut-off leader is told before another is elected, `leader()`
//! names the leader, a campaign dropped at any moment leaves nothing held, and a
//! shutdown steps the leader down as it begins.

#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tower_keyed_lock::backend::{default_instance_id, LostReason};
use tower_keyed_lock::{LeaderElection, LockError};

use crate::support::fixtures::{locks_on, wait_free, within, Fixture, Proxied, Remote, PATIENCE};
use crate::support::tcp_proxy::TcpProxy;

const KEY: &str = "leader";

for_each_fixture!(
    all: [
        exactly_one_leader_at_a_time,
        a_step_down_elects_the_waiting_candidate,
        a_dropped_campaign_leaves_nothing_held,
        leader_names_the_current_leader,
    ],
    remote: [a_shutdown_steps_the_leader_down_at_once],
);

/// `leader_cut_off!(module, Fixture, "feature")`: the leader's connection goes silent.
macro_rules! leader_cut_off {
    ($module:ident, $fixture:ty, $feature:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_cut_off_leader_is_told_before_the_next_is_elected() {
                crate::leader::a_cut_off_leader_is_told_before_the_next_is_elected::<$fixture>()
                    .await
            }
        }
    };
}

mod cut_off {
    leader_cut_off!(redis, crate::support::fixtures::Redis, "redis");
    leader_cut_off!(postgres, crate::support::fixtures::Postgres, "postgres");
    leader_cut_off!(dynamodb, crate::support::fixtures::DynamoDb, "dynamodb");
    leader_cut_off!(mysql, crate::support::fixtures::MySql, "mysql");
    leader_cut_off!(zookeeper, crate::support::fixtures::ZooKeeper, "zookeeper");
    leader_cut_off!(etcd, crate::support::fixtures::Etcd, "etcd");
}

/// Three candidates on three instances run as leader in turn, four terms each: never
/// two leaders at once, and every term is served (no candidate is starved or stuck).
async fn exactly_one_leader_at_a_time<F: Fixture>() {
    let fixture = F::start();
    let leaders = Arc::new(AtomicUsize::new(0));
    let terms = Arc::new(AtomicUsize::new(0));
    let mut candidates = Vec::new();
    for name in ["a", "b", "c"] {
        let election = LeaderElection::new(fixture.instance(name).await, KEY);
        let (leaders, terms) = (leaders.clone(), terms.clone());
        candidates.push(tokio::spawn(async move {
            for _ in 0..4 {
                let served = election
                    .run_as_leader(|_| async {
                        assert_eq!(leaders.fetch_add(1, SeqCst), 0, "two leaders at once");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        leaders.fetch_sub(1, SeqCst);
                        terms.fetch_add(1, SeqCst);
                    })
                    .await;
                served.expect("campaign").expect("the leadership held");
            }
        }));
    }
    for candidate in candidates {
        within("every term served", PATIENCE * 3, candidate)
            .await
            .unwrap();
    }
    assert_eq!(terms.load(SeqCst), 12);
}

/// The leader steps down while another candidate campaigns: that candidate is elected,
/// with a newer fencing token where the backend issues them.
async fn a_step_down_elects_the_waiting_candidate<F: Fixture>() {
    let fixture = F::start();
    let a = LeaderElection::new(fixture.instance("a").await, KEY);
    let b = LeaderElection::new(fixture.instance("b").await, KEY);

    let first = a.campaign().await.unwrap();
    assert!(matches!(b.try_campaign().await, Err(LockError::Busy)));
    let waiting = tokio::spawn(async move { b.campaign().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "elected while another was leader");

    let token = first.fencing_token();
    first.step_down().await;
    let second = within("the waiting candidate is elected", PATIENCE, waiting)
        .await
        .unwrap()
        .expect("elected");
    if let (Some(before), Some(after)) = (token, second.fencing_token()) {
        assert!(
            after > before,
            "the new leader's token {after} is not above {before}"
        );
    }
    assert!(matches!(a.try_campaign().await, Err(LockError::Busy)));
    second.step_down().await;
}

/// A campaign dropped at moments from 0 to 50 ms, while another candidate leads (so it
/// waits, here or at the backend) or while nobody does (so it may just have won):
/// nothing stays held, and the next candidate is elected.
async fn a_dropped_campaign_leaves_nothing_held<F: Fixture>() {
    let fixture = F::start();
    let a = LeaderElection::new(fixture.instance("a").await, KEY);
    let b = LeaderElection::new(fixture.instance("b").await, KEY);
    let c = fixture.instance("c").await;
    for ms in [0, 1, 2, 5, 10, 20, 50] {
        let limit = Duration::from_millis(ms);
        // Waiting behind a leader of another instance.
        let leader = a.campaign().await.unwrap();
        let _ = tokio::time::timeout(limit, b.campaign()).await;
        leader.step_down().await;
        wait_free(&c, KEY, fixture.freed_within()).await;
        // Racing for a free key.
        if let Ok(Ok(won)) = tokio::time::timeout(limit, b.campaign()).await {
            drop(won);
        }
        wait_free(&c, KEY, fixture.freed_within()).await;
    }
}

/// `leader()` is `None` without a leader, names the leader's instance and fencing token
/// while there is one (a backend that cannot name it: says only that there is one), and is `None` again after the step-down; reading it elects no
/// one.
async fn leader_names_the_current_leader<F: Fixture>() {
    let fixture = F::start();
    let a = LeaderElection::new(fixture.instance("a").await, KEY);
    let b = LeaderElection::new(fixture.instance("b").await, KEY);

    assert_eq!(b.leader().await.unwrap(), None);
    let leadership = a.try_campaign().await.expect("reading elected no one");
    let leader = b.leader().await.unwrap().expect("a leader");
    if F::NAMES_HOLDERS {
        assert_eq!(leader.instance(), Some(default_instance_id().as_str()));
        if leadership.fencing_token().is_some() {
            assert_eq!(leader.fencing_token(), leadership.fencing_token());
        }
    } else {
        // Held or free only, as the backend documents (MySQL).
        assert_eq!(leader, tower_keyed_lock::backend::Holder::new());
    }
    leadership.step_down().await;
    assert_eq!(b.leader().await.unwrap(), None);
    b.try_campaign()
        .await
        .expect("free after the step-down")
        .step_down()
        .await;
}

/// The leader's path to the engine goes silent (it is cut off, as a crashed or
/// partitioned leader is): the other candidate is elected, but only after the old
/// leader's lost signal fired, and the old leader's work was dropped.
async fn a_cut_off_leader_is_told_before_the_next_is_elected<F: Remote + Proxied>() {
    let fixture = F::start();
    let proxy = TcpProxy::start(fixture.upstream()).await;
    let a = LeaderElection::new(locks_on(fixture.backend_via(&proxy.host_port()).await), KEY);
    let b = LeaderElection::new(fixture.instance("b").await, KEY);

    let (started_tx, started) = tokio::sync::oneshot::channel();
    let stopped = Arc::new(std::sync::Mutex::new(None));
    let probe = StopProbe(stopped.clone());
    let old = tokio::spawn(async move {
        a.run_as_leader(|_| async move {
            let _probe = probe;
            let _ = started_tx.send(());
            std::future::pending::<()>().await
        })
        .await
        .expect("elected")
    });
    within("a is leader", PATIENCE, started).await.unwrap();
    proxy.blackhole();

    let next = within("b is elected", PATIENCE * 3, b.campaign())
        .await
        .expect("b is elected once a's lease is gone");
    let elected = Instant::now();
    let outcome = within("a steps down", PATIENCE * 3, old).await.unwrap();
    assert!(
        outcome.is_err(),
        "the old leader's work ended without a lost lease"
    );
    let told = stopped
        .lock()
        .unwrap()
        .expect("the old leader's work was dropped");
    assert!(
        told <= elected,
        "b was elected {:?} before the old leader's work was stopped",
        told - elected
    );
    next.step_down().await;
}

/// Lives in the leader's work: records when it was dropped.
struct StopProbe(Arc<std::sync::Mutex<Option<Instant>>>);

impl Drop for StopProbe {
    fn drop(&mut self) {
        *self.0.lock().unwrap() = Some(Instant::now());
    }
}

/// The leader's instance shuts down with a deadline longer than the test waits: the
/// leader steps down as the shutdown begins — told first (reason `ShutDown`), its lease
/// given back — so the candidate waiting on another instance is elected while the
/// shutdown still drains, not at its deadline. The old leader's work then ends, and the
/// drain with it.
async fn a_shutdown_steps_the_leader_down_at_once<F: Remote>() {
    let fixture = F::start();
    let a = fixture.instance("a").await;
    let leadership = LeaderElection::new(a.clone(), KEY)
        .campaign()
        .await
        .unwrap();
    let rival = LeaderElection::new(fixture.instance("b").await, KEY);
    let waiting = tokio::spawn(async move { rival.campaign().await });
    // Time to queue at the backend (setup only).
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "one leader at a time");

    let deadline = 3 * PATIENCE;
    let draining = tokio::spawn({
        let a = a.clone();
        async move { a.shutdown(deadline).await }
    });
    within(
        "the leader is told as the shutdown begins",
        PATIENCE,
        leadership.lost(),
    )
    .await;
    assert_eq!(leadership.guard().lost_reason(), Some(LostReason::ShutDown));
    let next = within("the rival is elected", PATIENCE, waiting)
        .await
        .unwrap()
        .expect("elected");
    assert!(
        !draining.is_finished(),
        "elected while the old leader's instance still drains (deadline {deadline:?})"
    );
    if let (Some(before), Some(after)) = (leadership.fencing_token(), next.fencing_token()) {
        assert!(after > before, "{after} after {before}");
    }

    // The old leader's work sees `lost` and ends: the drain ends with it.
    drop(leadership);
    let report = within("the drain ends", PATIENCE, draining).await.unwrap();
    assert_eq!(
        (report.finished, report.cut_off, report.leases_released),
        (1, 0, 1),
        "{report}"
    );
    next.step_down().await;
}
