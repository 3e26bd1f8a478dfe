//! Soak runs of two instances sharing one DynamoDB table (on moto), with and without
//! the server frozen (SIGSTOP) for longer than a lease meanwhile. `SOAK_REQUESTS`
//! scales them (default 1 500: moto serves about 150 calls a second, one at a time);
//! the full size is
//! `SOAK_SECONDS=0 SOAK_REQUESTS=100000 cargo test --all-features --test soak dynamodb:: -- --nocapture --test-threads 1`
//! (moto, not the crate, is the bottleneck: a debug build does).
#![cfg(feature = "dynamodb")]

use std::time::Duration;

use tower_keyed_lock::backend::dynamodb::DynamoDbBackend;
use tower_keyed_lock::{KeyedLockLayer, PathParam};

use crate::support::moto_server::MotoServer;
use crate::support::soak::Soak;

fn requests() -> u64 {
    std::env::var("SOAK_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_500)
}

/// One instance of the service: its own client and backend, its own layer.
async fn instance(
    dynamo: &MotoServer,
    lease: Duration,
    command_timeout: Duration,
) -> KeyedLockLayer<PathParam> {
    let builder = DynamoDbBackend::builder(dynamo.client(), "locks")
        .lease(lease)
        .command_timeout(command_timeout)
        .poll_interval(Duration::from_millis(100));
    let patient = builder.clone().command_timeout(Duration::from_secs(10));
    patient.create_table().await.expect("create the table");
    let backend = builder.build().await.expect("connect to dynamodb");
    KeyedLockLayer::by_path("id")
        .name("soak")
        .wait_timeout(Duration::from_secs(2))
        .backend(backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_dynamodb_never_overlap() {
    let dynamo = MotoServer::start();
    // Generous: moto on a loaded machine now and then takes over a second per call.
    let timeout = Duration::from_secs(2);
    let layers = [
        instance(&dynamo, Duration::from_secs(5), timeout).await,
        instance(&dynamo, Duration::from_secs(5), timeout).await,
    ];
    // Enough clients to keep moto (one request at a time) busy, few enough that its
    // queue stays well inside the command timeout.
    let soak = Soak {
        requests: requests(),
        keys: 1_000,
        clients: 16,
    };

    let started = std::time::Instant::now();
    let report = soak.run(&layers, std::future::pending()).await;

    println!("dynamodb soak in {:?}: {report:?}", started.elapsed());
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
async fn dynamodb_frozen_during_a_soak() {
    let lease = Duration::from_millis(500);
    let dynamo = MotoServer::start();
    let timeout = Duration::from_millis(400);
    let layers = [
        instance(&dynamo, lease, timeout).await,
        instance(&dynamo, lease, timeout).await,
    ];
    let soak = Soak {
        requests: requests(),
        keys: 1_000,
        clients: 8,
    };
    let mut faults = 0;
    let inject = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            dynamo.pause();
            faults += 1;
            // Longer than a lease: every holder loses its lease meanwhile.
            tokio::time::sleep(2 * lease).await;
            dynamo.resume();
        }
    };

    let started = std::time::Instant::now();
    let report = soak.run(&layers, inject).await;
    dynamo.resume();

    println!(
        "dynamodb soak with {faults} freezes in {:?}: {report:?}",
        started.elapsed()
    );
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
    // A freeze shorter than the wait is waited out (only the wait bounds the
    // waiting): it shows as waits that ran out (409) or 503s at their end.
    assert!(
        report.unavailable + report.conflict > 0,
        "the freezes were not seen: {report:?}"
    );

    crate::support::soak::wait_until_served(&layers, String::new).await;
}
