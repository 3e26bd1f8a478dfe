//! What the etcd backend promises beyond the conformance suite, on a real 3-member
//! cluster: waiters served in arrival order across instances, a hold that survives the
//! leader's death or a member's restart (or is signalled lost before anyone else is
//! granted), and the key mapping seen from etcd.
#![cfg(feature = "etcd")]
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::etcd_server::{EtcdCluster, ELECTION_TIMEOUT};
use crate::support::fixtures::{self as servers, locks_on, Fixture, Remote, PATIENCE};
use crate::support::hold::hold_through;
use tokio::time::{sleep, Instant};
use tower_keyed_lock::backend::etcd::EtcdBackend;
use tower_keyed_lock::DistributedLocks;

const LEASE: Duration = Duration::from_secs(1);

async fn backend(cluster: &EtcdCluster) -> EtcdBackend {
    servers::Etcd::backend_on_endpoints(cluster.endpoints()).await
}

/// How many contenders (holder and waiters) the queue of `key` has at etcd.
async fn queued(backend: &EtcdBackend, key: &str) -> usize {
    let mut client = backend.client().clone();
    let prefix = backend.queue_prefix(servers::NAME, key);
    let found = client
        .get(
            prefix,
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await
        .expect("etcd answers");
    usize::try_from(found.count()).unwrap()
}

async fn until_queued(backend: &EtcdBackend, key: &str, count: usize) {
    let started = Instant::now();
    while queued(backend, key).await < count {
        assert!(
            started.elapsed() < PATIENCE,
            "{count} contenders never queued for {key:?}"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// Four instances: one holds, three queue one after another. On release the key passes
/// in the order they arrived, whatever instance they are on, and the fencing tokens
/// follow that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_served_in_arrival_order_across_instances() {
    let cluster = EtcdCluster::start();
    let probe = backend(&cluster).await;
    let holder = locks_on(Arc::new(backend(&cluster).await));
    let guard = holder.lock("fifo").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (n, name) in ["first", "second", "third"].into_iter().enumerate() {
        let locks = locks_on(Arc::new(backend(&cluster).await));
        let order = order.clone();
        waiters.push(tokio::spawn(async move {
            let guard = locks.lock_timeout("fifo", 3 * PATIENCE).await.unwrap();
            order
                .lock()
                .unwrap()
                .push((name, guard.fencing_token().unwrap()));
            sleep(Duration::from_millis(20)).await;
            guard.release().await;
        }));
        // The next waiter arrives only once this one is in the queue.
        until_queued(&probe, "fifo", n + 2).await;
    }
    guard.release().await;
    for waiter in waiters {
        servers::within("every waiter is served", 3 * PATIENCE, waiter)
            .await
            .unwrap();
    }
    let order = order.lock().unwrap().clone();
    let names: Vec<&str> = order.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["first", "second", "third"], "not FIFO: {order:?}");
    assert!(
        order.windows(2).all(|pair| pair[0].1 < pair[1].1),
        "fencing tokens out of order: {order:?}"
    );
    assert_eq!(queued(&probe, "fifo").await, 0, "a contender key was left");
}

/// The leader dies while a key is held: a new one is elected within one to two
/// election timeouts and extends every lease, and the holder's keep-alives reach it
/// through the other members. With a lease of 3 s (keep-alives every second) the hold
/// normally goes on; on a machine too loaded to elect in time it is signalled lost
/// before the waiter is granted. Either way, no unsignalled overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_killed_mid_hold() {
    let mut cluster = servers::Etcd::start();
    let lease = 3 * LEASE;
    let holder = with_lease(&cluster.0, lease).await;
    let waiter = with_lease(&cluster.0, lease).await;
    let leader = cluster.0.leader().expect("a leader");
    let cluster_ref = &mut cluster.0;
    let survived = hold_through(&holder, waiter, "leader", 2 * lease, async {
        cluster_ref.kill(leader);
    })
    .await;
    eprintln!("leader {leader} killed mid-hold: hold survived = {survived}");
    cluster
        .0
        .wait_for_leader(PATIENCE)
        .expect("the two others elect a leader");
    assert_ne!(cluster.0.leader(), Some(leader));
    // Serving goes on with two members of three.
    let again = holder.lock_timeout("after", PATIENCE).await.unwrap();
    again.release().await;
}

/// Locks on a backend with `lease` (keep-alives every lease/3) on every member.
async fn with_lease(cluster: &EtcdCluster, lease: Duration) -> DistributedLocks {
    let backend = EtcdBackend::builder(cluster.endpoints())
        .lease(lease)
        .command_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("the backend connects to etcd");
    locks_on(Arc::new(backend))
}

/// A follower is killed and started again on its data while a key is held: the hold
/// goes on (the other two keep the quorum; a keep-alive sent to the dead member is
/// sent again to another within the lease of 3 s), and the member rejoins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_restarted_mid_hold() {
    let mut cluster = servers::Etcd::start();
    let holder = with_lease(&cluster.0, 3 * LEASE).await;
    let waiter = with_lease(&cluster.0, 3 * LEASE).await;
    let member = (cluster.0.leader().expect("a leader") + 1) % cluster.0.size();
    let cluster_ref = &mut cluster.0;
    let survived = hold_through(&holder, waiter, "restart", 6 * LEASE, async {
        cluster_ref.kill(member);
        sleep(ELECTION_TIMEOUT).await;
        cluster_ref.restart(member);
    })
    .await;
    assert!(
        survived,
        "a follower's restart cost the holder its lease (the quorum never went away)"
    );
    // Every member serves again, the restarted one too.
    let direct = locks_on(Arc::new(
        servers::Etcd::backend_on_endpoints(vec![cluster.0.endpoint(member)]).await,
    ));
    let guard = servers::within(
        "the restarted member serves",
        3 * PATIENCE,
        direct.lock_timeout("after", 2 * PATIENCE),
    )
    .await
    .unwrap();
    guard.release().await;
}

/// Every member dies: the holder is told at its local deadline, and acquisitions fail
/// with a backend error within their wait plus a command timeout, never hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_cluster_down_is_a_lost_lease_and_a_prompt_error() {
    let mut cluster = servers::Etcd::start();
    let holder = cluster.instance("holder").await;
    let guard = holder.lock("down").await.unwrap();
    cluster.kill();
    // Every member is dead from here: no keep-alive sent later is answered.
    let killed = Instant::now();
    // Its last keep-alive was sent before the kill: by the clock alone, the lease is
    // lost one lease after the kill at the latest.
    tokio::time::sleep_until(killed + LEASE).await;
    assert!(
        guard.is_lost(),
        "the holder's lease still counts as valid a lease after the cluster died"
    );
    drop(guard);
    let started = Instant::now();
    let outcome = holder
        .lock_timeout("down-2", Duration::from_millis(300))
        .await;
    assert!(outcome.is_err(), "granted with no cluster: {outcome:?}");
    assert!(
        started.elapsed()
            < Duration::from_millis(300) + 2 * Duration::from_millis(500) + PATIENCE / 10,
        "an acquisition took {:?} with the cluster down",
        started.elapsed()
    );
}

/// Keys with separators, `%`, non-ASCII text and more than 128 bytes each get a queue
/// of their own, exactly one level under the layer name, and two such keys exclude
/// nobody but themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_keys_map_to_one_queue_each() {
    let cluster = EtcdCluster::start();
    let backend = backend(&cluster).await;
    let locks = locks_on(Arc::new(backend.clone()));
    let long = "é".repeat(100);
    let keys = ["a/b", "a%2Fb", "../..", "é", long.as_str(), "#", "a b"];
    let mut guards = Vec::new();
    for key in keys {
        // Each is free although the others are held: no two share a queue.
        guards.push(locks.try_lock(key).await.expect("a queue of its own"));
        let queue = backend.queue_prefix(servers::NAME, key);
        assert_eq!(queue.matches('/').count(), 3, "{queue}");
        assert!(
            queue.len() <= "keyed-lock/".len() + 4 + 1 + 129 + 1,
            "{queue}"
        );
        assert_eq!(queued(&backend, key).await, 1);
    }
    for guard in guards {
        guard.release().await;
    }
}

/// Two members of three die, the leader survives: it goes on answering keep-alives
/// (etcd renews leases on the leader without a quorum round) until it finds the quorum
/// gone and steps down, one to two election timeouts later. From then on the holder
/// cannot renew and is told by its local deadline, by the clock alone. No other
/// instance can be granted meanwhile (a grant needs the quorum), and the next leader
/// extends every lease by an election timeout. When the members come back, the same
/// backend serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_majority_down_is_a_lost_lease_then_recovers() {
    let mut cluster = servers::Etcd::start();
    let holder = cluster.instance("holder").await;
    let guard = holder.lock("majority").await.unwrap();
    let survivor = cluster.0.leader().expect("a leader");
    let others: Vec<usize> = (0..cluster.0.size()).filter(|m| *m != survivor).collect();
    for member in &others {
        cluster.0.kill(*member);
    }
    let killed = Instant::now();
    let signal = guard.lease().unwrap().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    tokio::time::sleep_until(killed + 2 * ELECTION_TIMEOUT + LEASE).await;
    assert!(
        guard.is_lost(),
        "the holder's lease still counts as valid two election timeouts and a lease \
         after the quorum was lost"
    );
    let told = told.await.unwrap();
    eprintln!(
        "majority down: the holder was told after {:?}",
        told - killed
    );
    drop(guard);
    for member in &others {
        cluster.0.restart(*member);
    }
    cluster
        .0
        .wait_for_leader(PATIENCE)
        .expect("the members elect a leader again");
    let again = servers::within("the backend serves again", 3 * PATIENCE, async {
        loop {
            match holder.lock_timeout("majority", PATIENCE).await {
                Ok(guard) => break guard,
                Err(_) => sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    again.release().await;
}
