//! What the ZooKeeper backend promises beyond the conformance suite and the queue
//! engines' shared tests (`queues.rs`: arrival order, odd keys, the leader killed
//! mid-hold, a majority down), on a real 3-server ensemble: waiters that keep their
//! place through the leader's death, a hold that survives a server's restart, a holder
//! cut off in a minority told before anyone else is granted, and the node of a create
//! whose answer never came deleted. The holder whose link goes silent past its
//! session timeout is the conformance suite's fault check
//! (`conformance::faults::zookeeper`), and here once more on a session heard for a
//! while first.
#![cfg(feature = "zookeeper")]
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::fixtures::{self as servers, locks_on, Fixture, PATIENCE};
use crate::support::hold::hold_through;
use crate::support::tcp_proxy::TcpProxy;
use crate::support::zookeeper_server::ZooKeeperEnsemble;
use tokio::time::{sleep, Instant};
use tower_keyed_lock::backend::zookeeper::ZooKeeperBackend;
use tower_keyed_lock::DistributedLocks;
use zookeeper_client as zk;

/// The session timeout of the fixture's backends.
pub(crate) const SESSION_TIMEOUT: Duration = servers::zookeeper::SESSION_TIMEOUT;

pub(crate) async fn backend(ensemble: &ZooKeeperEnsemble) -> ZooKeeperBackend {
    servers::ZooKeeper::backend_on_servers(&ensemble.connect_string()).await
}

/// A plain client of the ensemble, to look at the nodes.
pub(crate) async fn probe(ensemble: &ZooKeeperEnsemble) -> zk::Client {
    zk::Client::connect(&ensemble.connect_string())
        .await
        .expect("a probe connects to ZooKeeper")
}

/// How many contenders (holder and waiters) the queue of `key` has at ZooKeeper, after
/// the probe's server caught up with the leader (`sync`): the probe may be connected to
/// a follower that has not applied the backend's last create yet.
pub(crate) async fn queued(probe: &zk::Client, backend: &ZooKeeperBackend, key: &str) -> usize {
    let queue = backend.queue_path(servers::NAME, key);
    match probe.sync(&queue).await {
        Ok(()) | Err(zk::Error::NoNode) => {}
        Err(error) => panic!("ZooKeeper answers: {error}"),
    }
    match probe.list_children(&queue).await {
        Ok(children) => children.len(),
        Err(zk::Error::NoNode) => 0,
        Err(error) => panic!("ZooKeeper answers: {error}"),
    }
}

async fn until_queued(probe: &zk::Client, backend: &ZooKeeperBackend, key: &str, count: usize) {
    let started = Instant::now();
    while queued(probe, backend, key).await != count {
        assert!(
            started.elapsed() < PATIENCE,
            "the queue of {key:?} never had {count} contenders"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// A holder and five waiters, each on an instance of its own, with waits of 30 s; the
/// leader is killed while they queue, and the holder releases once a new one leads.
/// Every waiter is granted before its wait ends, in the order it arrived, one at a time:
/// a read of the queue or a watch that fails during the election (the connection lost,
/// no answer within the command timeout) is tried again within the wait, and the
/// waiter keeps its node and so its place. The waiters read their queue every 50 ms, so
/// that some of them are mid-read when the leader dies. The ensemble's tick is 500 ms,
/// so that a session of 10 s outlives an election on a loaded machine (a session lost
/// would send its waiter to the back of the queue, which is allowed but not FIFO).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_keep_their_place_through_the_leaders_death() {
    const WAIT: Duration = Duration::from_secs(30);
    let mut ensemble = ZooKeeperEnsemble::start_with_tick(Duration::from_millis(500));
    let connect = ensemble.connect_string();
    let instance = || async {
        let backend = ZooKeeperBackend::builder(&connect)
            .lease(Duration::from_secs(10))
            .command_timeout(Duration::from_millis(500))
            .poll_interval(Duration::from_millis(50))
            .build()
            .await
            .expect("the backend connects to ZooKeeper");
        locks_on(Arc::new(backend))
    };
    let probe = probe(&ensemble).await;
    let paths = backend(&ensemble).await;
    let holder = instance().await;
    let guard = holder.lock("election").await.unwrap();
    let overlap = Arc::new(crate::support::Overlap::default());
    let grants = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for n in 0..5 {
        let locks = instance().await;
        let (overlap, grants) = (overlap.clone(), grants.clone());
        waiters.push(tokio::spawn(async move {
            let started = Instant::now();
            let outcome = locks.lock_timeout("election", WAIT).await;
            let granted = Instant::now();
            let guard = outcome.map_err(|error| {
                format!(
                    "waiter {n} failed after {:?} of its {WAIT:?} wait: {error}",
                    granted - started
                )
            })?;
            {
                let _inside = overlap.enter();
                grants.lock().unwrap().push((n, granted, started + WAIT));
                sleep(Duration::from_millis(20)).await;
            }
            guard.release().await;
            Ok::<(), String>(())
        }));
        // The next waiter arrives only once this one is in the queue.
        until_queued(&probe, &paths, "election", n + 2).await;
    }
    drop(probe);
    let leader = ensemble.leader().expect("a leader");
    ensemble.kill(leader);
    let killed = Instant::now();
    ensemble
        .wait_for_leader(3 * PATIENCE)
        .expect("the two others elect a leader");
    eprintln!(
        "leader {leader} killed; a new one leads after {:?}",
        killed.elapsed()
    );
    // Long enough for every waiter to have read its queue through the election.
    sleep(Duration::from_millis(500)).await;
    let holder_lost = guard.is_lost();
    let released = Instant::now();
    guard.release().await;
    let mut failures = Vec::new();
    for waiter in waiters {
        if let Err(failure) = servers::within("every waiter ends", 2 * WAIT, waiter)
            .await
            .unwrap()
        {
            failures.push(failure);
        }
    }
    assert!(failures.is_empty(), "waits ended early: {failures:#?}");
    let grants = grants.lock().unwrap().clone();
    let order: Vec<usize> = grants.iter().map(|(n, _, _)| *n).collect();
    assert_eq!(order, [0, 1, 2, 3, 4], "not FIFO");
    for (n, granted, wait_ends) in &grants {
        assert!(
            granted < wait_ends,
            "waiter {n} granted after its wait ended"
        );
    }
    assert_eq!(overlap.max(), 1, "two waiters held the key at once");
    assert!(
        holder_lost || grants[0].1 >= released,
        "a waiter was granted while the holder held the key, unsignalled"
    );
    eprintln!(
        "through the election: 5 waiters granted in order, the last {:?} after the release",
        grants[4].1 - released
    );
}

/// Locks on a backend with `session_timeout` on `servers` (a connect string).
pub(crate) async fn with_session(servers: &str, session_timeout: Duration) -> DistributedLocks {
    let backend = ZooKeeperBackend::builder(servers)
        .lease(session_timeout)
        .command_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("the backend connects to ZooKeeper");
    locks_on(Arc::new(backend))
}

/// A follower is killed and started again on its data while a key is held: the hold
/// goes on (the other two keep the quorum; a client on the dead server reconnects to
/// another within its session of 4 s), and the server rejoins and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_restarted_mid_hold() {
    let mut ensemble = ZooKeeperEnsemble::start();
    let session = 2 * SESSION_TIMEOUT;
    let holder = with_session(&ensemble.connect_string(), session).await;
    let waiter = with_session(&ensemble.connect_string(), session).await;
    let server = (ensemble.leader().expect("a leader") + 1) % ensemble.size();
    let ensemble_ref = &mut ensemble;
    let survived = hold_through(&holder, waiter, "restart", 2 * session, async {
        ensemble_ref.kill(server);
        sleep(Duration::from_millis(500)).await;
        ensemble_ref.restart(server);
    })
    .await;
    assert!(
        survived,
        "a follower's restart cost the holder its lease (the quorum never went away)"
    );
    ensemble
        .wait_for_server(server, 3 * PATIENCE)
        .expect("the restarted server rejoins");
    let direct = with_session(&ensemble.address(server), SESSION_TIMEOUT).await;
    let guard = servers::within(
        "the restarted server serves",
        3 * PATIENCE,
        direct.lock_timeout("after", 2 * PATIENCE),
    )
    .await
    .unwrap();
    guard.release().await;
}

/// The holder's only server is cut off from the other two (a minority partition): it
/// loses its leader within the sync limit and stops serving, so no heartbeat of the
/// holder is answered, and the leader, on the majority side, expires the session one
/// session timeout after it last heard of it and deletes the node. The waiter, on the
/// majority side, is granted then — after the holder was told, by its local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_in_a_minority_partition_is_told_before_the_majority_grants() {
    let ensemble = ZooKeeperEnsemble::start_partitionable();
    let cut = (ensemble.leader().expect("a leader") + 1) % ensemble.size();
    let majority: Vec<String> = (0..ensemble.size())
        .filter(|&server| server != cut)
        .map(|server| ensemble.address(server))
        .collect();
    let holder = with_session(&ensemble.address(cut), SESSION_TIMEOUT).await;
    let waiter = with_session(&majority.join(","), SESSION_TIMEOUT).await;
    let guard = holder.lock("minority").await.unwrap();
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    ensemble.partition(cut);
    let partitioned = Instant::now();
    let taken = servers::within(
        "the majority side grants the key",
        3 * PATIENCE,
        waiter.lock_timeout("minority", 2 * PATIENCE),
    )
    .await
    .expect("the waiter is granted once the holder's session expired");
    let granted = Instant::now();
    let told = servers::within("the holder is told", PATIENCE, told)
        .await
        .unwrap();
    assert!(
        told <= granted,
        "unsignalled overlap: the majority granted {:?} before the holder was told",
        told - granted
    );
    assert!(guard.is_lost());
    eprintln!(
        "minority partition: holder told after {:?}, majority granted after {:?} (margin {:?})",
        told - partitioned,
        granted - partitioned,
        granted - told
    );
    taken.release().await;
    drop(guard);
    ensemble.heal(cut);
    ensemble
        .wait_for_server(cut, 3 * PATIENCE)
        .expect("the healed server rejoins");
    // The same backend serves again, with a new session.
    let again = servers::within("the healed side serves again", 3 * PATIENCE, async {
        loop {
            match holder.lock_timeout("minority-after", PATIENCE).await {
                Ok(guard) => break guard,
                Err(_) => sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    again.release().await;
}

/// The conformance suite's cut-off check, on a session heard for a while first (its
/// heartbeats answered for 3 s): the deadline then counts from the heartbeat before the
/// last answered one, so the holder is told 0.67–1.33 s after its path goes silent,
/// well before ZooKeeper expires the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_heard_for_a_while_is_told_well_before_its_session_expires() {
    let fixture = servers::ZooKeeper::start();
    let proxy = TcpProxy::start(fixture.0.client_addr(0)).await;
    let a = locks_on(Arc::new(
        servers::ZooKeeper::backend_with(
            &proxy.host_port(),
            servers::ZooKeeper::PROXIED_COMMAND_TIMEOUT,
        )
        .await,
    ));
    let b = fixture.instance("b").await;
    let guard = a.lock("heard").await.unwrap();
    sleep(3 * SESSION_TIMEOUT / 2).await;
    assert!(!guard.is_lost(), "a heard session lost its lease");
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    proxy.blackhole();
    let cut = Instant::now();
    let taken = servers::within(
        "b takes the cut-off holder's key",
        3 * PATIENCE,
        b.lock_timeout("heard", 3 * PATIENCE),
    )
    .await
    .expect("b is granted once the holder's session expired");
    let granted = Instant::now();
    let told = servers::within("the holder is told", PATIENCE, told)
        .await
        .unwrap();
    assert!(
        told <= granted,
        "unsignalled overlap: b was granted {:?} before the holder was told",
        told - granted
    );
    eprintln!(
        "heard, then cut off: holder told after {:?}, other instance granted after {:?} \
         (margin {:?})",
        told - cut,
        granted - cut,
        granted - told
    );
    taken.release().await;
}

/// The create of an acquisition reaches ZooKeeper only after the acquisition gave up
/// (its bytes held on the path, then delivered): the node is created for a contender
/// that is gone. The in-flight guard finds it by its token and deletes it, while the
/// session that owns it lives on, so another instance gets the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_create_whose_answer_never_came_is_deleted() {
    let fixture = servers::ZooKeeper::start();
    let probe = probe(&fixture.0).await;
    let paths = backend(&fixture.0).await;
    let proxy = TcpProxy::start(fixture.0.client_addr(0)).await;
    let a = locks_on(Arc::new(
        servers::ZooKeeper::backend_with(
            &proxy.host_port(),
            servers::ZooKeeper::PROXIED_COMMAND_TIMEOUT,
        )
        .await,
    ));
    // The session is open, through the proxy, and the queue node exists (a create
    // under a missing queue would be refused, not late).
    a.lock("late").await.unwrap().release().await;
    // Every node created and deleted under the queue, as the probe sees it.
    let queue = paths.queue_path(servers::NAME, "late");
    let mut watcher = probe
        .watch(&queue, zk::AddWatchMode::PersistentRecursive)
        .await
        .expect("a persistent watch");
    let events = tokio::spawn(async move {
        let mut events = Vec::new();
        loop {
            let event = watcher.changed().await;
            events.push((event.event_type, event.path));
            let created = events
                .iter()
                .filter(|(t, _)| *t == zk::EventType::NodeCreated);
            let deleted = events
                .iter()
                .filter(|(t, _)| *t == zk::EventType::NodeDeleted);
            // The late node, then the next instance's: both created and deleted.
            if created.count() >= 2 && deleted.count() >= 2 {
                return events;
            }
        }
    });
    proxy.hold_existing();
    // Given up by its caller, before its first attempt's command timeout: that is also
    // the client's connection timeout, and a create on a connection the client dropped
    // never arrives, late or not.
    let outcome = tokio::time::timeout(Duration::from_millis(100), a.lock("late")).await;
    assert!(outcome.is_err(), "granted through a held path: {outcome:?}");
    // Delivered well within the session timeout: the session lives on, and so would
    // the node, but for the guard.
    proxy.release_held();
    let b = fixture.instance("b").await;
    let taken = servers::within(
        "the late node is deleted",
        PATIENCE,
        b.lock_timeout("late", PATIENCE),
    )
    .await
    .expect("another instance gets the key");
    assert!(proxy.delivered_late() > 0, "nothing was held on the path");
    taken.release().await;
    let events = servers::within("the nodes come and go", PATIENCE, events)
        .await
        .unwrap();
    let late = events
        .iter()
        .find(|(t, path)| *t == zk::EventType::NodeCreated && path != &queue)
        .map(|(_, path)| path.clone())
        .expect("the late create landed");
    assert!(
        events.contains(&(zk::EventType::NodeDeleted, late.clone())),
        "the late node {late} was not deleted: {events:?}"
    );
    eprintln!("late create: {late} created after its acquisition gave up, then deleted");
    until_queued(&probe, &paths, "late", 0).await;
}

/// Building a backend against an address nobody listens on fails with an error that
/// names the engine and the address, then the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_ensemble_is_named_in_the_setup_error() {
    let servers = format!("127.0.0.1:{}", crate::support::ports::free_port());
    let refused = ZooKeeperBackend::builder(&servers)
        .command_timeout(Duration::from_millis(300))
        .build()
        .await
        .expect_err("built against an address nobody listens on");
    let shown = refused.to_string();
    let cause = std::error::Error::source(&refused)
        .expect("the cause is kept")
        .to_string();
    assert!(
        shown.contains("ZooKeeper") && shown.contains(&servers),
        "the engine or the address is missing: {shown}"
    );
    assert!(
        shown.ends_with(&cause),
        "the cause does not follow: {shown}"
    );
}
