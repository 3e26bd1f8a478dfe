//! What the queue engines (etcd, ZooKeeper: a contender's record per waiter, ordered by
//! the engine, on a 3-member cluster) promise alike, one test body run on both: waiters
//! served in arrival order across instances; odd keys mapped to one queue each; a hold
//! through the leader's death; a majority down told by the holder's local deadline,
//! before anyone else is granted, and served again once it returns.
#![cfg(any(feature = "etcd", feature = "zookeeper"))]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{sleep, Instant};
use tower_keyed_lock::DistributedLocks;

use crate::support::fixtures::{self as servers, PATIENCE};
use crate::support::hold::hold_through;

/// A queue engine's cluster of three, as the shared tests drive it.
trait QueueCluster: Sized + Send + Sync {
    /// The lease (etcd) or session timeout (ZooKeeper) of the instances below.
    const LEASE: Duration;
    /// The lease of the leader-kill test: long enough to outlast an election.
    const THROUGH_AN_ELECTION: Duration;
    /// How soon after the majority test's kill the holder is told at the latest.
    const TOLD_WITHIN: Duration;
    /// How long a key's queue path may be (one level under the lock name, its key
    /// part at most 129 bytes).
    const LONGEST_QUEUE: usize;

    fn start() -> impl Future<Output = Self> + Send;

    /// An instance on every member, with `lease` and a 500 ms command timeout.
    fn instance(&self, lease: Duration) -> impl Future<Output = DistributedLocks> + Send;

    /// How many contenders (holder and waiters) the queue of `key` holds, as the
    /// engine's own reads see it.
    fn queued(&self, key: &str) -> impl Future<Output = usize> + Send;

    /// Where the queue of `key` lives.
    fn queue_of(&self, key: &str) -> String;

    fn leader(&self) -> Option<usize>;
    fn kill(&mut self, member: usize);
    fn restart(&mut self, member: usize);
    fn wait_for_leader(&self, limit: Duration) -> Result<(), String>;

    /// The two members of three the majority test kills.
    fn majority(&self) -> [usize; 2];
}

async fn until_queued<C: QueueCluster>(cluster: &C, key: &str, count: usize) {
    let started = Instant::now();
    while cluster.queued(key).await != count {
        assert!(
            started.elapsed() < PATIENCE,
            "the queue of {key:?} never had {count} contenders"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// Four instances: one holds, three queue one after another. On release the key passes
/// in the order they arrived, whatever instance they are on, the fencing tokens follow
/// that order, and no contender is left in the queue.
async fn waiters_are_served_in_arrival_order_across_instances<C: QueueCluster>() {
    let cluster = C::start().await;
    let holder = cluster.instance(C::LEASE).await;
    let guard = holder.lock("fifo").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (n, name) in ["first", "second", "third"].into_iter().enumerate() {
        let locks = cluster.instance(C::LEASE).await;
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
        until_queued(&cluster, "fifo", n + 2).await;
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
    until_queued(&cluster, "fifo", 0).await;
}

/// Keys with separators, dots, `%`, non-ASCII text, names the engine reserves and more
/// than 128 bytes each get a queue of their own, exactly one level under the lock name,
/// and two such keys exclude nobody but themselves; the queues empty with the release.
async fn odd_keys_map_to_one_queue_each<C: QueueCluster>() {
    let cluster = C::start().await;
    let locks = cluster.instance(C::LEASE).await;
    let long = "é".repeat(100);
    let keys = [
        "a/b",
        "a%2Fb",
        "..",
        ".",
        "../..",
        "zookeeper",
        "é",
        long.as_str(),
        "#",
        "a b",
    ];
    let mut guards = Vec::new();
    for key in keys {
        // Each is free although the others are held: no two share a queue.
        guards.push(locks.try_lock(key).await.expect("a queue of its own"));
        let queue = cluster.queue_of(key);
        assert_eq!(queue.matches('/').count(), 3, "{queue}");
        assert!(queue.len() <= C::LONGEST_QUEUE, "{queue}");
        assert_eq!(cluster.queued(key).await, 1, "{queue}");
    }
    for guard in guards {
        guard.release().await;
    }
    for key in keys {
        until_queued(&cluster, key, 0).await;
    }
}

/// The leader dies while a key is held: the other two elect a new one, and the holder
/// keeps its lease through the surviving members. With a lease that outlasts an
/// election the hold normally goes on; on a machine too loaded to elect in time it is
/// signalled lost before the waiter is granted. Either way, no unsignalled overlap;
/// then the two serve on.
async fn the_leader_killed_mid_hold<C: QueueCluster>() {
    let mut cluster = C::start().await;
    let lease = C::THROUGH_AN_ELECTION;
    let holder = cluster.instance(lease).await;
    let waiter = cluster.instance(lease).await;
    let leader = cluster.leader().expect("a leader");
    let cluster_ref = &mut cluster;
    let survived = hold_through(&holder, waiter, "leader", 2 * lease, async {
        cluster_ref.kill(leader);
    })
    .await;
    eprintln!("leader {leader} killed mid-hold: hold survived = {survived}");
    cluster
        .wait_for_leader(PATIENCE)
        .expect("the two others elect a leader");
    assert_ne!(cluster.leader(), Some(leader));
    // Serving goes on with two members of three.
    let again = holder.lock_timeout("after", PATIENCE).await.unwrap();
    again.release().await;
}

/// Two members of three die while a key is held and another instance keeps asking for
/// it. The holder cannot renew and is told by its local deadline
/// ([`QueueCluster::TOLD_WITHIN`]); nobody else is granted meanwhile (a grant needs the
/// quorum). When the members come back, the waiter is granted, after the holder was
/// told, and the holder's instance serves again.
async fn a_majority_down_is_a_lost_lease_then_recovers<C: QueueCluster>() {
    let mut cluster = C::start().await;
    let holder = cluster.instance(C::LEASE).await;
    let waiter = cluster.instance(C::LEASE).await;
    let guard = holder.lock("majority").await.unwrap();
    let signal = guard.lease().unwrap().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    let down = cluster.majority();
    for member in down {
        cluster.kill(member);
    }
    let killed = Instant::now();
    let granted = Arc::new(Mutex::new(None));
    let other = tokio::spawn({
        let granted = granted.clone();
        async move {
            loop {
                match waiter
                    .lock_timeout("majority", Duration::from_millis(500))
                    .await
                {
                    Ok(guard) => {
                        *granted.lock().unwrap() = Some(Instant::now());
                        return guard;
                    }
                    Err(_) => sleep(Duration::from_millis(20)).await,
                }
            }
        }
    });
    tokio::time::sleep_until(killed + C::TOLD_WITHIN).await;
    assert!(
        guard.is_lost(),
        "the holder's lease still counts as valid {:?} after the quorum was lost",
        C::TOLD_WITHIN
    );
    let told = told.await.unwrap();
    eprintln!(
        "majority down: the holder was told after {:?}",
        told - killed
    );
    for member in down {
        cluster.restart(member);
    }
    cluster
        .wait_for_leader(3 * PATIENCE)
        .expect("the members elect a leader again");
    let taken = servers::within("the waiter gets the key", 3 * PATIENCE, other)
        .await
        .unwrap();
    let granted = granted.lock().unwrap().expect("granted");
    assert!(
        told <= granted,
        "unsignalled overlap: granted {:?} before the holder was told",
        told - granted
    );
    eprintln!(
        "majority down: waiter granted {:?} after the holder was told",
        granted - told
    );
    taken.release().await;
    drop(guard);
    let again = servers::within("the backend serves again", 3 * PATIENCE, async {
        loop {
            match holder.lock_timeout("majority-after", PATIENCE).await {
                Ok(guard) => break guard,
                Err(_) => sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    again.release().await;
}

/// `queues!(module, Cluster, "feature")`: the shared tests on one engine.
macro_rules! queues {
    ($module:ident, $cluster:ty, $feature:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn waiters_are_served_in_arrival_order_across_instances() {
                super::waiters_are_served_in_arrival_order_across_instances::<$cluster>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn odd_keys_map_to_one_queue_each() {
                super::odd_keys_map_to_one_queue_each::<$cluster>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn the_leader_killed_mid_hold() {
                super::the_leader_killed_mid_hold::<$cluster>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_majority_down_is_a_lost_lease_then_recovers() {
                super::a_majority_down_is_a_lost_lease_then_recovers::<$cluster>().await;
            }
        }
    };
}

queues!(etcd, super::Etcd, "etcd");
queues!(zookeeper, super::ZooKeeper, "zookeeper");

/// etcd: a lease per contender, waiters ordered by create revision.
#[cfg(feature = "etcd")]
struct Etcd {
    cluster: crate::support::etcd_server::EtcdCluster,
    probe: tower_keyed_lock::backend::etcd::EtcdBackend,
}

#[cfg(feature = "etcd")]
impl QueueCluster for Etcd {
    const LEASE: Duration = crate::etcd::LEASE;
    /// 3 s: keep-alives every second, through an election of 1–2 election timeouts.
    const THROUGH_AN_ELECTION: Duration = Duration::from_secs(3);
    /// The survivor of the majority test is the leader: it goes on answering
    /// keep-alives (etcd renews leases on the leader without a quorum round) until it
    /// finds the quorum gone and steps down, one to two election timeouts later; from
    /// then the holder is told by its local deadline, a lease at most.
    const TOLD_WITHIN: Duration = Duration::from_millis(
        2 * crate::support::etcd_server::ELECTION_TIMEOUT.as_millis() as u64
            + crate::etcd::LEASE.as_millis() as u64,
    );
    /// `keyed-lock/<name>/<key part>/`.
    const LONGEST_QUEUE: usize = "keyed-lock/".len() + 4 + 1 + 129 + 1;

    async fn start() -> Self {
        let cluster = crate::support::etcd_server::EtcdCluster::start();
        let probe = crate::etcd::backend(&cluster).await;
        Etcd { cluster, probe }
    }

    async fn instance(&self, lease: Duration) -> DistributedLocks {
        crate::etcd::with_lease(&self.cluster, lease).await
    }

    async fn queued(&self, key: &str) -> usize {
        crate::etcd::queued(&self.probe, key).await
    }

    fn queue_of(&self, key: &str) -> String {
        self.probe.queue_prefix(servers::NAME, key)
    }

    fn leader(&self) -> Option<usize> {
        self.cluster.leader()
    }

    fn kill(&mut self, member: usize) {
        self.cluster.kill(member);
    }

    fn restart(&mut self, member: usize) {
        self.cluster.restart(member);
    }

    fn wait_for_leader(&self, limit: Duration) -> Result<(), String> {
        self.cluster.wait_for_leader(limit)
    }

    /// The two followers: the leader survives without its quorum (see
    /// [`TOLD_WITHIN`](Self::TOLD_WITHIN)).
    fn majority(&self) -> [usize; 2] {
        let leader = self.cluster.leader().expect("a leader");
        let size = self.cluster.size();
        [(leader + 1) % size, (leader + 2) % size]
    }
}

/// ZooKeeper: a session per backend, waiters as sequential nodes.
#[cfg(feature = "zookeeper")]
struct ZooKeeper {
    ensemble: crate::support::zookeeper_server::ZooKeeperEnsemble,
    probe: zookeeper_client::Client,
    paths: tower_keyed_lock::backend::zookeeper::ZooKeeperBackend,
}

#[cfg(feature = "zookeeper")]
impl QueueCluster for ZooKeeper {
    const LEASE: Duration = crate::zookeeper::SESSION_TIMEOUT;
    /// A session of 4 s: the new leader restarts every session's timeout, and the
    /// holder's client reconnects to a live server within it.
    const THROUGH_AN_ELECTION: Duration = Duration::from_secs(4);
    /// The last heartbeat answered was sent before the kill: a session timeout.
    const TOLD_WITHIN: Duration = crate::zookeeper::SESSION_TIMEOUT;
    /// `/keyed-lock/<name>/<key part>`.
    const LONGEST_QUEUE: usize = "/keyed-lock/".len() + 4 + 1 + 129;

    async fn start() -> Self {
        let ensemble = crate::support::zookeeper_server::ZooKeeperEnsemble::start();
        let probe = crate::zookeeper::probe(&ensemble).await;
        let paths = crate::zookeeper::backend(&ensemble).await;
        ZooKeeper {
            ensemble,
            probe,
            paths,
        }
    }

    async fn instance(&self, lease: Duration) -> DistributedLocks {
        crate::zookeeper::with_session(&self.ensemble.connect_string(), lease).await
    }

    async fn queued(&self, key: &str) -> usize {
        crate::zookeeper::queued(&self.probe, &self.paths, key).await
    }

    fn queue_of(&self, key: &str) -> String {
        self.paths.queue_path(servers::NAME, key)
    }

    fn leader(&self) -> Option<usize> {
        self.ensemble.leader()
    }

    fn kill(&mut self, member: usize) {
        self.ensemble.kill(member);
    }

    fn restart(&mut self, member: usize) {
        self.ensemble.restart(member);
    }

    fn wait_for_leader(&self, limit: Duration) -> Result<(), String> {
        self.ensemble.wait_for_leader(limit)
    }

    /// The leader and one more: the survivor cannot lead alone.
    fn majority(&self) -> [usize; 2] {
        let leader = self.ensemble.leader().expect("a leader");
        [leader, (leader + 1) % self.ensemble.size()]
    }
}
