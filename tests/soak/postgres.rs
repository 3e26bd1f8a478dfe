//! Soak runs of two instances sharing one real PostgreSQL, with and without the
//! server being stopped and started again meanwhile. `SOAK_REQUESTS` scales them
//! (default 4 000).
#![cfg(feature = "postgres")]

use std::time::Duration;

use tower_keyed_lock::backend::postgres::PostgresBackend;
use tower_keyed_lock::{KeyedLockLayer, PathParam};

use crate::support::pg_server::PgServer;
use crate::support::soak::Soak;

fn requests() -> u64 {
    std::env::var("SOAK_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(4_000)
}

/// One instance of the service: its own pool and its own layer.
fn instance(pg: &PgServer) -> KeyedLockLayer<PathParam> {
    let backend = PostgresBackend::builder_from_str(&pg.conn_str())
        .expect("a valid connection string")
        .max_connections(16)
        .liveness_interval(Duration::from_millis(100))
        .command_timeout(Duration::from_millis(500))
        .build_lazy();
    KeyedLockLayer::by_path("id")
        .name("soak")
        .wait_timeout(Duration::from_secs(2))
        .backend(backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_postgres_never_overlap() {
    let pg = PgServer::start();
    let layers = [instance(&pg), instance(&pg)];
    let soak = Soak {
        requests: requests(),
        keys: 1_000,
        clients: 512,
    };

    let report = soak.run(&layers, std::future::pending()).await;

    println!("postgres soak: {report:?}");
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
    // A pool that is momentarily exhausted answers 409 within the wait; nothing else.
    // A 503 is a backend command that outlived its timeout on a loaded machine: honest,
    // not a broken guarantee. Exclusion, no hang and no lost request are asserted above.
    assert_eq!(report.other, 0, "{report:?}");
    // Some requests ran the handler: the soak exercised the lock (how many depends on
    // the machine's load, not on the crate).
    assert!(report.ok > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_during_a_soak() {
    let mut pg = PgServer::start();
    let layers = [instance(&pg), instance(&pg)];
    let soak = Soak {
        requests: requests(),
        keys: 1_000,
        clients: 512,
    };
    let mut faults = 0;
    let inject = async {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            // Fast shutdown ends every session, and with them every advisory lock.
            tokio::task::block_in_place(|| pg.stop());
            faults += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
            tokio::task::block_in_place(|| pg.start_again());
        }
    };

    let report = soak.run(&layers, inject).await;

    println!("postgres soak with {faults} restarts: {report:?}");
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
    assert!(
        report.unavailable > 0,
        "the outages were not seen: {report:?}"
    );

    if !pg.is_running() {
        pg.start_again();
    }
    // Recovery without restarting the app: wait for the first request to be served,
    // then all must be.
    crate::support::soak::wait_until_served(&layers, String::new).await;
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
