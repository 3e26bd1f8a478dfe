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
//! 2. Uncontended, 32 tasks (each its own key) for a fixed time: the backend against
//!    the same bare calls, in interleaved rounds; locks per second and the median of the
//!    per-round ratios.
//! 3. Hot key, 2 instances × 32 tasks: every task locks one key, counts, releases,
//!    again, for a fixed time: the crate (two `DistributedLocks`, each with a backend of
//!    its own) against 64 tasks on etcd's `Lock` call, once with a lease per lock
//!    (grant, `Lock`, revoke: what the backend does) and once on a session lease per
//!    task (granted once, `Lock` then `Unlock`: what a shared-lease mode would send).
//!    Hand-offs per second, their ratios, and Jain's fairness index over the tasks.
//! 4. Hand-off between two instances: instance A holds the key, instance B waits for
//!    it, A releases; the time from the start of A's release to B's grant (B is woken
//!    by a watch on etcd, a release message on Redis, PostgreSQL's own lock queue).

#[path = "../tests/support/etcd_server.rs"]
mod etcd_server;
mod support;
use support::{ports, process};

use std::sync::Arc;
use std::time::Duration;

use support::engine::{hand_off, reference_hand_offs, report_hand_off, EngineBench};
use support::hot_key::{self, Op};

use etcd_client::{Client, LockOptions};
use etcd_server::EtcdCluster;
use tower_keyed_lock::backend::etcd::EtcdBackend;
use tower_keyed_lock::{DistributedLocks, Key, LockBackend};

/// Long enough for the waiter to be queued (or subscribed) before the release.
const SETTLE: Duration = Duration::from_millis(50);
/// Tasks of the many-task run, and of each instance on the hot key.
const TASKS: usize = 32;
/// The lease of the backend and of the bare calls.
const LEASE: Duration = Duration::from_secs(10);

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

    let (rounds, run) = if bench.quick {
        (1, Duration::from_millis(200))
    } else {
        (7, Duration::from_secs(2))
    };
    bench.rt.block_on(many_tasks(&backend, &bare, rounds, run));
    let other = bench.rt.block_on(etcd_backend(&cluster));
    bench
        .rt
        .block_on(hot_key([backend.clone(), other], rounds, run));

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
        .lease(LEASE)
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
    bare_lock(client.clone(), "bare/order-1".to_owned()).await;
}

/// etcd's own lock call on `name`, with a lease of its own, revoked after.
async fn bare_lock(mut client: Client, name: String) {
    let lease = client
        .lease_grant(LEASE.as_secs() as i64, None)
        .await
        .unwrap()
        .id();
    client
        .lock(name, Some(LockOptions::new().with_lease(lease)))
        .await
        .unwrap();
    client.lease_revoke(lease).await.unwrap();
}

/// `TASKS` tasks, each locking and releasing a key of its own for `run`: the backend
/// against the bare calls, interleaved.
async fn many_tasks(backend: &EtcdBackend, bare: &Client, rounds: usize, run: Duration) {
    let ours: Op = {
        let backend = backend.clone();
        Arc::new(move |task| {
            let backend = backend.clone();
            Box::pin(async move {
                let key = Key::new(&format!("order-{task}"), 256).unwrap();
                backend_round(&backend, &key).await;
            })
        })
    };
    let bare: Op = {
        let client = bare.clone();
        Arc::new(move |task| Box::pin(bare_lock(client.clone(), format!("bare/order-{task}"))))
    };
    let measured = hot_key::interleaved([&ours, &bare], TASKS, rounds, run).await;
    let [ours_rate, bare_rate] = measured.rates;
    println!(
        "etcd uncontended acquire+release, {TASKS} tasks: backend {ours_rate:.0} locks/s, \
         bare grant + Lock + revoke {bare_rate:.0}/s, ratio {:.2}x (median of {rounds} \
         interleaved rounds of {run:?})",
        measured.ratios[1]
    );
}

/// One key, 2 instances × `TASKS` tasks: the crate against etcd's `Lock` call with a
/// lease per lock and on a session lease per task; interleaved rounds.
async fn hot_key(backends: [EtcdBackend; 2], rounds: usize, run: Duration) {
    let clients = backends.each_ref().map(|backend| backend.client().clone());
    let ours =
        hot_key::locking(backends.map(|backend| DistributedLocks::new("bench-hot", backend)));
    let lease_per_lock: Op = {
        let clients = clients.clone();
        Arc::new(move |task| Box::pin(bare_lock(clients[task % 2].clone(), "hot-bare".to_owned())))
    };
    // One lease per task, granted once and never revoked here (it outlives the bench:
    // the cluster goes with it); a `Lock` on it names a key of its own.
    let mut sessions = Vec::new();
    for task in 0..2 * TASKS {
        let mut client = clients[task % 2].clone();
        let lease = client.lease_grant(3600, None).await.unwrap().id();
        sessions.push((client, lease));
    }
    let sessions = Arc::new(sessions);
    let session_lease: Op = Arc::new(move |task| {
        let (mut client, lease) = sessions[task].clone();
        Box::pin(async move {
            let held = client
                .lock("hot-session", Some(LockOptions::new().with_lease(lease)))
                .await
                .unwrap();
            client.unlock(held.key().to_vec()).await.unwrap();
        })
    });
    let hot = hot_key::interleaved(
        [&ours, &lease_per_lock, &session_lease],
        2 * TASKS,
        rounds,
        run,
    )
    .await;
    let [ours_rate, per_lock_rate, session_rate] = hot.rates;
    let [ours_fair, per_lock_fair, session_fair] = hot.fairness;
    println!(
        "etcd hot key, 2 instances x {TASKS} tasks (median of {rounds} interleaved rounds of \
         {run:?}): backend {ours_rate:.0} hand-offs/s (Jain {ours_fair:.3}); Lock with a \
         lease per lock {per_lock_rate:.0}/s (Jain {per_lock_fair:.3}): {:.2}x; Lock on a \
         session lease {session_rate:.0}/s (Jain {session_fair:.3}): {:.2}x",
        hot.ratios[1], hot.ratios[2]
    );
}
