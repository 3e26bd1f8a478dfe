//! The Azure Blob backend against Azurite (Azure Blob Storage's emulator, from npm)
//! started on a free port, and the hand-off between two instances.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench azure_blob
//! cargo bench -p tower-keyed-lock-benches --bench azure_blob -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `AzureBlobBackend` (`acquire` then
//!    `Lease::release`: read the blob's properties, acquire its lease, write the fencing
//!    token under it, release the lease) against the bare lease calls on the same blob
//!    with the same SDK: acquire lease, release lease. Criterion times each; then both
//!    run in alternating batches (A B, B A, …) and the median ratio is printed.
//! 2. Hand-off between two instances: instance A holds the key, instance B waits for it
//!    (polling: Azure has no notification), A releases; the time from the start of A's
//!    release to B's grant, with the default poll interval (500 ms) and with 50 ms.
//!
//! Azurite is a Node.js process on this machine: the figures are round trips to it,
//! not to Azure (tens of milliseconds per call from a region's own network).

#[path = "../tests/support/azurite_server.rs"]
mod azurite_server;
mod support;
use support::process;

use std::sync::Arc;
use std::time::Duration;

use support::engine::{hand_off, report_hand_off, EngineBench};

use azure_storage_blob::models::BlobClientAcquireLeaseOptions;
use azure_storage_blob::BlobClient;
use tower_keyed_lock::backend::azure_blob::{AzureBlobBackend, DEFAULT_POLL_INTERVAL};
use tower_keyed_lock::{Key, LockBackend};

const LEASE: Duration = Duration::from_secs(15);
const BARE_LEASE_ID: &str = "00000000-0000-4000-8000-000000000001";

/// Long enough for the waiter to have polled a few times and reached its longest pause.
const SETTLE: Duration = Duration::from_millis(1000);

fn main() {
    let mut bench = EngineBench::new();
    let server = azurite_server::AzuriteServer::start();
    let url = server.container_url("bench");
    let backend = bench
        .rt
        .block_on(azure_backend(&url, DEFAULT_POLL_INTERVAL));
    let key = Key::new("order-1", 256).unwrap();
    // The backend's round makes its blob; the bare round leases another one.
    let bare = backend.container().blob_client("bare/order-1");
    bench.rt.block_on(async {
        let _ = bare.append_blob_client().create(None).await;
    });
    bench.uncontended(
        "azure-blob",
        || backend_round(&backend, &key),
        (
            "bare-lease-acquire-release",
            "lease acquire + release",
            || bare_round(&bare),
        ),
        50,
    );

    let (rt, handoffs) = (&bench.rt, if bench.quick { 3 } else { 30 });
    for poll in [DEFAULT_POLL_INTERVAL, Duration::from_millis(50)] {
        let (a, b) = rt.block_on(async {
            let a: Arc<dyn LockBackend> = Arc::new(azure_backend(&url, poll).await);
            let b: Arc<dyn LockBackend> = Arc::new(azure_backend(&url, poll).await);
            (a, b)
        });
        let times = rt.block_on(hand_off(a, b, handoffs, SETTLE));
        report_hand_off(
            &format!("azure-blob (Azurite), poll interval {poll:?}"),
            &times,
        );
    }
    bench.finish();
}

async fn azure_backend(url: &str, poll: Duration) -> AzureBlobBackend {
    AzureBlobBackend::builder(url)
        .lease(LEASE)
        .poll_interval(poll)
        .build()
        .await
        .expect("the backend reaches Azurite")
}

async fn backend_round(backend: &AzureBlobBackend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

/// The lease calls alone: acquire with a lease id of our own, then release it.
async fn bare_round(blob: &BlobClient) {
    let options = BlobClientAcquireLeaseOptions {
        proposed_lease_id: Some(BARE_LEASE_ID.to_owned()),
        ..Default::default()
    };
    blob.acquire_lease(LEASE.as_secs() as i32, Some(options))
        .await
        .expect("a free blob");
    blob.release_lease(BARE_LEASE_ID.to_owned(), None)
        .await
        .expect("our lease");
}
