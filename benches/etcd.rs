//! The etcd backend against a real 3-member etcd cluster the bench starts on free
//! ports, and the hand-off between two instances side by side with Redis and
//! PostgreSQL (when their features are on).
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench etcd
//! cargo bench -p tower-keyed-lock-benches --bench etcd -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `EtcdBackend` (`acquire` then
//!    `Lease::release`: a lease grant, the queue transaction, a lease revoke) against
//!    etcd's own lock call on the same client: lease grant, `Lock` (the v3lock service,
//!    which runs the same recipe inside the server), lease revoke. Criterion times
//!    each; then both run in alternating batches (A B, B A, …) and the median ratio is
//!    printed.
//! 2. Hand-off between two instances: instance A holds the key, instance B waits for
//!    it, A releases; the time from the start of A's release to B's grant (B is woken
//!    by a watch on etcd, a release message on Redis, PostgreSQL's own lock queue).

#[path = "../tests/support/etcd_server.rs"]
mod etcd_server;
mod support;
use support::{ports, process};

use std::sync::Arc;
use std::time::Duration;

use support::engine::{hand_off, reference_hand_offs, report_hand_off, EngineBench};

use etcd_client::{Client, LockOptions};
use etcd_server::EtcdCluster;
use tower_keyed_lock::backend::etcd::EtcdBackend;
use tower_keyed_lock::{Key, LockBackend};

/// Long enough for the waiter to be queued (or subscribed) before the release.
const SETTLE: Duration = Duration::from_millis(50);

fn main() {
    let mut bench = EngineBench::new();
    let cluster = EtcdCluster::start();
    let backend = bench.rt.block_on(etcd_backend(&cluster));
    let bare = backend.client().clone();
    let key = Key::new("order-1", 256).unwrap();
    bench.uncontended(
        "etcd",
        || backend_round(&backend, &key),
        ("bare-grant-lock-revoke", "grant + Lock + revoke", || {
            bare_round(&bare)
        }),
        100,
    );

    let handoffs = if bench.quick { 3 } else { 50 };
    let a: Arc<dyn LockBackend> = Arc::new(backend.clone());
    let b: Arc<dyn LockBackend> = Arc::new(bench.rt.block_on(etcd_backend(&cluster)));
    let etcd = bench.rt.block_on(hand_off(a, b, handoffs, SETTLE));
    report_hand_off("etcd (3 members)", &etcd);

    reference_hand_offs(&bench.rt, handoffs, SETTLE);
    bench.finish();
}

async fn etcd_backend(cluster: &EtcdCluster) -> EtcdBackend {
    EtcdBackend::builder(cluster.endpoints())
        .lease(Duration::from_secs(10))
        .build()
        .await
        .expect("the backend connects to etcd")
}

async fn backend_round(backend: &EtcdBackend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

/// etcd's own lock call, with the lease it needs, given back by revoking the lease
/// (which deletes the lock's key, as the backend's release does).
async fn bare_round(client: &Client) {
    let mut client = client.clone();
    let lease = client.lease_grant(10, None).await.unwrap().id();
    client
        .lock("bare/order-1", Some(LockOptions::new().with_lease(lease)))
        .await
        .unwrap();
    client.lease_revoke(lease).await.unwrap();
}
