//! Soak runs of two instances sharing one real Redis, with and without Redis being
//! killed and restarted meanwhile. `SOAK_REQUESTS` scales them (default 4 000).
#![cfg(feature = "redis")]

use std::time::Duration;

use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::{KeyedLockLayer, PathParam};

use crate::support::redis_server::{self, RedisServer};
use crate::support::soak::Soak;

fn requests() -> u64 {
    std::env::var("SOAK_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(4_000)
}

/// One instance of the service: its own backend connection and its own layer.
async fn instance(redis: &RedisServer, lease: Duration) -> KeyedLockLayer<PathParam> {
    // The guard would refuse grants for a lease after each (re)start of the server;
    // the soak measures serialization, and `tests/backends/redis_faults.rs` tests the guard.
    let backend = RedisBackend::builder(redis.client())
        .restart_guard(false)
        .lease(lease)
        .command_timeout(Duration::from_millis(300))
        .build()
        .await
        .expect("connect to redis");
    KeyedLockLayer::by_path("id")
        .name("soak")
        .wait_timeout(Duration::from_secs(2))
        .backend(backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_redis_never_overlap() {
    let redis = RedisServer::start();
    let layers = [
        instance(&redis, Duration::from_secs(5)).await,
        instance(&redis, Duration::from_secs(5)).await,
    ];
    let soak = Soak {
        requests: requests(),
        keys: 1_000,
        clients: 512,
    };

    let report = soak.run(&layers, std::future::pending()).await;

    println!("redis soak: {report:?}");
    assert_eq!(
        report.overlaps, 0,
        "a second handler entered a key whose holder was not told: {report:?}"
    );
    assert_eq!(report.hung, 0, "a request hung");
    assert_eq!(
        report.answered() + report.cancelled,
        report.sent,
        "a request was lost"
    );
    // A 503 is a backend command that outlived its timeout on a loaded machine: honest,
    // not a broken guarantee. Exclusion, no hang and no lost request are asserted above.
    assert_eq!(report.other, 0, "{report:?}");
    // Some requests ran the handler: the soak exercised the lock (how many depends on
    // the machine's load, not on the crate).
    assert!(report.ok > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_during_a_soak() {
    let lease = Duration::from_millis(500);
    let mut redis = RedisServer::start();
    let layers = [instance(&redis, lease).await, instance(&redis, lease).await];
    let soak = Soak {
        requests: requests(),
        keys: 1_000,
        clients: 512,
    };
    let mut faults = 0;
    let inject = async {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            // The kill and the start wait on the process: off the runtime's workers, so
            // the requests in flight are not held up by the fault injector itself.
            tokio::task::block_in_place(|| redis.stop());
            faults += 1;
            // Redis keeps nothing on disk: it stays down for longer than a lease, as
            // the Redis docs ask, so no lease granted before the crash is still valid
            // when it comes back empty.
            tokio::time::sleep(lease + Duration::from_millis(100)).await;
            tokio::task::block_in_place(|| redis.restart());
        }
    };

    let report = soak.run(&layers, inject).await;

    println!("redis soak with {faults} kills: {report:?}");
    assert!(faults >= 1, "no fault was injected; raise SOAK_REQUESTS");
    assert_eq!(
        report.overlaps, 0,
        "a second handler entered a key whose holder was not told: {report:?}"
    );
    assert_eq!(report.hung, 0, "a request hung");
    assert_eq!(
        report.answered() + report.cancelled,
        report.sent,
        "a request was lost"
    );
    assert_eq!(report.other, 0, "{report:?}");
    // No count of 503s is asserted: an outage shorter than the wait is ridden out (a
    // failed attempt is tried again within the wait), so whether a wait ends inside
    // one depends on timing (4 000 requests through 3 outages once answered none).
    // That the outages came while requests flowed is `faults >= 1` above.

    // Recovery without restarting the app. The load may have ended mid-outage: start
    // Redis (again), wait for the first request to be served, then all must be.
    redis.restart();
    let port = redis.port();
    // What Redis sees of its clients, should the layer not recover.
    let clients = || match redis.is_running() {
        true => tokio::task::block_in_place(|| redis_server::cli(port, &["CLIENT", "LIST"])),
        false => "stopped".to_owned(),
    };
    crate::support::soak::wait_until_served(&layers, clients).await;
    let after = Soak {
        requests: 200,
        keys: 20,
        clients: 8,
    };
    let recovered = after.run(&layers, std::future::pending()).await;
    assert_eq!(
        recovered.ok + recovered.cancelled,
        200,
        "not recovered: {recovered:?}"
    );
}
