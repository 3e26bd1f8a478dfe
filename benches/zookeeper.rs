//! The ZooKeeper backend against a real 3-server ensemble the bench starts on free
//! ports, and the hand-off between two instances side by side with etcd (a 3-member
//! cluster started beside it), Redis and PostgreSQL.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench zookeeper
//! cargo bench -p tower-keyed-lock-benches --bench zookeeper -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `ZooKeeperBackend` (`acquire` then
//!    `Lease::release`: the create of an ephemeral sequential node, a read of the
//!    queue, the delete) against the bare recipe calls on a client of the same
//!    ensemble: create an ephemeral sequential node, delete it. Criterion times each;
//!    then both run in alternating batches (A B, B A, …) and the median ratio is
//!    printed.
//! 2. Hand-off between two instances: instance A holds the key, instance B waits for
//!    it, A releases; the time from the start of A's release to B's grant (B is woken
//!    by a watch on its predecessor, on ZooKeeper and on etcd alike).

#[path = "../tests/support/etcd_server.rs"]
mod etcd_server;
mod support;
use support::{ports, process};
#[path = "../tests/support/zookeeper_server.rs"]
mod zookeeper_server;

use std::sync::Arc;
use std::time::Duration;

use support::engine::{hand_off, reference_hand_offs, report_hand_off, EngineBench};

use tower_keyed_lock::backend::zookeeper::ZooKeeperBackend;
use tower_keyed_lock::{Key, LockBackend};
use zookeeper_client as zk;
use zookeeper_server::ZooKeeperEnsemble;

/// Long enough for the waiter to be queued (watching) before the release.
const SETTLE: Duration = Duration::from_millis(50);

fn main() {
    let mut bench = EngineBench::new();
    let ensemble = ZooKeeperEnsemble::start();
    let backend = bench.rt.block_on(zookeeper_backend(&ensemble));
    let bare = bench.rt.block_on(bare_client(&ensemble));
    let key = Key::new("order-1", 256).unwrap();
    bench.uncontended(
        "zookeeper",
        || backend_round(&backend, &key),
        (
            "bare-create-delete",
            "create ephemeral sequential + delete",
            || bare_round(&bare),
        ),
        100,
    );

    let (rt, handoffs) = (&bench.rt, if bench.quick { 3 } else { 50 });
    let a: Arc<dyn LockBackend> = Arc::new(backend.clone());
    let b: Arc<dyn LockBackend> = Arc::new(rt.block_on(zookeeper_backend(&ensemble)));
    report_hand_off(
        "zookeeper (3 servers)",
        &rt.block_on(hand_off(a, b, handoffs, SETTLE)),
    );
    {
        let cluster = etcd_server::EtcdCluster::start();
        let backend = || async {
            let backend = tower_keyed_lock::EtcdBackend::builder(cluster.endpoints())
                .lease(Duration::from_secs(10))
                .build()
                .await
                .expect("the backend connects to etcd");
            Arc::new(backend) as Arc<dyn LockBackend>
        };
        let (a, b) = rt.block_on(async { (backend().await, backend().await) });
        report_hand_off(
            "etcd (3 members)",
            &rt.block_on(hand_off(a, b, handoffs, SETTLE)),
        );
    }
    reference_hand_offs(rt, handoffs, SETTLE);
    bench.finish();
}

async fn zookeeper_backend(ensemble: &ZooKeeperEnsemble) -> ZooKeeperBackend {
    ZooKeeperBackend::builder(ensemble.connect_string())
        .lease(Duration::from_secs(4))
        .build()
        .await
        .expect("the backend connects to ZooKeeper")
}

/// A plain client, with the parent of its nodes made.
async fn bare_client(ensemble: &ZooKeeperEnsemble) -> zk::Client {
    let client = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(4))
        .connect(&ensemble.connect_string())
        .await
        .expect("a client connects to ZooKeeper");
    let parent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    client
        .mkdir("/bare/order-1", &parent)
        .await
        .expect("the parent node");
    client
}

async fn backend_round(backend: &ZooKeeperBackend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

/// The recipe's two writes without the lock around them: an ephemeral sequential node
/// created, then deleted.
async fn bare_round(client: &zk::Client) {
    let node = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let (_, sequence) = client
        .create("/bare/order-1/lock-", b"", &node)
        .await
        .unwrap();
    client
        .delete(&format!("/bare/order-1/lock-{sequence}"), None)
        .await
        .unwrap();
}
